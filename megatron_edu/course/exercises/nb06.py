"""Checkers for notebook 06, data parallelism (2104.04473 §2.1; ZeRO stage 1).

06.1 ★   average the replicas' gradients with one all-reduce per bucket;
06.2 ★★  gradient accumulation: m microbatches, one communication per bucket per step;
06.3 ★★★ a ZeRO-1 step: reduce-scatter, update this rank's shard, all-gather;
06.4 ★★★ the bucket hook: each bucket's all-reduce launched from a post-accumulate-grad hook
         during backward, in order, once its last gradient has arrived (PyTorch DDP, Li et al.
         2020; the papers' Megatron all-reduced after backward).

06.1–06.3 run the learner's function on 2 and 4 gloo ranks and compare it with plain data
parallelism computed on every rank from the same seeds. 06.4 runs the learner's class on 2 ranks
whose gradients arrive in different orders, and reads from ``comm.record()`` when each all-reduce
was launched and waited for, against the checker's own hooks and the span of backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.data_parallel import DataParallel, ZeRO1
from megatron_edu.grid import ParallelGrid

__all__ = []

DP_SIZES = (2, 4)
TIMEOUT = 20.0  # seconds: a backstop; a deadlock is detected sooner (on_ranks)
ATOL = 1e-5


def _same(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= atol)


def _values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- 06.1 ★ one all-reduce per bucket ------------------------------------------------------------

BUCKETS = [[(4, 3), (3,)], [(2, 2, 2)], [(5,), (1, 3), (2,)]]  # 3 buckets of 6 gradient tensors


def _bucket_grads(rank: int) -> list[list[torch.Tensor]]:
    return [[_values(1000 * rank + 10 * b + i, shape) for i, shape in enumerate(bucket)]
            for b, bucket in enumerate(BUCKETS)]


def _run_average(fn: Callable) -> dict[str, Any]:
    grid = ParallelGrid(dp=dist.get_world_size())
    grads = _bucket_grads(grid.rank)
    with comm.record() as log:
        fn(grads, grid.dp_group)
    return dict(grads=grads, log=log)


@exercise("06.1", "average the gradients, one all-reduce per bucket",
          reference=(DataParallel._launch,),
          marks=(r"\.split\(\[\w+\.numel\(\)for\w+in\w+\]\)",  # the bucket's slices copied back
                 r"/=\w*\.?group\.size"))  # the sum made an average
def _average_gradients(fn: Callable) -> str:
    tensors = sum(len(b) for b in BUCKETS)
    for dp in DP_SIZES:
        results = on_ranks(dp, _run_average, fn, timeout=TIMEOUT, may_deadlock=True)
        everyone = [_bucket_grads(r) for r in range(dp)]
        mean = [[sum(e[b][i] for e in everyone) / dp for i in range(len(bucket))]
                for b, bucket in enumerate(BUCKETS)]
        for rank, result in enumerate(results):
            _check_average(result["grads"], mean, everyone[rank], rank, dp)
        for rank, result in enumerate(results):
            _check_one_per_bucket(result["log"], rank, tensors)
    return (f"on {' and '.join(map(str, DP_SIZES))} ranks every gradient is the replicas' "
            f"average, with {len(BUCKETS)} all-reduces per step: one per bucket, not one per "
            f"tensor ({tensors})")


def _check_average(got, mean, own, rank: int, dp: int) -> None:
    for b, bucket in enumerate(got):
        for i, g in enumerate(bucket):
            want = mean[b][i]
            where = f"on {dp} ranks, rank {rank}'s tensor {i} of bucket {b}"
            if not isinstance(g, torch.Tensor) or g.shape != want.shape:
                raise Hint(f"{where} is no longer a tensor of shape {tuple(want.shape)}: "
                           "write the average into each gradient in place (g.copy_(…))")
            if _same(g, want):
                continue
            if _same(g, own[b][i]):
                raise Hint(f"{where} still holds the rank's own gradient: nothing came back. "
                           "All-reduce a buffer, then copy its slices back into the tensors "
                           "(torch.cat makes a copy)")
            if _same(g, want * dp):
                raise Hint(f"{where} is {dp}× the average (off by a factor dp = {dp}): the "
                           "all-reduce sums over the replicas; divide by group.size")
            if _same(g, want / dp):
                raise Hint(f"{where} is the average divided by dp = {dp} once more: divide "
                           "only once, by group.size")
            raise Hint(f"{where} differs from the replicas' average by up to "
                       f"{(g - want).abs().max().item():.3g}")


def _check_one_per_bucket(log: comm.CommLog, rank: int, tensors: int) -> None:
    reduces, others = log.count("all_reduce"), len(log.events) - log.count("all_reduce")
    if reduces == len(BUCKETS) and not others:
        return
    if not log.events:
        raise Hint("the values are right, but no collective went through megatron_edu.comm: "
                   "use comm.all_reduce_ (or comm.all_reduce) so that the calls are counted")
    if reduces == tensors:
        raise Hint(f"rank {rank} made {reduces} all-reduces for {len(BUCKETS)} buckets: one "
                   "per tensor, each paying a message's latency. Flatten each bucket's "
                   "tensors into one buffer (torch.cat of their .flatten()), all-reduce it "
                   "once, and copy its slices back")
    ops = ", ".join(f"{n} {op}" for (op, _, _), (n, _) in log.summary().items())
    raise Hint(f"rank {rank} made {ops}; the scheme is exactly one all-reduce per bucket "
               f"({len(BUCKETS)})")


# --- 06.2 ★★ gradient accumulation ---------------------------------------------------------------

GLOBAL_BATCH, MICROBATCHES, FEATURES = 16, 4, 4
BUCKET_MB = 50 / 2**20  # 50 bytes: this tiny model's gradients make 3 buckets


class Regression(nn.Module):
    """A three-layer MLP whose forward returns the mean squared error over its batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                 nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean squared error of the prediction for x against y."""
        return nn.functional.mse_loss(self.net(x), y)


def _regression_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = _values(7, (GLOBAL_BATCH, FEATURES))
    return x, x.sum(dim=1, keepdim=True).sin()


def _run_accumulate(fn: Callable) -> dict[str, Any]:
    grid = ParallelGrid(dp=dist.get_world_size())
    x, y = _regression_batch()
    serial = Regression()
    serial(x, y).backward()                       # the reference: the whole batch at once
    model = Regression()
    ddp = DataParallel(model, grid.dp_group, bucket_mb=BUCKET_MB)
    launched_in_backward = []
    finish = ddp.finish_grad_sync

    def finish_and_note() -> None:               # buckets launched before finish_grad_sync
        launched_in_backward.append(ddp._next)
        finish()

    ddp.finish_grad_sync = finish_and_note
    mine = x.chunk(grid.dp)[grid.dp_rank], y.chunk(grid.dp)[grid.dp_rank]
    early = None
    with comm.record() as log:
        try:
            fn(model, ddp, *mine, MICROBATCHES)
        except RuntimeError as err:
            if "already started" not in str(err):
                raise
            early = str(err)
    finished = bool(launched_in_backward) and not ddp._works
    finish()                                     # leave nothing in flight, whatever happened
    return dict(early=early, finished=finished, launched=launched_in_backward,
                buckets=len(ddp.buckets), reduces=log.count("all_reduce", "dp"),
                grads={n: p.grad.clone() for n, p in model.named_parameters()},
                serial={n: p.grad.clone() for n, p in serial.named_parameters()})


@exercise("06.2", "gradient accumulation: communicate once per step",
          marks=(r"\.sync\(\w+==\w+-1\)",  # communicate in the last backward
                 r"\.sync\(last\)",  # ... said with its flag's name
                 r"model\(\w+,\w+\)\)?/(?:m|microbatches)(?!\w)"))  # each loss divided by m
def _accumulate(fn: Callable) -> str:
    for dp in DP_SIZES:
        results = on_ranks(dp, _run_accumulate, fn, timeout=TIMEOUT, may_deadlock=True)
        for rank, r in enumerate(results):
            _check_accumulated(r, rank, dp)
    buckets = results[0]["buckets"]
    return (f"on {' and '.join(map(str, DP_SIZES))} ranks, {MICROBATCHES} microbatches each: "
            f"every .grad is the full batch's gradient, after {buckets} all-reduces per step "
            f"(one per bucket, launched during the last backward), not "
            f"{MICROBATCHES * buckets}")


def _check_accumulated(r: dict[str, Any], rank: int, dp: int) -> None:
    m, buckets = MICROBATCHES, r["buckets"]
    if r["early"]:
        raise Hint("a bucket was all-reduced during an earlier microbatch's backward, then "
                   "another gradient arrived for it (DataParallel refused: "
                   f"'{r['early'][:60]}…'). Run every backward but the last inside "
                   "ddp.sync(False), and the last inside ddp.sync(True): with "
                   "ddp.sync(i == m - 1): …")
    if not r["finished"]:
        raise Hint("ddp.finish_grad_sync() was not called after the last backward: the last "
                   "buckets may still be in flight (and a bucket never completed is never "
                   "launched), so .grad is not the average yet")
    for name, grad in r["grads"].items():
        want = r["serial"][name]
        if _same(grad, want):
            continue
        where = f"on {dp} ranks, rank {rank}'s gradient of {name}"
        if _same(grad, want * m):
            raise Hint(f"{where} is {m}× the full batch's (off by a factor m = {m}): each "
                       "microbatch's loss is the mean over its samples; divide it by m so "
                       "that the m backward passes add up to the mean over the slice")
        raise Hint(f"{where} differs from the full batch's gradient by up to "
                   f"{(grad - want).abs().max().item():.3g}")
    if r["reduces"] != buckets:
        raise Hint(f"rank {rank} made {r['reduces']} all-reduces for {buckets} buckets in one "
                   f"step of {m} microbatches: let DataParallel communicate, once per bucket")
    if r["launched"] and r["launched"][0] == 0:
        raise Hint("the gradients are right, but no bucket was launched during backward: "
                   "finish_grad_sync sent them all afterwards. Run the last microbatch's "
                   "backward inside ddp.sync(True), so that each bucket starts as soon as its "
                   "gradients are final, overlapping the rest of backward")


# --- 06.3 ★★★ a ZeRO-1 step ----------------------------------------------------------------------

NUMEL, STEPS, LR, MOMENTUM = 48, 3, 0.1, 0.9


def _zero1_grads(rank: int, step: int) -> torch.Tensor:
    return _values(100 * step + rank, (NUMEL,))


def _plain_dp(dp: int, average: bool = True, keep_momentum: bool = True) -> list[torch.Tensor]:
    """Plain data parallelism's weights after each step: the whole buffer, on every rank."""
    params, momentum, history = _values(1, (NUMEL,)), torch.zeros(NUMEL), []
    for step in range(STEPS):
        grad = sum(_zero1_grads(r, step) for r in range(dp)) / (dp if average else 1)
        momentum = (MOMENTUM * momentum if keep_momentum else 0) + grad
        params = params - LR * momentum
        history.append(params)
    return history


