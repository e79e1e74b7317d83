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
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from megatron_edu.comm import CommGroup

__all__ = ["Bucket", "make_buckets"]


class Bucket:
    """Consecutive parameters whose gradients (and, under ZeRO, values) share a flat buffer,
    reduced over ``group``: the dp (× cp) ranks, or for experts the expert-data-parallel ranks.

    The buffer is padded to a multiple of dp (the group's size) so that it splits into dp equal
    shards; dp rank r owns shard r, [``start``, ``end``). Which buffers exist, and when, is the
    data-parallel stage's to say (Rajbhandari et al. 2020, §5):

    stage  gradients                                     parameters
    0      ``grad_data`` whole, always                   the model's own tensors
    1      ``grad_data`` whole; ``grad_shard`` views     ``param_data`` whole, which the weights
           this rank's part                              view; ``param_shard`` views its part
    2      ``grad_data`` only during a backward, until   as stage 1
           reduce-scattered into (own) ``grad_shard``
    3      as stage 2                                    (own) ``param_shard`` at rest;
                                                         ``param_data`` only while gathered
    """

    def __init__(self, index: int, params: list[nn.Parameter], group: CommGroup) -> None:
        self.index, self.params, self.group, self.dp = index, params, group, group.size
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # [start of each]
        self._position = {id(p): i for i, p in enumerate(params)}
        self.numel = math.ceil(self.offsets[-1] / self.dp) * self.dp
        self.dtype, self.device = params[0].dtype, params[0].device
        self.start, self.end = self.shard(group.rank)
        self.grad_data: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None

    def zeros(self, n: int | None = None) -> torch.Tensor:
        """A buffer of ``n`` zeros (default: the whole bucket) in its dtype, on its device."""
        return torch.zeros(self.numel if n is None else n, dtype=self.dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its slice of ``flat``, shaped like it."""
        for p, start in zip(self.params, self.offsets, strict=False):
            yield p, flat[start:start + p.numel()].view_as(p)

    def view(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """``param``'s slice of ``flat``, shaped like it."""
        start = self.offsets[self._position[id(param)]]
        return flat[start:start + param.numel()].view_as(param)

    def shard(self, rank: int) -> tuple[int, int]:
        """The [start, end) of the buffer that dp rank ``rank`` owns under ZeRO."""
        size = self.numel // self.dp
        return rank * size, (rank + 1) * size

    @torch.no_grad()
    def flatten_params(self) -> None:
        """Make each parameter a view of one flat ``param_data``, so that shards are all-gathered
        in place (ZeRO); ``param_shard`` is this rank's part."""
        self.param_data = self.zeros()
        for p, view in self.views(self.param_data):
            view.copy_(p)
            p.data = view
        self.param_shard = self.param_data[self.start:self.end]


def make_buckets(modules: list[nn.Module], bucket_bytes: float,
                 group_of: Callable[[nn.Parameter], CommGroup],
                 alone: Iterable[nn.Parameter] = ()) -> list[Bucket]:
    """Trainable parameters in reverse registration order (last module first), cut into buckets:
    one closes once it holds ``bucket_bytes``, at the end of each module and where the dtype or
    the group the gradients are reduced over (``group_of``: dense or expert) changes. Each
    parameter in ``alone`` gets its own (a tied embedding: its shards then lie alike on the first
    and last pipeline stage, so the copies' gradients sum shard by shard under ZeRO, as in
    Megatron-LM)."""
    alone = {id(p) for p in alone}
    groups: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for module in reversed(modules):
        current: list[nn.Parameter] = []
        for p in reversed(list(module.parameters())):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if current and (id(p) in alone or _kind(p, group_of) != _kind(current[0], group_of)):
                groups.append(current)
                current = []
            current.append(p)
            if id(p) in alone or _nbytes(current) >= bucket_bytes:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    return [Bucket(i, params, group_of(params[0])) for i, params in enumerate(groups)]


def _kind(p: nn.Parameter, group_of: Callable[[nn.Parameter], CommGroup]) -> tuple:
    return p.dtype, group_of(p).name


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
