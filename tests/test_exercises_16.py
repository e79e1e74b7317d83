"""The checkers of notebook 16: each reference design passes, each typical wrong design is told
which constraint it breaks, a stub gets "not done yet"."""

import sys

import cloudpickle
import pytest

from megatron_edu.course.exercises import check
from megatron_edu.grid import Layout
from megatron_edu.pipeline.schedules import PipelineConfig, make_schedule
from megatron_edu.ptdp import Parallelism

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stub(*args):
    raise NotImplementedError("exercise NN.k: your code here")


def failed(result, *fragments):
    return result.passed is False and all(f in result.message for f in fragments)


def split(tp: int, pp: int, dp: int, m: int, schedule: str = "1f1b",
          chunks: int | None = None) -> Parallelism:
    """tp × pp × dp ranks running ``schedule`` over m microbatches of one sequence."""
    return Parallelism(Layout(tp, pp, dp), PipelineConfig(schedule, chunks, num_microbatches=m))


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: make_schedule("interleaved", 4, 8, 4), ()),
    (lambda: make_schedule("zb-h1", 4, 8), ()),
    (lambda: make_schedule("gpipe", 4, 8), ("8 stages' worth", "bubble is 0.375")),
    (lambda: make_schedule("1f1b", 4, 8), ("0.225 over",)),
    (lambda: make_schedule("interleaved", 4, 8, 2), ("0.5 over", "0.0375 over")),
    (lambda: make_schedule("1f1b", 4, 16), ("batch is fixed",)),
    (lambda: "1f1b", ("return a Schedule",)),
    (stub, ("not done yet",)),
])
def test_16_1(answer, fragments):
    result = check("16.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: (split(4, 8, 16, 96, "interleaved", 3), "selective"), ()),
    (lambda: (split(8, 2, 32, 48), "full"), ("3.5 GiB more",)),
    (lambda: (split(16, 2, 16, 96), "full"), ("NVLink",)),
    (lambda: (split(8, 8, 8, 192), "full"), ("short of 130",)),
    (lambda: (split(8, 8, 8, 96), "full"), ("B = 1536",)),
    (lambda: (Layout(8, 8, 8), "full"), ("should be a megatron_edu.ptdp.Parallelism",)),
    (lambda: split(8, 8, 8, 192), ("return a pair",)),
    (stub, ("not done yet",)),
])
def test_16_2(answer, fragments):
    result = check("16.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: 36, ()), (lambda: 8, ("too small",)), (lambda: 40, ("too large",)),
    (lambda: 37, ("multiple of 4",)), (lambda: 36.0, ("an int",)), (stub, ("not done yet",)),
])
def test_16_3(answer, fragments):
    result = check("16.3", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: ("selective", True), ()), (lambda: ("full", False), ("fits", "+33.1 %")),
    (lambda: ("selective", False), ("8.0 over",)), (lambda: ("none", True), ("10.4 over",)),
    (lambda: "full", ("return a pair",)), (stub, ("not done yet",)),
])
def test_16_4(answer, fragments):
    result = check("16.4", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
