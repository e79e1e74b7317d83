"""Checkers for notebook 16, design puzzles: each answer is a design, judged by the package's own
simulator (``pipeline.simulate``) and cost model (``perf``), not by a stored solution.

16.1 ★    a pipeline schedule for p = 4, m = 8 that holds at most 5 stages' worth of activations
          on every rank and idles at most 15 % (2104.04473 §2.2; 2401.10241)
16.2 ★★   a split (``Parallelism``) of Table 1's 39.1B GPT on 512 A100 40GB that fits and beats
          130 TFLOP/s per GPU, with the memory and TFLOP/s the learner computed for it
          (2104.04473 §3, Table 1)
16.3 ★★   the largest m at which interleaving (v = 2) still beats 1F1B once its 2× point-to-point
          sends are costed, on nodes joined by 100 Gb/s Ethernet, with the two numbers it
          follows from: the bubble saved and the sends added per microbatch (2104.04473 §2.2.2,
          §3)
16.4 ★★   the recomputation and sequence parallelism with the least extra compute that fits the
          76.1B GPT in a 64 GiB budget, with its memory and recomputed FLOPs (2205.05198 §4–5)

The oracles that solve the puzzles by search (``advise``, ``interleaving_wins``, ``crossover``,
``recompute_options``, ``schedule_space``) are in reach of a learner; so 16.2–16.4 ask for the
reasoning too — the numbers the design is chosen by, computed with the model's pieces
(``memory_per_rank``, ``predict``) — and check each against the model. A wrong number is told
what it was computed as (another configuration, GB for GiB, 16 bytes per parameter for 18, the
whole for the difference, a total for a per-microbatch figure); a wrong design which constraint
it breaks and by how much: the bubble or the memory over its limit, GiB over the GPU, TFLOP/s
short of the target, the two times at the answer's m, the FLOPs recomputed beyond the best
choice. The notebook shows the oracles only after the exercises (the marks below). All
arithmetic in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from itertools import product

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.grid import Layout
from megatron_edu.model.config import RECOMPUTE, GPTConfig
from megatron_edu.perf import (
    GIB,
    MIXED,
    MIXED_FP32_GRADS,
    SELENE_A100,
    Prediction,
    advise,
    memory_per_rank,
    predict,
    read_paper_table,
    rejection_reason,
    table1_config,
)
from megatron_edu.perf.advisor import TimeBreakdown
from megatron_edu.pipeline.schedules import (
    SCHEDULES,
    PipelineConfig,
    Schedule,
    check_schedule,
    make_schedule,
)
from megatron_edu.pipeline.simulate import Timeline, simulate
from megatron_edu.ptdp import Parallelism

__all__ = ["P1", "M1", "MAX_STAGES_HELD", "MAX_BUBBLE", "play", "stages_held", "schedule_space",
           "MODEL_39B", "GPUS_39B", "BATCH_39B", "A100_40GB", "TARGET_TFLOPS",
           "ETHERNET_A100", "LAYOUT_16_3", "iteration_times", "interleaving_wins", "crossover",
           "MODEL_76B", "PARALLELISM_76B", "BUDGET_GIB", "recompute_options"]


def _row(billions: float) -> dict:
    return next(r for r in read_paper_table("2104.04473_table1.csv")
                if r["params_billion"] == billions)


def _short(split: Parallelism) -> str:
    chunks = f" v={split.chunks}" if split.chunks > 1 else ""
    return (f"tp={split.tp} pp={split.pp} dp={split.dp} b={split.microbatch} "
            f"m={split.num_microbatches} {split.schedule}{chunks}")


# --- 16.1 ★ a schedule within two limits --------------------------------------------------------

P1, M1 = 4, 8                      # 4 pipeline ranks, the batch is 8 microbatches
MAX_STAGES_HELD = 5                # activations of at most 5 whole stages per rank
MAX_BUBBLE = Fraction(3, 20)       # idle at most 15 % of the compute (2104.04473's fraction)


def play(schedule: Schedule) -> Timeline:
    """``schedule`` simulated with the puzzle's costs: forward 1, backward 2 — split 1 + 1 into
    B and W for a zero-bubble schedule (2401.10241)."""
    if schedule.splits_backward:
        return simulate(schedule, 1, 1, weight_time=1)
    return simulate(schedule, 1, 2)


def stages_held(timeline: Timeline) -> list[Fraction]:
    """Per rank, the peak activations in whole stages' worth: a chunk is 1/v of a stage."""
    return [Fraction(n, timeline.stages.v) for n in timeline.peak_activations]


