"""ZeRO stage 3 (Rajbhandari et al. 2020, §5.3, "P_os+g+p"; PyTorch's FSDP, Zhao et al. 2023): the
parameters sharded over the dp ranks too, gathered only where they are used.

At rest a dp rank holds 1/dp of every parameter: its shard of each unit's flat buffer, which
the ``DistributedOptimizer`` steps. A *unit* is a transformer block or the rest of a model chunk
(the root), one bucket each. Forward all-gathers a unit just before its forward, prefetching the
next, and frees it after; backward gathers it again when it reaches the unit's output,
prefetching the previous, and frees it, and its whole gradients, once those are reduce-scattered
(ZeRO-2's way). The root stays gathered from forward to backward: the tied embedding reads the
words in and scores them out, as FSDP2 keeps its root.

Traffic per step, Ψ a unit's bytes, d ranks: two all-gathers and one reduce-scatter of
(d − 1)/d · Ψ each, 1.5× data parallelism's all-reduce (the ZeRO paper's §7), and m times with
m microbatches: why Megatron-LM's code pairs pipelines with ZeRO-1 only (its distributed
optimizer; 2104.04473 itself shards nothing), and DeepSpeed refuses ZeRO-2/3 inside a pipeline.

An emptied parameter stays a view of its unit's flat buffer, whose storage is resized to nothing
at rest and back when gathered (``_fill``, ``_free``; FSDP's mechanism): shapes stay intact, and
what autograd saved reads the refilled storage. The all-gather writes into that buffer, its
input this rank's own slice of it (FSDP2's copy-in): no other copy of the unit. Under full
recomputation a block's forward runs again inside backward; its hooks see that (``in_backward``)
and neither free nor prefetch. Gathers are tagged with their bucket for ``timing.UnitTimer``.

Under autocast a forward gathers its units in the compute dtype, bf16, as FSDP2's
``MixedPrecisionPolicy(param_dtype)``: gathered in fp32, each matmul's bf16 cast of its weight
would be kept for backward, a bf16 copy of the whole model by the end of forward — which
autocast's ``cache_enabled=False`` cannot prevent. The fp32 shards stay the master weights and
gradients are reduce-scattered in fp32; matmuls read the casts autocast would make, embeddings
and layer norms bf16 weights (as in FSDP2's and Megatron-LM's bf16 models).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.data_parallel.zero2 import ZeRO2

__all__ = ["ZeRO3", "ParameterSharding", "in_backward"]


class ZeRO3(ZeRO2):
    """``ZeRO2`` whose parameters are sharded too: one bucket per unit (each of ``units``, and
    the rest of each of ``modules``), gathered around its forward and backward by a
    ``ParameterSharding``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sharding = ParameterSharding(self.buckets, self.modules, self.units)

    def _make_buckets(self, bucket_bytes: float, alone: Iterable[nn.Parameter],
                      units: list[nn.Module]) -> list[Bucket]:
        unit_ids = {id(u) for u in units}
        self.units = [u for m in self.modules for u in m.modules() if u is m or id(u) in unit_ids]
        return make_buckets(self.units, math.inf, self.group_of, alone)

    def _allocate(self, bucket: Bucket) -> None:
        super()._allocate(bucket)
        bucket.param_shard = bucket.param_shard.clone()      # the master copy, at rest
        _free(bucket)

    def _launch(self, bucket: Bucket) -> None:
        super()._launch(bucket)
        self.sharding.after_backward(bucket)     # its gradients are all in: free the unit

    def held_params(self) -> list[torch.Tensor]:
        return [b.param_shard for b in self.buckets]

    def gathered(self) -> AbstractContextManager:
        return self.sharding.gathered()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step this rank's pieces; each keeps its shard until the next forward gathers it."""
        self.sharding.free_all()                 # no gathered copy outlives the update
        optimizer.step()


def in_backward() -> bool:
    """Is autograd running a backward pass right now (a recomputed forward)? Observers of the
    units (``timing.UnitTimer``) ask it too."""
    return torch._C._current_graph_task_id() != -1


def _gathered(bucket: Bucket) -> bool:
    """Does ``param_data`` hold its storage (gathered, or its all-gather on the way)?"""
    return bucket.param_data.untyped_storage().nbytes() > 0


@torch.no_grad()
def _fill(bucket: Bucket, dtype: torch.dtype) -> None:
    """Give ``param_data`` its storage back, in ``dtype``, with this rank's shard in its own slice:
    the all-gather's input. Another dtype (autocast turned on or off) is a new flat buffer, which
    the parameters then view."""
    if bucket.param_data.dtype == dtype:
        bucket.param_data.untyped_storage().resize_(bucket.numel * dtype.itemsize)
    else:
        bucket.param_data = torch.empty(bucket.numel, dtype=dtype, device=bucket.device)
        for p, view in bucket.views(bucket.param_data):
            p.data = view
    bucket.param_data[bucket.start:bucket.end].copy_(bucket.param_shard)


