"""Pictures of pipeline schedules: who computes what, when, and where the bubble is.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2, Figures 3 (GPipe) and 4 (1F1B and
interleaved 1F1B); Qi et al. 2023, arXiv 2401.10241 Figure 3 (ZB-H1, ZB-H2) and §6 (ZB-V), drawn
here from a `Timeline` — simulated, or measured by the engine.

draw_schedule: a Gantt chart, one row per rank (rank 0 on top); each microbatch has its own hue,
forward light, backward dark, weight gradient (W, zero-bubble schedules) darker still, with a
white outline; chunks ≥ 1 hatched; idle time left blank — the blank is the bubble.
draw_memory_vs_bubble: 2401.10241's trade-off in one picture — each schedule's peak memory
against its bubble.
draw_measured_vs_simulated: a measured run above its simulation.
draw_peak_activations: memory in flight per rank, one bar group per schedule (and measured peaks).
draw_bubble_vs_latency: how send latency eats the interleaved schedule's gain.
draw_measured_run: a measured run above its simulation with its own mean costs
(``simulate.simulate_measured``), on one time axis.
draw_backward_split: one linear layer's F, B and W and who waits for what (2401.10241 Figure 1).
draw_scatter_gather: the activation between two stages with and without scatter/gather
(2104.04473 §4.1, Figure 9).
show_schedule / explore: the notebook's static call and the ipywidgets explorer that calls it
(through show_explored, which moves m to a valid value for the interleaved schedule and says so;
t_W is a slider of its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from megatron_edu.perf.bubble import BUBBLE_SIZE_WEIGHTS, bubble_formula, bubble_size_formula
from megatron_edu.pipeline.p2p import exchange_plan
from megatron_edu.pipeline.schedules import SCHEDULES, Schedule, make_schedule, stage_map
from megatron_edu.pipeline.simulate import Timeline, simulate, simulate_measured

__all__ = ["format_plan", "draw_schedule", "draw_measured_vs_simulated", "draw_peak_activations",
           "draw_bubble_vs_latency", "draw_memory_vs_bubble", "explorer_setting", "show_explored",
           "explore", "draw_measured_run", "draw_backward_split", "draw_scatter_gather", "EXPLORER"]

HATCHES = ["", "//", "..", "xx", "\\\\", "oo"]  # chunk 0, 1, 2, … (§2.2.2)
LABEL_FONTSIZE = 7


def _colour(microbatch: int, kind: str):
    """tab20 pairs a dark and a light shade of ten hues: backward dark, forward light; the
    weight-gradient pass W the dark shade halfway to black."""
    colour = np.array(plt.get_cmap("tab20")(2 * (microbatch % 10) + (1 if kind == "F" else 0)))
    if kind == "W":
        colour[:3] *= 0.5
    return tuple(colour)


def _fits(label: str, width: float, ax: Axes, span: float) -> bool:
    """Whether `label` fits inside a box `width` wide on an axis `span` wide."""
    axes_points = ax.get_position().width * ax.figure.get_figwidth() * 72
    return width / span * axes_points > 0.7 * LABEL_FONTSIZE * len(label) + 2


def draw_schedule(timeline: Timeline, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Gantt chart of a Timeline, simulated or measured."""
    p = len(timeline.ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * p + 1.3))
    origin = min(float(start) for row in timeline.ranks for _, start, _ in row)
    span = float(timeline.total_time)
    for rank, row in enumerate(timeline.ranks):
        for action, start, end in row:
            left, width = float(start) - origin, float(end - start)
            ax.barh(rank, width, left=left, height=0.8, color=_colour(action.microbatch,
                    action.kind), edgecolor="white" if action.kind == "W" else "black",
                    linewidth=0.5, hatch=HATCHES[action.chunk % len(HATCHES)])
            label = str(action.microbatch)
            if _fits(label, width, ax, span):
                ax.text(left + width / 2, rank, label, ha="center", va="center",
                        fontsize=LABEL_FONTSIZE, color="white" if action.kind == "W" else "black")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the paper's figures
    ax.set_xlim(0, span)
    split = any(action.kind == "W" for row in timeline.ranks for action, _, _ in row)
    ax.set_xlabel("time   (light: forward, dark: backward, "
                  + ("darkest: weight gradient W, " if split else "")
                  + "hatched: chunk ≥ 1, blank: bubble)")
    bubble = f"bubble fraction {float(timeline.bubble_fraction):.3f}"
    ax.set_title(f"{title} — {bubble}" if title else bubble)
    ax.figure.tight_layout()
    return ax


