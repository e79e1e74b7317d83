"""Tokenize a corpus once, before training: ``python -m megatron_edu.data.prepare``.

Megatron-LM's ``tools/preprocess_data.py`` (and nanoGPT's ``prepare.py``) turn text into token ids
offline, so that a training run on many ranks reads ids, not text: nothing is tokenized at
start, no rank reads or hashes the corpus, each reads only the samples it is handed. Here a
prepared folder holds

* ``tokens.npy``: every document's ids, each followed by the end-of-document token, uint16 while
  the vocabulary fits (else uint32) — the file ``prepare_data`` builds in its cache, read the
  same way, as a memory map: opening it reads nothing;
* ``documents.npy``: the index, where each document ends in ``tokens.npy`` (int64 offsets);
* ``tokenizer.model`` (or ``tokenizer.json``): the tokenizer the ids are of;
* ``prepared.json``: what was prepared from, and the sizes (written last: a folder without it is
  not a prepared folder).

``train --data DIR`` then reads the folder (``prepare_data`` sees ``prepared.json``), its batches
the same as from the text with the same tokenizer. ``--workers`` encodes the documents in that
many processes, in order.

    python -m megatron_edu.data.prepare --data corpus.jsonl --vocab-size 32000 --out data/corpus
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_edu.cli import Parser, positive_int
from megatron_edu.data.corpus import load_corpus, write_atomically
from megatron_edu.data.dataset import PREPARED, encode_documents, token_dtype
from megatron_edu.data.tokenizer import Tokenizer, tokenizer_name, train_tokenizer

__all__ = ["prepare", "main"]


def prepare(documents: Sequence[str], tokenizer: Tokenizer, out: str | Path,
            workers: int = 1, source: str = "") -> Path:
    """Write ``documents`` as token ids with their index and tokenizer into the folder ``out``
    (see the module docstring); return it. Progress goes to stderr, a line per part done."""
    out = Path(out)
    parts = _encoded(documents, tokenizer, workers)
    tokens = np.concatenate(parts) if parts else np.zeros(0, token_dtype(tokenizer.vocab_size))
    ends = np.flatnonzero(tokens == tokenizer.eos_id).astype(np.int64) + 1  # eos ends each
    _save(out / "tokens.npy", tokens)
    _save(out / "documents.npy", ends)
    shutil.copyfile(tokenizer.path, out / tokenizer_name(tokenizer.path))
    meta = {"source": source, "documents": len(ends), "tokens": len(tokens),
            "vocab_size": tokenizer.vocab_size, "dtype": str(tokens.dtype)}
    write_atomically(out / PREPARED, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    return out


def _save(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("wb") as file:
            np.save(file, array)

    write_atomically(path, write)


def _encoded(documents: Sequence[str], tokenizer: Tokenizer, workers: int) -> list[np.ndarray]:
    """The documents' ids (each followed by eos), part by part in order, in ``workers``
    processes (spawned, each loading the tokenizer from its file)."""
    size = max(1, min(256, -(-len(documents) // workers)))
    jobs = [(str(tokenizer.path), documents[i:i + size]) for i in range(0, len(documents), size)]
    with multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else _Serial() as pool:
        parts = []
        for i, part in enumerate(pool.imap(_encode_part, jobs), 1):
            parts.append(part)
            print(f"\rencoded {i}/{len(jobs)} parts of the corpus", end="", file=sys.stderr)
    print(file=sys.stderr)
    return parts


class _Serial:
    """A pool of one: this process (``imap`` as ``map``)."""

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc) -> None:
        pass

    imap = staticmethod(map)


def _encode_part(job: tuple[str, Sequence[str]]) -> np.ndarray:
    """One part's documents as ids, each followed by eos."""
    path, documents = job
    return encode_documents(documents, Tokenizer.load(path))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: the prepared folder's path printed, or one error line (status 2)."""
    parser = Parser(prog="python -m megatron_edu.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--data", nargs="+", required=True,
                        help="'default', 'wikitext103', or .txt and .jsonl files or folders")
    parser.add_argument("--text-field", default="text", help="a .jsonl line's text field")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="a sentencepiece .model or a Hugging Face "
                       "tokenizer.json (or a folder holding one) to encode with")
    which.add_argument("--vocab-size", type=positive_int, help="train a tokenizer of this size")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--workers", type=positive_int, default=1)
    parser.add_argument("--cache-dir", type=Path, help="default ~/.cache/megatron_edu")
    args = parser.parse_args(argv)
    try:
        source = args.data[0] if args.data[0] in ("default", "wikitext103") else args.data
        documents = load_corpus(source, args.cache_dir, args.text_field)
        tokenizer = (Tokenizer.load(args.tokenizer) if args.tokenizer is not None
                     else train_tokenizer(documents, args.vocab_size, args.cache_dir))
    except (ValueError, OSError) as error:
        parser.error(str(error))
    print(prepare(documents, tokenizer, args.out, args.workers, " ".join(args.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