def schedule_space(chunks: tuple[int, ...] = (2, 4, 8)
                   ) -> dict[tuple[str, int | None], tuple[Fraction, Fraction]]:
    """Every schedule the package makes at P1, M1 — interleaved once per v in ``chunks`` — keyed
    (name, v) → (the most stages' worth any rank holds, the bubble), as ``play`` judges them."""
    points = {}
    for name in SCHEDULES:
        for v in chunks if name == "interleaved" else (None,):
            timeline = play(make_schedule(name, P1, M1, v))
            points[name, v] = max(stages_held(timeline)), Fraction(timeline.bubble_fraction)
    return points


@exercise("16.1", "a schedule within a memory and a bubble limit",
          marks=(r"schedule_space\(", r"4\.75stages"))
def _schedule_puzzle(fn: Callable[[], Schedule]) -> str:
    schedule = fn()
    if not isinstance(schedule, Schedule):
        raise Hint(f"return a Schedule — make_schedule(name, p, m, v), or your own lists as "
                   f"Schedule(rows, StageMap(p, v, 'interleaved')) — got "
                   f"{type(schedule).__name__}")
    if len(schedule) != P1 or schedule.num_microbatches != M1:
        raise Hint(f"the pipeline has p = {P1} ranks and the batch is m = {M1} microbatches; "
                   f"your schedule has {len(schedule)} ranks and {schedule.num_microbatches} "
                   f"microbatches (a larger m shrinks the bubble, but the batch is fixed)")
    try:
        check_schedule(schedule)
    except ValueError as error:
        raise Hint(f"check_schedule rejects it: {error}") from None
    timeline = play(schedule)
    held, bubble = stages_held(timeline), timeline.bubble_fraction
    broken = []
    if max(held) > MAX_STAGES_HELD:
        rank = held.index(max(held))
        broken.append(f"rank {rank} holds {float(max(held)):.3g} stages' worth of activations, "
                      f"{float(max(held) - MAX_STAGES_HELD):.3g} over the limit of "
                      f"{MAX_STAGES_HELD} (GPipe holds m; interleaving holds p + (p − 1)/v on "
                      f"rank 0: more chunks, less)")
    if bubble > MAX_BUBBLE:
        broken.append(f"its bubble is {float(bubble):.4g} of the compute, "
                      f"{float(bubble - MAX_BUBBLE):.3g} over the limit of "
                      f"{float(MAX_BUBBLE):g} ((p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) "
                      f"interleaved)")
    if broken:
        raise Hint("; and ".join(broken))
    return (f"a valid schedule: at most {float(max(held)):.3g} stages' worth of activations on "
            f"any rank (limit {MAX_STAGES_HELD}) and a bubble of {float(bubble):.4g} "
            f"(limit {float(MAX_BUBBLE):g}), simulated with forward 1, backward 2")


# --- reading a learner's numbers ------------------------------------------------------------------