def draw_measured_vs_simulated(measured: Timeline, simulated: Timeline) -> Figure:
    """A measured timeline above the simulated one, each on its own time axis."""
    p = len(measured.ranks)
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
        peaks = np.array(timeline.peak_activations) / timeline.stages.v
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


def draw_memory_vs_bubble(p: int, m: int, forward_time: float = 1.0, backward_time: float = 1.0,
                          weight_time: float = 1.0,
                          names: Sequence[str] = ("1f1b", "zb-h1", "zb-h2", "zb-v"),
                          ax: Axes | None = None) -> Axes:
    """Each schedule as one point: its peak activation memory (microbatches of whole stages, on
    its fullest rank) against its bubble size (2401.10241 §2.3: the most a rank idles between its
    own first and last action), simulated with t_F, t_B, t_W. ZB-H1 keeps 1F1B's memory and cuts
    the bubble; ZB-H2 pays 2p − 1 microbatches for none; ZB-V none at 1F1B's memory."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.6))
    for name in names:
        timeline = simulate(make_schedule(name, p, m), forward_time, backward_time,
                            weight_time=weight_time)
        memory = max(timeline.peak_activations) / timeline.stages.v
        bubble = float(timeline.bubble_size)
        ax.plot(memory, bubble, "o", markersize=9, label=name, gid=name)
        ax.annotate(name, (memory, bubble), textcoords="offset points", xytext=(7, 4))
    ax.set_xlabel("peak activations (microbatches of a whole stage)")
    ax.set_ylabel("bubble size (time, units of t_F)")
    ax.set_title(f"p={p}, m={m}, t_F={forward_time:g}, t_B={backward_time:g}, "
                 f"t_W={weight_time:g}: memory against bubble")
    ax.margins(0.2)
    ax.figure.tight_layout()
    return ax


def show_schedule(name: str, p: int, m: int, v: int = 1, ratio: float = 2.0,
                  latency: float = 0.0, weight: float = 0.0) -> None:
    """Simulate and draw one schedule; print its bubble next to the paper's, and its memory.

    Costs in units of t_F: ``ratio`` = t_B / t_F, ``weight`` = t_W / t_F (2401.10241). A schedule
    without W actions runs the whole backward, t_B + t_W, as its B.
    """
    v = v if name == "interleaved" else None   # the others have their own (ZB-V: 2)
    timeline = simulate(make_schedule(name, p, m, v), 1.0, ratio, latency, weight_time=weight)
    v = timeline.stages.v
    draw_schedule(timeline, title=f"{name}, p={p}, m={m}" + (f", v={v}" if v > 1 else ""))
    plt.show()
    if name in ("gpipe", "1f1b", "interleaved"):
        formula = "(p-1)/(v·m)" if name == "interleaved" else "(p-1)/m"
        print(f"simulated bubble {float(timeline.bubble_fraction):.4f}; paper's {formula} = "
              f"{float(bubble_formula(name, p, m, v)):.4f} (zero send latency, t_W = 0)")
    else:
        print(f"bubble fraction {float(timeline.bubble_fraction):.4f} (every rank waits for the "
              f"whole step)")
    size = f"bubble size (2401.10241: most idle between a rank's own first and last action) " \
           f"{float(timeline.bubble_size):.3g}"
    if name in BUBBLE_SIZE_WEIGHTS and latency == 0:
        size += f"; Table 2's = {float(bubble_size_formula(name, p, 1.0, ratio, weight)):.3g}"
    print(size)
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
    "weight": [0.25 * k for k in range(9)],           # t_w / t_f from 0 to 2
}


def explorer_setting(name: str, p: int, m: int, v: int) -> tuple[int, int, str]:
    """The (m, v) the explorer draws for its sliders' values, and a note when it changed m.

    GPipe, 1F1B, ZB-H1 and ZB-H2 have one chunk per rank, ZB-V two (the v slider is ignored).
    The interleaved schedule sends microbatches through the chunks in groups of p, so m must be a
    multiple of p: m is raised to the next multiple, and the note says so — no setting of the
    sliders is a dead end.
    """
    if name != "interleaved":
        return m, stage_map(name, p).v, ""
    if m % p == 0:
        return m, v, ""
    snapped = -(-m // p) * p
    return snapped, v, (f"interleaved: microbatches go through the chunks in groups of p = {p}, "
                        f"so m must be a multiple of p — drawn with m = {snapped} instead of {m}")


def show_explored(name: str, p: int, m: int, v: int, ratio: float, latency: float,
                  weight: float = 0.0) -> None:
    """The explorer's callback: ``show_schedule`` at the nearest valid setting (said if moved)."""
    m, v, note = explorer_setting(name, p, m, v)
    if note:
        print(note)
    show_schedule(name, p, m, v, ratio, latency, weight)


