"""Pictures of a design puzzle's space: every candidate design placed by the numbers the puzzle's
checker judges it by (``course.exercises.nb16``: the simulator and the cost model), with the
puzzle's limits drawn and no design marked; notebook 16 shows each after its exercise, where the
learner's answer sits.

References: Narayanan et al. 2021, arXiv 2104.04473 — §2.2 bubbles and activations in flight,
§2.2.2 interleaving's extra sends; Korthikanti et al. 2022, arXiv 2205.05198 §4–5 sequence
parallelism and selective recomputation; Qi et al. 2023, arXiv 2401.10241 the zero-bubble
schedules.

draw_schedule_space          schedules by peak activations and bubble, against two limits
draw_interleaving_vs_m       1F1B and interleaved iteration time as m grows, and their difference
draw_recompute_options       memory and extra FLOPs of each recomputation × sequence parallelism,
                             with the memory budget
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

__all__ = ["draw_schedule_space", "draw_interleaving_vs_m", "draw_recompute_options"]


# ---- 16.1: schedules ---------------------------------------------------------------------------


def draw_schedule_space(points: Mapping[tuple[str, int | None], tuple[Real, Real]],
                        max_stages_held: Real, max_bubble: Real, title: str) -> Figure:
    """Each schedule of ``points`` ((name, v) → (stages' worth held, bubble)) as a labelled point,
    with the two limits as lines and the corner both allow shaded (2104.04473 §2.2; 2401.10241)."""
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
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return fig


# ---- 16.3: interleaving against m --------------------------------------------------------------


def draw_interleaving_vs_m(times: Mapping[str, Sequence[float]], microbatch_counts: Sequence[int],
                           title: str) -> Figure:
    """Seconds per iteration of each schedule in ``times`` (two: 1F1B, then interleaved) at each m
    (left), and the second minus the first (right): the bubble interleaving saves is fixed in m,
    its extra sends grow with m (2104.04473 §2.2.2)."""
    times = {label: np.asarray(seconds, dtype=float) for label, seconds in times.items()}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, seconds in times.items():
        left.plot(microbatch_counts, seconds, marker="o", markersize=3, label=label, gid=label)
    left.set_xlabel("microbatches m")
    left.set_ylabel("predicted s per iteration")
    left.legend(fontsize=8)
    left.set_title("iteration time", fontsize=10)
    first, second = times.values()
    gap = 1e3 * (second - first)
    right.plot(microbatch_counts, gap, marker="o", markersize=3, color="tab:gray", gid="gap")
    right.axhline(0, color="black", linewidth=1)
    right.set_xticks(microbatch_counts[::2])
    right.grid(alpha=0.3)
    right.set_xlabel("microbatches m")
    right.set_ylabel(" − ".join(reversed(times)) + " (ms)")
    right.set_title(f"below 0: {list(times)[1]} is faster", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ---- 16.4: recomputation -----------------------------------------------------------------------


def draw_recompute_options(options: Mapping[tuple[str, bool], tuple[float, float]],
                           budget_gib: float, title: str) -> Figure:
    """For each (recompute, sequence_parallel) of ``options`` → (GiB per GPU, FLOPs recomputed
    per iteration): memory against the budget (left), the recomputed FLOPs (right), one bar
    pair per recomputation (2205.05198 §4–5)."""
    modes = list(dict.fromkeys(mode for mode, _ in options))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, sp in enumerate((False, True)):
        label = "with sequence parallelism" if sp else "without sequence parallelism"
        where = np.arange(len(modes)) + 0.4 * i
        left.bar_label(left.bar(where, [options[m, sp][0] for m in modes], 0.4, label=label),
                       fmt="%.1f", fontsize=8)
        right.bar_label(right.bar(where, [options[m, sp][1] / 1e15 for m in modes], 0.4,
                                  label=label), fmt="%.0f", fontsize=8)
    left.axhline(budget_gib, color="tab:red", linestyle="--", linewidth=1,
                 label=f"budget: {budget_gib:g} GiB", gid="budget")
    left.set_ylabel("GiB per GPU")
    left.set_title("memory", fontsize=10)
    right.set_ylabel("PFLOP recomputed per iteration")
    right.set_title("extra compute", fontsize=10)
    for ax in (left, right):
        ax.set_xticks(np.arange(len(modes)) + 0.2, modes)
        ax.set_xlabel("recomputation")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the bars' labels
        ax.legend(fontsize=8, loc="upper left" if ax is right else "upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
