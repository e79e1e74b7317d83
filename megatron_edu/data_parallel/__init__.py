"""Data parallelism: averaged gradients in overlapped buckets, and the ZeRO-1 sharded optimizer.

References: Narayanan et al. 2021 (arXiv 2104.04473) §2.1 and §3.3; Rajbhandari et al. 2020,
*ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, stage 1 ("P_os", which
Megatron-LM calls the *distributed optimizer*); Li et al. 2020, *PyTorch Distributed* (buckets).

Every one of the dp replicas holds the same weights and runs its own slice of the global batch.
If each replica's loss is the mean over its slice, the mean of the replicas' gradients is the
gradient of the mean loss over the whole batch (§2.1) — so after averaging, every replica takes
the same optimizer step and the replicas never drift apart.

``DataParallel`` averages the gradients of one or more modules over the dp group:

* **Once per optimizer step.** With gradient accumulation (a pipeline runs m microbatches per
  step, §2.2) the gradients of all microbatches are summed locally and communicated once: wrap
  every backward in ``with ddp.sync(is_last_microbatch)``; hooks communicate only during the
  last one. (Dividing each microbatch's loss by m, so that the sum is a mean, is the caller's.)
* **In buckets, overlapped with backward** (as PyTorch DDP does). Gradients live in a few flat
  buffers ("buckets") of about ``bucket_mb`` MiB, filled in reverse registration order — the
  order backward produces them. A bucket's all-reduce is launched asynchronously the moment its
  last gradient arrives, so it runs while backward computes earlier layers. Fewer, larger
  messages use the network better than one per tensor; several buckets rather than one let
  communication start before backward ends. Buckets are launched strictly in order, so every
  rank issues the same collectives in the same order even when a gradient is late or missing.
* **Contiguous gradient buffer** (Megatron-LM's grad buffer): each ``param.grad`` *is* a view
  into its bucket, so backward accumulates straight into the buffer that is communicated and the
  averaged result needs no copy back. A parameter that got no gradient counts as zero: the
  collective still runs, identically, on every rank (a mismatch would hang).

``DataParallel(..., sharded=True)`` plus ``DistributedOptimizer`` is ZeRO-1: each of the dp
ranks owns 1/dp of every bucket. Gradients are *reduce-scattered* (a rank receives only the
averaged gradient of its shard), the optimizer — and so its Adam moments — exists for that shard
only, and the updated shards are *all-gathered* back into every replica's weights. The traffic
is the same as one all-reduce (= reduce-scatter + all-gather); the optimizer state per rank
falls to 1/dp.

Per optimizer step (a pipeline engine, or any training loop)::

    for i, microbatch in enumerate(microbatches):
        with ddp.sync(i == len(microbatches) - 1):   # communicate during the last backward only
            (loss(microbatch) / len(microbatches)).backward()
    ddp.finish_grad_sync()      # launch what is left, wait: every .grad is now the dp average
    # (tied embedding copies: all-reduce their .grad over grid.embedding_group here)
    clip_grad_norm_(...); optimizer.step(); ddp.zero_grad()
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.grid import ParallelGrid
from megatron_edu.optim import clip_grad_norm_, optimizer_state_bytes

__all__ = ["BucketTiming", "Bucket", "DataParallel", "DistributedOptimizer"]

MiB = 2**20


@dataclass(frozen=True)
class BucketTiming:
    """When one bucket's communication ran (``time.perf_counter()`` seconds)."""

    index: int
    bytes: int
    ready_at: float     # its last gradient arrived (its launch time if one never did)
    launched_at: float
    done_at: float


class Bucket:
    """Consecutive parameters whose gradients (and, sharded, values) share one flat buffer.

    The buffer is padded to a multiple of dp so that it splits into dp equal shards (ZeRO-1).
    """

    def __init__(self, index: int, params: list[nn.Parameter], dp: int) -> None:
        self.index, self.params, self.dp = index, params, dp
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # [start of each]
        self.numel = math.ceil(self.offsets[-1] / dp) * dp
        first = params[0]
        self.grad_data = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.param_data: torch.Tensor | None = None   # sharded only: see flatten_params
        self.ready: set[int] = set()                   # ids of params whose gradient arrived
        self.ready_at = 0.0
        self.launched_at: float | None = None
        self.done: torch.futures.Future | None = None  # its value: the time it completed

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