def _state_bytes(obj: Any, skip: set[int], seen: set[int]) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists, optimizers), each storage once; storages
    in ``skip`` (the weights and gradients themselves) are not state."""
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        if ptr in skip or ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, torch.optim.Optimizer):
        obj = obj.state
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(x, skip, seen) for x in obj)
    return 0


def _run_zero1(fn: Callable) -> dict[str, Any]:
    grid = ParallelGrid(dp=dist.get_world_size())
    params, state, history, state_bytes, logs = _values(1, (NUMEL,)), {}, [], [], []
    for step in range(STEPS):
        grads = _zero1_grads(grid.rank, step)
        with comm.record() as log:
            fn(params, grads, state, grid.dp_group, lr=LR, momentum=MOMENTUM)
        skip = {params.untyped_storage().data_ptr(), grads.untyped_storage().data_ptr()}
        history.append(params.clone())
        state_bytes.append(_state_bytes(state, skip, set()))
        logs.append(log)
    return dict(history=history, state_bytes=state_bytes, logs=logs)


@exercise("06.3", "a ZeRO-1 step: reduce-scatter, update a shard, all-gather",
          reference=(ZeRO1._reduce, ZeRO1.step),
          marks=(r"\w+\[\w+\]-=lr\*",  # the shard's update, in place
                 r"\.copy_\(comm\.all_gather\("))  # the shards gathered back
def _zero1_step(fn: Callable) -> str:
    for dp in DP_SIZES:
        results = on_ranks(dp, _run_zero1, fn, timeout=TIMEOUT, may_deadlock=True)
        expected = _plain_dp(dp)
        for rank, r in enumerate(results):
            _check_zero1_weights(r["history"], expected, rank, dp)
        for rank, r in enumerate(results):
            _check_zero1_state(r["state_bytes"], rank, dp)
            _check_zero1_collectives(r["logs"], rank)
    return (f"on {' and '.join(map(str, DP_SIZES))} ranks, {STEPS} steps: the weights equal "
            "plain data parallelism's, each rank keeps the momentum of its shard only "
            f"({NUMEL // DP_SIZES[-1] * 4} bytes at dp = {DP_SIZES[-1]}, 1/dp of "
            f"{NUMEL * 4}), with one reduce-scatter and one all-gather per step: the bytes of "
            "one all-reduce")


def _check_zero1_weights(history, expected, rank: int, dp: int) -> None:
    for step, (got, want) in enumerate(zip(history, expected, strict=True)):
        if _same(got, want):
            continue
        where = f"on {dp} ranks, after step {step + 1}, rank {rank}'s weights"
        if step == 0:
            _diagnose_first_step(got, rank, dp, where)
        elif _same(got, _plain_dp(dp, keep_momentum=False)[step]):
            raise Hint(f"step 1 is right but step {step + 1} is not: the momentum must survive "
                       "between steps. Keep your shard's buffer in `state` (e.g. "
                       "state['momentum']) and update it in place")
        raise Hint(f"{where} differ from plain data parallelism's by up to "
                   f"{(got - want).abs().max().item():.3g}")


def _diagnose_first_step(got: torch.Tensor, rank: int, dp: int, where: str) -> None:
    """Step 1: which shard is wrong, and how (momentum is just the gradient at step 1)."""
    before = _values(1, (NUMEL,))
    step = (sum(_zero1_grads(r, 0) for r in range(dp)) / dp) * -LR   # plain DP's update
    if _same(got, before + dp * step):
        raise Hint(f"{where} moved {dp}× too far (off by a factor dp = {dp}): the reduce-"
                   "scatter sums the replicas' gradients; divide your shard by dp "
                   "(group.size) to get their average")
    if _same(got, before):
        raise Hint(f"{where} did not change: update `params` in place, and copy the "
                   "all-gathered shards back into it (params.copy_(…))")
    n = NUMEL // dp
    shards = [slice(k * n, (k + 1) * n) for k in range(dp)]
    right = [_same(got[s], before[s] + step[s]) for s in shards]
    old = [_same(got[s], before[s]) for s in shards]
    if right[rank] and all(old[k] for k in range(dp) if k != rank):
        raise Hint(f"{where}: its own shard is updated but the other shards still hold the "
                   "old weights. All-gather after the update, and copy the result into params")
    for (k, s), (i, w), (j, g) in itertools.product(enumerate(shards), repeat=3):
        if (i, j) != (k, k) and _same(got[s], before[w] + step[g]):
            raise Hint(f"{where}: shard {k} holds shard {i} of the old weights moved by the "
                       f"gradient of shard {j}. Rank r owns [r·N/dp, (r+1)·N/dp): that slice "
                       "of params, the reduce-scatter's result (its shard of the gradient), and "
                       "that place in the all-gather's output")
    raise Hint(f"{where} differ from plain data parallelism's by up to "
               f"{(got - (before + step)).abs().max().item():.3g}")


def _check_zero1_state(state_bytes: list[int], rank: int, dp: int) -> None:
    shard = NUMEL // dp * 4
    held = state_bytes[-1]
    if held == shard:
        return
    if held >= NUMEL * 4:
        raise Hint(f"the weights are right, but on {dp} ranks rank {rank} keeps {held} bytes of "
                   f"state: the momentum of the whole buffer ({NUMEL} values). ZeRO-1 keeps "
                   f"only the shard this rank updates: {NUMEL // dp} values, {shard} bytes — "
                   "1/dp of it")
    if held == 0:
        raise Hint("the weights are right, but `state` holds no tensor: keep your shard's "
                   "momentum there (state['momentum']), not in a global variable")
    raise Hint(f"on {dp} ranks rank {rank} keeps {held} bytes of state; its shard's momentum "
               f"is {NUMEL // dp} fp32 values = {shard} bytes")


def _check_zero1_collectives(logs: list[comm.CommLog], rank: int) -> None:
    log = logs[-1]
    counts = {op: log.count(op) for op in ("reduce_scatter", "all_gather", "all_reduce")}
    if counts == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 0} and \
            len(log.events) == 2:
        return
    if not log.events:
        raise Hint("no collective went through megatron_edu.comm: use comm.reduce_scatter and "
                   "comm.all_gather so that the calls are counted")
    if counts["all_reduce"]:
        raise Hint(f"rank {rank} made {counts['all_reduce']} all-reduce(s) per step: that "
                   "hands every rank the whole gradient, as plain data parallelism does. "
                   "ZeRO-1 reduce-scatters the gradients (each rank receives its shard's sum) "
                   "and all-gathers the updated weights — together the bytes of one all-reduce")
    ops = ", ".join(f"{n} {op}" for (op, _, _), (n, _) in log.summary().items())
    raise Hint(f"rank {rank} made {ops} per step; ZeRO-1 needs exactly one reduce-scatter "
               "(gradients) and one all-gather (weights)")


# --- 06.4 ★★★ the bucket hook --------------------------------------------------------------------

HOOK_DP = 2
HOOK_SHAPES = [(2, 2), (4,), (4,), (1, 4), (2, 2), (4,)]   # six parameters of 4 values
HOOK_BUCKETS = [[0, 1], [2, 3], [4, 5]]                    # in three buckets of 8
ARRIVALS = ([0, 1, 2, 3, 4, 5], [2, 3, 0, 1, 5, 4])       # the order their gradients arrive
MICROBATCHES_PER_STEP = (1, 2)                             # a plain step, then one accumulating 2
# Parameters of one size, buckets of one size: launched in different orders on the two ranks,
# per bucket or per parameter, the all-reduces still pair up (gloo aborts a process whose
# collective does not match its peer's in size), and the checker names what it saw launched.


@dataclass
class _Launch:
    """An all-reduce the answer launched: in which step and microbatch, whether backward was
    running, which parameters' gradients had arrived in this backward by then (the last one:
    the hook running), and where its work was waited for ("backward", "after", or never)."""

    step: int
    microbatch: int
    sync: bool
    in_backward: bool
    arrived: tuple[int, ...]
    asynchronous: bool
    waited: str | None = None


class _Watch(comm.CommLog):
    """The step as the checker sees it: its own hooks, registered before the answer's, note each
    gradient's arrival; each collective the answer makes becomes a ``_Launch``, its work handed
    back wrapped to see where it is waited for."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.step = self.microbatch = 0
        self.sync = self.running = False
        self.arrived: list[int] = []
        self.launches: list[_Launch] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.arrived.append(i))

    def add(self, event: comm.CommEvent, work):
        self.events.append(event)
        launch = _Launch(self.step, self.microbatch, self.sync, self.running,
                         tuple(self.arrived), work is not None)
        self.launches.append(launch)
        return None if work is None else _Watched(work, launch, self)


