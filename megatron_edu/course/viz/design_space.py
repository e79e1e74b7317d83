"""Pictures of a design puzzle's space: every candidate design, placed by the numbers the package's
simulator (``pipeline.simulate``) and cost model (``perf``) give it, with the puzzle's limits
drawn and no design marked; notebook 16 shows each after its exercise, where the learner's
answer sits.

References: Narayanan et al. 2021, arXiv 2104.04473 — §2.2 bubbles and activations in flight,
§2.2.2 interleaving's extra sends, §3 the takeaways; Korthikanti et al. 2022, arXiv 2205.05198
§4–5 sequence parallelism and selective recomputation; Qi et al. 2023, arXiv 2401.10241 the
zero-bubble schedules.

schedule_points              every schedule at p, m: its peak activations and bubble, simulated
draw_schedule_space          those points against the puzzle's two limits
draw_interleaving_vs_m       1F1B and interleaved iteration time as m grows, and their difference
draw_recompute_options       memory per GPU and extra FLOPs of each recomputation × sequence
                             parallelism, with the memory budget
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from numbers import Real

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from megatron_edu.grid import Layout
from megatron_edu.model.config import RECOMPUTE, GPTConfig
from megatron_edu.perf import GIB, MIXED_FP32_GRADS, SELENE_A100, Hardware, memory_per_rank, predict
from megatron_edu.pipeline.schedules import SCHEDULES, make_schedule
from megatron_edu.pipeline.simulate import simulate

__all__ = ["schedule_points", "draw_schedule_space", "draw_interleaving_vs_m",
           "draw_recompute_options"]


# ---- 16.1: schedules ---------------------------------------------------------------------------


def schedule_points(p: int, m: int, chunks: Sequence[int] = (2, 4, 8), forward: Real = 1,
                    backward: Real = 2) -> dict[tuple[str, int | None], tuple[Fraction, Fraction]]:
    """Every schedule the package makes at p stages and m microbatches, keyed (name, v) — v is
    None except for interleaved, drawn once per v in ``chunks`` — → (the most stages' worth of
    activations any rank holds, the bubble fraction), simulated with these forward and backward
    costs; a zero-bubble schedule runs the backward as equal B and W halves (2104.04473 §2.2;
    2401.10241 §2)."""
    half = Fraction(backward) / 2  # B + W: the whole backward of a schedule that does not split it
    points = {}
    for name in SCHEDULES:
        for v in chunks if name == "interleaved" else (None,):
            timeline = simulate(make_schedule(name, p, m, v), forward, half, weight_time=half)
            held = Fraction(max(timeline.peak_activations), timeline.stages.v)
            points[name, v] = held, Fraction(timeline.bubble_fraction)
    return points


def draw_schedule_space(p: int, m: int, max_stages_held: Real, max_bubble: Real,
                        chunks: Sequence[int] = (2, 4, 8)) -> Figure:
    """Each schedule of ``schedule_points`` as a labelled point — peak activations in stages'
    worth against the bubble — with the two limits as lines and the corner both allow shaded
    (2104.04473 §2.2; 2401.10241 §2)."""
    points = schedule_points(p, m, chunks)
    max_stages_held, max_bubble = float(max_stages_held), float(max_bubble)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    held = [float(x) for x, _ in points.values()]
    bubble = [float(y) for _, y in points.values()]
    ax.fill_between([min(held) - 1.2, max_stages_held], 0, max_bubble, color="tab:green",
                    alpha=0.15, label="within both limits", gid="feasible")
    ax.axvline(max_stages_held, color="tab:red", linestyle="--", linewidth=1,
               label=f"memory limit: {max_stages_held:g} stages' worth", gid="memory limit")
    ax.axhline(max_bubble, color="tab:purple", linestyle="--", linewidth=1,
               label=f"bubble limit: {max_bubble:.0%}", gid="bubble limit")
    ax.scatter(held, bubble, color="black", zorder=3, gid="schedules")
    for (name, v), x, y in zip(points, held, bubble, strict=True):
        left = x == min(held)  # several schedules share the leftmost column: label them outside
        ax.annotate(name + (f" v={v}" if v else ""), (x, y), xytext=(-7 if left else 7, 0),
                    textcoords="offset points", ha="right" if left else "left", va="center",
                    fontsize=8)
    ax.set_xlim(min(held) - 1.2, max(held) + 1.2)
    ax.set_ylim(0, max(bubble) * 1.12)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("most activations any rank holds (stages' worth)")
    ax.set_ylabel("bubble (idle / compute)")
    ax.set_title(f"every schedule at p = {p}, m = {m} (forward 1, backward 2)", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


# ---- 16.3: interleaving against m --------------------------------------------------------------


def draw_interleaving_vs_m(config: GPTConfig, layout: Layout, hardware: Hardware,
                           microbatch_counts: Sequence[int], chunks: int = 2) -> Figure:
    """Predicted seconds per iteration of ``layout`` run as 1F1B and as interleaved with
    ``chunks`` chunks per rank, at each m (left), and interleaved minus 1F1B (right): the bubble
    interleaving saves is fixed in m, its extra sends grow with m (2104.04473 §2.2.2)."""
    times = {}
    for schedule, v in (("1f1b", None), ("interleaved", chunks)):
        times[schedule] = np.array([
            predict(config, replace(layout, schedule=schedule, chunks=v, num_microbatches=m),
                    hardware).time.total for m in microbatch_counts])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for schedule, seconds in times.items():
        label = schedule + (f" v={chunks}" if schedule == "interleaved" else "")
        left.plot(microbatch_counts, seconds, marker="o", markersize=3, label=label, gid=label)
    left.set_xlabel("microbatches m")
    left.set_ylabel("predicted s per iteration")
    left.legend(fontsize=8)
    left.set_title("iteration time", fontsize=10)
    gap = 1e3 * (times["interleaved"] - times["1f1b"])
    right.plot(microbatch_counts, gap, marker="o", markersize=3, color="tab:gray", gid="gap")
    right.axhline(0, color="black", linewidth=1)
    right.set_xticks(microbatch_counts[::2])
    right.grid(alpha=0.3)
    right.set_xlabel("microbatches m")
    right.set_ylabel("interleaved − 1F1B (ms)")
    right.set_title("below 0: interleaving is faster", fontsize=10)
    fig.suptitle(f"tp = {layout.tp}, pp = {layout.pp}, b = {layout.microbatch} on "
                 f"{hardware.name}", fontsize=10)
    fig.tight_layout()
    return fig


# ---- 16.4: recomputation -----------------------------------------------------------------------


def draw_recompute_options(config: GPTConfig, layout: Layout, budget_gib: float,
                           hardware: Hardware = SELENE_A100) -> Figure:
    """For each recomputation × sequence parallelism of ``config`` split as ``layout``: GiB per GPU
    (mixed precision, fp32 gradients) against the budget (left), and the FLOPs recomputed per
    iteration as a share of the model's FLOPs without recomputation (right) (2205.05198 §4–5)."""
    def flops(recompute: str) -> float:
        return predict(replace(config, recompute=recompute), layout, hardware).flops_per_iteration

    model_flops = flops("none")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, sp in enumerate((False, True)):
        gib = [memory_per_rank(replace(config, recompute=r, sequence_parallel=sp), layout,
                               precision=MIXED_FP32_GRADS).total / GIB for r in RECOMPUTE]
        extra = [100 * (flops(r) - model_flops) / model_flops for r in RECOMPUTE]
        label = "with sequence parallelism" if sp else "without sequence parallelism"
        where = np.arange(len(RECOMPUTE)) + 0.4 * i
        left.bar_label(left.bar(where, gib, 0.4, label=label),
                       fmt="%.1f", fontsize=8)
        right.bar_label(right.bar(where, extra, 0.4, label=label),
                        fmt="%.1f %%", fontsize=8)
    left.axhline(budget_gib, color="tab:red", linestyle="--", linewidth=1,
                 label=f"budget: {budget_gib:g} GiB", gid="budget")
    left.set_ylabel("GiB per GPU")
    left.set_title("memory", fontsize=10)
    right.set_ylabel("recomputed, % of the model's FLOPs")
    right.set_title("extra compute", fontsize=10)
    for ax in (left, right):
        ax.set_xticks(np.arange(len(RECOMPUTE)) + 0.2, RECOMPUTE)
        ax.set_xlabel("recomputation")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the bars' labels
        ax.legend(fontsize=8, loc="upper left" if ax is right else "upper right")
    fig.suptitle(f"{config.num_layers} layers, h = {config.hidden}: tp = {layout.tp}, "
                 f"pp = {layout.pp}, d = {layout.dp}, b = {layout.microbatch}, "
                 f"{layout.schedule}", fontsize=10)
    fig.tight_layout()
    return fig
