"""A byte-level-fallback BPE tokenizer (sentencepiece), trained once per corpus and cached.

1909.08053 §4.1 uses GPT-2's byte-pair encoding (Sennrich et al. 2016, arXiv 1508.07909; Radford
et al. 2019) with a 50,257-token vocabulary, padded so it splits evenly across tensor-parallel
ranks (§3). Here the same idea is trained on whatever corpus is at hand, in about a second:
sentencepiece's BPE (Kudo & Richardson 2018, arXiv 1808.06226) with

- byte fallback: a character outside the vocabulary is spelled as its UTF-8 bytes, so every
  string round-trips exactly (`decode(encode(s)) == s`) and there is no <unk> in practice;
- identity normalisation, kept whitespace and no dummy prefix: what is encoded is what decodes;
- fixed special ids (unk 0, bos 1, eos 2, pad 3), and the end-of-document token `eos_id` that the
  dataset puts between documents (Megatron's "eod");
- deterministic training (every line of the corpus in order, no sampling), so training twice
  gives the same model byte for byte, and quiet logging (nothing on stderr in a notebook).

Trained models are cached under `cache_dir/tokenizers/`, keyed by the corpus' sha256, the vocabulary
size and the model type. `model_type="byte-bpe"` trains GPT-2's kind instead, a byte-level BPE
with the `tokenizers` library (the same special ids), saved as a `tokenizer.json`; and
`Tokenizer.load` reads any Hugging Face `tokenizer.json` (GPT-2's, a Llama 3's) as a
`JsonTokenizer` with the same interface.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from megatron_edu.data.corpus import documents_sha256, resolve_cache_dir, write_atomically

__all__ = ["Tokenizer", "JsonTokenizer", "train_tokenizer", "tokenizer_name"]

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")   # sentencepiece's names of those ids
MODEL_TYPES = ("bpe", "unigram", "byte-bpe")
TOKENIZER_FORMAT = 1  # bump when the training options below change, so stale caches are not reused


class Tokenizer:
    """Text <-> token ids with a trained sentencepiece model (use `load` or `train_tokenizer`)."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path) -> None:
        self._processor = processor
        self.path = path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer | JsonTokenizer:
        """Load a sentencepiece `.model` file, a Hugging Face `tokenizer.json`, or a folder
        holding one (its tokenizer.model first: an export holds both, with the same ids), with
        a clear error if it is missing or corrupt."""
        path = Path(path)
        if path.is_dir():
            found = [path / name for name in ("tokenizer.model", "tokenizer.json")
                     if (path / name).is_file()]
            if not found:
                raise FileNotFoundError(f"{path} holds no tokenizer.model or tokenizer.json")
            path = found[0]
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        if path.suffix == ".json":
            return JsonTokenizer(path)
        try:
            processor = spm.SentencePieceProcessor(model_file=str(path))
        except RuntimeError as error:
            raise ValueError(f"{path} is not a valid sentencepiece .model file ({error})") from None
        return cls(processor, path)

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of many texts at once (sentencepiece runs the batch in C++)."""
        return self._processor.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])  # accepts tensors and arrays too

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    def __reduce__(self) -> tuple:
        return (Tokenizer.load, (self.path,))  # ranks started by spawn reload the cached file

    def save_hf(self, out_dir: str | Path, max_length: int) -> None:
        """Write this tokenizer as Hugging Face's fast tokenizer (tokenizer.json, read by the
        ``tokenizers`` library: no sentencepiece or conversion needed) with its
        tokenizer_config.json, so that ``AutoTokenizer.from_pretrained(out_dir)`` gives the
        same ids; ``max_length``: the model's sequence length."""
        sp, out_dir = self._processor, Path(out_dir)
        shutil.copyfile(self.path, out_dir / "tokenizer.model")
        (out_dir / "tokenizer.json").write_text(json.dumps(_hf_tokenizer(sp), ensure_ascii=False))
        _hf_tokenizer_config(out_dir, max_length, {name: sp.id_to_piece(i) for name, i in (
            ("unk", sp.unk_id()), ("bos", self.bos_id), ("eos", self.eos_id),
            ("pad", self.pad_id)) if i >= 0})