class _Watched:
    """A launched all-reduce's work: notes whether backward was running when it was waited for."""

    def __init__(self, work, launch: _Launch, watch: _Watch) -> None:
        self.work, self.launch, self.watch = work, launch, watch

    def wait(self, *args, **kwargs):
        self.launch.waited = "backward" if self.watch.running else "after"
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _hook_grad(rank: int, step: int, microbatch: int, i: int) -> torch.Tensor:
    return _values(10_000 + 1000 * rank + 100 * step + 10 * microbatch + i, HOOK_SHAPES[i])


def _hook_loss(params: list[nn.Parameter], rank: int, step: int, microbatch: int) -> torch.Tensor:
    """Σᵢ ⟨cᵢ, pᵢ⟩, whose gradient of pᵢ is cᵢ; the terms made in the reverse of this rank's
    arrival order: autograd runs the latest-made first, so the gradients arrive in that order."""
    terms = [(params[i] * _hook_grad(rank, step, microbatch, i)).sum()
             for i in reversed(ARRIVALS[rank])]
    return torch.stack(terms).sum()


def _run_bucket_hooks(answer: type) -> dict[str, Any]:
    group = ParallelGrid(dp=dist.get_world_size()).dp_group
    params = [nn.Parameter(torch.zeros(shape)) for shape in HOOK_SHAPES]
    for p in params:
        p.grad = torch.zeros_like(p)
    watch = _Watch(params)
    hooks = answer([[params[i] for i in bucket] for bucket in HOOK_BUCKETS], group)
    grads = []
    with comm.record(watch):
        for step, m in enumerate(MICROBATCHES_PER_STEP):
            watch.step = step
            for p in params:
                p.grad.zero_()                     # in place: an answer may hold views of .grad
            for mb in range(m):
                hooks.sync = watch.sync = mb == m - 1
                watch.microbatch, watch.arrived = mb, []
                loss = _hook_loss(params, group.rank, step, mb)
                watch.running = True
                loss.backward()
                watch.running = False
            hooks.finish()
            grads.append([p.grad.clone() for p in params])
    return dict(launches=watch.launches, grads=grads)


