"""The checkers of notebook 16: each reference design passes, each typical wrong design is told
which constraint it breaks, each number computed wrongly (16.2–16.4 ask for the reasoning too)
what it was computed as, a stub gets "not done yet"."""

import sys
from dataclasses import replace

import cloudpickle
import pytest
from helpers import failed, stub

from megatron_edu.course.exercises import check, nb16
from megatron_edu.grid import Layout
from megatron_edu.perf import GIB, MIXED, MIXED_FP32_GRADS, memory_per_rank, predict
from megatron_edu.pipeline.schedules import PipelineConfig, make_schedule
from megatron_edu.ptdp import Parallelism

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


# --- 16.2–16.4: the design and the numbers it was chosen by, computed with the model's pieces ---

def design(tp, pp, dp, m, mode, schedule="1f1b", chunks=None, gib=None, tflops=None):
    """A 16.2 answer: the split, its recomputation, and (unless given) the memory in GiB and the
    TFLOP/s per GPU the model predicts for it."""
    parallelism = split(tp, pp, dp, m, schedule, chunks)
    prediction = predict(replace(nb16.MODEL_39B, recompute=mode), parallelism, nb16.A100_40GB)
    return (parallelism, mode, prediction.memory.total / GIB if gib is None else gib,
            prediction.tflops_per_gpu if tflops is None else tflops)


BEST = (4, 8, 16, 96, "selective", "interleaved", 3)   # the advisor's best at 40 GiB


def best_with(**numbers):
    return design(*BEST, **numbers)


def memory_39b(mode, precision=MIXED_FP32_GRADS):
    config = replace(nb16.MODEL_39B, recompute=mode)
    return memory_per_rank(config, split(*BEST[:4], *BEST[5:]), precision=precision)