def explore() -> None:
    """The ipywidgets explorer: schedule, p, m, v, t_B/t_F, t_W/t_F, send latency."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    style = {"description_width": "initial"}

    def slider(kind, key: str, value, description: str, **step):
        values = EXPLORER[key]
        return kind(value=value, min=values[0], max=values[-1], description=description,
                    style=style, **step)

    widgets.interact(
        show_explored,
        name=widgets.Dropdown(options=EXPLORER["name"], value="1f1b",
                              description="schedule", style=style),
        p=slider(widgets.IntSlider, "p", 4, "p (stages)"),
        m=slider(widgets.IntSlider, "m", 8, "m (microbatches)"),
        v=slider(widgets.IntSlider, "v", 2, "v (chunks)"),
        ratio=slider(widgets.FloatSlider, "ratio", 1.0, "t_b / t_f", step=0.5),
        latency=slider(widgets.FloatSlider, "latency", 0.0, "send latency", step=0.05),
        weight=slider(widgets.FloatSlider, "weight", 1.0, "t_w / t_f", step=0.25),
    )


# --- measured runs (notebook 05) -----------------------------------------------------------------


def draw_measured_run(measured: Timeline, title: str) -> Figure:
    """A measured run above ``simulate_measured`` of it, on one time axis in seconds."""
    simulated = simulate_measured(measured)
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


# --- NCCL's exchange plan, as text (notebook 05) -----------------------------------------------


def format_plan(schedule: Schedule) -> str:
    """Each rank's actions with its exchanges between them: 'F0 [⇄1 send act0>1] F1 …'."""
    plan, stages = exchange_plan(schedule), schedule.stages
    lines = []
    for rank, row in enumerate(schedule):
        items = []
        for i, action in enumerate([*row, None]):
            for e in plan[rank][i]:
                ops = ", ".join(("send " if stages.sender(m) == rank else "recv ")
                                + f"{m.kind}{m.microbatch}>{m.stage}" for m in e.messages)
                items.append(f"[⇄{e.peer} {ops}]")
            if action is not None:
                items.append(str(action))
        lines.append(f"rank {rank}: " + " ".join(items))
    return "\n".join(lines)


# --- diagrams: the backward split (notebook 20) and scatter/gather (notebook 05) -----------------


def _box(ax: Axes, x: float, y: float, width: float, height: float, text: str, colour,
         text_colour: str = "black", **style) -> None:
    ax.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.05", facecolor=colour,
                                edgecolor=style.pop("edgecolor", "black"), **style))
    ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", color=text_colour,
            fontsize=9)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], label: str = "",
           colour: str = "black", width: float = 1.2, style: str = "-", offset: float = 0.18,
           **text) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=colour,
                                                          linewidth=width, linestyle=style))
    if label:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + offset, label, ha="center",
                va="bottom" if offset >= 0 else "top", fontsize=8, color=colour, **text)


