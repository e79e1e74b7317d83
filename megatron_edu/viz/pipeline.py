"""Pictures of pipeline schedules: who computes what, when, and where the bubble is.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2, Figures 3 (GPipe) and 4 (1F1B and
interleaved 1F1B), drawn here from a `Timeline` — simulated, or measured by the engine.

draw_schedule: a Gantt chart, one row per rank (rank 0 on top); each microbatch has its own hue,
forward light and backward dark; chunks ≥ 1 hatched; idle time left blank — the blank is the bubble.
draw_measured_vs_simulated: a measured run above its simulation.
draw_peak_activations: memory in flight per rank, one bar group per schedule (and measured peaks).
draw_bubble_vs_latency: how send latency eats the interleaved schedule's gain.
measured_costs / simulate_measured: a measured run's mean costs per rank, and the simulation
that uses them (free sends, no noise); draw_measured_run draws the two on one time axis.
show_schedule / explore: the notebook's static call and the ipywidgets explorer that calls it
(through show_explored, which moves m to a valid value for the interleaved schedule and says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..pipeline.schedules import SCHEDULES, Schedule, make_schedule
from ..pipeline.simulate import Timeline, bubble_formula, simulate

HATCHES = ["", "//", "..", "xx", "\\\\", "oo"]  # chunk 0, 1, 2, … (§2.2.2)
LABEL_FONTSIZE = 7


def _colour(microbatch: int, kind: str):
    """tab20 pairs a dark and a light shade of ten hues: backward dark, forward light."""
    return plt.get_cmap("tab20")(2 * (microbatch % 10) + (1 if kind == "F" else 0))


def _fits(label: str, width: float, ax: Axes, span: float) -> bool:
    """Whether `label` fits inside a box `width` wide on an axis `span` wide."""
    axes_points = ax.get_position().width * ax.figure.get_figwidth() * 72
    return width / span * axes_points > 0.7 * LABEL_FONTSIZE * len(label) + 2


def draw_schedule(timeline: Timeline | list, ax: Axes | None = None,
                  title: str | None = None) -> Axes:
    """Gantt chart of a Timeline (or of its per-rank lists of (action, start, end))."""
    timeline = timeline if isinstance(timeline, Timeline) else Timeline(timeline)
    p = len(timeline.ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * p + 1.3))
    origin = min(float(start) for row in timeline.ranks for _, start, _ in row)
    span = float(timeline.total_time)
    for rank, row in enumerate(timeline.ranks):
        for action, start, end in row:
            left, width = float(start) - origin, float(end - start)
            ax.barh(rank, width, left=left, height=0.8, color=_colour(action.microbatch,
                    action.kind), edgecolor="black", linewidth=0.5,
                    hatch=HATCHES[action.chunk % len(HATCHES)])
            label = str(action.microbatch)
            if _fits(label, width, ax, span):
                ax.text(left + width / 2, rank, label, ha="center", va="center",
                        fontsize=LABEL_FONTSIZE)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the paper's figures
    ax.set_xlim(0, span)
    ax.set_xlabel("time   (light: forward, dark: backward, hatched: chunk ≥ 1, blank: bubble)")
    bubble = f"bubble fraction {float(timeline.bubble_fraction):.3f}"
    ax.set_title(f"{title} — {bubble}" if title else bubble)
    ax.figure.tight_layout()
    return ax


def draw_measured_vs_simulated(measured: Timeline | list, simulated: Timeline | list) -> Figure:
    """A measured timeline above the simulated one, each on its own time axis."""
    p = len(measured.ranks if isinstance(measured, Timeline) else measured)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 0.9 * p + 2.6))
    draw_schedule(measured, ax=top, title="measured")
    draw_schedule(simulated, ax=bottom, title="simulated")
    return fig


def draw_peak_activations(timelines: dict[str, Timeline], ax: Axes | None = None,
                          measured: dict[str, Sequence[float]] | None = None) -> Axes:
    """Per rank, the most microbatches' activations held at once, in whole-stage units.

    An interleaved chunk holds 1/v of a stage's layers, so its count is divided by v.
    ``measured``: per schedule, the peaks a run measured in the same unit, drawn as dots.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(timelines)
    for i, (name, timeline) in enumerate(timelines.items()):
        peaks = np.array(timeline.peak_activations) / timeline.num_chunks
        ax.bar(np.arange(len(peaks)) + i * width, peaks, width, label=name)
        if measured is not None and name in measured:
            ax.plot(np.arange(len(peaks)) + i * width, measured[name], "o", color="black",
                    label="measured" if i == 0 else None, gid=f"measured {name}")
    ranks = range(len(next(iter(timelines.values())).ranks))
    ax.set_xticks(np.array(ranks) + 0.4 - width / 2, [f"rank {r}" for r in ranks])
    ax.set_ylabel("microbatches in flight")
    ax.set_title("peak activation memory per rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    ax.figure.tight_layout()
    return ax


def draw_bubble_vs_latency(p: int, m: int, chunks: Sequence[int], latencies: Sequence[float],
                           ratio: float = 2.0, ax: Axes | None = None) -> Axes:
    """Simulated bubble fraction against send latency, for 1F1B (v = 1) and interleaved v > 1."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    for v in chunks:
        schedule = make_schedule("interleaved", p, m, v)
        bubbles = [float(simulate(schedule, 1.0, ratio, lat).bubble_fraction) for lat in latencies]
        ax.plot(latencies, bubbles, marker="o", label="1F1B" if v == 1 else f"interleaved v={v}")
    ax.set_xlabel("send latency (in units of one stage's forward time)")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"p={p}, m={m}: each chunk adds a send to the critical path")
    ax.legend()
    ax.figure.tight_layout()
    return ax


def show_schedule(name: str, p: int, m: int, v: int = 1, ratio: float = 2.0,
                  latency: float = 0.0) -> None:
    """Simulate and draw one schedule; print its bubble next to the paper's, and its memory."""
    v = v if name == "interleaved" else 1
    timeline = simulate(make_schedule(name, p, m, v), 1.0, ratio, latency)
    draw_schedule(timeline, title=f"{name}, p={p}, m={m}" + (f", v={v}" if v > 1 else ""))
    plt.show()
    formula = "(p-1)/(v·m)" if name == "interleaved" else "(p-1)/m"
    print(f"simulated bubble {float(timeline.bubble_fraction):.4f}; paper's {formula} = "
          f"{float(bubble_formula(name, p, m, v)):.4f} (zero send latency)")
    print(f"peak activations per rank, in (microbatch, chunk) units: {timeline.peak_activations}")
    print(f"point-to-point messages: {timeline.num_p2p_messages}")


# The explorer's controls: every combination of these values is a setting it draws.
EXPLORER = {
    "name": list(SCHEDULES),
    "p": list(range(1, 9)),
    "m": list(range(1, 33)),
    "v": list(range(1, 5)),
    "ratio": [0.5 * k for k in range(1, 9)],          # t_b / t_f from 0.5 to 4
    "latency": [round(0.05 * k, 2) for k in range(21)],  # 0 to 1 forward time
}


def explorer_setting(name: str, p: int, m: int, v: int) -> tuple[int, int, str]:
    """The (m, v) the explorer draws for its sliders' values, and a note when it changed m.

    GPipe and 1F1B have one chunk per rank (v is ignored). The interleaved schedule sends
    microbatches through the chunks in groups of p, so m must be a multiple of p: m is raised to
    the next multiple, and the note says so — no setting of the sliders is a dead end.
    """
    if name != "interleaved":
        return m, 1, ""
    if m % p == 0:
        return m, v, ""
    snapped = -(-m // p) * p
    return snapped, v, (f"interleaved: microbatches go through the chunks in groups of p = {p}, "
                        f"so m must be a multiple of p — drawn with m = {snapped} instead of {m}")


def show_explored(name: str, p: int, m: int, v: int, ratio: float, latency: float) -> None:
    """The explorer's callback: ``show_schedule`` at the nearest valid setting (said if moved)."""
    m, v, note = explorer_setting(name, p, m, v)
    if note:
        print(note)
    show_schedule(name, p, m, v, ratio, latency)


def explore() -> None:
    """The ipywidgets explorer: schedule, p, m, v, backward/forward ratio, send latency."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    style = {"description_width": "initial"}

    def slider(kind, key: str, value, description: str, **step):
        values = EXPLORER[key]
        return kind(value=value, min=values[0], max=values[-1], description=description,
                    style=style, **step)

    widgets.interact(
        show_explored,
        name=widgets.Dropdown(options=EXPLORER["name"], value="interleaved",
                              description="schedule", style=style),
        p=slider(widgets.IntSlider, "p", 4, "p (stages)"),
        m=slider(widgets.IntSlider, "m", 8, "m (microbatches)"),
        v=slider(widgets.IntSlider, "v", 2, "v (chunks)"),
        ratio=slider(widgets.FloatSlider, "ratio", 2.0, "t_b / t_f", step=0.5),
        latency=slider(widgets.FloatSlider, "latency", 0.0, "send latency", step=0.05),
    )


# --- measured runs (notebook 05): the simulator fed with the engine's own timings ---------------


def measured_costs(timeline: Timeline | list) -> tuple[list[float], list[float]]:
    """Per rank, the mean time of a whole stage's forward and of its backward pass.

    With v chunks per rank an action runs 1/v of the stage's layers, so its mean is scaled by v:
    these are the costs `simulate` takes.
    """
    timeline = timeline if isinstance(timeline, Timeline) else Timeline(timeline)
    v = timeline.num_chunks

    def mean(row, kind: str):
        durations = [end - start for action, start, end in row if action.kind == kind]
        return v * sum(durations) / len(durations)

    return ([mean(row, "F") for row in timeline.ranks], [mean(row, "B") for row in timeline.ranks])


def simulate_measured(measured: Timeline | list, schedule: Schedule) -> Timeline:
    """`schedule` simulated with a measured run's per-rank costs: the same work, with free sends
    and every action as long as its rank's average (equal costs would give (p − 1)/m exactly)."""
    return simulate(schedule, *measured_costs(measured))


def draw_measured_run(measured: Timeline | list, schedule: Schedule, title: str) -> Figure:
    """A measured run above `simulate_measured` of it, on one time axis in seconds."""
    measured = measured if isinstance(measured, Timeline) else Timeline(measured)
    simulated = simulate_measured(measured, schedule)
    fig = draw_measured_vs_simulated(measured, simulated)
    top, bottom = fig.axes
    top.set_title(f"{title}, measured — bubble fraction {float(measured.bubble_fraction):.3f}")
    bottom.set_title("simulated with the measured mean costs per rank, free sends — bubble "
                     f"fraction {float(simulated.bubble_fraction):.3f}")
    span = max(float(measured.total_time), float(simulated.total_time))
    for ax in (top, bottom):
        ax.set_xlim(0, span)
        ax.set_xlabel(ax.get_xlabel().replace("time", "seconds", 1))
    return fig
