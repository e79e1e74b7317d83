"""The checkers of notebooks 06 and 07: the reference solutions pass; typical wrong answers get
the hint that names their mistake; a stub is "not done yet"; a deadlock is said to be one."""

import dataclasses
import sys

import cloudpickle
import pytest
import torch
from helpers import marked, stub, verdict

from megatron_edu import comm
from megatron_edu.course.exercises import check, nb07
from megatron_edu.grid import Layout
from megatron_edu.perf import parameters_per_rank
from megatron_edu.ptdp import Parallelism

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("exercise_id", ["06.1", "06.2", "06.3", "06.4", "07.1", "07.2", "07.3"])
def test_a_stub_is_not_done_yet(exercise_id):
    result = check(exercise_id, stub)
    assert result.passed is False and "not done yet" in result.message, result


# --- the marks: what gives an answer away before its exercise (megatron_edu/course/reveals.py) --

GIVEAWAYS = {  # per exercise: lines that showed (or would show) its answer before it
    "06.1": ["flat /= group.size",
             "zip(grads, flat.split([g.numel() for g in grads]), strict=True)"],
    "06.2": ["with ddp.sync(i == microbatches - 1):  # communicate in the last backward",
             "`ddp.sync(last)` says which backward pass communicates",
             "loss = model(x, y) / microbatches"],
    "06.3": ["params[mine] -= lr * u", "params.copy_(comm.all_gather(params[mine], group, dim=0))"],
    "06.4": ["p.register_post_accumulate_grad_hook(self.ready)",
             "while k < n and len(self.marked[k]) == len(self.buckets[k]):"],
    "07.1": ["return p * dp * tp + d * tp + t", "[sorted({g[0], g[-1]}) for g in groups]"],
    "07.2": ["return comm.all_reduce(grad, grid.embedding_group)",
             "the two parts are summed over the **embedding group** {first stage, last stage}"],
    "07.3": ["tp=2 pp=2 dp=2      4,593,664     131,072   3,504,128     262,144"],
}


@pytest.mark.parametrize("exercise_id", sorted(GIVEAWAYS))
def test_the_marks_see_what_gives_the_answer_away(exercise_id):
    assert [text for text in GIVEAWAYS[exercise_id] if not marked(exercise_id, text)] == []


# --- 06.1 one all-reduce per bucket --------------------------------------------------------------

def average_gradients(buckets, group):
    for grads in buckets:
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce_(flat, group, "dp grads")
        flat /= group.size
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))


