"""Checkers for notebook 16, design puzzles: each answer is a design, judged by the package's own
simulator (``pipeline.simulate``) and cost model (``perf``), not by a stored solution.

16.1 ★    a pipeline schedule for p = 4, m = 8 that holds at most 5 stages' worth of activations
          on every rank and idles at most 15 % (2104.04473 §2.2; 2401.10241)
16.2 ★★   a split (``Parallelism``) of Table 1's 39.1B GPT on 512 A100 40GB that fits and beats
          130 TFLOP/s per GPU (2104.04473 §3, Table 1)
16.3 ★★   the largest m at which interleaving (v = 2) still beats 1F1B once its 2× point-to-point
          sends are costed, on nodes joined by 100 Gb/s Ethernet (2104.04473 §2.2.2, §3)
16.4 ★★   the recomputation and sequence parallelism with the least extra compute that fits the
          76.1B GPT in a 64 GiB budget (2205.05198 §4–5)

Every checker computes the numbers it judges by (bubble, peak memory, predicted time, FLOPs) from
the package, and a wrong answer is told which constraint it breaks and by how much: the bubble or
the memory over its limit, GiB over the GPU, TFLOP/s short of the target, the two times at the
answer's m, the FLOPs recomputed beyond the best choice. All arithmetic in this process.
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


@exercise("16.1", "a schedule within a memory and a bubble limit")
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


# --- 16.2 ★★ a layout that fits and is fast enough ------------------------------------------------

MODEL_39B: GPTConfig = table1_config(_row(39.1))    # 48 layers, h = 8192, 64 heads
GPUS_39B, BATCH_39B = 512, 1536                      # Table 1's row, on 40 GB GPUs
A100_40GB = replace(SELENE_A100, name="DGX A100 40GB", memory_bytes=40 * GIB)
TARGET_TFLOPS = 130.0


def _as_parallelism_and_mode(answer: object) -> tuple[Parallelism, str]:
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise Hint(f"return a pair (parallelism, recompute), e.g. (Parallelism(Layout(...), "
                   f"PipelineConfig(...)), 'full'), got {type(answer).__name__}")
    parallelism, recompute = answer
    if not isinstance(parallelism, Parallelism):
        raise Hint(f"the first item should be a megatron_edu.ptdp.Parallelism, got "
                   f"{type(parallelism).__name__}")
    if recompute not in RECOMPUTE:
        raise Hint(f"the second item is the recomputation, one of {RECOMPUTE}; got "
                   f"{recompute!r}")
    return parallelism, recompute


def _short_of(prediction: Prediction) -> str:
    """Where the time goes beyond compute, largest first."""
    time = prediction.time
    parts = {"bubble": time.bubble, "tensor-parallel all-reduces": time.tensor_parallel,
             "pipeline sends": time.pipeline_p2p, "data-parallel all-reduce": time.data_parallel,
             "optimizer step": time.optimizer}
    worst = max(parts, key=parts.get)
    return (f"of its {time.total:.2f} s per iteration, {time.compute:.2f} s compute and "
            f"{parts[worst]:.2f} s {worst}, the largest of the rest")


@exercise("16.2", "a layout of the 39.1B GPT on 512 A100 40GB")
def _layout_puzzle(fn: Callable[[], tuple[Parallelism, str]]) -> str:
    split, recompute = _as_parallelism_and_mode(fn())
    config = replace(MODEL_39B, recompute=recompute)
    if split.world_size == GPUS_39B and split.global_batch != BATCH_39B:
        raise Hint(f"the batch is B = {BATCH_39B} sequences: dp·m·b = {split.dp}·"
                   f"{split.num_microbatches}·{split.microbatch} = {split.global_batch}")
    reason = rejection_reason(config, split, GPUS_39B, A100_40GB)
    if reason is not None:
        if "GiB" in reason:
            over = memory_per_rank(config, split, precision=MIXED_FP32_GRADS).total / GIB - 40
            reason = (f"it needs {over:.1f} GiB more than the 40 GiB of a GPU ({reason}): "
                      f"recompute more, hold fewer microbatches (1F1B, not GPipe; a smaller b) "
                      f"or split the weights further (larger tp·pp)")
        elif "node" in reason:
            reason = (f"{reason}: tensor parallelism all-reduces every layer, twice forward and "
                      f"twice backward, so its ranks stay within a node's NVLink (2104.04473 "
                      f"§3.2)")
        raise Hint(f"{_short(split)} with recompute={recompute!r} is rejected: {reason}")
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
            f"TFLOP/s per GPU in {prediction.memory.total / GIB:.1f} GiB — one of {passing} of "
            f"the {len(ranked)} layouts that fit; the advisor's best, {_short(best.parallelism)} "
            f"with recompute={best.config.recompute!r}, reaches {best.tflops_per_gpu:.1f}")


# --- 16.3 ★★ when interleaving stops paying ---------------------------------------------------

ETHERNET_A100 = replace(SELENE_A100, name="A100 nodes on 100 Gb/s Ethernet",
                        inter_node_bandwidth=12.5e9)
LAYOUT_16_3 = Layout(8, 4, 1)       # tp = 8 in a node, 4 stages on 4 nodes (microbatches of 1)
M_SEARCH = 64                       # m searched in multiples of p up to M_SEARCH·p


def iteration_times(m: int) -> tuple[float, float]:
    """Predicted seconds per iteration of 1F1B and interleaved (v = 2) at m microbatches."""
    pipelines = (PipelineConfig("1f1b", num_microbatches=m),
                 PipelineConfig("interleaved", 2, num_microbatches=m))
    return tuple(predict(MODEL_39B, Parallelism(LAYOUT_16_3, pipeline), ETHERNET_A100).time.total
                 for pipeline in pipelines)


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


@exercise("16.3", "the largest m at which interleaving still pays")
def _interleaving_puzzle(fn: Callable[[], int]) -> str:
    m, p = fn(), LAYOUT_16_3.pp
    if isinstance(m, bool) or not isinstance(m, int):
        raise Hint(f"return the number of microbatches m, an int; got {type(m).__name__}")
    if m < p or m % p:
        raise Hint(f"the interleaved schedule runs m in groups of p = {p}: m must be a multiple "
                   f"of {p} (and at least {p}); got {m}")
    best = crossover()

    def times(at: int) -> str:
        one, two = iteration_times(at)
        return f"at m = {at} 1F1B takes {one:.4f} s and interleaving {two:.4f} s"

    if m < best:
        raise Hint(f"too small: interleaving still wins at m = {m + p} ({times(m + p)}). The "
                   f"bubble it saves, (p − 1)(1 − 1/v) of a microbatch's stage time, does not "
                   f"grow with m; its extra sends, 2·(v − 1) per microbatch, do")
    if m > best:
        raise Hint(f"too large: {times(m)} — 1F1B is faster. Its extra sends cost 2·(v − 1) "
                   f"messages per microbatch, m times, and overtake the bubble saved before "
                   f"that")
    return (f"m = {m}: {times(m)}; {times(m + p)}. Beyond m = {m} the doubled sends cost more "
            f"than the bubble interleaving saves")


# --- 16.4 ★★ the cheapest recomputation that fits -------------------------------------------------

MODEL_76B: GPTConfig = table1_config(_row(76.1))    # 60 layers, h = 10240, 80 heads
PARALLELISM_76B = Parallelism(Layout(8, 4, 32), PipelineConfig(microbatch=2,
                                                               num_microbatches=28))  # B = 1792
BUDGET_GIB = 64                                      # of an 80 GB A100, the rest for buffers


def recompute_options() -> dict[tuple[str, bool], tuple[float, float]]:
    """(recompute, sequence_parallel) → (GiB per GPU, FLOPs recomputed per iteration beyond
    recompute = 'none'), for ``MODEL_76B`` split as ``PARALLELISM_76B``."""
    def flops(config: GPTConfig) -> float:
        return predict(config, PARALLELISM_76B).flops_per_iteration

    baseline = flops(replace(MODEL_76B, recompute="none"))
    options = {}
    for recompute, sp in product(RECOMPUTE, (False, True)):
        config = replace(MODEL_76B, recompute=recompute, sequence_parallel=sp)
        memory = memory_per_rank(config, PARALLELISM_76B, precision=MIXED_FP32_GRADS).total / GIB
        options[recompute, sp] = (memory, flops(config) - baseline)
    return options


def _name(option: tuple[str, bool]) -> str:
    return f"recompute={option[0]!r}" + (" with sequence parallelism" if option[1] else "")


@exercise("16.4", "the cheapest recomputation that fits")
def _recompute_puzzle(fn: Callable[[], tuple[str, bool]]) -> str:
    answer = fn()
    if not (isinstance(answer, tuple) and len(answer) == 2 and answer[0] in RECOMPUTE
            and isinstance(answer[1], bool)):
        raise Hint(f"return a pair (recompute, sequence_parallel): one of {RECOMPUTE} and a "
                   f"bool, e.g. ('full', False); got {answer!r}")
    options = recompute_options()
    total = predict(MODEL_76B, PARALLELISM_76B).flops_per_iteration - options["full", False][1]
    fitting = {o: v for o, v in options.items() if v[0] <= BUDGET_GIB}
    best = min(fitting, key=lambda o: (fitting[o][1], fitting[o][0]))
    memory, extra = options[answer]
    best_memory, best_extra = options[best]

    def extra_text(flops: float) -> str:
        return f"{flops / 1e15:.1f} PFLOP ({100 * flops / total:+.1f} % of the model's FLOPs)"

    if memory > BUDGET_GIB:
        raise Hint(f"{_name(answer)} needs {memory:.1f} GiB per GPU, {memory - BUDGET_GIB:.1f} "
                   f"over the {BUDGET_GIB} GiB budget")
    if extra > best_extra:
        raise Hint(f"{_name(answer)} fits ({memory:.1f} GiB) but recomputes "
                   f"{extra_text(extra)} per iteration; another choice fits with "
                   f"{extra_text(best_extra)} — which activations are large and cheap to "
                   f"recompute, and which are split by sequence parallelism for free?")
    return (f"{_name(answer)}: {memory:.1f} GiB of {BUDGET_GIB}, recomputing "
            f"{extra_text(extra)} per iteration (full recomputation: "
            f"{extra_text(options['full', False][1])}; best: {_name(best)}, "
            f"{best_memory:.1f} GiB)")
