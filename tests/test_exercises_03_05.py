"""The checkers of notebooks 03–05: each reference solution passes, each typical mistake gets the
hint written for it (in words), a stub says "not done yet", a deadlock is named as one."""

import sys
from fractions import Fraction

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from helpers import marked, stub, verdict

from megatron_edu import comm
from megatron_edu.pipeline.schedules import Action, dependencies
from megatron_edu.pipeline.stages import Message

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("exercise", ["03.1", "03.2", "03.3"])
def test_a_stub_is_not_done_yet(exercise):
    verdict(exercise, stub, "not done yet")


# --- 03.1 the masked lookup ---------------------------------------------------------------------

def _outside(ids, weight, vocab_start):
    return (ids < vocab_start) | (ids >= vocab_start + weight.shape[0])


def lookup(ids, weight, vocab_start, group):
    outside = _outside(ids, weight, vocab_start)
    local = (ids - vocab_start).masked_fill(outside, 0)
    return comm.g(F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0), group)


def lookup_without_g(ids, weight, vocab_start, group):
    outside = _outside(ids, weight, vocab_start)
    local = (ids - vocab_start).masked_fill(outside, 0)
    return F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)


def lookup_without_zeros(ids, weight, vocab_start, group):
    local = (ids - vocab_start).masked_fill(_outside(ids, weight, vocab_start), 0)
    return comm.g(F.embedding(local, weight), group)


def lookup_unshifted(ids, weight, vocab_start, group):
    outside = _outside(ids, weight, vocab_start)
    return comm.g(F.embedding(ids.masked_fill(outside, 0), weight), group)


def lookup_of_the_gathered_table(ids, weight, vocab_start, group):
    return F.embedding(ids, comm.all_gather(weight, group, dim=0))


def test_03_1_the_masked_lookup_passes():
    verdict("03.1", lookup)


@pytest.mark.parametrize("fn, words", [
    (lookup_without_g, ["only its own partial lookup", "comm.g"]),
    (lookup_without_zeros, ["must contribute zeros"]),
    (lookup_unshifted, ["rank 1 raised IndexError", "subtract vocab_start"]),
    (lookup_of_the_gathered_table, ["all-gathered", "one all-reduce"]),
], ids=["no-g", "no-zeros", "unshifted", "gathered-table"])
def test_03_1_mistakes_get_their_hint(fn, words):
    verdict("03.1", fn, *words)


# --- 03.2 the gradient, without communication -------------------------------------------------

def _owned(target, vocab_start, width):
    return (target >= vocab_start) & (target < vocab_start + width)


def gradient(softmax, target, vocab_start, group):
    ours = _owned(target, vocab_start, softmax.shape[-1])
    onehot = F.one_hot((target - vocab_start).masked_fill(~ours, 0), softmax.shape[-1])
    return softmax - onehot * ours[:, None]


def gradient_without_onehot(softmax, target, vocab_start, group):
    return softmax.clone()


def gradient_flipped(softmax, target, vocab_start, group):
    return -gradient(softmax, target, vocab_start, group)


def gradient_on_every_rank(softmax, target, vocab_start, group):
    return softmax - F.one_hot(target % softmax.shape[-1], softmax.shape[-1])


def gradient_unshifted(softmax, target, vocab_start, group):
    grad, ours = softmax.clone(), _owned(target, vocab_start, softmax.shape[-1])
    grad[torch.arange(len(target))[ours], target[ours]] -= 1
    return grad


def gradient_all_reduced(softmax, target, vocab_start, group):
    return comm.all_reduce(gradient(softmax, target, vocab_start, group), group)


def test_03_2_the_local_gradient_passes():
    verdict("03.2", gradient)


@pytest.mark.parametrize("fn, words", [
    (gradient_without_onehot, ["−1 at each target is missing"]),
    (gradient_flipped, ["sign is flipped"]),
    (gradient_on_every_rank, ["on every rank", "only the rank that holds the target"]),
    (gradient_unshifted, ["IndexError", "subtract vocab_start"]),
    (gradient_all_reduced, ["communicated (all_reduce", "needs none"]),
], ids=["no-onehot", "flipped", "every-rank", "unshifted", "all-reduced"])
def test_03_2_mistakes_get_their_hint(fn, words):
    verdict("03.2", fn, *words)


