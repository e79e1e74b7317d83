"""Pictures of data parallelism and of PTD-P's traffic: buckets overlapping backward, ZeRO-1
memory per rank, and the bytes each layout of the grid sends per step.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.1 (data parallelism), §3.2–3.4 (how much
each of tensor, pipeline and data parallelism communicates), §4.1 (scatter/gather); Li et al.
2020, *PyTorch Distributed* (gradient buckets overlapped with backward); Rajbhandari et al. 2020,
ZeRO stage 1 (the optimizer state sharded over dp).

draw_bucket_timeline: backward as one bar, each bucket's all-reduce as a bar of its own, on one
    time axis per run (overlapped with backward, or after it).
draw_optimizer_state: optimizer-state bytes per rank, plain data parallelism vs ZeRO-1, per dp.
draw_memory_per_rank: a GPU's memory as stacked weights, gradients, optimizer and activations.
show_zero1_memory / explore_zero1_memory: that picture for plain DP and ZeRO-1 at several dp,
    from the memory model (`perf.memory`); the notebook's static call and its ipywidgets explorer.
draw_bytes_per_layout: the bytes every rank puts on the wire, by purpose (counted by
    `perf.wire_bytes_by_group`), as a heatmap, one row per layout.
format_bytes: 1234567 -> "1.23 MB" (decimal units, as links are rated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from megatron_edu.grid import Layout
from megatron_edu.model.config import GPTConfig
from megatron_edu.perf.memory import GIB, MemoryEstimate, memory_per_rank
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import Parallelism
from megatron_edu.timing import BucketTiming

__all__ = ["PARTS", "format_bytes", "draw_bucket_timeline", "draw_optimizer_state",
           "draw_memory_per_rank", "show_zero1_memory", "explore_zero1_memory",
           "draw_bytes_per_layout"]

PARTS = ("weights", "grads", "optimizer", "activations")
PART_COLOURS = ("#4c72b0", "#dd8452", "#c44e52", "#8c8c8c")
BACKWARD_COLOUR, BUCKET_COLOUR = "#4c72b0", "#dd8452"


def format_bytes(n: float) -> str:
    """Decimal units: 999 B, 1.23 kB, 45.6 MB, 7.89 GB, 1.02 TB (three significant digits)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


# --- buckets overlapped with backward ------------------------------------------------------------

Run = tuple[float, float, Sequence[BucketTiming]]  # backward start, backward end, buckets


def draw_bucket_timeline(runs: Mapping[str, Run]) -> Figure:
    """One panel per run on a shared time axis (ms from the start of backward): backward as one
    bar, each bucket's communication as a bar from its launch to its completion, a tick where
    its last gradient arrived. Times are ``time.perf_counter()`` values, as ``DataParallel``
    records them; each run's backward start is its zero."""
    rows = max(len(buckets) for _, _, buckets in runs.values()) + 1
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, (0.32 * rows + 0.9) * len(runs)),
                             sharex=True, squeeze=False)
    for ax, (title, run) in zip(axes[:, 0], runs.items(), strict=True):
        _bucket_panel(ax, run, rows)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms since backward started (tick: the bucket's last gradient arrived;"
                           " dotted: backward returned)")
    fig.tight_layout()
    return fig


def _bucket_panel(ax: Axes, run: Run, rows: int) -> None:
    start, end, buckets = run
    ax.barh(0, 1e3 * (end - start), color=BACKWARD_COLOUR, height=0.7, gid="backward")
    for b in buckets:
        launched, done, ready = (1e3 * (t - start) for t in (b.launched_at, b.done_at, b.ready_at))
        ax.barh(b.index + 1, done - launched, left=launched, color=BUCKET_COLOUR, height=0.7,
                gid=f"bucket {b.index}")
        ax.plot([ready, ready], [b.index + 0.6, b.index + 1.4], color="black", lw=1)
    ax.axvline(1e3 * (end - start), color=BACKWARD_COLOUR, ls=":", lw=1)
    ax.set_yticks(range(len(buckets) + 1), ["backward"] + [
        f"bucket {b.index} ({format_bytes(b.bytes)})" for b in buckets])
    ax.set_ylim(rows - 0.5, -0.5)


# --- memory per rank: measured optimizer state, and the memory model ----------------------------

