"""Gradient buckets: parameters whose gradients share one flat buffer (Li et al. 2020; Megatron-LM's
contiguous gradient buffer).

Fewer, larger messages use the network better than one per tensor; several buckets rather than
one let communication start before backward ends. Gradients are produced in reverse
registration order (the last layer's first), so buckets are filled in that order. Each
``param.grad`` is a view into its bucket's buffer: backward accumulates straight into what is
communicated, and the averaged result needs no copy back.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["Bucket", "make_buckets"]


class Bucket:
    """Consecutive parameters whose gradients (and, under ZeRO-1, values) share a flat buffer.

    The buffer is padded to a multiple of dp so that it splits into dp equal shards (ZeRO-1).
    """

    def __init__(self, index: int, params: list[nn.Parameter], dp: int) -> None:
        self.index, self.params, self.dp = index, params, dp
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # [start of each]
        self.numel = math.ceil(self.offsets[-1] / dp) * dp
        first = params[0]
        self.grad_data = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.param_data: torch.Tensor | None = None   # ZeRO-1 only: see flatten_params

    @property
    def bytes(self) -> int:
        return self.grad_data.numel() * self.grad_data.element_size()

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its slice of ``flat``, shaped like it."""
        for p, start in zip(self.params, self.offsets, strict=False):
            yield p, flat[start:start + p.numel()].view_as(p)

    def shard(self, rank: int) -> tuple[int, int]:
        """The [start, end) of the buffer that dp rank ``rank`` owns under ZeRO-1."""
        size = self.numel // self.dp
        return rank * size, (rank + 1) * size

    @torch.no_grad()
    def flatten_params(self) -> None:
        """Move the parameters into one flat buffer too, so shards can be all-gathered in place."""
        self.param_data = torch.zeros_like(self.grad_data)
        for p, view in self.views(self.param_data):
            view.copy_(p)
            p.data = view


def make_buckets(modules: list[nn.Module], bucket_bytes: float, dp: int,
                 alone: Iterable[nn.Parameter] = ()) -> list[Bucket]:
    """Trainable parameters in reverse registration order (last module first), cut into buckets.

    A bucket closes once it holds ``bucket_bytes``, at the end of each module and where the dtype
    changes. Each parameter in ``alone`` gets a bucket of its own (ZeRO-1 gives one to a tied
    embedding, so that its shards are laid out alike on the first and the last pipeline stage
    and the two copies' gradients can be summed shard by shard, as in Megatron-LM).
    """
    alone = {id(p) for p in alone}
    groups: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for module in reversed(modules):
        current: list[nn.Parameter] = []
        for p in reversed(list(module.parameters())):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if current and (id(p) in alone or p.dtype != current[0].dtype):
                groups.append(current)
                current = []
            current.append(p)
            if id(p) in alone or _nbytes(current) >= bucket_bytes:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    return [Bucket(i, params, dp) for i, params in enumerate(groups)]


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