# --- 03.3 the fused loss ----------------------------------------------------------------------

def _vocab_start(logits, group):
    return group.rank * logits.shape[-1]


def _target_logit(shifted, target, vocab_start):
    ours = _owned(target, vocab_start, shifted.shape[-1])
    local = (target - vocab_start).masked_fill(~ours, 0)
    return torch.where(ours, shifted.gather(-1, local[:, None]).squeeze(-1), 0.0)


def _global_max(logits, group):
    local_max = logits.detach().max(dim=-1, keepdim=True).values
    return comm.all_gather(local_max, group).max(dim=-1, keepdim=True).values


def loss(logits, target, group):
    shifted = logits - _global_max(logits, group)
    target_logit = comm.g(_target_logit(shifted, target, _vocab_start(logits, group)), group)
    return comm.g(shifted.exp().sum(dim=-1), group).log() - target_logit


def loss_with_plain_all_reduces(logits, target, group):  # autograd: identity, as g does
    shifted = logits - _global_max(logits, group)
    target_logit = comm.all_reduce(_target_logit(shifted, target, _vocab_start(logits, group)),
                                   group)
    return comm.all_reduce(shifted.exp().sum(dim=-1), group).log() - target_logit


def loss_without_max(logits, target, group):
    target_logit = comm.g(_target_logit(logits, target, _vocab_start(logits, group)), group)
    return comm.g(logits.exp().sum(dim=-1), group).log() - target_logit


def loss_with_local_max(logits, target, group):
    comm.all_gather(logits.detach().max(dim=-1, keepdim=True).values, group)  # gathered, unused
    shifted = logits - logits.detach().max(dim=-1, keepdim=True).values
    target_logit = comm.g(_target_logit(shifted, target, _vocab_start(logits, group)), group)
    return comm.g(shifted.exp().sum(dim=-1), group).log() - target_logit


def loss_with_target_from_every_rank(logits, target, group):
    shifted = logits - _global_max(logits, group)
    everyone = shifted.gather(-1, (target % logits.shape[-1])[:, None]).squeeze(-1)
    return comm.g(shifted.exp().sum(dim=-1), group).log() - comm.g(everyone, group)


def loss_with_local_target(logits, target, group):
    shifted = logits - _global_max(logits, group)
    target_logit = _target_logit(shifted, target, _vocab_start(logits, group))
    comm.g(target_logit, group)  # reduced, but the local value is used
    return comm.g(shifted.exp().sum(dim=-1), group).log() - target_logit


def loss_of_gathered_logits(logits, target, group):
    return F.cross_entropy(comm.gather(logits, group), target, reduction="none")


def loss_deadlocking(logits, target, group):
    if group.rank == 0:  # the other ranks never join this all-gather
        _global_max(logits, group)
    return loss(logits, target, group)


def test_03_3_the_fused_loss_passes_with_g_or_plain_all_reduces():
    verdict("03.3", loss)
    verdict("03.3", loss_with_plain_all_reduces)


@pytest.mark.parametrize("fn, words", [
    (loss_without_max, ["exp overflows", "subtract the global maximum"]),
    (loss_with_local_max, ["its own maximum", "all-gather the local maxima"]),
    (loss_with_target_from_every_rank, ["came from every rank", "holds the target"]),
    (loss_with_local_target, ["different losses", "target logit"]),
    (loss_of_gathered_logits, ["whole logits", "three numbers per token"]),
], ids=["no-max", "local-max", "every-rank", "local-target", "gathered-logits"])
def test_03_3_mistakes_get_their_hint(fn, words):
    verdict("03.3", fn, *words)