def _number(value: object, what: str) -> float:
    """The learner's number as a float; a Hint if it is not one."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise Hint(f"{what} should be a number, got {value!r}")
    return float(value)


def _near(value: float, right: float, tolerance: float) -> bool:
    return abs(value - right) <= tolerance


def _memory_gib(config: GPTConfig, split: Parallelism, precision=MIXED_FP32_GRADS) -> float:
    return memory_per_rank(config, split, precision=precision).total / GIB


def _memory_mistake(gib: float, config: GPTConfig, split: Parallelism,
                    others: dict[str, GPTConfig]) -> str | None:
    """None if ``gib`` is the model's memory per GPU of ``config`` split as ``split``; else what
    it was computed as: another configuration (``others``: its name → it), GB for GiB, 16 bytes
    per parameter for 18, the activations alone."""
    estimate = memory_per_rank(config, split, precision=MIXED_FP32_GRADS)
    if _near(gib, estimate.total / GIB, GIB_TOLERANCE):
        return None
    said = f"your memory, {gib:.1f} GiB,"
    mistakes = {f"{said} is the memory {name}: build the configuration your answer names, "
                f"replace(model, recompute=…, sequence_parallel=…)":
                _memory_gib(other, split) for name, other in others.items()}
    mistakes |= {
        f"{said} is counted in GB (10⁹ bytes): divide the bytes by GIB = 2**30":
            estimate.total / 1e9,
        f"{said} counts 16 bytes per parameter, memory_per_rank's default precision: the "
        f"advisor counts Megatron's fp32 gradients, 18 (precision=MIXED_FP32_GRADS, as "
        f"predict does)": _memory_gib(config, split, MIXED),
        f"{said} is the activations alone: a GPU also holds the weights, their gradients and "
        f"the optimizer's state (MemoryEstimate.total)": estimate.activations / GIB,
    }
    for hint, value in mistakes.items():
        if _near(gib, value, GIB_TOLERANCE):
            return hint
    return (f"{said} is not the model's for this design: memory_per_rank(config, split, "
            f"precision=MIXED_FP32_GRADS).total / GIB, config set as your answer says")


# --- 16.2 ★★ a layout that fits and is fast enough ------------------------------------------------

MODEL_39B: GPTConfig = table1_config(_row(39.1))    # 48 layers, h = 8192, 64 heads
GPUS_39B, BATCH_39B = 512, 1536                      # Table 1's row, on 40 GB GPUs
A100_40GB = replace(SELENE_A100, name="DGX A100 40GB", memory_bytes=40 * GIB)
TARGET_TFLOPS = 130.0
GIB_TOLERANCE = 0.1                                  # GiB: a tenth, as an answer rounds it
TFLOPS_TOLERANCE = 0.5                               # TFLOP/s


def _as_design(answer: object) -> tuple[Parallelism, str, float, float]:
    if not (isinstance(answer, tuple) and len(answer) == 4):
        raise Hint(f"return a tuple (parallelism, recompute, gib, tflops): the design, e.g. "
                   f"(Parallelism(Layout(...), PipelineConfig(...)), 'full', 38.4, 131.0), with "
                   f"the memory per GPU and the TFLOP/s per GPU the model predicts for it; got "
                   f"{type(answer).__name__}")
    parallelism, recompute, gib, tflops = answer
    if not isinstance(parallelism, Parallelism):
        raise Hint(f"the first item should be a megatron_edu.ptdp.Parallelism, got "
                   f"{type(parallelism).__name__}")
    if recompute not in RECOMPUTE:
        raise Hint(f"the second item is the recomputation, one of {RECOMPUTE}; got "
                   f"{recompute!r}")
    return (parallelism, recompute, _number(gib, "gib, the memory per GPU in GiB,"),
            _number(tflops, "tflops, the predicted TFLOP/s per GPU,"))


def _short_of(prediction: Prediction) -> str:
    """Where the time goes beyond compute, largest first."""
    time = prediction.time
    parts = {"bubble": time.bubble, "tensor-parallel all-reduces": time.tensor_parallel,
             "pipeline sends": time.pipeline_p2p, "data-parallel all-reduce": time.data_parallel,
             "optimizer step": time.optimizer}
    worst = max(parts, key=parts.get)
    return (f"of its {time.total:.2f} s per iteration, {time.compute:.2f} s compute and "
            f"{parts[worst]:.2f} s {worst}, the largest of the rest")


def _tflops_mistake(tflops: float, config: GPTConfig, split: Parallelism) -> str | None:
    """None if ``tflops`` is the model's prediction for the design; else what it was."""
    prediction = predict(config, split, A100_40GB)
    if _near(tflops, prediction.tflops_per_gpu, TFLOPS_TOLERANCE):
        return None
    said = f"your throughput, {tflops:.4g},"
    mistakes = {
        f"{said} is the percent of the GPU's peak: give TFLOP/s per GPU (tflops_per_gpu)":
            prediction.percent_of_peak,
        f"{said} is in FLOP/s: give TFLOP/s (10¹² FLOP/s)": prediction.tflops_per_gpu * 1e12,
    } | {f"{said} is the prediction with recompute={mode!r}, not your answer's "
         f"{config.recompute!r}: predict the configuration your answer names":
         predict(replace(config, recompute=mode), split, A100_40GB).tflops_per_gpu
         for mode in RECOMPUTE if mode != config.recompute}
    for hint, value in mistakes.items():
        if abs(tflops - value) <= max(TFLOPS_TOLERANCE, 1e-3 * abs(value)):
            return hint
    return (f"{said} is not the model's prediction for this design: predict(config, split, "
            f"nb16.A100_40GB).tflops_per_gpu, config set as your answer says")


