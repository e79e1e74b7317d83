"""Pictures of collectives: what every rank holds before and after, and what the ring costs.

References: Shoeybi et al. 2019, arXiv 1909.08053 §3 (all-reduce inside `f` and `g`); Narayanan
et al. 2021, arXiv 2104.04473 §2.2 and §4.1 (send/recv between pipeline stages, all-gather and
reduce-scatter in the scatter/gather optimisation). The ring cost is `comm.CommEvent.wire_bytes`.

draw_collective: one row per rank, each element a coloured cell with its value, before → after.
    A cell's colour says where its value came from: rank r's colour, or stripes of every rank's
    colour for a sum (a mix of all of them).
element_origins: that colouring as data (which rank each element came from, or MIXED).
draw_ring_cost: bytes one rank sends per byte of buffer, for t = 2..16 ranks in a ring.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from megatron_edu.comm import CommEvent

__all__ = ["element_origins", "draw_collective", "draw_ring_cost"]

MIXED = -1  # an element that is a sum over every rank
Origins = list[list[int]]  # per rank, per element: the rank its value came from, or MIXED
TITLES = {
    "all_reduce": "all-reduce: every rank gets the sum",
    "all_gather": "all-gather: every rank gets every rank's chunk, in rank order",
    "reduce_scatter": "reduce-scatter: the sum, cut in t chunks; rank r keeps chunk r",
    "broadcast": "broadcast: every rank gets a copy of rank {src}'s tensor",
    "send_recv": "send/recv: a tensor moves from one rank to another (colour = sender)",
}
CELL_HEIGHT = 0.8
ARROW_GAP = 2.5  # room between the before and after blocks


def element_origins(op: str, before: Sequence, after: Sequence,
                    sources: Sequence[int] | None = None) -> tuple[Origins, Origins]:
    """For every element before and after, the rank its value came from (or MIXED for a sum).

    ``sources`` (broadcast and send/recv): the rank each rank's *after* tensor came from; by
    default rank 0 for a broadcast, and rank r − 1 for send/recv (rank 0, which receives nothing
    in a pipeline, keeps its own).
    """
    if op not in TITLES:
        raise ValueError(f"unknown collective {op!r}; choose one of {sorted(TITLES)}")
    t = len(before)
    lengths_after = [len(_values(y)) for y in after]
    before_origins = [[r] * len(_values(x)) for r, x in enumerate(before)]
    if op in ("all_reduce", "reduce_scatter"):
        return before_origins, [[MIXED] * n for n in lengths_after]
    if op == "all_gather":  # element j of the result is element j − offset of its rank's chunk
        gathered = [r for row in before_origins for r in row]
        return before_origins, [gathered[:n] for n in lengths_after]
    if sources is None:
        sources = [0] * t if op == "broadcast" else [max(r - 1, 0) for r in range(t)]
    return before_origins, [[s] * n for s, n in zip(sources, lengths_after, strict=True)]


def _values(x) -> list[float]:
    """A rank's tensor (or list) as a flat list of numbers, drawn row-major."""
    return torch.as_tensor(x).reshape(-1).tolist()


def _rank_colour(rank: int) -> tuple[float, float, float]:
    """tab10, mixed half-way with white so the values written on top stay readable."""
    r, g, b, _ = plt.get_cmap("tab10")(rank % 10)
    return (0.5 + r / 2, 0.5 + g / 2, 0.5 + b / 2)


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def _draw_cell(ax: Axes, x: float, y: float, value: float, origin: int, ranks: int) -> None:
    """One element: a box in its origin's colour (stripes of all ranks if MIXED), its value."""
    stripes = range(ranks) if origin == MIXED else [origin]
    for k, rank in enumerate(stripes):
        ax.add_patch(Rectangle((x + k / len(stripes), y), 1 / len(stripes), CELL_HEIGHT,
                               facecolor=_rank_colour(rank), edgecolor="none"))
    ax.add_patch(Rectangle((x, y), 1, CELL_HEIGHT, fill=False, edgecolor="black",
                           linewidth=0.8, gid="cell"))
    ax.text(x + 0.5, y + CELL_HEIGHT / 2, _format(value), ha="center", va="center", fontsize=9)