def test_03_3_a_collective_on_one_rank_only_is_named_a_deadlock():
    verdict("03.3", loss_deadlocking, "did not finish: they sat blocked, using no CPU", "deadlock")


# --- 04.1 the peak of 1F1B --------------------------------------------------------------------

@pytest.mark.parametrize("exercise", ["04.1", "04.2", "04.3", "04.4"])
def test_a_stub_of_04_is_not_done_yet(exercise):
    verdict(exercise, stub, "not done yet")


def test_04_1_min_of_p_minus_rank_and_m_passes():
    verdict("04.1", lambda p, m, rank: min(p - rank, m))


@pytest.mark.parametrize("fn, words", [
    (lambda p, m, r: min(p - r - 1, m), ["warm-up forwards only", "one more forward"]),
    (lambda p, m, r: p - r, ["p=2, m=1, rank 0: you said 2, the schedule holds 1",
                             "cannot hold more than the m"]),
    (lambda p, m, r: m, ["GPipe's peak"]),
    (lambda p, m, r: min(r + 1, m), ["reversed", "rank 0"]),
    (lambda p, m, r: p, ["p=4, m=8, rank 1: you said 4, the schedule holds 3", "each F adds"]),
    (lambda p, m, r: float(min(p - r, m)), ["float", "int"]),
], ids=["warm-up-only", "no-min", "gpipe", "reversed", "other", "float"])
def test_04_1_mistakes_get_their_hint(fn, words):
    verdict("04.1", fn, *words)


# --- 04.2 one rank's 1F1B order ---------------------------------------------------------------

def _warmup_then_alternate(forwards, backwards, warmup):
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup:]


def one_f_one_b_rank(p, m, rank):
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    return _warmup_then_alternate(forwards, backwards, min(p - rank - 1, m))


def one_f_one_b_one_too_many(p, m, rank):
    forwards, backwards = [Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)]
    return _warmup_then_alternate(forwards, backwards, min(p - rank, m))


def one_f_one_b_uncapped(p, m, rank):
    warmup = p - rank - 1
    order = [Action("F", i) for i in range(warmup)]
    for i in range(max(m - warmup, 0)):
        order += [Action("F", warmup + i), Action("B", i)]
    return order + [Action("B", i) for i in range(max(m - warmup, 0), m)]


def one_f_one_b_backward_first(p, m, rank):
    warmup = min(p - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("B", i), Action("F", warmup + i)] if i else \
            [Action("F", warmup), Action("B", 0)]
    return order + [Action("B", i) for i in range(m - warmup, m)]


def one_f_one_b_lifo_cooldown(p, m, rank):
    row = one_f_one_b_rank(p, m, rank)
    steady = len(row) - min(p - rank - 1, m)
    return row[:steady] + row[steady:][::-1]


def gpipe_rank(p, m, rank):
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def test_04_2_the_1f1b_order_passes():
    verdict("04.2", one_f_one_b_rank)


@pytest.mark.parametrize("fn, words", [
    (one_f_one_b_one_too_many, ["p=4, m=8, rank 0 starts its first backward after 5 "
                                "forwards, expected 4"]),
    (gpipe_rank, ["after 8 forwards, expected 4", "min(p − r − 1, m) = 3"]),
    (one_f_one_b_uncapped, ["there are only m = 1 microbatches"]),
    (one_f_one_b_backward_first, ["first difference at position", "alternate one forward and "
                                  "one backward", "fail check_schedule: dependency violation"]),
    (one_f_one_b_lifo_cooldown, ["first difference at position"]),
    (lambda p, m, rank: "F0 B0", ["returned str", "list of Action"]),
], ids=["one-too-many", "gpipe", "uncapped", "backward-first", "lifo-cooldown", "string"])
def test_04_2_mistakes_get_their_hint(fn, words):
    verdict("04.2", fn, *words)


# --- 04.3 one rank's interleaved order --------------------------------------------------------