@exercise("16.2", "a layout of the 39.1B GPT on 512 A100 40GB",
          marks=(r"advise\((nb16\.)?MODEL_39B", r"advise\([^)]*A100_40GB",
                 r"tp=4pp=8dp=16b=1(m=96)?interleavedv=3"))
def _layout_puzzle(fn: Callable[[], tuple[Parallelism, str, float, float]]) -> str:
    split, recompute, gib, tflops = _as_design(fn())
    config = replace(MODEL_39B, recompute=recompute)
    if split.world_size == GPUS_39B and split.global_batch != BATCH_39B:
        raise Hint(f"the batch is B = {BATCH_39B} sequences: dp·m·b = {split.dp}·"
                   f"{split.num_microbatches}·{split.microbatch} = {split.global_batch}")
    reason = rejection_reason(config, split, GPUS_39B, A100_40GB)
    if reason is not None and "GiB" not in reason:
        if "node" in reason:
            reason = (f"{reason}: tensor parallelism all-reduces every layer, twice forward and "
                      f"twice backward, so its ranks stay within a node's NVLink (2104.04473 "
                      f"§3.2)")
        raise Hint(f"{_short(split)} with recompute={recompute!r} is rejected: {reason}")
    others = {f"with recompute={mode!r}": replace(config, recompute=mode)
              for mode in RECOMPUTE if mode != recompute}
    wrong = _memory_mistake(gib, config, split, others) or _tflops_mistake(tflops, config, split)
    if wrong:
        raise Hint(f"{_short(split)} with recompute={recompute!r}: {wrong}")
    if reason is not None:
        over = _memory_gib(config, split) - 40
        raise Hint(f"{_short(split)} with recompute={recompute!r} is rejected: it needs "
                   f"{over:.1f} GiB more than the 40 GiB of a GPU ({reason}): recompute more, "
                   f"hold fewer microbatches (1F1B, not GPipe; a smaller b) or split the weights "
                   f"further (larger tp·pp)")
    prediction = predict(config, split, A100_40GB)
    if prediction.tflops_per_gpu < TARGET_TFLOPS:
        raise Hint(f"{_short(split)} with recompute={recompute!r} fits "
                   f"({prediction.memory.total / GIB:.1f} GiB) but is predicted at "
                   f"{prediction.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                   f"{TARGET_TFLOPS - prediction.tflops_per_gpu:.1f} short of "
                   f"{TARGET_TFLOPS:g}: {_short_of(prediction)}")
    ranked = advise(MODEL_39B, BATCH_39B, GPUS_39B, A100_40GB, recompute=RECOMPUTE)
    passing = sum(p.tflops_per_gpu >= TARGET_TFLOPS for _, p in ranked)
    best = ranked[0][1]
    return (f"{_short(split)} with recompute={recompute!r}: {prediction.tflops_per_gpu:.1f} "
            f"TFLOP/s per GPU in {prediction.memory.total / GIB:.1f} GiB, as you computed — one "
            f"of {passing} of the {len(ranked)} layouts that fit; the advisor's best, "
            f"{_short(best.parallelism)} with recompute={best.config.recompute!r}, reaches "
            f"{best.tflops_per_gpu:.1f}")


