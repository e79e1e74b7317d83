"""``DataParallel``: the dp replicas' gradients summed or averaged once per optimizer step, in
buckets whose all-reduces overlap the rest of backward (2104.04473 §2.1; PyTorch DDP's scheme).

* **Once per optimizer step.** With gradient accumulation (a pipeline runs m microbatches per
  step, §2.2) the gradients of all microbatches are summed locally and communicated once: wrap
  every backward in ``with ddp.sync(is_last_microbatch)``; hooks communicate only during the
  last one.
* **Overlapped, in order.** A bucket's all-reduce is launched asynchronously the moment its last
  gradient arrives, so it runs while backward computes earlier layers. Buckets are launched
  strictly in order, so every rank issues the same collectives in the same order even when a
  gradient is late or missing (a mismatch would hang). A parameter that got no gradient counts
  as zero.
* **Sharded** (``sharded=True``, for ZeRO-1's ``DistributedOptimizer``): reduce-scatter instead of
  all-reduce — each rank receives only its shard's sum. ``comm.reduce_scatter`` has no
  asynchronous form yet, so a sharded bucket's communication blocks backward while it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.timing import BucketTimer, BucketTiming

__all__ = ["DataParallel"]

MiB = 2**20


class DataParallel:
    """Average (or sum) the gradients of ``modules`` over ``group`` once per step, in buckets.

    ``modules``: one module or several (the model chunks of an interleaved pipeline); buckets
    never span two modules. ``bucket_mb``: bucket size in MiB (a bucket closes once it holds at
    least that much). ``overlap=False``: no communication during backward; ``finish_grad_sync``
    then communicates bucket after bucket (with a huge ``bucket_mb``: one all-reduce of all
    gradients after backward, the baseline). ``sharded=True``: ZeRO-1 (see the module docstring).
    ``average=False``: sum instead of average, for losses that are already each replica's share
    of the global mean. ``alone``: parameters that get a bucket of their own (``make_buckets``).

    Build it after the model is on its device: parameters are broadcast from dp rank 0 (one
    starting point for every replica) and, sharded, become views of the flat buffers.
    """

    def __init__(self, modules: nn.Module | Iterable[nn.Module], group: CommGroup,
                 bucket_mb: float = 25.0, overlap: bool = True, sharded: bool = False, *,
                 average: bool = True, alone: Iterable[nn.Parameter] = ()) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.group, self.overlap, self.sharded, self.average = group, overlap, sharded, average
        self.buckets = make_buckets(self.modules, bucket_mb * MiB, group.size, alone)
        self.params = [p for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._arrived: dict[int, set[int]] = {b.index: set() for b in self.buckets}
        self._sync = True
        self._next = 0                       # the next bucket to launch (always in order)
        self._works: dict[int, torch.distributed.Work | None] = {}
        self.timer = BucketTimer(self.params[0].device) if self.params else None
        self.timeline: list[BucketTiming] = []  # the last step's, for notebooks and tests
        with torch.no_grad():
            for p in self.params:
                comm.broadcast(p.data, group.ranks[0], group, "dp params init")
        for bucket in self.buckets:
            if sharded:
                bucket.flatten_params()
            for p, _ in bucket.views(bucket.grad_data):
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket_of[id(param)]

    @contextmanager
    def sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside, backward communicates (``enabled``: the last microbatch) or only accumulates."""
        previous, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Zero the gradient buffers; every ``.grad`` is (again) a view into its bucket."""
        for bucket in self.buckets:
            bucket.grad_data.zero_()
            for p, view in bucket.views(bucket.grad_data):
                p.grad = view

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all: each ``.grad`` is the dp average.

        Sharded: only this rank's shard of each buffer holds the average (the rest is stale).
        """
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        for work in self._works.values():
            if work is not None:
                work.wait()
        self._works.clear()
        self._arrived = {b.index: set() for b in self.buckets}
        self._next = 0
        if self.timer is not None:
            self.timeline = self.timer.collect([b.bytes for b in self.buckets])

    # --- inside backward ---------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of(param)
        if bucket.index in self._works:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index}, whose communication already "
                "started: run the backward of every microbatch but the last inside "
                "ddp.sync(False)")
        if not self._sync:
            return
        self._arrived[bucket.index].add(id(param))
        self.timer.on_ready(bucket.index)
        while self.overlap and self._next < len(self.buckets) and self._complete(self._next):
            self._launch(self.buckets[self._next])

    def _complete(self, index: int) -> bool:
        return len(self._arrived[index]) == len(self.buckets[index].params)

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        for p, view in bucket.views(bucket.grad_data):
            _adopt_grad(p, view)
        if self.average:
            bucket.grad_data.div_(self.group.size)  # Σ_r g_r / dp: the gradient of the mean
        if self.sharded:                            # ZeRO-1: keep only this rank's shard
            start, end = bucket.shard(self.group.rank)
            bucket.grad_data[start:end] = comm.reduce_scatter(bucket.grad_data, self.group,
                                                              dim=0, label="dp grads")
            work = None
        else:
            work = comm.all_reduce_(bucket.grad_data, self.group, "dp grads", async_op=True)
        self._works[bucket.index] = work
        self.timer.on_launch(bucket.index, work)
        self._next = bucket.index + 1


def _adopt_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket's view again if someone replaced it (``zero_grad(
    set_to_none=True)`` then backward makes a fresh tensor): a missing gradient counts as zero."""
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad)
    param.grad = view
