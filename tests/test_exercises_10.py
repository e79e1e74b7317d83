"""The checkers of notebook 10: the reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import pytest

from megatron_edu.course.exercises import check


def stub(*args):
    raise NotImplementedError("exercise NN.k: your code here")


def failed(result, *fragments):
    return result.passed is False and all(f in result.message for f in fragments)


def layer_bytes(s, b, h, a, t, sp, selective,
                sp_splits_10=True, elements=False, core_t=True, drop34=False):
    keep = 34 * s * b * h / t if sp and sp_splits_10 else (10 + 24 / t) * s * b * h
    core = 5 * a * s * s * b / (t if core_t else 1)
    total = (core if drop34 else keep) if selective else keep + core
    return total / 2 if elements else total


@pytest.mark.parametrize(("answer", "fragments"), [
    (layer_bytes, ()),
    (lambda *x: layer_bytes(*x, sp_splits_10=False), ("split t ways",)),
    (lambda *x: layer_bytes(*x, drop34=True), ("not the 34",)),
    (lambda *x: layer_bytes(*x, elements=True), ("elements",)),
    (lambda *x: layer_bytes(*x, core_t=False), ("not divided by t",)),
    (stub, ("not done yet",)),
])
def test_10_1_layer_bytes(answer, fragments):
    result = check("10.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