# --- 16.3 ★★ when interleaving stops paying ---------------------------------------------------

ETHERNET_A100 = replace(SELENE_A100, name="A100 nodes on 100 Gb/s Ethernet",
                        inter_node_bandwidth=12.5e9)
LAYOUT_16_3 = Layout(8, 4, 1)       # tp = 8 in a node, 4 stages on 4 nodes (microbatches of 1)
M_SEARCH = 64                       # m searched in multiples of p up to M_SEARCH·p
RELATIVE = 0.01                     # a learner's seconds and FLOPs: within 1 %


def _breakdowns(m: int) -> tuple[TimeBreakdown, TimeBreakdown]:
    """The predicted time breakdowns of 1F1B and interleaved (v = 2) at m microbatches."""
    pipelines = (PipelineConfig("1f1b", num_microbatches=m),
                 PipelineConfig("interleaved", 2, num_microbatches=m))
    return tuple(predict(MODEL_39B, Parallelism(LAYOUT_16_3, pipeline), ETHERNET_A100).time
                 for pipeline in pipelines)


def iteration_times(m: int) -> tuple[float, float]:
    """Predicted seconds per iteration of 1F1B and interleaved (v = 2) at m microbatches."""
    one, two = _breakdowns(m)
    return one.total, two.total


def interleaving_wins(m: int) -> bool:
    """Whether interleaving (v = 2) is predicted faster than 1F1B at m microbatches."""
    one, two = iteration_times(m)
    return two < one


def crossover() -> int:
    """The largest m (a multiple of p) at which interleaving still wins, by search."""
    p = LAYOUT_16_3.pp
    wins = [m for m in range(p, M_SEARCH * p + 1, p) if interleaving_wins(m)]
    if not wins or wins[-1] == M_SEARCH * p:
        raise RuntimeError("no crossover in the searched range: the puzzle's numbers changed")
    return wins[-1]


def _close(value: float, right: float) -> bool:
    return abs(value - right) <= RELATIVE * abs(right)


def _saved_mistake(saved: float, m: int) -> str | None:
    """None if ``saved`` is the bubble interleaving saves; else what it was computed as."""
    one, two = _breakdowns(m)
    right = one.bubble - two.bubble
    if _close(saved, right):
        return None
    said = f"your saving, {saved:.4g} s,"
    if _close(saved, one.bubble):
        return (f"{said} is 1F1B's whole bubble: interleaving still idles part of it — take "
                f"the difference of the two bubbles (TimeBreakdown.bubble)")
    if _close(saved, two.bubble):
        return (f"{said} is what interleaving still idles: the saving is 1F1B's bubble less "
                f"that")
    if _close(-saved, right):
        return f"{said} has the wrong sign: 1F1B's bubble is the larger"
    p = LAYOUT_16_3.pp
    for at in range(p, M_SEARCH * p + 1, p):
        net = iteration_times(at)
        if _close(saved, net[0] - net[1]):
            return (f"{said} is the difference of the two iteration times at m = {at}: it nets "
                    f"the extra sends against the bubble — take the two bubbles alone "
                    f"(TimeBreakdown.bubble)")
    return (f"{said} is not the model's: the bubble of 1F1B less the interleaved one, both from "
            f"predict(...).time (at any m: neither grows with m)")


def _extra_mistake(extra: float, m: int) -> str | None:
    """None if ``extra`` is the seconds of sends interleaving adds per microbatch; else what
    it was computed as."""
    one, two = _breakdowns(m)
    right = (two.pipeline_p2p - one.pipeline_p2p) / m
    if _close(extra, right):
        return None
    said = f"your extra sends, {extra:.4g} s,"
    if _close(extra, two.pipeline_p2p / m):
        return (f"{said} are all of interleaving's sends per microbatch: 1F1B sends too — "
                f"subtract its share (TimeBreakdown.pipeline_p2p)")
    if _close(extra, right / 2):
        return (f"{said} are one message: interleaving adds 2·(v − 1) = 2 per microbatch, a "
                f"forward and a backward for its second chunk")
    if _close(-extra, right):
        return f"{said} have the wrong sign: interleaving sends more"
    times = round(extra / right)
    if times >= 2 and times % LAYOUT_16_3.pp == 0 and _close(extra, times * right):
        return (f"{said} are the extra sends of {times} microbatches: divide the difference of "
                f"the two pipeline_p2p times by the m they were predicted at")
    return (f"{said} are not the model's: the difference of the two pipeline_p2p times of "
            f"predict(...).time, per microbatch")


