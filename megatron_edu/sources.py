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
from megatron_edu.data.tokenizer import JsonTokenizer
from megatron_edu.grid import ParallelGrid
from megatron_edu.hf import read_hf
from megatron_edu.model import GPTConfig, config_from_dict
from megatron_edu.pipeline.engine import build_chunks

__all__ = ["Source", "hf_source", "checkpoint_source"]


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


def hf_source(path: str) -> tuple[Source, Tokenizer | JsonTokenizer]:
    """A Hugging Face folder's model and tokenizer: the sentencepiece model an export copies in,
    else the folder's own tokenizer.json (``Tokenizer.load``; ``tokenizer.save_pretrained``
    writes one)."""
    return Source(read_hf(path)[0], hf=path), Tokenizer.load(path)   # a GPT-2 or a Llama


def checkpoint_source(path: str | Path,
                      tokenizer: str | None = None) -> tuple[Source, Tokenizer]:
    """A checkpoint's model and its tokenizer (``tokenizer``: another sentencepiece model)."""
    meta = read_metadata(path)
    if tokenizer is None and meta["tokenizer"] is None:
        raise ValueError(f"the checkpoint {meta['path']} names no tokenizer: pass --tokenizer")
    config = config_from_dict(meta["config"])
    return Source(config, checkpoint=meta), Tokenizer.load(tokenizer or meta["tokenizer"])