def summed_not_averaged(buckets, group):
    for grads in buckets:
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce_(flat, group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(piece.view_as(g))


def one_all_reduce_per_tensor(buckets, group):
    for grads in buckets:
        for g in grads:
            comm.all_reduce_(g, group)
            g /= group.size


def reduced_but_not_copied_back(buckets, group):
    for grads in buckets:
        flat = torch.cat([g.flatten() for g in grads])
        comm.all_reduce_(flat, group)
        flat /= group.size


def test_06_1_the_solution_passes():
    result = check("06.1", average_gradients)
    assert result.passed, result
    assert "3 all-reduces" in result.message


@pytest.mark.parametrize("wrong, words", [
    (summed_not_averaged, "off by a factor dp = 2"),
    (one_all_reduce_per_tensor, "6 all-reduces for 3 buckets: one per tensor"),
    (reduced_but_not_copied_back, "still holds the rank's own gradient"),
], ids=["no-division", "per-tensor", "not-copied-back"])
def test_06_1_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("06.1", wrong, words)


# --- 06.2 gradient accumulation ------------------------------------------------------------------

def accumulate(model, ddp, x, y, m):
    for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
        with ddp.sync(i == m - 1):
            (model(xi, yi) / m).backward()
    ddp.finish_grad_sync()


def loss_not_divided_by_m(model, ddp, x, y, m):
    for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
        with ddp.sync(i == m - 1):
            model(xi, yi).backward()
    ddp.finish_grad_sync()


def syncs_every_microbatch(model, ddp, x, y, m):
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        (model(xi, yi) / m).backward()
    ddp.finish_grad_sync()


def never_finishes(model, ddp, x, y, m):
    for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
        with ddp.sync(i == m - 1):
            (model(xi, yi) / m).backward()


def communicates_after_backward(model, ddp, x, y, m):
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        with ddp.sync(False):
            (model(xi, yi) / m).backward()
    ddp.finish_grad_sync()


def test_06_2_the_solution_passes():
    result = check("06.2", accumulate)
    assert result.passed, result
    assert "3 all-reduces per step" in result.message and "not 12" in result.message


@pytest.mark.parametrize("wrong, words", [
    (loss_not_divided_by_m, "off by a factor m = 4"),
    (syncs_every_microbatch, "ddp.sync(False)"),
    (never_finishes, "finish_grad_sync() was not called"),
    (communicates_after_backward, "no bucket was launched during backward"),
], ids=["no-division", "every-microbatch", "no-finish", "no-overlap"])
def test_06_2_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("06.2", wrong, words)


# --- 06.3 a ZeRO-1 step --------------------------------------------------------------------------

def zero1_step(params, grads, state, group, lr=0.1, momentum=0.9):
    dp, r = group.size, group.rank
    n = params.numel() // dp
    mine = slice(r * n, (r + 1) * n)
    grad = comm.reduce_scatter(grads, group, dim=0) / dp
    buf = state.setdefault("momentum", torch.zeros_like(grad))
    buf.mul_(momentum).add_(grad)
    params[mine] -= lr * buf
    params.copy_(comm.all_gather(params[mine], group, dim=0))


def zero1_not_divided(params, grads, state, group, lr=0.1, momentum=0.9):
    r, n = group.rank, params.numel() // group.size
    grad = comm.reduce_scatter(grads, group, dim=0)
    buf = state.setdefault("momentum", torch.zeros_like(grad))
    buf.mul_(momentum).add_(grad)
    params[r * n:(r + 1) * n] -= lr * buf
    params.copy_(comm.all_gather(params[r * n:(r + 1) * n], group, dim=0))


def whole_buffer(params, grads, state, group, lr=0.1, momentum=0.9):
    grad = comm.all_reduce(grads, group) / group.size
    buf = state.setdefault("momentum", torch.zeros_like(grad))
    buf.mul_(momentum).add_(grad)
    params -= lr * buf


def gathers_before_updating(params, grads, state, group, lr=0.1, momentum=0.9):
    r, n = group.rank, params.numel() // group.size
    grad = comm.reduce_scatter(grads, group, dim=0) / group.size
    buf = state.setdefault("momentum", torch.zeros_like(grad))
    params.copy_(comm.all_gather(params[r * n:(r + 1) * n], group, dim=0))
    buf.mul_(momentum).add_(grad)
    params[r * n:(r + 1) * n] -= lr * buf


def reversed_shards(params, grads, state, group, lr=0.1, momentum=0.9):
    r, n = group.size - 1 - group.rank, params.numel() // group.size  # the wrong offset
    grad = comm.reduce_scatter(grads, group, dim=0) / group.size
    buf = state.setdefault("momentum", torch.zeros_like(grad))
    buf.mul_(momentum).add_(grad)
    params[r * n:(r + 1) * n] -= lr * buf
    params.copy_(comm.all_gather(params[r * n:(r + 1) * n], group, dim=0))


def forgets_momentum(params, grads, state, group, lr=0.1, momentum=0.9):
    r, n = group.rank, params.numel() // group.size
    buf = comm.reduce_scatter(grads, group, dim=0) / group.size
    params[r * n:(r + 1) * n] -= lr * buf
    params.copy_(comm.all_gather(params[r * n:(r + 1) * n], group, dim=0))


def gathers_on_rank_0_only(params, grads, state, group, lr=0.1, momentum=0.9):
    r, n = group.rank, params.numel() // group.size
    grad = comm.reduce_scatter(grads, group, dim=0) / group.size
    params[r * n:(r + 1) * n] -= lr * grad
    if r == 0:
        params.copy_(comm.all_gather(params[:n], group, dim=0))


def test_06_3_the_solution_passes():
    result = check("06.3", zero1_step)
    assert result.passed, result
    assert "48 bytes at dp = 4" in result.message


@pytest.mark.parametrize("wrong, words", [
    (zero1_not_divided, "off by a factor dp = 2"),
    (whole_buffer, "the momentum of the whole buffer"),
    (gathers_before_updating, "the other shards still hold the old weights"),
    (reversed_shards, "shard 0 holds shard 1 of the old weights moved by the gradient of shard 0"),
    (forgets_momentum, "the momentum must survive between steps"),
], ids=["no-division", "whole-buffer", "gather-first", "wrong-offset", "no-momentum"])
def test_06_3_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("06.3", wrong, words)


def test_06_3_a_deadlock_is_named():
    verdict("06.3", gathers_on_rank_0_only, "did not finish: they sat blocked, using no CPU",
             "a deadlock")


# --- 06.4 the bucket hook -----------------------------------------------------------------------

class BucketHooks:
    def __init__(self, buckets, group):
        self.buckets, self.group, self.sync = buckets, group, True
        self.bucket_of = {p: i for i, bucket in enumerate(buckets) for p in bucket}
        self.marked = [set() for _ in buckets]
        self.launched = []
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, param):
        if not self.sync:
            return
        self.marked[self.bucket_of[param]].add(param)
        while self.complete(len(self.launched)):
            self.launch(self.buckets[len(self.launched)])

    def complete(self, k):
        return k < len(self.buckets) and len(self.marked[k]) == len(self.buckets[k])

    def launch(self, params):
        flat = torch.cat([p.grad.flatten() for p in params]) / self.group.size
        self.launched.append((params, flat, comm.all_reduce_(flat, self.group, async_op=True)))

    def finish(self):
        for params, flat, work in self.launched:
            work.wait()
            for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(piece.view_as(p))
        self.marked, self.launched = [set() for _ in self.buckets], []


