"""The picture of sequence parallelism: one transformer layer, which parts are split along the
sequence and which along the hidden size, and the conjugate collectives between them.

Reference: Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2 and Figure 5. The layer norms and the
dropouts (with the residual adds) run *sequence-parallel*: each of the t tensor-parallel ranks
holds s/t of the positions, [s/t, b, h]. Attention and the MLP run *tensor-parallel*: each rank
holds every position and h/t of the heads or of the MLP's columns. Between them the conjugate
operators: g all-gathers the sequence forward (each rank's heads need every position) and
reduce-scatters its gradient backward; ḡ reduce-scatters the row-parallel layer's partial sums
forward (each rank keeps the sum of its own positions) and all-gathers the gradient backward.

draw_sequence_parallel_layer: the layer left to right, each operation a box cut into t stripes in
    the ranks' colours — across (split along s) in the sequence-parallel regions, down (split
    along h) in the tensor-parallel ones — with g and ḡ at the boundaries and the residual paths.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Patch, Rectangle

__all__ = ["draw_sequence_parallel_layer"]

# The layer of Figure 5, in order: (kind, name); kind "sp", "tp", a conjugate operator, or "+".
LAYER = (("sp", "LayerNorm"), ("g", "g"), ("tp", "Self-\nattention"), ("ḡ", "ḡ"),
         ("sp", "Dropout"), ("+", "+"), ("sp", "LayerNorm"), ("g", "g"), ("tp", "MLP"),
         ("ḡ", "ḡ"), ("sp", "Dropout"), ("+", "+"))
REGIONS = {"sp": ("#e5f2dc", "sequence parallel: [s/t, b, h] per rank"),
           "tp": ("#ebe7f3", "tensor parallel: [s, b, h/t] per rank (heads, MLP columns)")}
COLLECTIVES = {"g": "all-gather fwd\nreduce-scatter bwd", "ḡ": "reduce-scatter fwd\nall-gather bwd"}
WIDTH = {"sp": 1.5, "tp": 1.6, "g": 0.56, "ḡ": 0.56, "+": 0.4}   # each item's width along x
BOX_H, FONT, GAP = 1.2, 8, 0.3


def _colour(rank: int):
    return plt.get_cmap("tab10")(rank % 10)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float],
           colour: str = "black") -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, lw=0.9,
                                 color=colour, shrinkA=0, shrinkB=0, zorder=2))


def _op_box(ax: Axes, x: float, w: float, name: str, kind: str, tp: int, index: int) -> None:
    """One operation: a box cut into tp stripes, across for "sp" (positions), down for "tp"."""
    for r in range(tp):
        if kind == "sp":      # rank r holds positions r·s/t … : a horizontal band, top down
            xy, sw, sh = (x, BOX_H * (1 - (r + 1) / tp) - BOX_H / 2), w, BOX_H / tp
        else:                 # rank r holds heads (columns) r·h/t … : a vertical band
            xy, sw, sh = (x + r * w / tp, -BOX_H / 2), w / tp, BOX_H
        ax.add_patch(Rectangle(xy, sw, sh, facecolor=_colour(r), alpha=0.35, edgecolor="white",
                               lw=0.8, gid=f"{index} {kind} stripe"))
    ax.add_patch(Rectangle((x, -BOX_H / 2), w, BOX_H, fill=False, edgecolor="black", lw=1.2,
                           gid=f"{index} {kind} op"))
    ax.text(x + w / 2, 0, name, ha="center", va="center", fontsize=FONT + 1)


def draw_sequence_parallel_layer(tp: int = 2, ax: Axes | None = None) -> Figure:
    """2205.05198 Figure 5 for ``tp`` ranks: the layer's operations left to right over the
    shaded sequence-parallel and tensor-parallel regions, g and ḡ at their boundaries with the
    collective each runs forward and backward, and the two residual paths."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.0))
    x, centres = 0.5, []
    for kind, _ in LAYER:
        centres.append(x + WIDTH[kind] / 2)
        x += WIDTH[kind] + GAP
    end = x
    regions, start = [], 0.0                 # contiguous runs of sp or tp, split at g and ḡ
    for (kind, _), c in zip(LAYER, centres, strict=True):
        if kind in ("g", "ḡ"):
            regions.append((start, c))
            start = c
    regions.append((start, end))
    for i, (left, right) in enumerate(regions):
        colour, _ = REGIONS["sp" if i % 2 == 0 else "tp"]
        ax.add_patch(Rectangle((left, -1.25), right - left, 2.2, facecolor=colour,
                               edgecolor="none", zorder=0, gid="region"))
    for index, ((kind, name), c) in enumerate(zip(LAYER, centres, strict=True)):
        w = WIDTH[kind]
        if kind in ("sp", "tp"):
            _op_box(ax, c - w / 2, w, name, kind, tp, index)
            continue
        ax.add_patch(Circle((c, 0), w / 2, facecolor="white", edgecolor="black", lw=1.2,
                            gid=f"{index} {kind}", zorder=3))
        ax.text(c, 0, name, ha="center", va="center", zorder=4, style="italic",
                fontsize=FONT + (5 if kind in COLLECTIVES else 3))
        if kind in COLLECTIVES:
            ax.text(c, -0.95, COLLECTIVES[kind], ha="center", va="center", fontsize=FONT - 1)
    edges = [(0.0, 0.0)] + [(c - WIDTH[k] / 2, c + WIDTH[k] / 2)
                            for (k, _), c in zip(LAYER, centres, strict=True)]
    for (_, right), (left, _) in zip(edges[:-1], edges[1:], strict=True):  # forward, left → right
        _arrow(ax, (right, 0), (left, 0))
    plus = [c for (kind, _), c in zip(LAYER, centres, strict=True) if kind == "+"]
    branch = [0.25, plus[0] + WIDTH["+"] / 2 + GAP / 2]       # x + f(LN(x)): the residuals
    for left, right in zip(branch, plus, strict=True):
        ax.plot([left, left, right], [0, 0.8, 0.8], color="grey", lw=1, zorder=1)
        _arrow(ax, (right, 0.8), (right, WIDTH["+"] / 2), colour="grey")
    ax.legend(handles=[Patch(facecolor=c, label=label) for c, label in REGIONS.values()]
              + [Patch(facecolor=_colour(r), alpha=0.35, label=f"rank {r}") for r in range(tp)],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2 + tp, fontsize=FONT,
              frameon=False)
    ax.set_xlim(-0.1, end + 0.1)
    ax.set_ylim(-1.3, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"A transformer layer with tensor and sequence parallelism, t = {tp} "
                 "(2205.05198 Fig. 5)", fontsize=FONT + 2)
    return ax.figure