class JsonTokenizer:
    """A Hugging Face fast tokenizer, ``tokenizer.json`` (the ``tokenizers`` library: GPT-2's,
    a Llama 3's, ``train_tokenizer(model_type="byte-bpe")``'s), with ``Tokenizer``'s interface.
    Its end of text (the documents' separator), beginning and padding are those its folder's
    tokenizer_config.json names (``save_pretrained`` writes one), else the first of ``NAMES``
    it holds; -1 where none (an end of text it must have)."""

    NAMES = {"bos": ("<s>", "<|begin_of_text|>", "<|endoftext|>", "<bos>"),
             "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
             "pad": ("<pad>", "<|finetune_right_pad_id|>")}

    def __init__(self, path: Path) -> None:
        tokenizers = _tokenizers(f"reading {path}")
        try:
            self._fast = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises bare Exceptions
            raise ValueError(f"{path} is not a valid tokenizer.json ({error})") from None
        self.path = path
        vocab = self._fast.get_vocab(with_added_tokens=True)
        config = path.with_name("tokenizer_config.json")
        named = json.loads(config.read_text()) if config.is_file() else {}
        self._ids = {kind: next((vocab[t] for t in (_content(named.get(f"{kind}_token")), *names)
                                 if t in vocab), -1) for kind, names in self.NAMES.items()}
        if self._ids["eos"] < 0:
            raise ValueError(f"{path} names no end-of-text token "
                             f"({', '.join(self.NAMES['eos'])}), "
                             f"which separates the documents")

    def encode(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._fast.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    def __reduce__(self) -> tuple:
        return (Tokenizer.load, (self.path,))

    def save_hf(self, out_dir: str | Path, max_length: int) -> None:
        """As ``Tokenizer.save_hf``: the tokenizer.json as it is, and its config."""
        shutil.copyfile(self.path, Path(out_dir) / "tokenizer.json")
        _hf_tokenizer_config(Path(out_dir), max_length, {
            name: self._fast.id_to_token(i) for name, i in self._ids.items() if i >= 0})


def _content(token: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json names it: a string, or {"content": …}."""
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_name(path: str | Path) -> str:
    """The name a tokenizer file takes in a checkpoint or a prepared folder: tokenizer.model
    or tokenizer.json, as its suffix says (``Tokenizer.load`` reads either from the folder)."""
    return "tokenizer" + Path(path).suffix


def _tokenizers(why: str):
    try:
        import tokenizers
    except ImportError:
        raise ImportError(f"{why} needs the tokenizers package: pip install tokenizers") from None
    return tokenizers


def _hf_tokenizer_config(out_dir: Path, max_length: int, specials: dict[str, str]) -> None:
    """tokenizer_config.json: ``AutoTokenizer`` reads tokenizer.json, with these special
    tokens, adding none of them to what it encodes (as the package's tokenizers do)."""
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "add_bos_token": False, "add_eos_token": False,
        **{f"{name}_token": piece for name, piece in specials.items()}}, indent=2))