class LaunchedAfterBackward(BucketHooks):
    def ready(self, param):
        pass

    def finish(self):
        for bucket in self.buckets:
            self.launch(bucket)
        super().finish()


class LaunchedPerParameter(BucketHooks):
    def ready(self, param):
        if self.sync:
            self.launch([param])


class LaunchedWhenComplete(BucketHooks):  # each bucket as it completes, whatever its turn
    def ready(self, param):
        if self.sync:
            k = self.bucket_of[param]
            self.marked[k].add(param)
            if self.complete(k):
                self.launch(self.buckets[k])


class LaunchedOnlyInTurn(BucketHooks):  # an if, not a while: a bucket complete early never goes
    def ready(self, param):
        if self.sync:
            k = self.bucket_of[param]
            self.marked[k].add(param)
            if k == len(self.launched) and self.complete(k):
                self.launch(self.buckets[k])


class LaunchedAtFirstGradient(BucketHooks):
    def ready(self, param):
        if self.sync:
            self.marked[self.bucket_of[param]].add(param)
            while len(self.launched) < len(self.buckets) and self.marked[len(self.launched)]:
                self.launch(self.buckets[len(self.launched)])


class MarksKept(BucketHooks):  # finish() forgets nothing: the next step's buckets go at once
    def finish(self):
        super().finish()
        self.marked = [set(bucket) for bucket in self.buckets]


class NeverWaits(BucketHooks):
    def finish(self):
        for params, flat, _ in self.launched:
            for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(piece.view_as(p))
        self.marked, self.launched = [set() for _ in self.buckets], []


class CommunicatesEveryMicrobatch(BucketHooks):
    def ready(self, param):
        self.sync = True
        super().ready(param)


class AddsUpEveryBackward(BucketHooks):  # .grad holds the sum so far: adding it counts twice
    def __init__(self, buckets, group):
        super().__init__(buckets, group)
        self.sums = {p: torch.zeros_like(p) for p in self.bucket_of}

    def ready(self, param):
        self.sums[param] += param.grad
        if self.sync:
            param.grad.copy_(self.sums[param])
            super().ready(param)

    def finish(self):
        super().finish()
        for total in self.sums.values():
            total.zero_()