def _stream(kind, p, m, v, reverse=True, grouped=True):
    stream = []
    for k in range(m * v):
        if grouped:
            chunk, microbatch = (k // p) % v, (k // (p * v)) * p + k % p
        else:  # every chunk of a microbatch before the next microbatch
            chunk, microbatch = k % v, k // v
        stream.append(Action(kind, microbatch, v - 1 - chunk if kind == "B" and reverse
                             else chunk))
    return stream


def interleaved_rank(p, m, v, rank, reverse=True, grouped=True, warmup=None):
    forwards = _stream("F", p, m, v, reverse, grouped)
    backwards = _stream("B", p, m, v, reverse, grouped)
    if warmup is None:
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
    return _warmup_then_alternate(forwards, backwards, warmup)


def test_04_3_the_interleaved_order_passes():
    verdict("04.3", interleaved_rank)


@pytest.mark.parametrize("fn, words", [
    (lambda p, m, v, r: interleaved_rank(p, m, v, r, reverse=False),
     ["visit the chunks in the forwards' order", "reverse"]),
    (lambda p, m, v, r: interleaved_rank(p, m, v, r, grouped=False),
     ["forward passes come in another order", "groups of p = 4"]),
    (lambda p, m, v, r: interleaved_rank(p, m, v, r, warmup=min(p - r - 1, m * v)),
     ["p=4, m=8, v=2, rank 0 runs 4 forwards before its first backward, expected 11",
      "(p − r − 1)·2 + (v − 1)·p"]),
    (lambda p, m, v, r: one_f_one_b_rank(p, m, r), ["missing B0.1", "F0.1", "on each chunk"]),
], ids=["unreversed", "ungrouped", "1f1b-warmup", "one-chunk"])
def test_04_3_mistakes_get_their_hint(fn, words):
    verdict("04.3", fn, *words)


# --- 04.4 the bubble, played on paper ---------------------------------------------------------

def played(schedule, forward_time, backward_time, wait=True):
    """Per rank, when its first action starts, when its last ends, and how long it computed
    (``wait``: each action waits for its inputs too)."""
    p, stages = len(schedule), schedule.stages
    cost = {"F": Fraction(forward_time) / stages.v, "B": Fraction(backward_time) / stages.v}
    ends, free_at, done, first = {}, [0] * p, [0] * p, [None] * p
    while any(done[r] < len(row) for r, row in enumerate(schedule)):
        for rank, row in enumerate(schedule):
            while done[rank] < len(row):
                action = row[done[rank]]
                inputs = dependencies(rank, action, stages)
                if any(dep not in ends for dep in inputs):
                    break
                start = max([free_at[rank], *(ends[dep] for dep in inputs if wait)])
                first[rank] = start if first[rank] is None else first[rank]
                free_at[rank] = ends[rank, action] = start + cost[action.kind]
                done[rank] += 1
    return first, free_at, [sum(cost[a.kind] for a in row) for row in schedule]


def bubble_fraction(schedule, forward_time, backward_time, over="compute", wait=True):
    _, ends, busy = played(schedule, forward_time, backward_time, wait)
    idle = [max(ends) - b for b in busy]
    return sum(idle) / {"compute": sum(busy), "step": len(busy) * max(ends),
                        "one rank": busy[0]}[over]


def bubble_until_own_end(schedule, forward_time, backward_time):
    _, ends, busy = played(schedule, forward_time, backward_time)
    return sum(e - b for e, b in zip(ends, busy, strict=True)) / sum(busy)


def bubble_within_own_span(schedule, forward_time, backward_time):
    starts, ends, busy = played(schedule, forward_time, backward_time)
    return sum(e - s - b for s, e, b in zip(starts, ends, busy, strict=True)) / sum(busy)


def formula(p_minus, v_divides=True):
    """(p − p_minus)/(v·m) of the schedule's sizes, or without v."""
    def answer(schedule, forward_time, backward_time):
        v = schedule.stages.v if v_divides else 1
        return Fraction(len(schedule) - p_minus, v * schedule.num_microbatches)
    return answer


def test_04_4_the_played_timeline_passes():
    result = verdict("04.4", bubble_fraction)
    assert "for all 24 schedules" in result.message and "t_pb / t_id" in result.message
    verdict("04.4", lambda *args: float(bubble_fraction(*args)))


@pytest.mark.parametrize("fn, words", [
    (lambda *a: bubble_fraction(*a, over="step"), ["1f1b, p=4, m=8, t_f=1, t_b=2: you said 3/11",
                                                   "ideal time", "not (p − 1)/(m + p − 1)"]),
    (bubble_within_own_span, ["its own first and last action", "until the last rank"]),
    (bubble_until_own_end, ["until its own last action ends", "the optimizer step waits"]),
    (lambda *a: 1 - bubble_fraction(*a, over="step"), ["share of the step spent computing"]),
    (lambda *a: bubble_fraction(*a, wait=False), ["no bubble", "depends on"]),
    (lambda *a: bubble_fraction(*a) / len(a[0]), ["(p − 1)/(p·m), p times too small"]),
    (lambda *a: bubble_fraction(*a, over="one rank"), ["p times too large"]),
    (formula(0), ["p/m", "p − 1 steps"]),
    (formula(1, v_divides=False), ["interleaved, p=4, m=8, v=2", "you said 3/8",
                                   "v times shorter"]),
    (formula(1), ["right for GPipe, 1F1B and interleaved",
                  "one microbatch at a time, p=4, m=2, t_f=1, t_b=2: you said 3/2, the timeline "
                  "gives 3", "naive model parallelism", "Play the schedule"]),
    (lambda *a: bubble_fraction(*a) + 0.01, ["you said 0.385", "each rank idles 9, 9, 9, 9 and "
                                             "computes 24, 24, 24, 24", "Σ idle / Σ compute"]),
    (lambda *a: str(bubble_fraction(*a)), ["returned '3/8' (str)", "one number"]),
], ids=["over-the-step", "own-span", "own-end", "utilisation", "no-waiting", "one-rank-over-all",
        "all-over-one-rank", "p-over-m", "v-forgotten", "formula", "other", "string"])
def test_04_4_mistakes_get_their_hint(fn, words):
    verdict("04.4", fn, *words)


@pytest.mark.parametrize("exercise, answers, harmless", [
    ("03.1", ["local = (ids - self.vocab_start).masked_fill(outside, 0)",
              "return out.masked_fill(outside.unsqueeze(-1), 0.0)"],
     ["z = comm.g(partial, group)", "zero the rows you looked up (`masked_fill`)"]),
    ("03.2", ["grad = softmax - F.one_hot(local, width)", "grad_2d[arange, target] -= 1.0"],
     ["its gradient softmax − onehot", "grad -= 1e-3"]),
    ("03.3", ["m = comm.all_gather(local_max, group)", "return sum_exp.log() - target_logit"],
     ["loss = log Σ exp(z − m) − (z_y − m)", "comm.all_gather(x, group)"]),
    ("04.1", ["holds at most **p − r** on rank r", "1f1b peak activations per rank: [4, 3, 2, 1]",
              "return min(p - rank, m)"],
     ["warms up with p − r − 1 forwards", "min(p − rank − 1, m)", "(p − r − 1)·2 + (v − 1)·p"]),
    ("04.2", ["order += [forwards[warmup + i], backwards[i]]"],
     ["build the streams [F0, F1, …] and [B0, B1, …] first"]),
    ("04.3", ["chunk = (k // p) % v", "microbatch = (k // (p * v)) * p + k % p"],
     ["k % p is the k-th action's place in its group"]),
    ("04.4", ["each rank idles p − 1 steps of every p"], ["bubble (p − 1)/m", "t_pb / t_id"]),
])
def test_the_marks_of_03_and_04_see_an_answer_not_its_prompt(exercise, answers, harmless):
    """The reveal detector's marks (megatron_edu/course/reveals.py) on text without spaces."""
    assert [text for text in answers if not marked(exercise, text)] == []
    assert [text for text in harmless if marked(exercise, text)] == []


# --- 05.1 a deadlock, predicted and seen ------------------------------------------------------

F0, F1, B0, B1 = Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)