@exercise("16.3", "the largest m at which interleaving still pays",
          marks=(r"interleaving_wins\(", r"crossover\(\)", r"iteration_times\(", r"39\.97"))
def _interleaving_puzzle(fn: Callable[[], tuple[int, float, float]]) -> str:
    answer, p = fn(), LAYOUT_16_3.pp
    if not (isinstance(answer, tuple) and len(answer) == 3):
        raise Hint(f"return a tuple (m, saved, extra): the number of microbatches, the seconds "
                   f"of bubble interleaving saves per iteration and the seconds of sends it "
                   f"adds per microbatch; got {answer!r}")
    m = answer[0]
    if isinstance(m, bool) or not isinstance(m, int):
        raise Hint(f"return the number of microbatches m, an int; got {type(m).__name__}")
    if m < p or m % p:
        raise Hint(f"the interleaved schedule runs m in groups of p = {p}: m must be a multiple "
                   f"of {p} (and at least {p}); got {m}")
    saved = _number(answer[1], "saved, the seconds of bubble saved,")
    extra = _number(answer[2], "extra, the seconds of sends added per microbatch,")
    wrong = _saved_mistake(saved, m) or _extra_mistake(extra, m)
    if wrong:
        raise Hint(wrong)
    best = crossover()

    def times(at: int) -> str:
        one, two = iteration_times(at)
        return f"at m = {at} 1F1B takes {one:.4f} s and interleaving {two:.4f} s"

    if m < best:
        raise Hint(f"too small: interleaving still wins at m = {m + p} ({times(m + p)}). The "
                   f"bubble it saves, (p − 1)(1 − 1/v) of a microbatch's stage time, does not "
                   f"grow with m; its extra sends, 2·(v − 1) per microbatch, do — your own "
                   f"numbers: {saved:.4g} s saved against {extra:.4g} s a microbatch")
    if m > best:
        raise Hint(f"too large: {times(m)} — 1F1B is faster. Its extra sends cost 2·(v − 1) "
                   f"messages per microbatch, m times, and overtake the bubble saved before "
                   f"that: {m} · {extra:.4g} s > {saved:.4g} s")
    return (f"m = {m}: {times(m)}; {times(m + p)}. Beyond m = {saved / extra:.2f} the doubled "
            f"sends, {extra:.4g} s a microbatch, cost more than the {saved:.4g} s of bubble "
            f"interleaving saves")


# --- 16.4 ★★ the cheapest recomputation that fits -------------------------------------------------

MODEL_76B: GPTConfig = table1_config(_row(76.1))    # 60 layers, h = 10240, 80 heads
PARALLELISM_76B = Parallelism(Layout(8, 4, 32), PipelineConfig(microbatch=2,
                                                               num_microbatches=28))  # B = 1792
BUDGET_GIB = 64                                      # of an 80 GB A100, the rest for buffers


def _flops(config: GPTConfig) -> float:
    return predict(config, PARALLELISM_76B).flops_per_iteration


def recompute_options() -> dict[tuple[str, bool], tuple[float, float]]:
    """(recompute, sequence_parallel) → (GiB per GPU, FLOPs recomputed per iteration beyond
    recompute = 'none'), for ``MODEL_76B`` split as ``PARALLELISM_76B``."""
    baseline = _flops(replace(MODEL_76B, recompute="none"))
    options = {}
    for recompute, sp in product(RECOMPUTE, (False, True)):
        config = replace(MODEL_76B, recompute=recompute, sequence_parallel=sp)
        options[recompute, sp] = (_memory_gib(config, PARALLELISM_76B),
                                  _flops(config) - baseline)
    return options