@exercise("06.4", "the bucket hook: each bucket's all-reduce launched during backward",
          reference=(DataParallel._on_grad_ready,),
          marks=(r"register_post_accumulate_grad_hook\(self\.",  # the hook, a method
                 r"len\(self\.\w+\[\w+\]\)==len\(self\.buckets\[\w+\]\)"))  # a bucket complete
def _bucket_hooks(fn: type) -> str:
    results = on_ranks(HOOK_DP, _run_bucket_hooks, fn, timeout=TIMEOUT, may_deadlock=True,
                       deadlock_advice="Here the gradients arrive in a different order on each "
                       "rank, so a bucket may be complete before its turn: every rank must "
                       "still launch every bucket, in the same order — when bucket k is "
                       "launched, launch k + 1 too if it is complete already (a while loop, "
                       "not an if)")
    for rank, r in enumerate(results):
        for step, m in enumerate(MICROBATCHES_PER_STEP):
            _check_launches([la for la in r["launches"] if la.step == step], rank, step, m)
    for rank, r in enumerate(results):
        for step, m in enumerate(MICROBATCHES_PER_STEP):
            _check_hooked_grads(r["grads"][step], rank, step, m)
    return (f"on {HOOK_DP} ranks whose gradients arrive in different orders, every .grad is the "
            f"replicas' average; each bucket's all-reduce ({len(HOOK_BUCKETS)}) was launched "
            "inside backward once its last gradient had arrived, in the same order on both "
            f"ranks, and waited for in finish(); with {MICROBATCHES_PER_STEP[-1]} microbatches "
            "only the last backward communicated")