def a_deadlock():  # rank 0 starts with microbatch 1 and waits for its gradient; rank 1 for F0
    return [[F1, B1, F0, B0], [F0, B0, F1, B1]]


@pytest.mark.parametrize("exercise", ["05.1", "05.2"])
def test_a_stub_of_05_is_not_done_yet(exercise):
    verdict(exercise, stub, "not done yet")


def test_05_1_a_deadlock_is_predicted_then_seen_stuck():
    result = verdict("05.1", a_deadlock)
    assert "check_schedule predicted it" in result.message
    assert "rank 0 waits at B1 for B1 on rank 1" in result.message
    assert "the launcher stopped it: ranks [0, 1] did not finish" in result.message


@pytest.mark.parametrize("schedule, words", [
    ([[F0, F1, B0, B1], [F0, B0, F1, B1]], ["this schedule is valid", "wait on each other"]),
    ([[F1, B1, F0, B0], [F0, B0, F1]], ["incomplete rather than deadlocking", "missing B1"]),
    ([[F0, B0, F1, B1], [B0, F0, F1, B1]], ["dependency violation", "waiting on itself"]),
    ([[F0, B0]], ["1 ranks", "at least 2"]),
    ("F0 B0", ["returned str", "one list of Action per rank"]),
], ids=["valid", "incomplete", "own-order", "one-rank", "string"])
def test_05_1_mistakes_get_their_hint(schedule, words):
    verdict("05.1", lambda: schedule, *words)