def _hf_tokenizer(sp: spm.SentencePieceProcessor) -> dict:
    """The ``tokenizers`` JSON of a sentencepiece model trained as ``train_tokenizer`` does (no
    normalization, no dummy prefix, byte fallback): spaces become ▁, then BPE whose merges are
    every split of a piece into two pieces, ranked by the merged piece's score as sentencepiece
    ranks its merges (transformers' ``SentencePieceExtractor``): the same ids; or Unigram with
    the scores: the same ids but where two segmentations score the same (a run of spaces)."""
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    model: dict = {"type": "Unigram", "unk_id": sp.unk_id(), "byte_fallback": True,
                   "vocab": [[sp.id_to_piece(i), sp.get_score(i)] for i in range(n)]}
    if all(sp.get_score(i).is_integer() for i in range(n) if _normal(sp, i)):
        merges = sorted((-sp.get_score(i), vocab[p[:k]], vocab[p[k:]], p[:k], p[k:])
                        for p, i in vocab.items() if _normal(sp, i)
                        for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab)
        model = {"type": "BPE", "unk_token": sp.id_to_piece(sp.unk_id()), "fuse_unk": True,
                 "byte_fallback": True, "vocab": vocab, "merges": [m[3:] for m in merges]}
    return {"version": "1.0",
            "added_tokens": [{"id": i, "content": sp.id_to_piece(i), "special": True,
                              "normalized": False, "single_word": False, "lstrip": False,
                              "rstrip": False} for i in range(n)
                             if not _normal(sp, i) and not sp.is_byte(i)],
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": model}


def _normal(sp: spm.SentencePieceProcessor, i: int) -> bool:
    """A piece of text, not a special token or a byte (BPE's scores: −rank, whole numbers;
    Unigram's: log-probabilities)."""
    return not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))


    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={str(self.path)!r})"


def train_tokenizer(
    text: str | Sequence[str],
    vocab_size: int,
    cache_dir: str | Path | None = None,
    model_type: str = "bpe",
    max_lines: int = 200_000,
) -> Tokenizer:
    """Train (or load from the cache) a tokenizer on `text`: one string or a list of documents.

    At most `max_lines` non-empty lines are used, evenly spaced through the corpus, which
    keeps training to seconds on large corpora such as WikiText-103.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    documents = [text] if isinstance(text, str) else text
    key = documents_sha256(documents)[:16]
    suffix = "json" if model_type == "byte-bpe" else "model"
    name = f"{model_type}-{vocab_size}-{key}-v{TOKENIZER_FORMAT}.{suffix}"
    path = resolve_cache_dir(cache_dir) / "tokenizers" / name
    if not path.exists():
        train = _train_byte_bpe if model_type == "byte-bpe" else _train_sentencepiece
        model = train(_training_lines(documents, max_lines), vocab_size, model_type)
        write_atomically(path, lambda tmp: tmp.write_bytes(model))
    return Tokenizer.load(path)


def _training_lines(documents: Sequence[str], max_lines: int) -> list[str]:
    """Non-empty lines of the corpus (sentencepiece trains on lines), every k-th if too many."""
    lines = [line for document in documents for line in document.splitlines() if line.strip()]
    return lines[:: math.ceil(len(lines) / max_lines)] if len(lines) > max_lines else lines


def _train_byte_bpe(lines: list[str], vocab_size: int, model_type: str) -> bytes:
    """A byte-level BPE (GPT-2's kind, Radford et al. 2019 §2.2) trained on `lines` with the
    `tokenizers` library, the special tokens at sentencepiece's ids: its tokenizer.json."""
    tokenizers = _tokenizers("--tokenizer byte-bpe")
    fast = tokenizers.Tokenizer(tokenizers.models.BPE())
    fast.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = tokenizers.decoders.ByteLevel()
    fast.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    return fast.to_str().encode()


def _train_sentencepiece(lines: list[str], vocab_size: int, model_type: str) -> bytes:
    """The serialized sentencepiece model trained on `lines`, deterministically and quietly."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,  # indentation runs become single tokens
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            input_sentence_size=0,  # use every line given, in order: no random sampling
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=1,
            minloglevel=2,  # errors only: sentencepiece logs to stderr, which notebooks show
        )
    except RuntimeError as error:  # e.g. a vocabulary larger than the corpus can fill
        raise ValueError(
            f"could not train a {vocab_size}-token {model_type} tokenizer on {len(lines)} lines "
            f"of text: {error}"
        ) from None
    return model.getvalue()
