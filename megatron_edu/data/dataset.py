"""Tokens on disk, sequences out, batches in an order every run and every replica agrees on.

The pipeline of Megatron's GPT data (1909.08053 §4.1; megatron-core's `GPTDataset`), reduced to
its ideas:

1. The corpus is encoded once into a flat array of token ids, with the end-of-document token
   (`eos`, Megatron's "eod") between documents, and stored as a memory-mapped `.npy` file
   (uint16 while the vocabulary fits, else uint32) so every rank reads it without a copy.
2. The last `val_fraction` of the tokens is held out for validation.
3. Sequence i is tokens[i*s : i*s + s + 1]: `input_ids` its first s tokens, `labels` its last s,
   so labels[t] is the token after input_ids[t] (language modelling, 1909.08053 §4).
4. Each step reads one global batch of B sequences. The order is a permutation drawn from
   (seed, epoch); data-parallel replica r of d reads the r-th contiguous slice of B/d sequences
   (2104.04473 §2.1: each replica sees a different shard of the batch). The sampler's state is
   two numbers (epoch, position), so a resumed run reads exactly what an uninterrupted run would,
   even with a different number of replicas.

`prepare_data` does all of it in one call for the training script; `unigram_entropy` is the loss
of a model that only knows token frequencies, the baseline a trained model must beat.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from megatron_edu.data.corpus import (
    documents_sha256,
    load_corpus,
    resolve_cache_dir,
    write_atomically,
)
from megatron_edu.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["token_dtype", "encode_documents", "split_point", "TokenDataset", "BatchSampler",
           "unigram_entropy", "prepare_data"]

_ENCODE_BATCH = 256  # documents (or pieces of long ones) per sentencepiece call
_NAMED = ("default", "wikitext103")  # the corpora named, not paths
PREPARED = "prepared.json"  # the marker of a prepared folder (``data/prepare.py``), written last
_PIECE_CHARS = 1 << 20  # a long document is encoded in pieces of about 1M characters


# ---------------------------------------------------------------------------------------------
# 1. The token file
# ---------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every token id: uint16 below 65,536."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_documents(documents: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """All documents as one array of token ids, each document followed by `eos`."""
    dtype = token_dtype(tokenizer.vocab_size)
    arrays = []
    for batch in _batched(_pieces(documents), _ENCODE_BATCH):
        encoded = tokenizer.encode_batch([text for text, _ in batch])
        for (_, ends_document), ids in zip(batch, encoded, strict=True):
            arrays.append(np.asarray(ids + [tokenizer.eos_id] if ends_document else ids, dtype))
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def _pieces(documents: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces: long documents cut after a newline every ~1M characters.

    No token contains a newline (the tokenizer trains on lines), so cutting there encodes to the
    same ids as the whole document; only a newline-free megabyte is cut mid-line.
    """
    for document in documents:
        start = 0
        while len(document) - start > _PIECE_CHARS:
            cut = document.rfind("\n", start, start + _PIECE_CHARS) + 1
            cut = cut if cut > start else start + _PIECE_CHARS
            yield document[start:cut], False
            start = cut
        yield document[start:], True