def _check_launches(launches: list[_Launch], rank: int, step: int, m: int) -> None:
    """One rank's launches in one step, against when the gradients arrived."""
    where = f"rank {rank}, step {step + 1}" + (f" ({m} microbatches)" if m > 1 else "")
    buckets = len(HOOK_BUCKETS)
    early = next((la for la in launches if not la.sync), None)
    if early is not None:
        raise Hint(f"{where}: an all-reduce was launched in the backward of microbatch "
                   f"{early.microbatch + 1} of {m}, where sync was False. Under gradient "
                   "accumulation only the last microbatch's backward communicates: with sync "
                   "False the hook returns at once, and autograd sums the gradients into .grad")
    if len(launches) == len(HOOK_SHAPES):
        raise Hint(f"{where}: {len(launches)} all-reduces for {buckets} buckets — one per "
                   "parameter. A bucket's gradients travel together, as one flat buffer "
                   "(torch.cat of their .flatten()): one all-reduce per bucket")
    if len(launches) != buckets:
        raise Hint(f"{where}: {len(launches)} all-reduces through megatron_edu.comm for "
                   f"{buckets} buckets; launch each bucket once (comm.all_reduce_ with "
                   "async_op=True)")
    for k, la in enumerate(launches):
        if not la.asynchronous:
            raise Hint(f"{where}: the all-reduce of bucket {k} was synchronous: the hook held "
                       "backward up until the transfer was done. Launch it with async_op=True, "
                       "keep its work, and wait for it in finish()")
    late = [k for k, la in enumerate(launches) if not la.in_backward]
    if len(late) == buckets:
        raise Hint(f"{where}: no all-reduce was launched during backward — all {buckets} after "
                   "it returned: no overlap. Launch each bucket from the post-accumulate-grad "
                   "hook as soon as its last gradient has arrived, so that its transfer runs "
                   "while backward computes the rest")
    if late:
        raise Hint(f"{where}: {len(late)} of the {buckets} all-reduces (the first: bucket "
                   f"{late[0]}'s) were launched after backward returned, though every gradient "
                   "had arrived during it. When a bucket is launched, launch the next ones too "
                   "if they are complete already (a while loop, not an if)")
    for k, la in enumerate(launches):
        _check_order(la, k, where)
    for k, la in enumerate(launches):
        if la.waited is None:
            raise Hint(f"{where}: finish() returned without waiting for bucket {k}'s "
                       "all-reduce: its sum may not have arrived when .grad is read. Wait for "
                       "every launched work (work.wait()), then copy the averages into .grad")
        if la.waited == "backward":
            raise Hint(f"{where}: bucket {k}'s all-reduce was waited for inside backward: "
                       "backward stood still until it was done — no overlap. Keep the works, "
                       "and wait for them in finish()")


