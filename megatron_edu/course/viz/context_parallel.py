"""Pictures of context parallelism: the ring's timeline, measured beside its simulation.

References: Liu et al. 2023, *Ring Attention*, arXiv 2310.01889 §3 (each step's block transfer
overlapped with the blockwise attention of the block held; hidden while a step's compute lasts
longer than a hop); megatron-core's context parallelism (the zig-zag split: every rank the same
causal work at every step).

fit_ring_costs: a chunk pair's forward and backward time (medians), from ``record_ring`` logs.
simulate_ring_step: forward then backward of the ring (``simulate_ring``), each rank's backward
    starting when its forward ends — what one training step of attention does.
draw_ring_timeline: one panel, one row per rank (rank 0 on top): compute light (forward) or dark
    (backward) blue, each labelled with its step; waiting red; blank: between the passes.
    Simulated hops as thin black bars under a rank's row (the block it sends to the next rank).
draw_ring_timelines: rows of splits (consecutive, zig-zag), measured on the left, simulated on the
    right, all on one time axis (ms).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from megatron_edu.perf.ring import RingTimeline, simulate_ring, step_pairs
from megatron_edu.timing import RingInterval

__all__ = ["fit_ring_costs", "simulate_ring_step", "draw_ring_timelines"]

Ranks = Sequence[Sequence[RingInterval]]   # ranks[r]: rank r's phases, measured or simulated
COLOURS = {(False, "compute"): "#9ecae1", (True, "compute"): "#3182bd", "wait": "#de2d26"}


def fit_ring_costs(runs: Mapping[bool, Ranks]) -> tuple[float, float]:
    """(forward, backward) seconds of one chunk pair: the median over every compute phase that
    computed any pair of its time per pair, over the runs given (``runs[zigzag]``: a run's
    intervals per rank, as ``RingLog.intervals`` gives them)."""
    per_pair: dict[bool, list[float]] = {False: [], True: []}
    for zigzag, ranks in runs.items():
        cp = len(ranks)
        for rank, row in enumerate(ranks):
            for i in row:
                pairs = step_pairs(rank, i.step, cp, zigzag)
                if i.kind == "compute" and pairs:
                    per_pair[i.backward].append((i.end - i.start) / pairs)
    return statistics.median(per_pair[False]), statistics.median(per_pair[True])


def simulate_ring_step(cp: int, forward_pair: float, backward_pair: float, hop_time: float,
                       zigzag: bool = True) -> RingTimeline:
    """The forward pass, then the backward pass, each rank's starting at its forward's end."""
    forward = simulate_ring(cp, forward_pair, hop_time, zigzag)
    backward = simulate_ring(cp, backward_pair, hop_time, zigzag, backward=True,
                             start=forward.ends)
    return RingTimeline([f + b for f, b in zip(forward.ranks, backward.ranks, strict=True)],
                        [f + b for f, b in zip(forward.hops, backward.hops, strict=True)])


def draw_ring_timeline(ranks: Ranks, ax: Axes, hops: Sequence[Sequence[tuple]] | None = None,
                       scale: float = 1e3, title: str = "") -> Axes:
    """One timeline, its first start at 0, times × ``scale`` (seconds → ms by default)."""
    origin = min(row[0].start for row in ranks if row)
    span = scale * (max(row[-1].end for row in ranks if row) - origin)
    for rank, row in enumerate(ranks):
        for i in row:
            left, width = scale * (i.start - origin), scale * (i.end - i.start)
            colour = COLOURS["wait"] if i.kind == "wait" else COLOURS[i.backward, i.kind]
            ax.barh(rank, width, left=left, height=0.7, color=colour, linewidth=0,
                    gid=f"{'backward' if i.backward else 'forward'} {i.kind} {i.step}")
            if i.kind == "compute" and width > 0.025 * span:      # its step, where it fits
                ax.text(left + width / 2, rank, str(i.step), ha="center", va="center",
                        fontsize=6, color="white" if i.backward else "black", clip_on=True)
        for start, end in (hops[rank] if hops else ()):
            ax.barh(rank + 0.42, scale * (end - start), left=scale * (start - origin),
                    height=0.1, color="black", gid="hop")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(len(ranks) - 0.45, -0.5)          # rank 0 on top
    ax.set_title(title, fontsize=9, loc="left")
    return ax


def draw_ring_timelines(measured: Mapping[str, Ranks], simulated: Mapping[str, RingTimeline],
                        costs: str = "") -> Figure:
    """Per split (the two mappings' keys, in order): its measured timeline (perf_counter seconds)
    left, its simulated one (seconds from fitted costs) right, one shared time axis in ms;
    ``costs``: the simulation's, said above the right column."""
    fig, axes = plt.subplots(len(measured), 2, figsize=(11, 1.5 * len(measured) + 1.2),
                             sharex=True, squeeze=False)
    for (name, ranks), (left, right) in zip(measured.items(), axes, strict=True):
        span = max(row[-1].end for row in ranks) - min(row[0].start for row in ranks)
        draw_ring_timeline(ranks, left, title=f"{name} — measured: {1e3 * span:.0f} ms")
        sim = simulated[name]
        draw_ring_timeline(sim.ranks, right, sim.hops,
                           title=f"{name} — simulated: {1e3 * sim.makespan:.0f} ms")
    for ax in axes[-1]:
        ax.set_xlabel("ms from the first start")
    if costs:
        fig.suptitle(f"simulated with {costs}", fontsize=9, x=0.75)
    handles = [Patch(color=COLOURS[False, "compute"], label="forward compute (its step)"),
               Patch(color=COLOURS[True, "compute"], label="backward compute"),
               Patch(color=COLOURS["wait"], label="waiting for the exchange"),
               Patch(color="black", label="simulated hop to the next rank")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