def test_06_4_the_solution_passes():
    result = check("06.4", BucketHooks)
    assert result.passed, result
    assert "in the same order on both ranks" in result.message


@pytest.mark.parametrize("wrong, words", [
    (LaunchedAfterBackward, "no all-reduce was launched during backward"),
    (LaunchedPerParameter, "6 all-reduces for 3 buckets — one per parameter"),
    (LaunchedWhenComplete, "rank 1, step 1: all-reduce no. 1 was launched as bucket 1's"),
    (LaunchedAtFirstGradient, "bucket 0's all-reduce was launched when 1 of its 2 gradients"),
    (MarksKept, "step 2 (2 microbatches): bucket 0's all-reduce was launched when 1 of its 2"),
    (NeverWaits, "finish() returned without waiting for bucket 0's all-reduce"),
    (CommunicatesEveryMicrobatch, "launched in the backward of microbatch 1 of 2"),
    (AddsUpEveryBackward, "the first microbatch's gradient counts twice"),
], ids=["after-backward", "per-parameter", "out-of-order", "too-early", "marks-kept", "no-wait",
        "every-microbatch", "counted-twice"])
def test_06_4_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("06.4", wrong, words)


def test_06_4_a_bucket_one_rank_never_launches_is_a_named_deadlock():
    verdict("06.4", LaunchedOnlyInTurn, "did not finish: they sat blocked, using no CPU",
             "a while loop, not an if")


# --- 07.1 the rank grid --------------------------------------------------------------------------