def _draw_block(ax: Axes, x0: float, rows: Sequence, origins: Origins,
                chunks: int | None) -> None:
    """Every rank's row of cells from ``x0``; thick dividers every ``chunks`` cells if given."""
    for rank, (row, row_origins) in enumerate(zip(rows, origins, strict=True)):
        values = _values(row)
        for j, (value, origin) in enumerate(zip(values, row_origins, strict=True)):
            _draw_cell(ax, x0 + j, rank, value, origin, len(rows))
        if chunks and len(values) % chunks == 0:
            step = len(values) // chunks
            for k in range(step, len(values), step):
                ax.plot([x0 + k, x0 + k], [rank - 0.05, rank + CELL_HEIGHT + 0.05],
                        color="black", linewidth=2.5)


def draw_collective(op: str, before: Sequence, after: Sequence,
                    sources: Sequence[int] | None = None, ax: Axes | None = None) -> Figure:
    """Per-rank tensors before and after a collective, one row per rank (rank 0 on top).

    ``op``: "all_reduce" | "all_gather" | "reduce_scatter" | "broadcast" | "send_recv";
    ``before[r]`` and ``after[r]`` are rank r's tensors (drawn flattened); ``sources`` as in
    ``element_origins``. Dividers mark the chunks a reduce-scatter cuts and an all-gather joins.
    """
    before_origins, after_origins = element_origins(op, before, after, sources)
    t = len(before)
    width_before = max(len(_values(x)) for x in before)
    width_after = max(len(_values(y)) for y in after)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.45 * (width_before + width_after) + 3.2, 0.5 * t + 1.1))
    x_after = width_before + ARROW_GAP
    _draw_block(ax, 0, before, before_origins, t if op == "reduce_scatter" else None)
    _draw_block(ax, x_after, after, after_origins, t if op == "all_gather" else None)
    middle = (t - 1 + CELL_HEIGHT) / 2
    ax.annotate("", xy=(x_after - 0.4, middle), xytext=(width_before + 0.4, middle),
                arrowprops={"arrowstyle": "-|>", "linewidth": 2, "color": "dimgray"})
    for rank in range(t):
        ax.text(-0.3, rank + CELL_HEIGHT / 2, f"rank {rank}", ha="right", va="center")
    ax.text(width_before / 2, -0.35, "before", ha="center", fontsize=10, style="italic")
    ax.text(x_after + width_after / 2, -0.35, "after", ha="center", fontsize=10, style="italic")
    src = sources[0] if sources else 0
    ax.set_title(TITLES[op].format(src=src), fontsize=11)
    ax.set_xlim(-1.8, x_after + width_after + 0.2)
    ax.set_ylim(t + 0.1, -0.9)  # rank 0 on top
    ax.axis("off")
    ax.figure.tight_layout()
    return ax.figure


def draw_ring_cost(group_sizes: Sequence[int] = range(2, 17), ax: Axes | None = None) -> Figure:
    """Bytes one rank sends, per byte of buffer, with the ring algorithm (comm.CommEvent).

    All-reduce = reduce-scatter then all-gather: 2(t − 1)/t, which tends to 2 — almost
    independent of t, which is why the ring is bandwidth-optimal; the others send (t − 1)/t.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    sizes = np.array(list(group_sizes))
    ops = [("all_reduce", "all-reduce: 2(t−1)/t"),
           ("all_gather", "all-gather or reduce-scatter: (t−1)/t")]
    for i, (op, label) in enumerate(ops):
        cost = [CommEvent(op, "ring", int(t), 1).wire_bytes for t in sizes]
        ax.bar(sizes + (i - 0.5) * 0.4, cost, width=0.4, label=label)
    for limit in (2, 1):
        ax.axhline(limit, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(sizes)
    ax.set_xlabel("t, ranks in the group")
    ax.set_ylabel("bytes sent per rank\n÷ buffer bytes")
    ax.set_title("ring algorithm: what one rank puts on the wire (limits 2 and 1 dashed)")
    ax.legend(loc="lower right")
    ax.figure.tight_layout()
    return ax.figure
