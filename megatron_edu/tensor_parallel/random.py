"""Dropout masks that depend on the data, not on the layout — and recomputation that replays them.

1909.08053 Appendix B.2: dropout outside the tensor-parallel regions (on the embeddings and on
each residual branch, where every tp rank holds the same full [b, s, h] activation) must draw the
*same* mask on every tp rank, or the replicas drift apart. Dropout inside a region (on the
attention probabilities, where each rank holds its own heads) must draw a *different* mask on
each rank, or the heads of different ranks would share one pattern. Megatron-LM keeps two
generator streams for this (its ``CudaRNGStatesTracker``), the inside one seeded per tp rank.

Here a mask is not drawn from a stream that advances with every use, but from a seed made of
what the mask is *for*, one per sequence of the batch:

    seed(model seed, step, global sample index, global layer, site [, tp rank inside a region])

* Outside the regions no tp rank enters the seed: every tp rank draws the same mask. Inside,
  each rank's own tp rank does: different masks per rank — Megatron's per-tp-rank streams.
* Nothing else enters it — not the microbatch, the pipeline stage, the interleaved chunk or the
  data-parallel replica that computes the sample. Every layout draws the masks the serial model
  draws for the same sample at the same step, so with tp = 1 every layout (pipelines, interleaving,
  dp, ZeRO-1) gives the serial model's losses and gradients *with dropout on*
  (tests/test_ptdp.py). With tp > 1 the attention-probability masks differ from the serial
  model's, as in Megatron-LM: each rank seeds its heads with its own tp rank, where the serial
  model seeds all heads with rank 0 (notebook 02).
* Activation recomputation (2104.04473 §3.5) replays the masks by construction: the key is an
  argument of the recomputed function, so its second run draws the same masks — no generator
  state to save and restore around it.

``DropoutKey(step, samples)`` names the step and the global sample index of each row of a batch;
the pipeline engine makes one per microbatch. Each sample's mask is drawn by a generator of its
own, seeded by its key: a boolean tensor, 1 byte per element, the mask 2205.05198 counts. Under
sequence parallelism a rank holds 1/t of each sequence: it draws the sample's whole mask and
keeps its part, so the masks are the same with and without it. (The fused attention kernel draws
its mask itself, from the device's default generator: ``seeded`` sets it per sample.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["DropoutKey", "mask_seed", "seeded", "per_sample", "Dropout", "checkpoint"]


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
    """The seed of one sample's mask at one dropout site (stable across processes/machines)."""
    text = f"{seed}/{step}/{sample}/{layer}/{site}" + ("" if tp_rank is None else f"/{tp_rank}")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Inside, the device's default generator starts from ``seed``; outside it is untouched."""
    generator = (torch.cuda.default_generators[device.index if device.index is not None
                                               else torch.cuda.current_device()]
                 if device.type == "cuda" else torch.default_generator)
    outer = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(outer)


def per_sample(fn: Callable[..., torch.Tensor], seeds: list[int],
               *rows: torch.Tensor) -> torch.Tensor:
    """``fn`` on each sample (dim 0 of every tensor in ``rows``) under its own seed; the results
    concatenated: one mask per sample, whatever batch the sample came in."""
    return torch.cat([_seeded_call(fn, seed, [x[i:i + 1] for x in rows])
                      for i, seed in enumerate(seeds)])


def _seeded_call(fn, seed: int, args: list[torch.Tensor]) -> torch.Tensor:
    with seeded(seed, args[0].device):
        return fn(*args)


class Dropout(nn.Module):
    """Dropout with each sample's mask seeded by (seed, step, sample, layer, site).

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

    def seeds(self, key: DropoutKey) -> list[int]:
        return [mask_seed(self.seed, key.step, sample, self.layer, self.site, self.tp_rank)
                for sample in key.samples]

    def keep(self, key: DropoutKey | None, x: torch.Tensor) -> torch.Tensor:
        """The boolean mask (True: kept) for ``x`` [b, ...], one sample per row."""
        if key is None or len(key.samples) != x.shape[0]:
            raise ValueError(f"dropout in training needs a DropoutKey naming the {x.shape[0]} "
                             f"samples of the batch, got {key}")
        part, parts = self.sequence_part
        row = list(x.shape[1:])
        if parts > 1:
            row[0] *= parts                      # the whole sequence's mask, then this part
        generator = torch.Generator(x.device)
        masks = [torch.rand(row, generator=generator.manual_seed(seed), device=x.device)
                 .ge(self.p).chunk(parts)[part] for seed in self.seeds(key)]
        return torch.stack(masks)

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
