"""The checkers of notebook 12: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import sys

import cloudpickle
import pytest
import torch
from helpers import failed, marked, stub

from megatron_edu import comm
from megatron_edu.comm import P2POp
from megatron_edu.course.exercises import check

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def merge(o1, lse1, o2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return (lse1 - lse).exp() * o1 + (lse2 - lse).exp() * o2, lse


@pytest.mark.parametrize(("answer", "fragments"), [
    (merge, ()),
    (lambda o1, l1, o2, l2: (o1 + o2, torch.logaddexp(l1, l2)), ("o1 + o2",)),
    (lambda o1, l1, o2, l2: (merge(o1, l1, o2, l2)[0], torch.maximum(l1, l2)), ("larger",)),
    (lambda o1, l1, o2, l2: merge(o1, l1, o2, l2)[0], ("tuple (o, lse)",)),
    (stub, ("not done yet",)),
])
def test_12_1_merge(answer, fragments):
    result = check("12.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda r, cp: (r, 2 * cp - 1 - r), ()),
    (lambda r, cp: (2 * r, 2 * r + 1), ("consecutive parts",)),
    (lambda r, cp: (2 * cp - 1 - r, r), ("wrong order",)),
    (lambda r, cp: (r, 2 * cp - 2 - r) if cp > 1 else (0, 1), ("not 0 …",)),
    (lambda r, cp: (r, r + cp), ("not equal",)),
    (stub, ("not done yet",)),
])
def test_12_2_zigzag(answer, fragments):
    result = check("12.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def ring_step(block, group, turn=1):
    r, n = group.rank, group.size
    received = torch.empty_like(block)
    works = comm.batch_isend_irecv([
        P2POp("send", block, group.ranks[(r + turn) % n]),
        P2POp("recv", received, group.ranks[(r - turn) % n])], group)
    for work in works:
        work.wait()
    return received


@pytest.mark.parametrize(("answer", "fragments"), [
    (ring_step, ()),
    (lambda b, g: ring_step(b, g, turn=-1), ("backwards",)),
    (lambda b, g: b.clone(), ("should hold rank 3's block",)),
    (stub, ("not done yet",)),
])
def test_12_3_ring_step(answer, fragments):
    result = check("12.3", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def dkv_step(q, do, lse, delta, kv, dkv, owner, group, turn=1, skip=True, mask=True,
             own_lse=False, scale_scores=True, scale_ds=True, send=True, order=(0, 1)):
    r, n = group.rank, group.size
    if owner <= r or not skip:
        scale = q.shape[-1] ** -0.5
        scores = q @ kv[0].T * (scale if scale_scores else 1.0)
        if owner == r and mask:
            future = torch.ones_like(scores, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        p = (scores - (scores.logsumexp(-1, keepdim=True) if own_lse else lse)).exp()
        ds = p * (do @ kv[1].T - delta) * (scale if scale_ds else 1.0)
        parts = (ds.T @ q, p.T @ do)
        dkv = dkv + torch.stack([parts[i] for i in order])
    if not send:
        return dkv
    received = torch.empty_like(dkv)
    for work in comm.batch_isend_irecv([P2POp("send", dkv, group.ranks[(r + turn) % n]),
                                        P2POp("recv", received, group.ranks[(r - turn) % n])],
                                       group):
        work.wait()
    return received


@pytest.mark.parametrize(("mistake", "fragments"), [
    ({}, ()),
    (dict(send=False), ("stayed on the rank that computed them",)),
    (dict(turn=-1), ("went to rank r − 1 while the blocks go to r + 1",)),
    (dict(skip=False), ("a part for the block of a later rank",)),
    (dict(mask=False), ("needs the causal mask inside it",)),
    (dict(own_lse=True), ("the visiting block's keys alone",)),
    (dict(scale_scores=False), ("was not scaled by 1/√h_d before exp",)),
    (dict(scale_ds=False), ("dK is √h_d = 2.83× too large and dV is right",)),
    (dict(order=(1, 0)), ("right but swapped",)),
    (dict(send=False, own_lse=True), ("stayed on the rank", "; and the probabilities")),
], ids=["solution", "kept", "wrong-way", "no-skip", "no-mask", "own-lse", "scores-unscaled",
        "ds-unscaled", "swapped", "kept-and-own-lse"])
def test_12_4_ring_dkv(mistake, fragments):
    def answer(*args):
        return dkv_step(*args, **mistake)

    result = check("12.4", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def test_12_4_a_stub_is_not_done_yet():
    assert failed(check("12.4", stub), "not done yet")


# --- the marks: the answer as the notebook states it, which no cell may show before the exercise

@pytest.mark.parametrize(("exercise", "text"), [
    ("12.1", "o = e^(ℓ₁ − ℓ)·o₁ + e^(ℓ₂ − ℓ)·o₂"),
    ("12.1", "ℓ = log(e^ℓ₁ + e^ℓ₂)"),
    ("12.1", "merged = (l1 - lse).exp() * o1 + (l2 - lse).exp() * o2"),
    ("12.2", "give rank i chunks i and 2·cp − 1 − i"),
    ("12.2", "return rank, 2 * cp - 1 - rank"),
    ("12.2", "rank 0 holds positions [0, 1, 14, 15]"),
])
def test_12_marks_see_the_answer_as_the_notebook_writes_it(exercise, text):
    assert marked(exercise, text)


@pytest.mark.parametrize(("exercise", "text"), [
    ("12.1", "Hint: `torch.logaddexp` computes log(e^x + e^y) without overflow."),
    ("12.1", "P = exp(S − ℓ); dV = Pᵀ·dO"),
    ("12.2", "Cut the sequence into 2·cp chunks, numbered 0 … 2·cp − 1 in order."),
    ("12.2", "rank 1 holds positions [2, 3, 4, 5]"),
])
def test_12_marks_pass_over_the_prompts_and_what_is_not_the_answer(exercise, text):
    assert not marked(exercise, text)