def _check_order(launch: _Launch, k: int, where: str) -> None:
    """The k-th all-reduce of a step must be bucket k's, every one of its gradients arrived."""
    def complete(b: int) -> bool:
        return set(HOOK_BUCKETS[b]) <= set(launch.arrived)

    if complete(k):
        return
    last = set(launch.arrived[-1:])                  # the gradient whose hook was running
    latest = next((b for b, bucket in enumerate(HOOK_BUCKETS) if last & set(bucket)), k)
    if latest != k and complete(latest):
        raise Hint(f"{where}: all-reduce no. {k + 1} was launched as bucket {latest}'s last "
                   f"gradient arrived, while bucket {k}, whose turn it was, was still incomplete "
                   "— out of order. "
                   "All-reduces pair up across ranks by the order they are launched, and here "
                   "the gradients arrive in a different order on each rank: the ranks summed "
                   "different buckets (of other sizes, a hang on NCCL, an abort on gloo). Launch "
                   "strictly in order: bucket k once it is complete and 0 … k − 1 are launched")
    have = len(set(HOOK_BUCKETS[k]) & set(launch.arrived))
    raise Hint(f"{where}: bucket {k}'s all-reduce was launched when {have} of its "
               f"{len(HOOK_BUCKETS[k])} gradients had arrived in this backward: the others "
               "were not in what was summed. Mark each parameter ready (a set per bucket, "
               "cleared in finish(), marking nothing while sync is False), and launch a bucket "
               "once every one of its parameters is marked")