def rank_groups(tp, pp, dp):
    def rank(t, p, d):
        return p * dp * tp + d * tp + t
    groups = {
        "tp": [[rank(t, p, d) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, p, d) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, p, d) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    return groups


def _groups_in_order(tp, pp, dp, rank):
    groups = {
        "tp": [[rank(t, p, d) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, p, d) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, p, d) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    return groups


def pp_before_dp(tp, pp, dp):
    return _groups_in_order(tp, pp, dp, lambda t, p, d: d * pp * tp + p * tp + t)


def tp_slowest(tp, pp, dp):
    return _groups_in_order(tp, pp, dp, lambda t, p, d: t * pp * dp + p * dp + d)


def first_and_last_even_when_one_stage(tp, pp, dp):
    groups = rank_groups(tp, pp, dp)
    groups["embedding"] = [[g[0], g[-1]] for g in groups["pp"]]
    return groups


def no_embedding(tp, pp, dp):
    groups = rank_groups(tp, pp, dp)
    del groups["embedding"]
    return groups


def test_07_1_the_solution_passes():
    assert check("07.1", rank_groups).passed


@pytest.mark.parametrize("wrong, words", [
    (pp_before_dp, "your dp groups are the pp groups"),
    (tp_slowest, "tp is the fastest coordinate"),
    (first_and_last_even_when_one_stage, "with pp = 1 the first stage is also the last"),
    (no_embedding, "missing: embedding"),
], ids=["pp-before-dp", "tp-slowest", "one-stage", "missing-kind"])
def test_07_1_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("07.1", wrong, words)


# --- 07.2 the tied embedding ---------------------------------------------------------------------

def sum_tied_embedding_grads(grad, grid):
    if grad is None:
        return None
    return comm.all_reduce(grad, grid.embedding_group)


def keeps_its_own_part(grad, grid):
    return grad


def averages_the_copies(grad, grid):
    if grad is None:
        return None
    return comm.all_reduce(grad, grid.embedding_group) / 2


def sums_over_dp(grad, grid):
    if grad is None:
        return None
    return comm.all_reduce(grad, grid.dp_group)


def sums_over_the_pipeline(grad, grid):  # right at pp = 2; the middle stages never join at pp = 4
    if grad is None:
        return None
    return comm.all_reduce(grad, grid.pp_group)


def sums_on_the_first_stage_only(grad, grid):  # the last stage never joins: a deadlock
    if grid.pp_rank == 0:
        return comm.all_reduce(grad, grid.embedding_group)
    return grad


def test_07_2_the_solution_passes():
    assert check("07.2", sum_tied_embedding_grads).passed


@pytest.mark.parametrize("wrong, words", [
    (keeps_its_own_part, "kept only its own part of ∇E"),
    (averages_the_copies, "holds half the sum"),
    (sums_over_dp, "summed over the data-parallel group"),
    (sums_over_the_pipeline, "you summed over the pp group"),
], ids=["no-sum", "mean", "dp-group", "pp-group"])
def test_07_2_a_typical_mistake_gets_its_hint(wrong, words):
    verdict("07.2", wrong, words)


def test_07_2_an_all_reduce_one_copy_never_joins_is_a_named_deadlock():
    verdict("07.2", sums_on_the_first_stage_only, "using no CPU", "a deadlock",
             "grid.embedding_group")


# --- 07.3 the bytes of a PTD-P step --------------------------------------------------------------

def predict_bytes(config, tp, pp, dp, batch, microbatches, ring=True, scatter_gather=True,
                  padding=True, per_microbatch=True):
    t, p, d, m = tp, pp, dp, microbatches
    b, s, h, layers = batch // (d * m), config.seq_len, config.hidden, config.num_layers
    act = 4 * b * s * h

    def all_reduce(g):
        return 2 * (g - 1) / g if ring else float(g > 1)

    def all_gather(g):
        return (g - 1) / g if ring else float(g > 1)

    if not padding:  # the vocabulary as given (a multiple of t here)
        config = dataclasses.replace(config, make_vocab_size_divisible_by=1)
    vocab = config.padded_vocab(t)
    tp_bytes = t * p * d * (layers // p) * 4 * m * all_reduce(t) * act
    tp_bytes += 2 * d * t * m * all_reduce(t) * act
    tp_bytes += 2 * (p - 1) * d * t * m * all_gather(t) * act * scatter_gather
    pp_bytes = 2 * (p - 1) * d * m * act * (1 if scatter_gather else t)
    embedding = 2 * d * t * all_reduce(2) * 4 * vocab * h / t if p > 1 else 0
    split = Parallelism(Layout(tp=t, pp=p))
    dp_bytes = d * t * sum(all_reduce(d) * 4 * parameters_per_rank(config, split, stage)
                           for stage in range(p))
    scale = 1 if per_microbatch else 1 / m
    return dict(tp=tp_bytes * scale, pp=pp_bytes * scale, dp=dp_bytes, embedding=embedding)


def test_07_3_the_reference_counts_equal_the_measured_bytes_exactly():
    for tp, pp, dp in nb07.BYTES_LAYOUTS:
        reference = nb07.reference_bytes(nb07.BYTES_CONFIG, tp, pp, dp, nb07.BYTES_BATCH,
                                         nb07.BYTES_MICROBATCHES)
        measured = nb07.measured_bytes(tp, pp, dp)
        assert {k: round(v) for k, v in reference.items()} == \
            {k: measured[k] for k in nb07.PREDICTED}, (tp, pp, dp)


def test_07_3_the_solution_passes():
    result = check("07.3", predict_bytes)
    assert result.passed, result


@pytest.mark.parametrize("mistake, words", [
    (dict(ring=False), "you counted the size of each buffer, not what a rank sends"),
    (dict(scatter_gather=False), "§4.1's scatter/gather"),
    (dict(padding=False), "the vocabulary padded to a multiple of 128·tp"),
    (dict(per_microbatch=False), "for each of the m microbatches"),
], ids=["no-ring-factor", "no-scatter-gather", "no-padding", "per-step"])
def test_07_3_a_typical_mistake_gets_its_hint(mistake, words):
    def wrong(*args):
        return predict_bytes(*args, **mistake)

    verdict("07.3", wrong, words)


def test_07_3_a_prediction_off_in_an_unknown_way_names_the_purpose_and_the_factor():
    def wrong(*args):
        return {**predict_bytes(*args), "pp": 3 * predict_bytes(*args)["pp"]}

    verdict("07.3", wrong, "tp=2 pp=2 dp=2: your pp bytes are 3× the measured 32,768",
             "1/t of it from each tp rank")