class DataParallel:
    """Average the gradients of ``modules`` over ``group`` once per step, in overlapped buckets.

    ``modules``: one module or several (the model chunks of an interleaved pipeline); buckets
    never span two modules. ``bucket_mb``: bucket size in MiB (a bucket closes once it holds at
    least that much). ``overlap=False``: no communication during backward; ``finish_grad_sync``
    then communicates bucket after bucket (with a huge ``bucket_mb``: one all-reduce of all
    gradients after backward, the baseline). ``sharded=True``: reduce-scatter instead of
    all-reduce, for ``DistributedOptimizer`` (ZeRO-1); ``comm.reduce_scatter`` has no
    asynchronous form yet, so a sharded bucket's communication blocks backward while it runs.

    Build it after the model is on its device: parameters are broadcast from dp rank 0 (one
    starting point for every replica) and, sharded, become views of the flat buffers.
    """

    def __init__(self, modules: nn.Module | Iterable[nn.Module], group: CommGroup,
                 bucket_mb: float = 25.0, overlap: bool = True, sharded: bool = False) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.group, self.overlap, self.sharded = group, overlap, sharded
        self.buckets = _make_buckets(self.modules, bucket_mb * MiB, group.size, sharded)
        self.params = [p for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._next = 0                       # the next bucket to launch (always in order)
        self.timeline: list[BucketTiming] = []
        with torch.no_grad():
            for p in self.params:
                comm.broadcast(p.data, group.ranks[0], group, "dp params init")
        for bucket in self.buckets:
            if sharded:
                bucket.flatten_params()
            for p, _ in bucket.views(bucket.grad_data):
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

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
        self.timeline = [self._wait(bucket) for bucket in self.buckets]
        self._next = 0

    # --- inside backward ---------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched_at is not None:
            raise RuntimeError(
                f"a gradient arrived for bucket {bucket.index}, whose communication already "
                "started: run the backward of every microbatch but the last inside "
                "ddp.sync(False)")
        if not self._sync:
            return
        bucket.ready.add(id(param))
        bucket.ready_at = time.perf_counter()
        while (self.overlap and self._next < len(self.buckets)
               and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        for p, view in bucket.views(bucket.grad_data):
            _adopt_grad(p, view)
        bucket.grad_data.div_(self.group.size)   # Σ_r g_r / dp: the gradient of the global mean
        bucket.launched_at = time.perf_counter()
        if not bucket.ready:
            bucket.ready_at = bucket.launched_at
        if self.sharded:                         # ZeRO-1: keep only this rank's averaged shard
            start, end = bucket.shard(self.group.rank)
            bucket.grad_data[start:end] = comm.reduce_scatter(bucket.grad_data, self.group,
                                                              dim=0, label="dp grads")
            work = None
        else:
            work = comm.all_reduce_(bucket.grad_data, self.group, "dp grads", async_op=True)
        bucket.done = _completion_time(work)
        self._next = bucket.index + 1

    def _wait(self, bucket: Bucket) -> BucketTiming:
        done_at = bucket.done.wait()
        timing = BucketTiming(bucket.index, bucket.bytes, bucket.ready_at, bucket.launched_at,
                              done_at)
        bucket.ready, bucket.launched_at, bucket.done = set(), None, None
        return timing


def _completion_time(work) -> torch.futures.Future:
    """A future whose value is the time the collective completed (now, if it is done)."""
    if work is None:
        done = torch.futures.Future()
        done.set_result(time.perf_counter())
        return done
    return work.get_future().then(lambda _: time.perf_counter())


def _adopt_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket's view again if someone replaced it (``zero_grad(
    set_to_none=True)`` then backward makes a fresh tensor): a missing gradient counts as zero."""
    if param.grad is None:
        view.zero_()
    elif param.grad.data_ptr() != view.data_ptr():
        view.copy_(param.grad)
    param.grad = view


def _make_buckets(modules: list[nn.Module], bucket_bytes: float, dp: int,
                  sharded: bool) -> list[Bucket]:
    """Trainable parameters in reverse registration order (last module first), cut into buckets.

    A bucket closes once it holds ``bucket_bytes``, at the end of each module and where the dtype
    changes. Sharded, a tied embedding (``param.shared_embedding``) gets a bucket of its own, so
    its shards are laid out the same on the first and the last pipeline stage: their gradients
    can then be summed over the embedding group after the dp reduce-scatter (as in Megatron-LM).
    """
    groups: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for module in reversed(modules):
        current: list[nn.Parameter] = []
        for p in reversed(list(module.parameters())):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            alone = sharded and getattr(p, "shared_embedding", False)
            if current and (alone or p.dtype != current[0].dtype):
                groups.append(current)
                current = []
            current.append(p)
            if alone or sum(q.numel() * q.element_size() for q in current) >= bucket_bytes:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    return [Bucket(i, params, dp) for i, params in enumerate(groups)]


class DistributedOptimizer:
    """ZeRO stage 1 (Megatron-LM's distributed optimizer): any element-wise optimizer, run by
    each dp rank on its 1/dp shard of every bucket, then the shards are all-gathered.

    ``params``: parameters or param groups (as for ``torch.optim``; e.g. ``build_param_groups``),
    covering exactly the parameters of ``ddp``, which must be ``sharded=True``.
    ``optimizer_cls(**defaults)`` is built over *pieces*: views of this rank's shard, one per
    parameter that overlaps it, in that parameter's group. Element-wise update rules (SGD, Adam,
    AdamW) give exactly the unsharded result; rules that need a whole tensor (LAMB's trust ratio,
    Adafactor) would not. Parameters are fp32 here — they are the master weights (mixed
    precision by autocast) — so ZeRO's separate fp32 master copy is not needed.
    """

    def __init__(self, params: Iterable, ddp: DataParallel,
                 optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **defaults) -> None:
        if not ddp.sharded:
            raise ValueError("DistributedOptimizer needs DataParallel(..., sharded=True): its "
                             "gradients must be reduce-scattered, not all-reduced")
        if any(p.dtype != torch.float32 for p in ddp.params):
            raise ValueError("DistributedOptimizer keeps fp32 parameters (use autocast for "
                             "bf16/fp16 compute)")
        self.ddp, self.group = ddp, ddp.group
        groups = _param_groups(params, ddp)
        self.pieces = _shard_pieces(ddp, groups)
        self.optimizer = optimizer_cls(groups, **defaults)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups: set ``group["lr"]`` here to schedule the learning rate."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self) -> None:
        self.ddp.zero_grad()

    def clip_grad_norm_(self, max_norm: float, grid: ParallelGrid) -> float:
        """Clip by the global norm; each rank holds 1/dp of the gradients, so sum over dp too."""
        return clip_grad_norm_(self.pieces, max_norm, grid, dp_sharded=True)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: ≈ 1/dp of the unsharded optimizer's."""
        return optimizer_state_bytes(self.optimizer)

    @torch.no_grad()
    def param_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's whole optimizer state, as an unsharded optimizer would hold it.

        A collective over dp: every rank writes its pieces into zeros, the sum assembles them.
        (Every rank holds some piece after a step: each bucket has a shard on every rank.)
        """
        if not self.optimizer.state:
            return {}
        sample = next(iter(self.optimizer.state.values()))
        scalars = {k: v.clone() for k, v in sample.items() if v.dim() == 0}  # Adam's step
        keys = sorted(k for k, v in sample.items() if v.dim() > 0)          # its moments
        full = {p: {k: torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for k in keys}
                for p in self.ddp.params}
        for piece in self.pieces:
            param, start = piece.origin
            for k in keys:
                full[param][k][start:start + piece.numel()] = self.optimizer.state[piece][k]
        return {p: {**{k: comm.all_reduce(v, self.group, "dp optimizer state").view_as(p)
                       for k, v in full[p].items()}, **scalars}
                for p in self.ddp.params}

    @torch.no_grad()
    def load_param_states(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """The inverse of ``param_states``: keep this rank's pieces of each whole state."""
        for piece in self.pieces:
            param, start = piece.origin
            self.optimizer.state[piece] = {
                k: (v.clone() if v.dim() == 0 else
                    v.reshape(-1)[start:start + piece.numel()].clone())
                for k, v in states[param].items()}

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()                    # on this rank's shard of each bucket only
        for bucket in self.ddp.buckets:          # then every rank gets every updated shard
            start, end = bucket.shard(self.group.rank)
            bucket.param_data.copy_(comm.all_gather(bucket.param_data[start:end], self.group,
                                                    dim=0, label="dp params"))