def _free(bucket: Bucket) -> None:
    """Empty ``param_data``'s storage; the parameters, and what autograd saved of them, stay its
    views, their values gone until ``_fill``."""
    bucket.param_data.untyped_storage().resize_(0)


class ParameterSharding:
    """The gathers and frees of ZeRO-3 for its ``buckets``, each over its group: ``modules`` are
    the bucketed modules in forward order (each root — a model chunk —, then its units)."""

    def __init__(self, buckets: list[Bucket], roots: list[nn.Module],
                 modules: list[nn.Module]) -> None:
        self.device, self.master = buckets[0].device, buckets[0].dtype  # fp32
        self._roots = roots = {id(m) for m in roots}      # kept gathered forward → backward
        owner: dict[int, nn.Module] = {}                 # each parameter's innermost unit
        for module in modules:
            for p in module.parameters():
                owner[id(p)] = module
        self.units: list[tuple[nn.Module, list[Bucket]]] = []
        for module in modules:
            mine = list({id(b): b for b in buckets for p in b.params
                         if owner[id(p)] is module}.values())
            if mine:
                self.units.append((module, mine))
        self._index = {id(m): i for i, (m, _) in enumerate(self.units)}
        # backward's next unit: the one before, but a root's is the last unit of its chunk
        self._backward_next = list(range(-1, len(self.units) - 1))
        starts = [i for i, (m, _) in enumerate(self.units) if id(m) in roots]
        for start, end in zip(starts, [*starts[1:], len(self.units)], strict=False):
            self._backward_next[start] = end - 1 if end - 1 > start else -1
        self._pending: dict[int, torch.distributed.Work] = {}      # bucket index -> its gather
        self.unit_of = {b.index: i for i, (_, bs) in enumerate(self.units) for b in bs}
        self._pinned = False                                 # inside ``gathered``
        for module, _ in self.units:
            module.register_forward_pre_hook(self._before_forward)
            module.register_forward_hook(self._after_forward)

    # --- the hooks -------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args) -> None:
        i = self._index[id(module)]
        if in_backward():                                # recomputed: backward gathered it
            self._gather(i)
            return
        dtype = comm.compute_dtype(self.device.type, self.master)  # FSDP2's param_dtype
        self._gather(i, dtype)
        self._prefetch(i + 1, dtype)                     # the next unit, during this one

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if in_backward():                                # recomputed: backward needs it now
            return
        i = self._index[id(module)]
        training = torch.is_grad_enabled()
        if not training or id(module) not in self._roots:
            self._free(i)
        if training and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._gather(i)                                  # in the dtype its forward used
        self._prefetch(self._backward_next[i])           # backward runs the units in reverse

    # --- called by ZeRO3 -------------------------------------------------------------------

    def after_backward(self, bucket: Bucket) -> None:
        """The bucket's gradients are all in (reduce-scatter launched): free its parameters."""
        self._free(self.unit_of[bucket.index], bucket)

    def free_all(self) -> None:
        """Free every gathered unit (before an optimizer step: no stale copy survives it)."""
        for i in range(len(self.units)):
            self._free(i)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Inside, every parameter is whole, in the master dtype, to read, save or load (a
        collective). What is written into them stays: each rank keeps its shard of it on leaving."""
        self.free_all()                                  # what a forward left, maybe bf16
        for i in range(len(self.units)):
            self._gather(i, self.master)
        self._pinned = True                              # the hooks inside free nothing
        try:
            yield
        finally:
            with torch.no_grad():
                for _, buckets in self.units:
                    for bucket in buckets:
                        bucket.param_shard.copy_(bucket.param_data[bucket.start:bucket.end])
            self._pinned = False
            self.free_all()

    # --- gathering -------------------------------------------------------------------------

    def _prefetch(self, i: int, dtype: torch.dtype | None = None) -> None:
        if 0 <= i < len(self.units):
            for bucket in self.units[i][1]:
                self._start(bucket, dtype)

    def _start(self, bucket: Bucket, dtype: torch.dtype | None = None) -> None:
        """Launch the all-gather of ``bucket``'s shards into its own buffer, in ``dtype`` (None:
        the buffer's, as the forward left it), unless it is gathered or on its way."""
        if _gathered(bucket):
            return
        _fill(bucket, dtype or bucket.param_data.dtype)
        self._pending[bucket.index], _ = comm.all_gather(
            bucket.param_data[bucket.start:bucket.end], bucket.group, 0, "dp params gather",
            out=bucket.param_data, async_op=True, tag=bucket.index)

    def _gather(self, i: int, dtype: torch.dtype | None = None) -> None:
        for bucket in self.units[i][1]:
            self._start(bucket, dtype)
            self._pending.pop(bucket.index, comm.DONE).wait()

    def _free(self, i: int, only: Bucket | None = None) -> None:
        """Free unit ``i``'s buckets (``only`` one of them), unless ``gathered`` pins them."""
        for bucket in self.units[i][1] if only is None else [only]:
            if _gathered(bucket) and not self._pinned:
                self._pending.pop(bucket.index, comm.DONE).wait()   # never under a gather
                _free(bucket)