def draw_optimizer_state(measured: Mapping[int, tuple[int, int]], ax: Axes | None = None) -> Axes:
    """Bars of optimizer-state bytes per rank: ``measured[dp] = (plain DP, ZeRO-1)``."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    dps = list(measured)
    x = np.arange(len(dps))
    for shift, name, column, colour in ((-0.2, "plain DP", 0, PART_COLOURS[2]),
                                        (0.2, "ZeRO-1", 1, "#f0a0a0")):
        values = [measured[dp][column] / 1e6 for dp in dps]
        ax.bar(x + shift, values, width=0.4, color=colour, label=name, gid=name)
    for i, dp in enumerate(dps):
        plain, zero1 = measured[dp]
        ax.text(i + 0.2, zero1 / 1e6, f"{zero1 / plain:.2f}×", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(x, [f"dp={dp}" for dp in dps])
    ax.set_ylabel("optimizer state per rank (MB)")
    ax.set_title("Adam's moments per rank: replicated, or sharded 1/dp (ZeRO-1)", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    ax.figure.tight_layout()
    return ax


def draw_memory_per_rank(estimates: Mapping[str, MemoryEstimate], capacity: int | None = None,
                         ax: Axes | None = None, title: str = "", group_size: int = 1) -> Axes:
    """One stacked bar per estimate (GiB): weights, gradients, optimizer state, activations;
    ``capacity`` (bytes) draws the GPU's memory as a line; a gap after every ``group_size``
    bars groups them (e.g. plain DP beside ZeRO-1)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.75 * len(estimates) + 1.5), 3.4))
    x = np.array([i + 0.5 * (i // group_size) for i in range(len(estimates))])
    bottom = np.zeros(len(estimates))
    for part, colour in zip(PARTS, PART_COLOURS, strict=True):
        heights = np.array([getattr(e, part) / GIB for e in estimates.values()])
        ax.bar(x, heights, bottom=bottom, color=colour, label=part, width=0.8, gid=part)
        bottom += heights
    top = bottom.max()
    if capacity is not None:
        ax.axhline(capacity / GIB, color="black", ls="--", lw=1, label="GPU memory")
        top = max(top, capacity / GIB)
    ax.set_ylim(0, 1.25 * top)
    ax.set_xticks(x, list(estimates), fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title, fontsize=10)
    ax.legend(frameon=False, fontsize=8, loc="upper center", ncol=5)
    ax.figure.tight_layout()
    return ax


def show_zero1_memory(config: GPTConfig, tp: int, pp: int, dps: Sequence[int],
                      global_batch: int, capacity: int | None = None) -> dict[str, MemoryEstimate]:
    """Plain DP beside ZeRO-1 at each dp (mixed precision, 16 bytes per parameter; 1F1B,
    microbatches of one sequence); returns the estimates drawn, keyed by bar label. Raises the
    ValueError of a split that cannot hold the model."""
    estimates = {}
    for dp in dps:
        pipeline = PipelineConfig(num_microbatches=global_batch // dp)
        for zero1 in (False, True):
            split = Parallelism(Layout(tp=tp, pp=pp, dp=dp), pipeline, zero=int(zero1))
            label = f"dp={dp}\n{'ZeRO-1' if zero1 else 'plain'}"
            estimates[label] = memory_per_rank(config, split)
    draw_memory_per_rank(estimates, capacity, group_size=2,
                         title=f"{config.num_layers} layers, h={config.hidden}, tp={tp}, pp={pp}")
    plt.show()
    return estimates


def explore_zero1_memory(config: GPTConfig, global_batch: int,
                         capacity: int | None = None) -> None:
    """The ipywidgets explorer: pick tp, pp and the largest dp; show_zero1_memory draws it."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    def update(tp: int, pp: int, max_dp: int) -> None:
        dps = [2**k for k in range(max_dp.bit_length()) if 2**k <= max_dp]
        try:
            show_zero1_memory(config, tp, pp, dps, global_batch, capacity)
        except ValueError as error:
            print(f"tp={tp}, pp={pp} cannot split this model: {error}")

    powers = [1, 2, 4, 8, 16, 32, 64]
    widgets.interact(update, tp=widgets.SelectionSlider(options=powers[:5], value=8),
                     pp=widgets.SelectionSlider(options=powers, value=1),
                     max_dp=widgets.SelectionSlider(options=powers, value=32))


# --- traffic per layout ---------------------------------------------------------------------------

def draw_bytes_per_layout(table: Mapping[str, Mapping[str, int]],
                          ax: Axes | None = None) -> Axes:
    """Heatmap: one row per layout, one column per purpose, colour on a log scale, each cell
    labelled with its bytes (blank where nothing is sent)."""
    purposes = list(next(iter(table.values())))
    values = np.array([[row[p] for p in purposes] for row in table.values()], dtype=float)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * len(purposes) + 2.2, 0.36 * len(table) + 1.4))
    shown = np.ma.masked_equal(values, 0)
    image = ax.imshow(shown, cmap="viridis", aspect="auto",
                      norm=LogNorm(vmin=max(shown.min(), 1), vmax=max(shown.max(), 2)))
    for (i, j), value in np.ndenumerate(values):
        if value:
            dark = image.norm(value) < 0.6
            ax.text(j, i, format_bytes(value), ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(purposes)), purposes)
    ax.set_yticks(range(len(table)), list(table))
    ax.xaxis.tick_top()
    ax.set_title("bytes on the wire per step, all ranks", fontsize=10, pad=22)
    ax.figure.colorbar(image, ax=ax, label="bytes (log scale)")
    ax.figure.tight_layout()
    return ax