def _param_groups(params: Iterable, ddp: DataParallel) -> list[dict]:
    """Normalise ``params`` to groups (dicts) and check they cover exactly ddp's parameters."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{**g, "params": list(g["params"])} for g in groups]
    given = {id(p) for g in groups for p in g["params"]}
    held = {id(p) for p in ddp.params}
    if given != held:
        raise ValueError(f"the optimizer's parameters must be exactly DataParallel's: "
                         f"{len(given - held)} given but not held, {len(held - given)} held but "
                         f"not given")
    return groups


def _shard_pieces(ddp: DataParallel, groups: list[dict]) -> list[torch.Tensor]:
    """Replace each group's parameters by the pieces of them that lie in this rank's shards.

    A piece is a view of the flat parameter buffer (the update lands in the model's weights) with
    ``.grad`` a view of the same range of the gradient buffer; it keeps the parameter's
    ``tp_dim`` and ``shared`` marks, which the global gradient norm reads.
    """
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    for g in groups:
        g["params"] = []
    pieces = []
    for bucket in ddp.buckets:
        lo, hi = bucket.shard(ddp.group.rank)
        for p, start in zip(bucket.params, bucket.offsets, strict=False):
            a, b = max(lo, start), min(hi, start + p.numel())
            if a >= b:
                continue
            piece = bucket.param_data[a:b]
            piece.grad = bucket.grad_data[a:b]
            piece.tp_dim = getattr(p, "tp_dim", None)
            piece.shared = getattr(p, "shared", False)
            piece.origin = (p, a - start)  # which parameter, from which flat element (checkpoints)
            groups[group_of[id(p)]]["params"].append(piece)
            pieces.append(piece)
    return pieces
