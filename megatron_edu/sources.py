"""Where a command's model comes from: a checkpoint of this package's, or a Hugging Face folder
(GPT-2 or Llama, ``megatron_edu.hf``), with the tokenizer that goes with it. ``evaluate`` and
``generate`` take either (``--checkpoint RUN`` or ``--hf DIR``), check it before any rank starts,
and each rank loads only its own slices (``Source.chunks``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from megatron_edu.checkpoint import load_model_chunks, read_metadata
from megatron_edu.data import Tokenizer
from megatron_edu.grid import ParallelGrid
from megatron_edu.hf import read_hf
from megatron_edu.model import GPTConfig, config_from_dict
from megatron_edu.pipeline.engine import build_chunks

__all__ = ["Source", "HFTokenizer", "hf_source", "checkpoint_source"]


@dataclass(frozen=True)
class Source:
    """Where the weights are: a checkpoint (meta.json's contents) or a Hugging Face directory."""

    config: GPTConfig
    checkpoint: dict[str, Any] | None = None
    hf: str | None = None

    def chunks(self, grid: ParallelGrid) -> list[nn.Module]:
        """This rank's pipeline stage, weights loaded (its slices only, from a checkpoint), in
        evaluation mode."""
        chunks = build_chunks(self.config, grid)
        if self.checkpoint is not None:
            load_model_chunks(self.checkpoint["path"], chunks, grid)
        else:
            state = read_hf(self.hf)[1]
            for chunk in chunks:
                chunk.load_full_state_dict(state)
        for chunk in chunks:
            chunk.eval()
        return chunks


class HFTokenizer:
    """A Hugging Face tokenizer saved with the model (``transformers``, offline), spoken to as
    this package's ``Tokenizer``: ids without special tokens, text back."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (ImportError, OSError, ValueError) as error:
            raise ValueError(f"no tokenizer in {path}: save one there (tokenizer.save_pretrained"
                             f", or the tokenizer.model of an export) — {error}") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_id(self) -> int:
        """The end-of-text id (−1, matching no token, if the tokenizer has none)."""
        eos = self._tokenizer.eos_token_id
        return -1 if eos is None else eos


def hf_source(path: str) -> tuple[Source, Tokenizer | HFTokenizer]:
    """A Hugging Face folder's model and tokenizer: the sentencepiece model an export copies in,
    else the folder's own Hugging Face tokenizer."""
    config = read_hf(path)[0]                            # a GPT-2 or a Llama
    own = Path(path) / "tokenizer.model"
    tokenizer = Tokenizer.load(own) if own.exists() else HFTokenizer(path)
    return Source(config, hf=path), tokenizer


def checkpoint_source(path: str | Path,
                      tokenizer: str | None = None) -> tuple[Source, Tokenizer]:
    """A checkpoint's model and its tokenizer (``tokenizer``: another sentencepiece model)."""
    meta = read_metadata(path)
    if tokenizer is None and meta["tokenizer"] is None:
        raise ValueError(f"the checkpoint {meta['path']} names no tokenizer: pass --tokenizer")
    config = config_from_dict(meta["config"])
    return Source(config, checkpoint=meta), Tokenizer.load(tokenizer or meta["tokenizer"])