def draw_backward_split(ax: Axes | None = None) -> Axes:
    """One linear layer Y = X·W on pipeline stage i, its backward split into B and W
    (2401.10241 Figure 1), in the colours of ``draw_schedule``: F computes Y and sends it on;
    B computes ∂L/∂X = ∂L/∂Y·Wᵀ, which stage i − 1 waits for (the critical path); W computes
    ∂L/∂W = Xᵀ·∂L/∂Y, which only the optimizer step needs — so it can wait, keeping X and
    ∂L/∂Y alive until it runs."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4.2))
    for x, name in [(0.0, "stage i − 1"), (8.7, "stage i + 1")]:
        _box(ax, x, 0.2, 1.3, 5.6, name, "0.93")
    (f_x, width, height), rows = (3.4, 3.2, 0.9), {"F": 4.6, "B": 2.6, "W": 0.6}
    texts = {"F": "F    Y = X·W", "B": "B    ∂L/∂X = ∂L/∂Y·Wᵀ",
             "W": "W    ∂L/∂W = Xᵀ·∂L/∂Y\n(X kept from F)"}
    for kind, y in rows.items():
        _box(ax, f_x, y, width, height, texts[kind], _colour(0, kind),
             "white" if kind == "W" else "black", linestyle="--" if kind == "W" else "-")
    middle = {kind: y + height / 2 for kind, y in rows.items()}
    right = f_x + width
    _arrow(ax, (1.4, middle["F"]), (f_x - 0.1, middle["F"]), "X")
    _arrow(ax, (right + 0.1, middle["F"]), (8.6, middle["F"]), "Y")
    _arrow(ax, (8.6, middle["B"]), (right + 0.1, middle["B"]), "∂L/∂Y")
    _arrow(ax, (8.6, middle["B"] - 0.2), (right + 0.1, middle["W"] + 0.1), style="--")
    ax.text(right + 0.5, middle["W"] - 0.1, "∂L/∂Y,\nkept until W", ha="left", va="center",
            fontsize=8)
    _arrow(ax, (f_x - 0.1, middle["B"]), (1.4, middle["B"]), "∂L/∂X", colour="tab:red",
           width=2.5, fontweight="bold")
    ax.text((f_x + 1.4) / 2, middle["B"] - 0.2, "stage i − 1\nwaits for it", ha="center",
            va="top", fontsize=8, color="tab:red")
    ax.text(f_x + width / 2, rows["W"] - 0.2, "∂L/∂W → .grad: needed only at the optimizer "
            "step, so W can wait and fill the bubble", ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.2, 10.2)
    ax.set_ylim(-0.6, 6.0)
    ax.set_axis_off()
    ax.set_title("one linear layer Y = X·W on stage i: the backward split into B and W "
                 "(2401.10241 Figure 1)")
    ax.figure.tight_layout()
    return ax


def draw_scatter_gather(t: int = 2, message_bytes: int | None = None) -> Figure:
    """The activation between two pipeline stages, each split over t tensor-parallel ranks
    (2104.04473 §4.1, Figure 9): on the left each tp rank sends its whole replicated copy, b·s·h
    numbers per link; on the right each sends its 1/t slice (scatter) and the next stage's ranks
    all-gather the slices over their node's fast links. ``message_bytes``: the size of one whole
    message, printed on the links (else the sizes are written b·s·h and b·s·h/t)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.9 * t + 2.2))
    colours = [plt.get_cmap("tab10")(k) for k in range(t)]
    whole = "b·s·h" if message_bytes is None else f"{message_bytes:,} B"
    part = "b·s·h/t" if message_bytes is None else f"{message_bytes // t:,} B"
    for ax, split in zip(axes, (False, True), strict=True):
        for x, name in [(0.2, "stage i (one node)"), (6.2, "stage i + 1 (another node)")]:
            ax.add_patch(Rectangle((x, -0.6), 3.6, t + 0.2, facecolor="0.94", edgecolor="0.6"))
            ax.text(x + 1.8, t - 0.25, name, ha="center", va="bottom", fontsize=9)
        for rank in range(t):
            y = t - 1 - rank
            for x, received in [(1.2, False), (6.4, True)]:
                for k in range(t):  # the activation, one slice per tp rank
                    sent = split and k == rank  # the slice this rank sends, or receives
                    kept = not (split and received) or sent
                    ax.add_patch(Rectangle((x + 2.4 * k / t, y - 0.25), 2.4 / t, 0.5,
                                           facecolor=colours[k], alpha=1 if kept else 0.35,
                                           hatch="" if kept else "//", edgecolor="black",
                                           linewidth=2 if sent else 0.6,
                                           gid=f"{'with' if split else 'without'} "
                                           f"{'stage i + 1' if received else 'stage i'} "
                                           f"rank {rank} slice {k}"))
            ax.text(1.1, y, f"tp rank {rank}", ha="right", va="center", fontsize=8)
            ax.text(8.9, y, f"tp rank {rank}", ha="left", va="center", fontsize=8)
            _arrow(ax, (3.7, y), (6.3, y), part if split else whole,
                   colour=colours[rank] if split else "black", offset=0.08)
        if split:
            ax.annotate("", xy=(10.1, -0.3), xytext=(10.1, t - 0.7),
                        arrowprops=dict(arrowstyle="<|-|>", color="black"))
            ax.text(10.2, (t - 1) / 2, "all-gather\n(NVLink)", ha="left", va="center",
                    fontsize=8)
        ax.text(5.0, -0.95, "between nodes (InfiniBand): "
                + (f"{t} × {part}" if split else f"{t} × {whole}"), ha="center", va="top",
                fontsize=9)
        ax.set_title("with scatter/gather: each rank sends its 1/t, stage i + 1 all-gathers"
                     if split else "without: the t tp ranks send t identical copies", fontsize=10)
        ax.set_xlim(-0.2, 11.3)
        ax.set_ylim(-1.4, t + 0.4)
        ax.set_axis_off()
    fig.suptitle(f"the activation between two stages with tensor parallelism t = {t} "
                 "(2104.04473 §4.1, Figure 9)")
    fig.tight_layout()
    return fig
