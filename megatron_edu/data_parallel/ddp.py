"""``DataParallel``: the dp replicas' gradients summed or averaged once per optimizer step, in
buckets whose all-reduces overlap the rest of backward (2104.04473 §2.1; PyTorch DDP's scheme).

* **Once per optimizer step.** Under gradient accumulation (m microbatches per step, §2.2) the
  gradients are summed locally and communicated once: wrap every backward in ``with
  ddp.sync(is_last_microbatch)``.
* **Overlapped, in order.** A bucket's all-reduce is launched asynchronously when its last
  gradient arrives, while backward computes earlier layers. Buckets are launched strictly in
  order, so every rank issues the same collectives in the same order even when a gradient is
  late or missing (a mismatch would hang); a missing gradient counts as zero.

This is ZeRO stage 0, and the machinery the ZeRO stages build on: each overrides what a bucket
holds (``_allocate``), how it is reduced (``_reduce``) and the optimizer (``optimizer``). Every
stage answers PTD-P and the checkpoints the same questions (``local_grads``, ``held_grads``,
``clip_grad_norm_``, ``gathered``), so they never ask which stage it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.grid import ParallelGrid
from megatron_edu.optim import clip_held_grads_

__all__ = ["DataParallel"]

MiB = 2**20

# A launched bucket: its collective's work and what to do once it is done.
Launched = tuple[torch.distributed.Work, Callable[[], object]]


class DataParallel:
    """Average (or sum) the gradients of ``modules`` over ``group`` once per step, in buckets.

    ``modules``: one module or several (an interleaved pipeline's chunks); buckets never span
    two. ``bucket_mb``: a bucket closes once it holds that many MiB. ``overlap=False``: nothing
    communicates during backward; ``finish_grad_sync`` then goes bucket by bucket (a huge
    ``bucket_mb``: one all-reduce after backward, the baseline). ``average=False``: sum, for
    losses already each replica's share of the global mean. ``alone``: parameters bucketed alone
    (``make_buckets``). ``units``: ZeRO-3's. ``experts``: (ep, edp) groups; a stack of experts
    (``expert_parallel.py``) is bucketed apart and reduced over edp, the ranks holding the same
    experts, but averaged by ``group``'s size, the dense dp: every replica's tokens reach some
    edp rank's experts. Build it with the model on its device: parameters are broadcast from
    the first rank of their group, so every replica starts from the same weights.
    """

    shards_optimizer = False         # each rank holds the whole optimizer state (checkpoints)

    def __init__(self, modules: nn.Module | Iterable[nn.Module], group: CommGroup,
                 bucket_mb: float = 25.0, overlap: bool = True, *, average: bool = True,
                 alone: Iterable[nn.Parameter] = (), units: Iterable[nn.Module] = (),
                 experts: tuple[CommGroup, CommGroup] | None = None) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.group, self.overlap, self.average = group, overlap, average
        self.ep_group, self.edp_group = experts or (CommGroup("ep", (group.ranks[group.rank],)),
                                                    group)
        self.buckets = self._make_buckets(bucket_mb * MiB, alone, list(units))
        self.params = [p for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._arrived: dict[int, set[int]] = {b.index: set() for b in self.buckets}
        self._sync = True
        self._next = 0                       # the next bucket to launch (always in order)
        self._works: dict[int, Launched] = {}
        with torch.no_grad():
            for b in self.buckets:
                for p in b.params:
                    comm.broadcast(p.data, b.group.ranks[0], b.group, "dp params init")
        for bucket in self.buckets:
            self._allocate(bucket)
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    # --- what this stage holds and how it reduces (the ZeRO stages override these) -------------

    def _make_buckets(self, bucket_bytes: float, alone: Iterable[nn.Parameter],
                      units: list[nn.Module]) -> list[Bucket]:
        return make_buckets(self.modules, bucket_bytes, self.group_of, alone)

    def group_of(self, param: nn.Parameter) -> CommGroup:
        """The ranks a parameter's gradient is reduced over: edp for experts, else dp (× cp)."""
        return self.edp_group if getattr(param, "expert_ids", None) is not None else self.group

    def _allocate(self, bucket: Bucket) -> None:
        """The bucket's buffers: here the whole gradients, which every ``.grad`` views."""
        bucket.grad_data = bucket.zeros()

    def _reduce(self, bucket: Bucket) -> Launched:
        """Start summing the bucket's gradients over the group: one all-reduce."""
        work = comm.all_reduce_(bucket.grad_data, bucket.group, "dp grads", async_op=True,
                                tag=bucket.index)
        return work, lambda: None                   # the sum is in place: nothing to keep

    def _prepare(self, bucket: Bucket) -> None:
        """Make each ``.grad`` its view of the buffer again (``zero_grad(set_to_none=True)`` then
        backward makes a fresh tensor); a missing gradient counts as zero."""
        for p, view in bucket.views(bucket.grad_data):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def _accumulate(self, param: nn.Parameter, bucket: Bucket) -> None:
        """Where a new gradient goes: here autograd wrote it into the bucket's view already."""

    # --- the step's interface: what PTD-P and checkpoints ask every stage ----------------------

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
        """Zero the gradients: every ``.grad`` is (again) a view into its bucket."""
        for bucket in self.buckets:
            bucket.grad_data.zero_()
            for p, view in bucket.views(bucket.grad_data):
                p.grad = view

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all: each ``.grad`` is the dp average
        (under ZeRO, this rank's shard of it)."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._wait_launched()
        self._arrived = {b.index: set() for b in self.buckets}
        self._next = 0

    def local_grads(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The gradients this rank holds of ``params``: here each whole."""
        return [p.grad for p in params]

    def held_grads(self) -> list[torch.Tensor]:
        """Every gradient buffer this rank steps with (to scale them all at once)."""
        return [b.grad_data for b in self.buckets]

    def held_params(self) -> list[torch.Tensor]:
        """The parameter values this rank holds between steps."""
        return self.params

    def clip_grad_norm_(self, max_norm: float, grid: ParallelGrid,
                        tied_copies: Iterable[nn.Parameter] = ()) -> torch.Tensor:
        """Clip by the global norm of the whole model's gradient (``optim.clip_grad_norm_``);
        the norm, a 0-d tensor on the device (as torch's)."""
        return clip_held_grads_([(p, p.grad) for p in self.params if p.grad is not None],
                                max_norm, grid, tied_copies, expert_sum_over=(self.ep_group,))

    def optimizer(self, param_groups: list[dict], optimizer_cls: type[torch.optim.Optimizer],
                  **defaults) -> torch.optim.Optimizer:
        """The optimizer over the parameters: here any torch optimizer, every replica's alike."""
        return optimizer_cls(param_groups, **defaults)

    def gathered(self) -> AbstractContextManager:
        """Inside, every parameter is whole (they are, here)."""
        return nullcontext()

    # --- inside backward ---------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of(param)
        if bucket.index < self._next:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index}, whose communication already "
                "started: run the backward of every microbatch but the last inside "
                "ddp.sync(False)")
        self._accumulate(param, bucket)
        if not self._sync:
            return
        self._arrived[bucket.index].add(id(param))
        while self.overlap and self._next < len(self.buckets) and self._complete(self._next):
            self._launch(self.buckets[self._next])

    def _complete(self, index: int) -> bool:
        return len(self._arrived[index]) == len(self.buckets[index].params)

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        self._prepare(bucket)
        if self.average:
            bucket.grad_data.div_(self.group.size)  # Σ_r g_r / dp: the gradient of the mean
        self._works[bucket.index] = self._reduce(bucket)
        self._next = bucket.index + 1

    def _wait_launched(self) -> None:
        """Wait for the collectives in flight, and keep what they brought."""
        for work, done in self._works.values():
            work.wait()
            done()
        self._works.clear()
