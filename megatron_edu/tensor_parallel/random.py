"""Dropout masks that depend on the data, not on the layout — and recomputation that replays them.

1909.08053 Appendix B.2: dropout outside the tp regions (embeddings, residual branches, where
every tp rank holds the same activation) must draw the *same* mask on every tp rank, or the
replicas drift apart; inside a region (attention probabilities, each rank's own heads) a
*different* one. Megatron-LM keeps two streams (``CudaRNGStatesTracker``), the inside one seeded
per tp rank: its masks depend on tp, and a tp = 2 run does not take the serial run's steps.

Here a mask is not drawn from a stream but computed, element by element, from a key per sequence
of the batch,

    key(model seed, step, global sample index, global layer, site)

and the element's index in the serial model's tensor. A rank holding part of a tensor — its
heads (part r of t), its part of the sequence under sequence or context parallelism — computes
that part of the serial mask (``Dropout(parts=…)``). Nothing else enters: not the microbatch,
stage, chunk, dp replica, nor tp rank. So every layout, tp > 1 included, gives the serial
model's losses and gradients *with dropout on* (tests/test_ptdp.py): different heads get
different masks because they are different elements of one mask, as B.2 asks. Recomputation
(2104.04473 §3.5) replays the masks: the key is an argument of the function.

As counter-based generators do (Philox), element j of a sample's mask hashes j with the sample's
64-bit key (``mask_seed``; 32-bit words k₀, k₁), fmix32 being MurmurHash3's finaliser (a
bijection; every output bit depends on every input bit):

    h = fmix32(fmix32(j ⊕ k₀) ⊕ k₁),    kept ⟺ h ≥ round(p·2³²).

The hash runs over the whole batch, on a GPU in one compiled kernel, on a CPU in int64 where no
product overflows: the same bits. The mask kept for backward is 1 byte an element (2205.05198).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.utils.checkpoint
from torch import nn

from megatron_edu.grid import to_device

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


def mask_seed(seed: int, step: int, sample: int, layer: int, site: str) -> int:
    """The 64-bit key of one sample's mask at one dropout site (the same on every machine)."""
    text = f"{seed}/{step}/{sample}/{layer}/{site}"
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


def _keep(keys: torch.Tensor, j: torch.Tensor, p: float) -> torch.Tensor:
    h = _fmix32(j ^ keys[:, :1])                 # [b, n]: element indices j [n] of each sample
    h ^= keys[:, 1:]
    return _fmix32(h) >= round(p * 2**32)


def _keep_mask(keys: torch.Tensor, start: int, n: int, p: float) -> torch.Tensor:
    return _keep(keys, torch.arange(start, start + n, device=keys.device), p)


@cache
def _keep_kernel() -> Callable[..., torch.Tensor]:
    """``_keep`` as one fused kernel (a GPU's: its ~23 elementwise passes in one)."""
    return torch.compile(_keep, dynamic=True, fullgraph=True)


def keep_mask(keys: torch.Tensor, start: int, n: int, p: float) -> torch.Tensor:
    """[b, n] booleans (True: kept): elements start … start+n−1 of each sample's mask, keyed by
    a row of ``keys`` [b, 2] (int64, 32-bit words). A GPU runs one compiled kernel (the same bits,
    tested); a CPU the chain on blocks of 2¹⁵ elements, whose ~23 passes stay in cache (2.4×)."""
    if keys.is_cuda:
        return _keep_kernel()(keys, torch.arange(start, start + n, device=keys.device), p)
    cols = max(1, 2**15 // len(keys))
    blocks = [_keep_mask(keys, start + c, min(cols, n - c), p) for c in range(0, n, cols)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)


class Dropout(nn.Module):
    """Dropout with each sample's mask keyed by (seed, step, sample, layer, site): the serial
    model's mask. ``parts``: the parts (r, t), part r of t, of dim 1 that x holds, in order:
    ((r, t),) for a tp rank's heads or an SP rank's sequence; the zig-zag chunks ((r, 2·cp),
    (2·cp − 1 − r, 2·cp)) under context parallelism; ((0, 1),) the whole."""

    def __init__(self, p: float, seed: int, layer: int, site: str,
                 parts: tuple[tuple[int, int], ...] = ((0, 1),)) -> None:
        super().__init__()
        self.p, self.seed, self.layer, self.site, self.parts = p, seed, layer, site, parts

    def keep(self, key: DropoutKey | None, x: torch.Tensor) -> torch.Tensor:
        """The boolean mask (True: kept) for ``x`` [b, ...], one sample per row."""
        if key is None or len(key.samples) != x.shape[0]:
            raise ValueError(f"dropout in training needs a DropoutKey naming the {x.shape[0]} "
                             f"samples of the batch, got {key}")
        n = x[0].numel() // len(self.parts)             # the elements of one part of a sample
        if n * self.parts[0][1] > 2**32:
            raise ValueError(f"a sample's mask is indexed by 32 bits: "
                             f"{n * self.parts[0][1]} elements")
        keys = self._keys(key, x.device)
        masks = [keep_mask(keys, r * n, n, self.p) for r, _ in self.parts]
        return (masks[0] if len(masks) == 1 else torch.cat(masks, 1)).view(x.shape)

    def keep_at(self, key: DropoutKey, index: torch.Tensor) -> torch.Tensor:
        """[b, *index.shape]: the mask at the elements ``index`` (int64, < 2³²) of each sample's
        whole mask — ``keep``'s bits there (a context-parallel rank's blocks of the scores)."""
        keep = _keep_kernel() if index.is_cuda else _keep    # the GPU's kernel, as ``keep``'s
        mask = keep(self._keys(key, index.device), index.flatten(), self.p)
        return mask.view(len(key.samples), *index.shape)

    @torch.compiler.disable       # host work (sha256): a compiled block calls it as it is
    def _keys(self, key: DropoutKey | None, device: torch.device) -> torch.Tensor:
        if key is None:
            raise ValueError("dropout in training needs a DropoutKey naming the samples")
        keys = [mask_seed(self.seed, key.step, sample, self.layer, self.site)
                for sample in key.samples]
        keys = torch.tensor([[k & _M32, k >> 32] for k in keys])       # [b, 2], on the host
        return to_device(keys, device)               # a GPU's: queued, no host sync a site

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
