"""The GPT configuration: sizes, presets from the papers, and the checks that tensor and pipeline
parallelism need, run before any process starts (DESIGN principle 7).

Presets:
  tiny                    a model a 2-core laptop trains in minutes (the notebooks' and tests' size)
  gpt2-small … gpt2-xl    Radford et al. 2019, Table 2 (117M, 345M, 762M, 1542M)
  megatron-1.2b … 8.3b    1909.08053 Table 1, the weak-scaling series (vocab 51,200, seq 1024;
                          /work/shared/papers/1909.08053_configs.csv)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["GPTConfig", "PRESETS", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "full")


@dataclass
class GPTConfig:
    """A GPT-2-style model. ``ffn_hidden`` = 0 means 4·hidden, resolved at construction (so
    ``dataclasses.replace(config, hidden=…)`` keeps the old value: pass ``ffn_hidden=0`` too).

    How activations are kept (Korthikanti et al. 2022, arXiv 2205.05198; ``perf.memory`` counts
    them): ``recompute`` "full" keeps only each block's input and runs the block again in the
    backward pass (2104.04473 §3.5); "selective" recomputes only the attention core — softmax,
    its dropout and the product with V, the 5·a·s²·b part that grows with s²; "none" keeps
    everything. ``sequence_parallel`` splits the activations along the sequence over the tp ranks
    wherever they would be replicated (layer norms, dropouts, residual adds). ``fused``: the
    attention core as one kernel (``scaled_dot_product_attention``), bias+GeLU and
    bias+dropout+add compiled into one each (``torch.compile``); off, every operation runs on its
    own, as the papers count them. (``True``/``False`` for ``recompute`` mean "full"/"none".)
    """

    vocab_size: int = 50257
    seq_len: int = 1024
    num_layers: int = 12
    hidden: int = 768
    num_heads: int = 12
    ffn_hidden: int = 0                  # 0 → 4·hidden (GPT-2)
    dropout: float = 0.1
    layernorm_eps: float = 1e-5
    seed: int = 1234
    recompute: str = "none"              # "none" | "selective" | "full" (see below)
    sequence_parallel: bool = False      # split the sequence outside the tp regions (2205.05198)
    fused: bool = False                  # fused kernels (2104.04473 §4.2; see below)
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # Megatron's padding unit, times tp

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            self.ffn_hidden = 4 * self.hidden
        for name in ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden = {self.hidden} is not divisible by "
                             f"num_heads = {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.recompute, bool):  # the older on/off flag (checkpoints keep it)
            self.recompute = "full" if self.recompute else "none"
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary rounded up to a multiple of 128·tp, so each tp rank gets whole
        128-row blocks (Megatron's ``make-vocab-size-divisible-by``: 50,257 → 50,304 at tp=1)."""
        unit = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / unit) * unit

    def validate(self, tp: int = 1, pp: int = 1, chunks: int = 1) -> None:
        """Raise a ValueError naming the numbers if this model cannot be split tp × pp·chunks."""
        for name, n in (("tp", tp), ("pp", pp), ("chunks", chunks)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        # §3: attention is split by heads, the MLP by its ffn columns (tp | heads ⇒ tp | hidden)
        for name in ("num_heads", "ffn_hidden"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name} = {getattr(self, name)} is not divisible by the "
                                 f"tensor-parallel size tp = {tp}")
        if self.sequence_parallel and self.seq_len % tp:
            raise ValueError(f"sequence parallelism splits the sequence over tp: seq_len = "
                             f"{self.seq_len} is not divisible by tp = {tp}")
        if self.num_layers % (pp * chunks):
            raise ValueError(f"num_layers = {self.num_layers} is not divisible by pp·chunks = "
                             f"{pp}·{chunks} = {pp * chunks} (every virtual pipeline stage "
                             f"holds the same number of layers)")

    def num_parameters(self, tp: int = 1) -> int:
        """Parameters held by one tensor-parallel rank of the whole model (padded vocabulary).

        Split by tp: the embedding table, qkv and fc (weights and biases), the two output
        projections' weights. Replicated: positions, layer norms, the output projections' biases.
        At tp=1 this is 12·l·h² + 13·l·h + (V + s)·h + 2h (2104.04473 §5.1, plus the final LN).
        """
        self.validate(tp)
        h, ffn = self.hidden, self.ffn_hidden
        split_per_layer = (3 * h * h + 3 * h) + h * h + (h * ffn + ffn) + ffn * h
        replicated_per_layer = 4 * h + 2 * h  # two layer norms, two row-parallel biases
        per_layer = split_per_layer // tp + replicated_per_layer
        embeddings = self.padded_vocab(tp) * h // tp + self.seq_len * h
        return self.num_layers * per_layer + embeddings + 2 * h

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration (see the module docstring), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _gpt2(layers: int, hidden: int, heads: int) -> dict[str, int]:
    return dict(vocab_size=50257, seq_len=1024, num_layers=layers, hidden=hidden, num_heads=heads)


def _megatron(layers: int, hidden: int, heads: int) -> dict[str, int]:
    return dict(vocab_size=51200, seq_len=1024, num_layers=layers, hidden=hidden, num_heads=heads)


# Keyword arguments rather than configs, so that overriding ``hidden`` also rescales ffn_hidden.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=4096, seq_len=128, num_layers=4, hidden=128, num_heads=4),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "megatron-1.2b": _megatron(40, 1536, 16),
    "megatron-2.5b": _megatron(54, 1920, 20),
    "megatron-4.2b": _megatron(64, 2304, 24),
    "megatron-8.3b": _megatron(72, 3072, 32),
}