# --- 05.2 the message keys --------------------------------------------------------------------

def messages_of(action, rank, stages, stage_of=lambda s, rank, chunk: s.stage(rank, chunk),
                first_receives=False, last_sends=False, grad_forward=False):
    stage, last = stage_of(stages, rank, action.chunk), stages.num_stages - 1
    mb = action.microbatch
    if action.kind == "F":
        return (Message("act", mb, stage) if stage > 0 or first_receives else None,
                Message("act", mb, stage + 1) if stage < last or last_sends else None)
    if action.kind == "W":
        return None, None
    return (Message("grad", mb, stage) if stage < last else None,
            Message("grad", mb, stage + 1 if grad_forward else stage - 1) if stage > 0 else None)


def test_05_2_the_message_keys_pass_and_run_in_the_engine():
    result = verdict("05.2", messages_of)
    assert "gives the serial model's loss" in result.message


@pytest.mark.parametrize("fn, words", [
    (lambda a, r, s: messages_of(a, r, s, stage_of=lambda s, r, c: r),
     ["F0.1 on rank 0 (StageMap(p=2, v=2, kind='interleaved'): virtual stage 2)",
      "stages.stage(rank, chunk) = 2, not 0"]),
    (lambda a, r, s: messages_of(a, r, s, stage_of=lambda s, r, c: c * s.p + r),
     ["under ZB-V's V the chunks do not sit at c·p + r"]),
    (lambda a, r, s: messages_of(a, r, s, first_receives=True),
     ["F0 on rank 0 (StageMap(p=4, v=1, kind='interleaved'): virtual stage 0) reads the token"]),
    (lambda a, r, s: messages_of(a, r, s, last_sends=True),
     ["is the last virtual stage", "sends nothing"]),
    (lambda a, r, s: messages_of(a, r, s, grad_forward=True),
     ["B0 on rank 1", "a gradient for i − 1 from B of i"]),
    (lambda a, r, s: [None, None], ["returned [None, None]", "a pair"]),
], ids=["rank-not-stage", "interleaved-under-v", "first-receives", "last-sends", "grad-forward",
        "list"])
def test_05_2_mistakes_get_their_hint(fn, words):
    verdict("05.2", fn, *words)


def test_03_3_the_packages_own_loss_is_not_an_answer():
    from megatron_edu.tensor_parallel import vocab_parallel_cross_entropy

    verdict("03.3", vocab_parallel_cross_entropy, "package's own")