def _batched(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch


def build_token_file(
    documents: Sequence[str], tokenizer: Tokenizer, cache_dir: str | Path | None = None
) -> Path:
    """Encode the corpus once into `cache_dir/tokens/*.npy`, keyed by corpus and tokenizer."""
    tokenizer_key = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()[:16]
    name = f"{documents_sha256(documents)[:16]}-{tokenizer_key}.npy"
    path = resolve_cache_dir(cache_dir) / "tokens" / name
    if not path.exists():
        tokens = encode_documents(documents, tokenizer)

        def save(tmp: Path) -> None:
            with tmp.open("wb") as file:
                np.save(file, tokens)

        write_atomically(path, save)
    return path


def load_tokens(path: str | Path) -> np.ndarray:
    """The token file as a read-only memory map: nothing is read until it is indexed."""
    return np.load(path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------
# 2. The train/validation split, 3. sequences
# ---------------------------------------------------------------------------------------------


def split_point(
    num_tokens: int, seq_len: int, val_fraction: float = 0.05, min_val_sequences: int = 4
) -> int:
    """Where validation starts: the last `val_fraction` of tokens, at least a few sequences."""
    val_tokens = max(round(num_tokens * val_fraction), min_val_sequences * seq_len + 1)
    if num_tokens - val_tokens < seq_len + 1:
        raise ValueError(
            f"{num_tokens} tokens are too few for seq_len={seq_len}: validation takes "
            f"{val_tokens}, leaving less than one training sequence ({seq_len + 1} tokens)"
        )
    return num_tokens - val_tokens


class TokenDataset(torch.utils.data.Dataset):
    """Sequence i of tokens[start:end]: (input_ids, labels), int64, labels shifted by one."""

    def __init__(
        self, path: str | Path, seq_len: int, start: int = 0, end: int | None = None
    ) -> None:
        self.path, self.seq_len, self.start, self.end = Path(path), seq_len, start, end
        self.tokens = load_tokens(path)[start:end]
        self.num_sequences = (len(self.tokens) - 1) // seq_len  # the last label needs one more
        if self.num_sequences < 1:
            raise ValueError(
                f"{path}[{start}:{end}] holds {len(self.tokens)} tokens: too few for one "
                f"sequence of seq_len={seq_len} (needs {seq_len + 1})"
            )

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, labels = self.batch([index])
        return input_ids[0], labels[0]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences at `indices`, stacked: input_ids and labels, each [len(indices), s]."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        windows = self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int64)  # [b, s+1]
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]  # [b, s] each: labels[t] = input_ids[t + 1]

    def fixed_batch(self, i: int, global_batch: int, dp_rank: int = 0,
                    dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica `dp_rank`'s slice of evaluation batch `i`: sequences i·B … (i+1)·B − 1,
        wrapping round, so every evaluation (and every layout) reads the same batches."""
        local = global_batch // dp_size
        first = i * global_batch + dp_rank * local
        return self.batch([(first + j) % self.num_sequences for j in range(local)])

    def __reduce__(self) -> tuple:
        # reopen the memory map in a spawned rank instead of pickling the tokens
        return (TokenDataset, (self.path, self.seq_len, self.start, self.end))


# ---------------------------------------------------------------------------------------------
# 4. Deterministic, data-parallel, resumable batches
# ---------------------------------------------------------------------------------------------


class BatchSampler:
    """Endless batches of sequence indices for one data-parallel replica.

    Epoch e visits the sequences in the order `permutation(seed, e)`, one global batch of
    `global_batch` sequences per step (an incomplete last batch is dropped); replica `dp_rank` of
    `dp_size` gets the `dp_rank`-th contiguous slice of `global_batch // dp_size` of them.
    """

    def __init__(
        self,
        num_sequences: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        if global_batch % dp_size != 0:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if not 0 < global_batch <= num_sequences:
            raise ValueError(f"global batch {global_batch} must be in 1..{num_sequences} sequences")
        self.num_sequences, self.global_batch, self.seed = num_sequences, global_batch, seed
        self.local_batch = global_batch // dp_size
        self.offset = dp_rank * self.local_batch  # this replica's slice of each global batch
        self.batches_per_epoch = num_sequences // global_batch
        self.epoch, self.position = 0, 0  # position: global batches already read this epoch
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of sequences in `epoch`: the same for every replica and every run."""
        if epoch != self._order_epoch:
            generator = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, generator.permutation(self.num_sequences)
        return self._order

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> list[int]:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.global_batch + self.offset
        self.position += 1
        return self.permutation(self.epoch)[start : start + self.local_batch].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ---------------------------------------------------------------------------------------------
# The baseline, and everything in one call
# ---------------------------------------------------------------------------------------------


def unigram_entropy(tokens: np.ndarray | torch.Tensor | Sequence[int]) -> float:
    """H = -sum_v p(v) ln p(v) over token frequencies, in nats.

    The cross-entropy of the best model that ignores context: a trained model's loss must be
    lower, and an untrained one starts near ln(vocab_size), above it.
    """
    counts = np.bincount(np.asarray(tokens, dtype=np.int64).ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def prepare_data(
    source: str | Path | Sequence[str | Path] = "default",
    vocab_size: int = 8192,
    seq_len: int = 128,
    cache_dir: str | Path | None = None,
    val_fraction: float = 0.05,
    model_type: str = "bpe",
    tokenizer_path: str | Path | None = None,
    text_field: str = "text",
) -> tuple[Tokenizer, TokenDataset, TokenDataset]:
    """(tokenizer, train, validation) for `source`, building whatever the cache lacks; a
    folder `python -m megatron_edu.data.prepare` wrote is read as it is (`data/prepare.py`).

    `tokenizer_path` loads an existing `.model` instead of training one on the corpus;
    `text_field`: the field of a .jsonl file's lines that holds the text.
    """
    paths = [source] if isinstance(source, (str, Path)) else list(source)
    if len(paths) == 1 and str(paths[0]) not in _NAMED and (Path(paths[0]) / PREPARED).is_file():
        return _prepared(Path(paths[0]), vocab_size, seq_len, val_fraction)   # tokenized once
    documents = load_corpus(source, cache_dir, text_field)
    if tokenizer_path is not None:
        tokenizer = Tokenizer.load(tokenizer_path)
    else:
        tokenizer = train_tokenizer(documents, vocab_size, cache_dir, model_type)
    path = build_token_file(documents, tokenizer, cache_dir)
    boundary = split_point(len(load_tokens(path)), seq_len, val_fraction)
    train, val = TokenDataset(path, seq_len, 0, boundary), TokenDataset(path, seq_len, boundary)
    return tokenizer, train, val


def _prepared(folder: Path, vocab_size: int, seq_len: int,
              val_fraction: float) -> tuple[Tokenizer, TokenDataset, TokenDataset]:
    """A folder ``python -m megatron_edu.data.prepare`` wrote: its ids read as a memory map,
    nothing tokenized, its tokenizer the model's."""
    tokenizer = Tokenizer.load(folder)                 # its tokenizer.model or tokenizer.json
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"--data {folder} was prepared with a vocabulary of "
                         f"{tokenizer.vocab_size}: the model has {vocab_size} (pass "
                         f"--vocab-size {tokenizer.vocab_size})")
    path = folder / "tokens.npy"
    boundary = split_point(len(load_tokens(path)), seq_len, val_fraction)
    return tokenizer, TokenDataset(path, seq_len, 0, boundary), TokenDataset(path, seq_len,
                                                                             boundary)
