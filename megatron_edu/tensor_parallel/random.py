"""Dropout masks that depend on the data, not on the layout — and recomputation that replays them.

1909.08053 Appendix B.2: dropout outside the tensor-parallel regions (on the embeddings and on
each residual branch, where every tp rank holds the same full [b, s, h] activation) must draw the
*same* mask on every tp rank, or the replicas drift apart. Dropout inside a region (on the
attention probabilities, where each rank holds its own heads) must draw a *different* mask on
each rank, or the heads of different ranks would share one pattern. Megatron-LM keeps two
generator streams for this (its ``CudaRNGStatesTracker``), the inside one seeded per tp rank.

Here a mask is not drawn from a stream that advances with every use, but computed from a key
made of what the mask is *for*, one per sequence of the batch:

    key(model seed, step, global sample index, global layer, site [, tp rank inside a region])

* Outside the regions no tp rank enters the key: every tp rank draws the same mask. Inside,
  each rank's own tp rank does: different masks per rank — Megatron's per-tp-rank streams.
* Nothing else enters it — not the microbatch, the pipeline stage, the interleaved chunk or the
  data-parallel replica that computes the sample. Every layout draws the masks the serial model
  draws for the same sample at the same step, so with tp = 1 every layout (pipelines, interleaving,
  dp, ZeRO-1) gives the serial model's losses and gradients *with dropout on*
  (tests/test_ptdp.py). With tp > 1 the attention-probability masks differ from the serial
  model's, as in Megatron-LM: each rank keys its heads with its own tp rank, where the serial
  model keys all heads with rank 0 (notebook 02).
* Activation recomputation (2104.04473 §3.5) replays the masks by construction: the key is an
  argument of the recomputed function, so its second run draws the same masks — no generator
  state to save and restore around it.

``DropoutKey(step, samples)`` names the step and the global sample index of each row of a batch;
the pipeline engine makes one per microbatch. The mask is computed the way counter-based
generators work (Philox, that of PyTorch's CUDA kernels): element j of a sample's mask is a hash
of j and the sample's 64-bit key (``mask_seed``; its 32-bit words k₀, k₁),

    h = fmix32(fmix32(j ⊕ k₀) ⊕ k₁),    kept ⟺ h ≥ round(p·2³²),

fmix32 being MurmurHash3's finaliser, a bijection of 32-bit integers whose every output bit
depends on every input bit. The b keys travel to the device as one [b, 2] tensor; the rest is a
fixed chain of integer kernels over the whole [b, …] batch, whatever b: no loop over samples, no
generator. Integer arithmetic only, in int64 holding 32-bit values, where no product overflows:
the same bits on a CPU and a GPU by construction. The mask is a boolean tensor, 1 byte per
element, the mask 2205.05198 counts (the int64 hashes, 16 bytes per element while they are
computed, are never saved for backward). Under sequence parallelism a rank holds 1/t of each
sequence: it hashes only its part of the element indices — its slice of the whole sequence's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["DropoutKey", "mask_seed", "keep_mask", "Dropout", "checkpoint"]

_M32 = 2**32 - 1


@dataclass(frozen=True)
class DropoutKey:
    """Which optimizer step, and which global sample each row of the batch is."""

    step: int
    samples: tuple[int, ...]

    @classmethod
    def first(cls, batch: int, step: int = 0) -> DropoutKey:
        """Rows 0 … batch−1 of ``step``: a batch used on its own."""
        return cls(step, tuple(range(batch)))


def mask_seed(seed: int, step: int, sample: int, layer: int, site: str,
              tp_rank: int | None = None) -> int:
    """The 64-bit key of one sample's mask at one dropout site (the same on every machine)."""
    text = f"{seed}/{step}/{sample}/{layer}/{site}" + ("" if tp_rank is None else f"/{tp_rank}")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser, in place, on int64 values < 2³². Each multiplier c > 2³¹ is
    applied as c − 2³² (≡ c mod 2³², and |x·(c − 2³²)| < 2⁶³: no overflow), then kept mod 2³²."""
    x ^= x >> 16
    x *= 0x85EBCA6B - 2**32
    x &= _M32
    x ^= x >> 13
    x *= 0xC2B2AE35 - 2**32
    x &= _M32
    x ^= x >> 16
    return x


def keep_mask(keys: torch.Tensor, start: int, n: int, p: float) -> torch.Tensor:
    """[b, n] booleans (True: kept): elements start … start+n−1 of each sample's mask, whose
    key is a row of ``keys`` [b, 2] (int64, 32-bit words). One kernel chain for the batch."""
    h = _fmix32(torch.arange(start, start + n, device=keys.device) ^ keys[:, :1])
    h ^= keys[:, 1:]
    return _fmix32(h) >= round(p * 2**32)


class Dropout(nn.Module):
    """Dropout with each sample's mask keyed by (seed, step, sample, layer, site).

    ``tp_rank``: None outside the tensor-parallel regions (the same mask on every tp rank);
    this rank's tp rank inside them (its own mask). ``sequence_part`` = (r, t): the input holds
    part r of t of the sequence (dim 1; sequence parallelism): the mask is that part of the
    whole sequence's.
    """

    def __init__(self, p: float, seed: int, layer: int, site: str, tp_rank: int | None = None,
                 sequence_part: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        self.p, self.seed, self.layer, self.site, self.tp_rank = p, seed, layer, site, tp_rank
        self.sequence_part = sequence_part

    def keep(self, key: DropoutKey | None, x: torch.Tensor) -> torch.Tensor:
        """The boolean mask (True: kept) for ``x`` [b, ...], one sample per row."""
        if key is None or len(key.samples) != x.shape[0]:
            raise ValueError(f"dropout in training needs a DropoutKey naming the {x.shape[0]} "
                             f"samples of the batch, got {key}")
        part, parts = self.sequence_part
        n = x[0].numel()                         # this rank's part of one sample
        if n * parts > 2**32:
            raise ValueError(f"a sample's mask is indexed by 32 bits: {n * parts} elements")
        keys = [mask_seed(self.seed, key.step, sample, self.layer, self.site, self.tp_rank)
                for sample in key.samples]
        keys = torch.tensor([[k & _M32, k >> 32] for k in keys], device=x.device)  # [b, 2]
        return keep_mask(keys, part * n, n, self.p).view(x.shape)

    def forward(self, x: torch.Tensor, key: DropoutKey | None) -> torch.Tensor:
        """x with the mask of ``key`` applied and the kept values scaled by 1/(1 − p)."""
        if not self.training or self.p == 0.0:
            return x
        return x * self.keep(key, x) * (1.0 / (1.0 - self.p))  # saves the 1-byte mask only


def checkpoint(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)`` keeping only its inputs; recomputed in backward (2104.04473 §3.5). The
    masks repeat because they are a function of the arguments (a ``DropoutKey`` among them)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                             preserve_rng_state=False)
