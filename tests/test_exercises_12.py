"""The checkers of notebook 12: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import sys

import cloudpickle
import pytest
import torch

from megatron_edu import comm
from megatron_edu.comm import P2POp
from megatron_edu.course.exercises import check

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stub(*args):
    raise NotImplementedError("exercise NN.k: your code here")


def failed(result, *fragments):
    return result.passed is False and all(f in result.message for f in fragments)


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