def prediction_39b(mode):
    return predict(replace(nb16.MODEL_39B, recompute=mode), split(*BEST[:4], *BEST[5:]),
                   nb16.A100_40GB)


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: best_with(), ()),
    (lambda: design(8, 2, 32, 48, "full"), ("3.5 GiB more",)),
    (lambda: design(16, 2, 16, 96, "full"), ("NVLink",)),
    (lambda: design(8, 8, 8, 192, "full"), ("short of 130",)),
    (lambda: design(8, 8, 8, 96, "full"), ("B = 1536",)),
    (lambda: (Layout(8, 8, 8), "full", 13.2, 125.1),
     ("should be a megatron_edu.ptdp.Parallelism",)),
    (lambda: (split(8, 8, 8, 192), "partial", 13.2, 125.1), ("one of ('none'",)),
    (lambda: (split(8, 8, 8, 192), "full"),
     ("return a tuple (parallelism, recompute, gib, tflops)",)),
    (lambda: best_with(gib="38.4"), ("should be a number",)),
    # the memory, computed wrongly
    (lambda: best_with(gib=memory_39b("full").total / GIB), ("memory with recompute='full'",)),
    (lambda: best_with(gib=memory_39b("selective").total / 1e9), ("in GB",)),
    (lambda: best_with(gib=memory_39b("selective", MIXED).total / GIB), ("16 bytes",)),
    (lambda: best_with(gib=memory_39b("selective").activations / GIB), ("activations alone",)),
    (lambda: best_with(gib=30.0), ("not the model's for this design",)),
    # the throughput, computed wrongly
    (lambda: best_with(tflops=prediction_39b("selective").percent_of_peak), ("percent",)),
    (lambda: best_with(tflops=prediction_39b("selective").tflops_per_gpu * 1e12), ("FLOP/s",)),
    (lambda: best_with(tflops=prediction_39b("full").tflops_per_gpu),
     ("prediction with recompute='full'",)),
    (lambda: best_with(tflops=150.0), ("not the model's prediction",)),
    (stub, ("not done yet",)),
])
def test_16_2(answer, fragments):
    result = check("16.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def breakdowns(m=8):
    """1F1B's and interleaving's predicted time breakdowns at m microbatches, for 16.3."""
    return [predict(nb16.MODEL_39B, Parallelism(nb16.LAYOUT_16_3, pipeline),
                    nb16.ETHERNET_A100).time
            for pipeline in (PipelineConfig("1f1b", num_microbatches=m),
                             PipelineConfig("interleaved", 2, num_microbatches=m))]


def reasoned(m, saved=None, extra=None, at=8):
    """A 16.3 answer: m, and (unless given) the bubble saved and the sends added per microbatch,
    read off the breakdowns at m = ``at``."""
    one, two = breakdowns(at)
    return (m, one.bubble - two.bubble if saved is None else saved,
            (two.pipeline_p2p - one.pipeline_p2p) / at if extra is None else extra)


def p2p(at=8):
    one, two = breakdowns(at)
    return one.pipeline_p2p, two.pipeline_p2p


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: reasoned(36), ()), (lambda: reasoned(36, at=4), ()),
    (lambda: reasoned(8), ("too small", "your own numbers")),
    (lambda: reasoned(40), ("too large", "40 · 0.005724 s > 0.2288 s")),
    (lambda: reasoned(37), ("multiple of 4",)), (lambda: reasoned(36.0), ("an int",)),
    (lambda: 36, ("return a tuple (m, saved, extra)",)),
    (lambda: reasoned(36, saved=None, extra="a lot"), ("should be a number",)),
    # the saving, computed wrongly
    (lambda: reasoned(36, saved=breakdowns()[0].bubble), ("1F1B's whole bubble",)),
    (lambda: reasoned(36, saved=breakdowns()[1].bubble), ("interleaving still idles",)),
    (lambda: reasoned(36, saved=-reasoned(36)[1]), ("wrong sign",)),
    (lambda: reasoned(36, saved=breakdowns(8)[0].total - breakdowns(8)[1].total),
     ("the two iteration times at m = 8",)),
    (lambda: reasoned(36, saved=1.0), ("not the model's",)),
    # the extra sends, computed wrongly
    (lambda: reasoned(36, extra=p2p()[1] / 8), ("all of interleaving's sends",)),
    (lambda: reasoned(36, extra=reasoned(36)[2] / 2), ("one message",)),
    (lambda: reasoned(36, extra=-reasoned(36)[2]), ("wrong sign",)),
    (lambda: reasoned(36, extra=p2p()[1] - p2p()[0]), ("extra sends of 8 microbatches",)),
    (lambda: reasoned(36, extra=1.0), ("are not the model's",)),
    (stub, ("not done yet",)),
])
def test_16_3(answer, fragments):
    result = check("16.3", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def flops_76b(recompute, sp=False):
    config = replace(nb16.MODEL_76B, recompute=recompute, sequence_parallel=sp)
    return predict(config, nb16.PARALLELISM_76B).flops_per_iteration


def option(recompute, sp, gib=None, extra=None):
    """A 16.4 answer: the option, and (unless given) its memory in GiB and its FLOPs beyond
    recompute='none', computed with the model's pieces."""
    config = replace(nb16.MODEL_76B, recompute=recompute, sequence_parallel=sp)
    memory = memory_per_rank(config, nb16.PARALLELISM_76B, precision=MIXED_FP32_GRADS)
    return (recompute, sp, memory.total / GIB if gib is None else gib,
            flops_76b(recompute, sp) - flops_76b("none") if extra is None else extra)


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda: option("selective", True), ()), (lambda: option("full", False), ("fits", "+33.1 %")),
    (lambda: option("selective", False), ("8.0 over",)),
    (lambda: option("none", True), ("10.4 over",)),
    (lambda: "full", ("return a tuple (recompute, sequence_parallel, gib, extra)",)),
    (lambda: ("selective", True), ("return a tuple",)),
    # the memory, computed wrongly
    (lambda: option("selective", True, gib=option("selective", False)[2]),
     ("memory of recompute='selective', no sequence parallelism",)),
    (lambda: option("selective", True, gib=option("selective", True)[2] * GIB / 1e9),
     ("in GB",)),
    # the extra compute, computed wrongly
    (lambda: option("selective", True, extra=flops_76b("selective", True)),
     ("whole compute",)),
    (lambda: option("selective", True, extra=flops_76b("selective", True) - flops_76b("full")),
     ("counted from recompute='full'",)),
    (lambda: option("selective", True, extra=option("selective", True)[3] / 1e15),
     ("in PFLOP",)),
    (lambda: option("selective", True, extra=1e17), ("is not the model's",)),
    (stub, ("not done yet",)),
])
def test_16_4(answer, fragments):
    result = check("16.4", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
