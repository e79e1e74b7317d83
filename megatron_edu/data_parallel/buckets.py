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
    """Consecutive parameters whose gradients (and, under ZeRO, values) share a flat buffer.

    The buffer is padded to a multiple of dp so that it splits into dp equal shards; dp rank r
    owns shard r (``shard``). What lives when, by ZeRO stage (Rajbhandari et al. 2020, §5):

    ==========  =============================================  ===================================
    stage       gradients                                      parameters
    ==========  =============================================  ===================================
    0 (DP)      ``grad_data``, whole, always                   the model's own tensors
    1           ``grad_data`` whole; ``grad_shard`` a view     ``param_data`` whole (the weights
                of this rank's part                            are views of it); ``param_shard``
                                                               a view of this rank's part
    2           ``grad_data`` only during a backward, until    as stage 1
                reduce-scattered into ``grad_shard`` (own)
    3           as stage 2                                     ``param_shard`` (own) at rest;
                                                               ``param_data`` only while gathered
    ==========  =============================================  ===================================
    """

    def __init__(self, index: int, params: list[nn.Parameter], dp: int, rank: int = 0,
                 zero: int = 0) -> None:
        self.index, self.params, self.dp, self.zero = index, params, dp, zero
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # [start of each]
        self._position = {id(p): i for i, p in enumerate(params)}
        self.numel = math.ceil(self.offsets[-1] / dp) * dp
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.start, self.end = self.shard(rank)
        self.grad_data: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.param_data: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        if zero <= 1:
            self.grad_data = self._zeros(self.numel)
        if zero == 1:
            self.grad_shard = self.grad_data[self.start:self.end]
        if zero >= 2:
            self.grad_shard = self._zeros(self.numel // dp)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=self.device)

    @property
    def bytes(self) -> int:
        return self.numel * self.params[0].element_size()

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
        """Move the parameters into one flat buffer, so that shards can be all-gathered in place
        (ZeRO-1, 2); ZeRO-3 then keeps only this rank's shard of it (``free_params``)."""
        self.param_data = self._zeros(self.numel)
        for p, view in self.views(self.param_data):
            view.copy_(p)
            p.data = view
        self.param_shard = self.param_data[self.start:self.end]
        if self.zero == 3:
            self.param_shard = self.param_shard.clone()      # the master copy, at rest
            self.free_params()

    @property
    def params_gathered(self) -> bool:
        """ZeRO-3: is ``param_data`` whole now (else its storage is empty)?"""
        return self.param_data.untyped_storage().nbytes() > 0

    @torch.no_grad()
    def fill_params(self, whole: torch.Tensor) -> None:
        """ZeRO-3: give ``param_data`` its storage back and the gathered values."""
        self.param_data.untyped_storage().resize_(self.bytes)
        self.param_data.copy_(whole)

    def free_params(self) -> None:
        """ZeRO-3: empty ``param_data``'s storage. The parameters stay its views — their shapes
        intact, their values gone until ``fill_params`` — and so does what autograd saved of
        them: in backward it reads the refilled storage (FSDP's storage resize)."""
        self.param_data.untyped_storage().resize_(0)

    def open_grads(self) -> torch.Tensor:
        """ZeRO-2, 3: the whole gradient buffer of one backward, zeros until gradients land."""
        if self.grad_data is None:
            self.grad_data = self._zeros(self.numel)
        return self.grad_data


def make_buckets(modules: list[nn.Module], bucket_bytes: float, dp: int,
                 alone: Iterable[nn.Parameter] = (), rank: int = 0,
                 zero: int = 0) -> list[Bucket]:
    """Trainable parameters in reverse registration order (last module first), cut into buckets.

    A bucket closes once it holds ``bucket_bytes``, at the end of each module and where the dtype
    changes. Each parameter in ``alone`` gets a bucket of its own (ZeRO-1 gives one to a tied
    embedding, so that its shards are laid out alike on the first and the last pipeline stage
    and the two copies' gradients can be summed shard by shard, as in Megatron-LM). ``rank``
    and ``zero``: this rank's place among the dp ranks and the ZeRO stage (``Bucket``).
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
    return [Bucket(i, params, dp, rank, zero) for i, params in enumerate(groups)]


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)
