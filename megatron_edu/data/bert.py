"""BERT's data: sentence pairs in or out of order, 15 % of their tokens masked (1909.08053 §5.3).

From the same corpus and tokenizer as the GPT's (``corpus.py``, ``tokenizer.py``):

1. **Sentences.** Each document is cut into sentences — after ``.``, ``!`` or ``?`` followed by
   whitespace, and at blank lines — each keeping the whitespace that follows it, so that
   consecutive sentences' tokens read as the text did.
2. **Pairs, packed to full length.** Consecutive sentences of one document are gathered until
   they fill s − 3 tokens; the run is cut at a random sentence boundary into segment a and
   segment b (inside the sentence when the run is a single one), the longer segment trimmed —
   a from its start, b from its end, so that the text still runs on from a into b — to fit
   exactly, and half the pairs are swapped. A document's tail too short to fill a sequence is
   dropped: every sample is ``[CLS] a [SEP] b [SEP]`` of exactly s tokens, no [PAD] — which is
   what lets BERT run under pipeline parallelism (``model/bert.py``), and wastes no compute.
   (Megatron-LM pads short samples instead.)
3. **Sentence order** (ALBERT's SOP, which 1909.08053 §5.3 trains): the label is 0 for a then b,
   1 for b then a. It rides in ``labels[:, 0]``, the [CLS] position.
4. **Masking** (Devlin et al. 2019 §3.1): 15 % of the non-special tokens of each sample are
   chosen; 80 % of those become [MASK], 10 % a random token, 10 % stay as they were; the
   labels hold the original token at the chosen positions, −100 elsewhere. The choice is drawn
   from (seed, sample index): a sample is masked the same way every time it is read, on any
   rank (original BERT's static masking).

The vocabulary is the GPT's tokenizer, whose four control ids take BERT's roles: [CLS] = bos,
[SEP] = eos, [PAD] = pad and [MASK] = unk — byte fallback spells every character, so unk never
occurs in text and is free to mean "masked". The GPT's tokenizer (and every GPT output) stays
as it was.

The samples are built once per corpus, tokenizer, length and seed and cached next to the GPT's
token files; ``BertDataset`` has the GPT ``TokenDataset``'s interface (``batch``,
``fixed_batch``, ``tokens``), so the trainer reads either alike.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_edu.data.corpus import (
    documents_sha256,
    load_corpus,
    resolve_cache_dir,
    write_atomically,
)
from megatron_edu.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer

__all__ = ["CLS_ID", "SEP_ID", "MASK_ID", "PAD_ID", "SPECIAL_IDS", "split_sentences",
           "sentence_pairs", "mask_tokens", "prepare_bert_data"]

CLS_ID, SEP_ID, MASK_ID = BOS_ID, EOS_ID, UNK_ID     # PAD_ID is the tokenizer's pad
SPECIAL_IDS = (UNK_ID, BOS_ID, EOS_ID, PAD_ID)       # ids 0-3: never chosen, never drawn
IGNORE_INDEX = -100
MASK_FRACTION, TO_MASK, TO_RANDOM = 0.15, 0.8, 0.1   # Devlin et al. 2019 §3.1
SAMPLES_FORMAT = 1  # bump when the sample construction below changes

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


# ---------------------------------------------------------------------------------------------
# 1-3. Sentences and sentence pairs
# ---------------------------------------------------------------------------------------------


def split_sentences(document: str) -> list[str]:
    """The document's sentences, each with the whitespace after it (empty ones dropped)."""
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(document):
        pieces.append(document[start : match.end()])
        start = match.end()
    pieces.append(document[start:])
    return [piece for piece in pieces if piece.strip()]


def _pack(sentences: list[list[int]], target: int, rng: np.random.Generator
          ) -> list[tuple[list[int], list[int]]]:
    """Runs of consecutive sentences of at least ``target`` tokens, each cut into (a, b) and
    trimmed to exactly ``target`` tokens; a tail too short is dropped."""
    pairs, i = [], 0
    while i < len(sentences):
        run, length = [], 0
        while i < len(sentences) and length < target:
            run.append(sentences[i])
            length += len(sentences[i])
            i += 1
        if length < target:
            break
        if len(run) > 1:
            cut = int(rng.integers(1, len(run)))               # a: sentences [0, cut)
            a, b = sum(run[:cut], []), sum(run[cut:], [])
        else:
            cut = int(rng.integers(1, len(run[0])))            # one long sentence, cut inside
            a, b = run[0][:cut], run[0][cut:]
        excess, longer = len(a) + len(b) - target, len(a) - len(b)
        first = min(abs(longer), excess)                       # the longer one first ...
        trim_a = (first if longer > 0 else 0) + (excess - first) // 2   # ... then both alike
        a, b = a[trim_a:], b[: len(b) - (excess - trim_a)]
        pairs.append((a, b))
    return pairs


