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
* **Sharded** (``zero`` ≥ 1, for the ``DistributedOptimizer``): reduce-scatter instead of
  all-reduce — each rank receives only its shard's sum (ZeRO-1), launched as asynchronously and
  kept when it is waited for (Megatron-LM's ``overlap_grad_reduce``). ZeRO-2 also frees the whole
  gradients: a bucket's buffer exists from its first gradient of a backward to its reduce-scatter,
  which therefore runs in *every* backward, accumulating into the rank's shard (as DeepSpeed's
  ZeRO-2 and FSDP do; with m microbatches per step that is m reduce-scatters, the price of never
  holding every gradient). ZeRO-3 shards the parameters too: ``zero3.ParameterSharding``
  gathers each unit's around its forward and its backward; here a bucket *is* a unit — one per
  module of ``units`` (a transformer block), one for the rest of each module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.data_parallel.zero3 import ParameterSharding, UnitEvent
from megatron_edu.timing import BucketTimer, BucketTiming

__all__ = ["DataParallel"]

MiB = 2**20


class DataParallel:
    """Average (or sum) the gradients of ``modules`` over ``group`` once per step, in buckets.

    ``modules``: one module or several (the model chunks of an interleaved pipeline); buckets
    never span two modules. ``bucket_mb``: bucket size in MiB (a bucket closes once it holds at
    least that much). ``overlap=False``: no communication during backward; ``finish_grad_sync``
    then communicates bucket after bucket (with a huge ``bucket_mb``: one all-reduce of all
    gradients after backward, the baseline). ``zero``: the ZeRO stage 0–3 (the module
    docstring; stages ≥ 1 need a ``DistributedOptimizer``); ``units``: ZeRO-3's units, each a
    bucket. ``average=False``: sum instead of average, for losses that are already each
    replica's share of the global mean. ``alone``: parameters that get a bucket of their own
    (``make_buckets``).

    Build it after the model is on its device: parameters are broadcast from dp rank 0 (one
    starting point for every replica) and, sharded, become views of the flat buffers.
    """

    def __init__(self, modules: nn.Module | Iterable[nn.Module], group: CommGroup,
                 bucket_mb: float = 25.0, overlap: bool = True, zero: int = 0, *,
                 average: bool = True, alone: Iterable[nn.Parameter] = (),
                 units: Iterable[nn.Module] = ()) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"zero is a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.group, self.overlap, self.zero, self.average = group, overlap, zero, average
        bucketed, size = self.modules, bucket_mb * MiB
        if zero == 3:                        # a bucket per unit, one for the rest of a module
            units = {id(u) for u in units}
            bucketed = [u for m in self.modules for u in m.modules() if u is m or id(u) in units]
            size = math.inf
        self.buckets = make_buckets(bucketed, size, group.size, alone, group.rank, zero)
        self.params = [p for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._arrived: dict[int, set[int]] = {b.index: set() for b in self.buckets}
        self._sync = True
        self._next = 0                       # the next bucket to launch (always in order)
        # launched buckets: (their collective, what to do once it is done)
        self._works: dict[int, tuple[torch.distributed.Work | None, Callable | None]] = {}
        self.timer = BucketTimer(self.params[0].device) if self.params else None
        self.timeline: list[BucketTiming] = []  # the last step's, for notebooks and tests
        self.unit_timeline: list[UnitEvent] = []  # ZeRO-3: the units' gathers and passes
        with torch.no_grad():
            for p in self.params:
                comm.broadcast(p.data, group.ranks[0], group, "dp params init")
        for bucket in self.buckets:
            if zero >= 1:
                bucket.flatten_params()
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sharding = (ParameterSharding(self.buckets, group, self.modules, bucketed)
                         if zero == 3 else None)
        self.zero_grad()

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket_of[id(param)]

    @contextmanager
    def sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside, backward communicates (``enabled``: the last microbatch) or only accumulates.
        ZeRO-2, 3 hold no whole gradients: every backward communicates — one not the last is
        finished on leaving, the last by ``finish_grad_sync``."""
        previous, self._sync = self._sync, enabled or self.zero >= 2
        try:
            yield
        finally:
            self._sync = previous
        if self.zero >= 2 and not enabled:
            self._launch_rest()

    def zero_grad(self) -> None:
        """Zero the gradients: every ``.grad`` is (again) a view into its bucket (ZeRO-2, 3:
        the shards are zeroed, and ``.grad`` is None until a backward)."""
        for bucket in self.buckets:
            if self.zero >= 2:
                bucket.grad_shard.zero_()
                for p in bucket.params:
                    p.grad = None
                continue
            bucket.grad_data.zero_()
            for p, view in bucket.views(bucket.grad_data):
                p.grad = view

    def held_grads(self) -> list[torch.Tensor]:
        """The gradient buffers this rank steps with: each bucket's shard under ZeRO, else its
        whole buffer (to scale them all, e.g. unscaling an fp16 loss)."""
        return [b.grad_shard if self.zero >= 1 else b.grad_data for b in self.buckets]

    def held_params(self) -> list[torch.Tensor]:
        """The parameter values this rank holds between steps: its shards under ZeRO-3, else
        the parameters themselves."""
        return [b.param_shard for b in self.buckets] if self.zero == 3 else self.params

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all: each ``.grad`` is the dp average.

        Sharded: only this rank's shard of each buffer (``grad_shard``) holds the average.
        """
        self._launch_rest()
        if self.timer is not None:
            self.timeline = self.timer.collect([b.bytes for b in self.buckets])
        if self.sharding is not None:
            self.unit_timeline = self.sharding.collect()

    def _launch_rest(self) -> None:
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._wait_launched()
        self._arrived = {b.index: set() for b in self.buckets}
        self._next = 0

    def _wait_launched(self) -> None:
        """Wait for the collectives in flight, and keep what they brought."""
        for index, (work, done) in self._works.items():
            if work is not None:
                work.wait()
            self.timer.on_wait(index)
            if done is not None:
                done()
        self._works.clear()

    # --- inside backward ---------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of(param)
        if bucket.index < self._next:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index}, whose communication already "
                "started: run the backward of every microbatch but the last inside "
                "ddp.sync(False)")
        if self.zero >= 2:                           # into the backward's whole buffer
            _add_grad(param, bucket.view(bucket.open_grads(), param))
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
        if self.zero >= 2:
            self._wait_launched()                    # one reduce-scatter in flight at a time:
            bucket.open_grads()                      # two whole buckets at most; zeros if no
        else:                                        # gradient arrived
            for p, view in bucket.views(bucket.grad_data):
                _adopt_grad(p, view)
        if self.average:
            bucket.grad_data.div_(self.group.size)  # Σ_r g_r / dp: the gradient of the mean
        if self.zero == 0:
            work = comm.all_reduce_(bucket.grad_data, self.group, "dp grads", async_op=True)
            self._works[bucket.index] = (work, None)
        else:                                       # only this rank's shard's sum, once here
            work, mine = (comm.reduce_scatter(bucket.grad_data, self.group, dim=0,
                                              label="dp grads", async_op=True)
                          if self.group.size > 1 else (None, bucket.grad_data))
            self._works[bucket.index] = (work, lambda: self._keep_shard(bucket, mine))
        if self.sharding is not None:
            self.sharding.after_backward(bucket)     # its gradients are all in: free the unit
        self.timer.on_launch(bucket.index, work)
        self._next = bucket.index + 1

    @torch.no_grad()
    def _keep_shard(self, bucket: Bucket, mine: torch.Tensor) -> None:
        """A bucket's reduce-scatter is done: its sum becomes the shard (ZeRO-1), or adds to it
        (ZeRO-2, 3: accumulated over microbatches) and the whole buffer goes."""
        if self.zero == 1:
            bucket.grad_shard.copy_(mine)
        else:
            bucket.grad_shard.add_(mine)
            bucket.grad_data = None


def _add_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """ZeRO-2, 3: move the gradient autograd made into the bucket's buffer; ``.grad`` is None
    again, so autograd makes a fresh one next time (never a whole set alive at once)."""
    if param.grad is not None:
        view.add_(param.grad)
        param.grad = None


def _adopt_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket's view again if someone replaced it (``zero_grad(
    set_to_none=True)`` then backward makes a fresh tensor): a missing gradient counts as zero."""
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad)
    param.grad = view