def _name(option: tuple[str, bool]) -> str:
    return f"recompute={option[0]!r}" + (" with sequence parallelism" if option[1] else "")


def _extra_flops_mistake(flops: float, option: tuple[str, bool], right: float) -> str | None:
    """None if ``flops`` is the option's FLOPs beyond recompute='none'; else what it was."""
    if abs(flops - right) <= RELATIVE * max(abs(right), 1e15):
        return None
    said = f"your extra compute, {flops:.4g} FLOPs,"
    config = replace(MODEL_76B, recompute=option[0], sequence_parallel=option[1])
    mistakes = {
        f"{said} is the iteration's whole compute: subtract what recompute='none' executes":
            _flops(config),
        f"{said} is counted from recompute='full', nb16.MODEL_76B's own mode: the baseline is "
        f"recompute='none', which recomputes nothing": _flops(config) - _flops(MODEL_76B),
    }
    if right:
        mistakes[f"{said} is in PFLOP: give FLOPs"] = right / 1e15
    for hint, value in mistakes.items():
        if abs(flops - value) <= RELATIVE * abs(value):
            return hint
    return (f"{said} is not the model's: predict(config, split).flops_per_iteration less that "
            f"of the same model with recompute='none'")


@exercise("16.4", "the cheapest recomputation that fits",
          marks=(r"recompute_options\(", r"51\.4GiBof64", r"18\.5PFLOP"))
def _recompute_puzzle(fn: Callable[[], tuple[str, bool, float, float]]) -> str:
    answer = fn()
    if not (isinstance(answer, tuple) and len(answer) == 4 and answer[0] in RECOMPUTE
            and isinstance(answer[1], bool)):
        raise Hint(f"return a tuple (recompute, sequence_parallel, gib, extra): one of "
                   f"{RECOMPUTE}, a bool, the memory per GPU in GiB and the FLOPs recomputed "
                   f"per iteration, e.g. ('full', False, 46.7, 5.7e17); got {answer!r}")
    option = answer[0], answer[1]
    gib = _number(answer[2], "gib, the memory per GPU in GiB,")
    flops = _number(answer[3], "extra, the FLOPs recomputed per iteration,")
    options = recompute_options()
    memory, extra = options[option]
    config = replace(MODEL_76B, recompute=option[0], sequence_parallel=option[1])
    others = {f"of {_name(other)}" + ("" if other[1] else ", no sequence parallelism"):
              replace(MODEL_76B, recompute=other[0], sequence_parallel=other[1])
              for other in options if other != option}
    wrong = (_memory_mistake(gib, config, PARALLELISM_76B, others)
             or _extra_flops_mistake(flops, option, extra))
    if wrong:
        raise Hint(f"{_name(option)}: {wrong}")
    total = predict(MODEL_76B, PARALLELISM_76B).flops_per_iteration - options["full", False][1]
    fitting = {o: v for o, v in options.items() if v[0] <= BUDGET_GIB}
    best = min(fitting, key=lambda o: (fitting[o][1], fitting[o][0]))
    best_memory, best_extra = options[best]

    def extra_text(flops: float) -> str:
        return f"{flops / 1e15:.1f} PFLOP ({100 * flops / total:+.1f} % of the model's FLOPs)"

    if memory > BUDGET_GIB:
        raise Hint(f"{_name(option)} needs {memory:.1f} GiB per GPU, {memory - BUDGET_GIB:.1f} "
                   f"over the {BUDGET_GIB} GiB budget")
    if extra > best_extra:
        raise Hint(f"{_name(option)} fits ({memory:.1f} GiB) but recomputes "
                   f"{extra_text(extra)} per iteration; another choice fits with "
                   f"{extra_text(best_extra)} — which activations are large and cheap to "
                   f"recompute, and which are split by sequence parallelism for free?")
    return (f"{_name(option)}: {memory:.1f} GiB of {BUDGET_GIB}, recomputing "
            f"{extra_text(extra)} per iteration, as you computed (full recomputation: "
            f"{extra_text(options['full', False][1])}; best: {_name(best)}, "
            f"{best_memory:.1f} GiB)")