def sentence_pairs(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """All samples of the corpus: ids [n, seq_len] ``[CLS] a [SEP] b [SEP]`` (b first when
    swapped) and the order labels [n] (0 in order, 1 swapped); deterministic in ``seed``."""
    if seq_len < 5:
        raise ValueError(f"seq_len = {seq_len} leaves no room for two segments besides "
                         f"[CLS] and two [SEP]s")
    rng = np.random.default_rng([seed, 0xB3])
    rows, orders = [], []
    for document in documents:
        sentences = [ids for ids in tokenizer.encode_batch(split_sentences(document)) if ids]
        for a, b in _pack(sentences, seq_len - 3, rng):
            swapped = bool(rng.random() < 0.5)
            if swapped:
                a, b = b, a
            rows.append([CLS_ID, *a, SEP_ID, *b, SEP_ID])
            orders.append(int(swapped))
    if not rows:
        raise ValueError(f"no document is long enough for one sample of seq_len = {seq_len}")
    return np.asarray(rows, dtype=np.int32), np.asarray(orders, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# 4. Masking
# ---------------------------------------------------------------------------------------------


def mask_tokens(ids: np.ndarray, vocab_size: int, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """(masked ids, masked-LM labels) of one sample [s]: round(15 %) of its non-special tokens
    chosen; of those 80 % → [MASK], 10 % → a random non-special token, 10 % unchanged. The
    labels hold the original id at the chosen positions, −100 elsewhere."""
    candidates = np.flatnonzero(~np.isin(ids, SPECIAL_IDS))
    n = min(len(candidates), max(1, round(MASK_FRACTION * len(candidates))))
    chosen = rng.choice(candidates, size=n, replace=False)
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    labels[chosen] = ids[chosen]
    masked = ids.astype(np.int64)
    fate = rng.random(n)
    masked[chosen[fate < TO_MASK]] = MASK_ID
    randomised = chosen[(fate >= TO_MASK) & (fate < TO_MASK + TO_RANDOM)]
    masked[randomised] = rng.integers(len(SPECIAL_IDS), vocab_size, size=len(randomised))
    return masked, labels


# ---------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------


class BertDataset(torch.utils.data.Dataset):
    """Samples [start, end) of a samples file: (input_ids, labels) [s] each, masked as above,
    the order label in labels[0]."""

    def __init__(self, path: str | Path, vocab_size: int, seed: int = 0, start: int = 0,
                 end: int | None = None) -> None:
        self.path, self.vocab_size, self.seed = Path(path), vocab_size, seed
        self.start, self.end = start, end
        with np.load(self.path) as saved:
            self.ids, self.orders = saved["ids"][start:end], saved["orders"][start:end]
        if len(self.ids) < 1:
            raise ValueError(f"{path}[{start}:{end}] holds no sample")
        self.seq_len = self.ids.shape[1]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the samples, unmasked (for ``unigram_entropy``)."""
        return self.ids.ravel()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, labels = self.batch([index])
        return input_ids[0], labels[0]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``, masked from (seed, its global index): the same on every read."""
        rng = np.random.default_rng([self.seed, self.start + index, 0x4D])
        ids, labels = mask_tokens(self.ids[index], self.vocab_size, rng)
        labels[0] = self.orders[index]                     # [CLS]: the sentence-order label
        return ids, labels

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices``: input_ids and labels, each [len(indices), s] int64."""
        ids, labels = zip(*(self.sample(int(i)) for i in indices), strict=True)
        return torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(labels))

    def fixed_batch(self, i: int, global_batch: int, dp_rank: int = 0,
                    dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica ``dp_rank``'s slice of evaluation batch ``i`` (as ``TokenDataset``'s)."""
        local = global_batch // dp_size
        first = i * global_batch + dp_rank * local
        return self.batch([(first + j) % len(self) for j in range(local)])

    def __reduce__(self) -> tuple:
        return (BertDataset, (self.path, self.vocab_size, self.seed, self.start, self.end))


def build_samples_file(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int,
                       seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Build the samples once into ``cache_dir/bert/*.npz``, keyed by corpus, tokenizer, s and
    seed."""
    key = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()[:16]
    name = f"{documents_sha256(documents)[:16]}-{key}-s{seq_len}-seed{seed}-v{SAMPLES_FORMAT}.npz"
    path = resolve_cache_dir(cache_dir) / "bert" / name
    if not path.exists():
        ids, orders = sentence_pairs(documents, tokenizer, seq_len, seed)

        def save(tmp: Path) -> None:
            with tmp.open("wb") as file:
                np.savez(file, ids=ids, orders=orders)

        write_atomically(path, save)
    return path


def prepare_bert_data(
    source: str | Path | Sequence[str | Path] = "default",
    vocab_size: int = 8192,
    seq_len: int = 128,
    cache_dir: str | Path | None = None,
    seed: int = 0,
    val_fraction: float = 0.05,
    tokenizer_path: str | Path | None = None,
) -> tuple[Tokenizer, BertDataset, BertDataset]:
    """(tokenizer, train, validation) BERT samples of ``source`` (``prepare_data``'s sources);
    the last ``val_fraction`` of the samples (at least 4) is held out."""
    documents = load_corpus(source, cache_dir)
    tokenizer = (Tokenizer.load(tokenizer_path) if tokenizer_path is not None
                 else train_tokenizer(documents, vocab_size, cache_dir))
    path = build_samples_file(documents, tokenizer, seq_len, seed, cache_dir)
    with np.load(path) as saved:
        total = len(saved["orders"])
    held_out = max(round(total * val_fraction), 4)
    if total - held_out < 1:
        raise ValueError(f"{total} samples of seq_len = {seq_len} are too few to hold out "
                         f"{held_out} for validation and train on the rest")
    boundary = total - held_out
    train = BertDataset(path, tokenizer.vocab_size, seed, 0, boundary)
    return tokenizer, train, BertDataset(path, tokenizer.vocab_size, seed, boundary)
