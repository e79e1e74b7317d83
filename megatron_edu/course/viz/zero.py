"""Pictures of ZeRO's three stages: what each rank holds, measured memory beside the model, and a
ZeRO-3 step's timeline.

References: Rajbhandari et al. 2020, *ZeRO*, arXiv 1910.02054 §3 (16 bytes per parameter in mixed
precision: 2 for the weights, 2 for the gradients, K = 12 for Adam's state), §5 and Figure 1
(stage 1 shards the optimizer state over the d data-parallel ranks, stage 2 the gradients too,
stage 3 the weights too), §7 (the bytes each stage sends); Zhao et al. 2023, *PyTorch FSDP*, arXiv
2304.11277 (ZeRO-3's units gathered just before their forward and backward, the next prefetched).

SHARDED_FROM: the stage from which each part of a rank's model state is sharded.
held_per_param: the bytes per parameter a rank holds of each part, at a stage and a dp.
draw_zero_stages: one panel per stage, one row per rank: weights, gradients and optimizer state as
    segments as wide as their bytes; a sharded part cut into d slices, only the rank's own filled.
draw_memory_by_stage: per stage, the measured bytes at rest (stacked) beside the model's, and the
    measured peak of a step as a tick above them.
draw_bytes_per_step: the data-parallel bytes a rank sent per step against the microbatches m, one
    line per stage, in halves of an all-reduce.
gather_leads: how long before the current unit's pass ended the next unit's gather was launched.
draw_zero3_timeline: one row per unit — its gathers, forward, backward and reduce-scatter — on
    one time axis (ms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from megatron_edu.timing import UnitEvent

__all__ = ["PARTS", "MIXED_BYTES", "SHARDED_FROM", "held_per_param", "draw_zero_stages",
           "draw_memory_by_stage", "draw_bytes_per_step", "gather_leads",
           "draw_zero3_timeline"]

PARTS = ("weights", "grads", "optimizer")
MIXED_BYTES = {"weights": 2, "grads": 2, "optimizer": 12}  # ZeRO §3: fp16 + fp16 + K = 12
SHARDED_FROM = {"weights": 3, "grads": 2, "optimizer": 1}   # ZeRO §5: P_os, P_os+g, P_os+g+p
COLOURS = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#c44e52"}
EVENT_COLOURS = {"gather": "#55a868", "forward": "#9ecae1", "backward": "#3182bd",
                 "reduce-scatter": "#dd8452"}
STAGE_NAMES = {0: "plain DP", 1: "ZeRO-1: P_os", 2: "ZeRO-2: P_os+g", 3: "ZeRO-3: P_os+g+p"}


def held_per_param(stage: int, dp: int,
                   bytes_per_param: Mapping[str, float] = MIXED_BYTES) -> dict[str, float]:
    """Bytes per parameter of the model that one of ``dp`` ranks holds of each part at ``stage``."""
    return {part: nbytes / dp if stage >= SHARDED_FROM[part] else nbytes
            for part, nbytes in bytes_per_param.items()}


# --- what each rank holds -----------------------------------------------------------------------

def draw_zero_stages(dp: int = 4, bytes_per_param: Mapping[str, float] = MIXED_BYTES) -> Figure:
    """A panel per stage 0–3, a row per rank: each part a segment as wide as its bytes per
    parameter; a part the stage shards is cut into ``dp`` slices, of which rank r holds slice r
    (filled) — the rest is held by the other ranks (outlined)."""
    fig, axes = plt.subplots(1, 4, figsize=(12, 0.45 * dp + 2.1), sharex=True)
    total = sum(bytes_per_param.values())
    for stage, ax in enumerate(axes):
        held = held_per_param(stage, dp, bytes_per_param)
        for rank in range(dp):
            left = 0.0
            for part, nbytes in bytes_per_param.items():
                sharded = stage >= SHARDED_FROM[part]
                for piece in range(dp if sharded else 1):
                    width = nbytes / dp if sharded else nbytes
                    mine = not sharded or piece == rank
                    ax.barh(rank, width, left=left, height=0.72, linewidth=0.6,
                            color=COLOURS[part] if mine else "white", edgecolor=COLOURS[part],
                            gid=f"stage {stage} rank {rank} {part}" if mine else "not held")
                    left += width
        ax.set_title(f"{STAGE_NAMES[stage]}\n{sum(held.values()):g} bytes/param per rank",
                     fontsize=9)
        ax.set_yticks(range(dp), [f"rank {r}" for r in range(dp)] if stage == 0 else [])
        ax.set_ylim(dp - 0.5, -0.6)
        ax.set_xlim(0, total)
        ax.set_xlabel("bytes per parameter", fontsize=8)
        ax.tick_params(labelsize=8, length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    handles = [Patch(color=COLOURS[p], label=f"{p} ({bytes_per_param[p]:g} B/param)")
               for p in bytes_per_param]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="held by the other ranks"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"what each of d = {dp} data-parallel ranks holds, mixed-precision Adam",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# --- memory: measured beside the model ----------------------------------------------------------

def draw_memory_by_stage(measured: Mapping[int, Mapping[str, int]],
                         model: Mapping[int, Mapping[str, int]],
                         peaks: Mapping[int, int] | None = None, ax: Axes | None = None) -> Axes:
    """Per stage (the keys), two stacked bars in MB: the ``measured`` bytes of each part at rest
    (solid) and the ``model``'s (hatched); ``peaks[stage]``, the measured peak during a step, as
    a black tick over the measured bar."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.6))
    stages = list(measured)
    x = np.arange(len(stages), dtype=float)
    for shift, source, style in ((-0.2, measured, {}), (0.2, model, {"hatch": "//", "alpha": 0.5})):
        bottom = np.zeros(len(stages))
        for part in PARTS:
            heights = np.array([source[s][part] / 1e6 for s in stages])
            ax.bar(x + shift, heights, width=0.38, bottom=bottom, color=COLOURS[part],
                   edgecolor="white", gid=f"{'measured' if source is measured else 'model'} {part}",
                   **style)
            bottom += heights
    if peaks:
        tops = [peaks[s] / 1e6 for s in stages]
        ax.scatter(x - 0.2, tops, marker="_", s=700, color="black", linewidths=2, zorder=3,
                   gid="peak")
    ax.set_xticks(x, [f"{STAGE_NAMES[s].split(':')[0]}\nmeasured | model" for s in stages],
                  fontsize=8)
    ax.set_ylabel("MB per rank")
    handles = [Patch(color=COLOURS[p], label=p) for p in PARTS]
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="the model"))
    if peaks:
        handles.append(plt.Line2D([], [], color="black", lw=2, label="measured peak in a step"))
    ax.legend(handles=handles, fontsize=8, frameon=False, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.set_title("memory per rank: at rest, measured beside ZeRO's model, and the peak of a step",
                 fontsize=10)
    ax.figure.tight_layout()
    return ax


# --- bytes per step, against the microbatches ---------------------------------------------------

def draw_bytes_per_step(measured: Mapping[int, Mapping[int, float]], unit: float,
                        ax: Axes | None = None) -> Axes:
    """Per stage (the keys), the bytes a rank sent per step at each m (``measured[stage][m]``)
    in units of ``unit`` — one reduce-scatter or all-gather of the model, (d − 1)/d of its
    bytes — against m, the points of a stage joined by a line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.4))
    styles = [("o", "--", 9), ("s", "-", 5), ("^", "-", 6), ("D", "-", 5)]  # plain DP under ZeRO-1
    for (stage, colour), (marker, line, size) in zip(zip(measured, plt.cm.tab10.colors,
                                                         strict=False), styles, strict=False):
        ms = sorted(measured[stage])
        ax.plot(ms, [measured[stage][m] / unit for m in ms], marker=marker, ls=line, ms=size,
                color=colour, lw=1.2, gid=f"stage {stage}", mfc="none" if line == "--" else colour,
                label=STAGE_NAMES[stage].split(":")[0])
    ax.set_ylim(0, None)
    ax.set_xlabel("microbatches m per step")
    ax.set_ylabel("halves sent per rank and step")
    ax.set_xticks(sorted({m for points in measured.values() for m in points}))
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("data-parallel bytes per step, in halves of an all-reduce", fontsize=10)
    ax.figure.tight_layout()
    return ax


# --- a ZeRO-3 step's timeline ----------------------------------------------------------------

def gather_leads(events: Sequence[UnitEvent]) -> list[tuple[str, int, int, float]]:
    """For each pass and each unit followed by another in it (forward: in order; backward: in
    reverse): (pass, unit, next unit, seconds by which the next unit's gather was launched
    before this unit's pass ended) — positive: the next gather was prefetched."""
    passes = {kind: [e for e in events if e.kind == kind] for kind in ("forward", "backward")}
    launched: dict[int, list[float]] = {}
    for e in sorted((e for e in events if e.kind == "gather"), key=lambda e: e.start):
        launched.setdefault(e.unit, []).append(e.start)
    leads = []
    for which, kind in enumerate(("forward", "backward")):
        order = sorted(passes[kind], key=lambda e: e.start)
        # a root (a model chunk's own parameters: its embeddings) encloses its units' passes
        blocks = [e for e in order if not any(o is not e and e.start <= o.start and o.end <= e.end
                                              for o in order)]
        for current, following in zip(blocks, blocks[1:], strict=False):
            starts = launched.get(following.unit, [])
            if len(starts) > which:
                leads.append((kind, current.unit, following.unit,
                              current.end - starts[which]))
    return leads


def draw_zero3_timeline(events: Sequence[UnitEvent],
                        scatters: Sequence[tuple[int, float, float]] = (),
                        names: Sequence[str] | None = None, ax: Axes | None = None) -> Axes:
    """One row per unit (unit 0 on top): its gathers as thin green bars above (from the launch
    to the end of the wait), its forward and backward passes, its reduce-scatters as thin bars
    below; ms from the first event."""
    units = sorted({e.unit for e in events} | {u for u, _, _ in scatters})
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * len(units) + 1.2))
    origin = min([e.start for e in events] + [s for _, s, _ in scatters])
    row = {u: i for i, u in enumerate(units)}
    lanes = {"gather": (-0.3, 0.16), "forward": (0.0, 0.42), "backward": (0.0, 0.42),
             "reduce-scatter": (0.3, 0.16)}
    items = [(e.unit, e.kind, e.start, e.end) for e in events]
    items += [(u, "reduce-scatter", start, end) for u, start, end in scatters]
    for unit, kind, start, end in items:
        offset, height = lanes[kind]
        ax.barh(row[unit] + offset, 1e3 * (end - start), left=1e3 * (start - origin),
                height=height, color=EVENT_COLOURS[kind], linewidth=0,
                gid=f"unit {unit} {kind}")
    labels = names if names is not None else [f"unit {u}" for u in units]
    ax.set_yticks(range(len(units)), labels, fontsize=8)
    ax.set_ylim(len(units) - 0.5, -0.5)
    ax.set_xlabel("ms from the step's first event")
    handles = [Patch(color=EVENT_COLOURS["gather"], label="all-gather: launched → waited for"),
               Patch(color=EVENT_COLOURS["forward"], label="forward"),
               Patch(color=EVENT_COLOURS["backward"], label="backward"),
               Patch(color=EVENT_COLOURS["reduce-scatter"], label="reduce-scatter")]
    ax.legend(handles=handles, fontsize=8, frameon=False, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.18))
    ax.set_title("one ZeRO-3 step on rank 0: each unit gathered for its forward and again for "
                 "its backward", fontsize=10)
    ax.figure.tight_layout()
    return ax