def _check_hooked_grads(got: list[torch.Tensor], rank: int, step: int, m: int) -> None:
    """Each .grad after the step: the replicas' average of the summed microbatch gradients."""
    def mean(per_rank: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return sum(per_rank(r) for r in range(HOOK_DP)) / HOOK_DP

    for i, g in enumerate(got):
        def summed(r: int, upto: int = m, i: int = i) -> torch.Tensor:
            return sum(_hook_grad(r, step, mb, i) for mb in range(upto))

        want = mean(summed)
        if _same(g, want):
            continue
        where = f"rank {rank}, step {step + 1}, parameter {i}"
        if _same(g, summed(rank)):
            raise Hint(f"{where}: .grad still holds this rank's own gradient — the average "
                       "never came back. After waiting, copy each bucket's slices into .grad")
        if _same(g, want * HOOK_DP):
            raise Hint(f"{where}: .grad is {HOOK_DP}× the average: the all-reduce sums over "
                       "the replicas; divide by group.size")
        if _same(g, want / HOOK_DP):
            raise Hint(f"{where}: .grad is the average divided by dp once more: divide once")
        if m > 1 and _same(g, mean(lambda r: sum(summed(r, j + 1) for j in range(m)))):
            raise Hint(f"{where}: the first microbatch's gradient counts twice. In a "
                       "post-accumulate-grad hook .grad already holds the sum of every backward "
                       "so far: copy it into the bucket when it is launched, do not add it up "
                       "in every backward")
        raise Hint(f"{where}: .grad differs from the replicas' average by up to "
                   f"{(g - want).abs().max().item():.3g}")
