"""Pictures of the process grid: which rank is which (pp stage, dp replica, tp rank), on which node.

Reference: Narayanan et al. 2021, arXiv 2104.04473 §3 (takeaway #1: tensor parallelism inside a
node, pipeline parallelism across nodes) — the rank order of `megatron_edu.grid.Layout`:
tp fastest, then dp, then pp, so consecutive ranks (one node's GPUs) share tp groups first.

draw_grid: one box per rank, labelled with its global rank; one column per pipeline stage, and in
    each column the dp replicas one below the other, each a block of its tp ranks (a tp group is a
    block of adjacent boxes). Nodes shaded when gpus_per_node is given; one kind of group
    coloured when highlight is given (a colour per group).
draw_grid_groups: the same grid once per kind of group, side by side.
explore_grid: an ipywidgets explorer of every layout of N ranks that calls draw_grid.
groups_across_nodes: how many groups of a kind need the slow links between nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from megatron_edu.grid import Layout, all_layouts

__all__ = ["groups_across_nodes", "draw_grid", "draw_grid_groups", "explore_grid"]

KINDS = ("tp", "dp", "pp", "embedding")
COLUMN_STEP = 1.6  # x distance between pipeline stages
BLOCK_GAP = 0.5    # extra y distance between dp replicas
BOX_WIDTH, BOX_HEIGHT = 1.2, 0.85
NODE_SHADES = ("#e4e4e4", "#c8c8c8")
GROUP_HUES = (0, 1, 2, 3, 4, 5, 6, 8, 9)  # tab10 without its gray, which the node shades use


def groups_across_nodes(groups: Sequence[Sequence[int]], gpus_per_node: int) -> int:
    """How many groups have ranks on more than one node (rank r is on node r // gpus_per_node)."""
    return sum(len({rank // gpus_per_node for rank in group}) > 1 for group in groups)


def _centre(layout: Layout, rank: int) -> tuple[float, float]:
    tp_rank, pp_rank, dp_rank = layout.coords(rank)
    return pp_rank * COLUMN_STEP, dp_rank * (layout.tp + BLOCK_GAP) + tp_rank


def _groups(layout: Layout, kind: str) -> list[list[int]]:
    if kind not in KINDS:
        raise ValueError(f"highlight must be one of {KINDS}, got {kind!r}")
    return getattr(layout, f"{kind}_groups")()


def _box_colours(layout: Layout, highlight: str | None) -> list:
    """White, or a light colour per group of the highlighted kind (non-members stay white)."""
    colours: list = ["white"] * layout.world_size
    if highlight is not None:
        for index, group in enumerate(_groups(layout, highlight)):
            r, g, b, _ = plt.get_cmap("tab10")(GROUP_HUES[index % len(GROUP_HUES)])
            for rank in group:
                colours[rank] = (0.45 + 0.55 * r, 0.45 + 0.55 * g, 0.45 + 0.55 * b)
    return colours


def _shade_nodes(ax: Axes, layout: Layout, gpus_per_node: int) -> None:
    """Behind the boxes, one shaded rectangle per (node, stage): adjacent ones merge visually."""
    for node in range(-(-layout.world_size // gpus_per_node)):
        members = range(node * gpus_per_node, min((node + 1) * gpus_per_node, layout.world_size))
        for stage in sorted({layout.coords(rank)[1] for rank in members}):
            ys = [_centre(layout, rank)[1] for rank in members if layout.coords(rank)[1] == stage]
            x = stage * COLUMN_STEP - COLUMN_STEP / 2
            ax.add_patch(Rectangle((x, min(ys) - 0.5), COLUMN_STEP, max(ys) - min(ys) + 1,
                                   facecolor=NODE_SHADES[node % 2], edgecolor="none",
                                   zorder=0, gid="node"))
        x, y = _centre(layout, members[0])
        ax.text(x - COLUMN_STEP / 2 + 0.05, y - 0.55, f"node {node}", fontsize=8, va="bottom")


def _title(layout: Layout, gpus_per_node: int | None, highlight: str | None) -> str:
    title = f"{layout.world_size} ranks as tp={layout.tp}, pp={layout.pp}, dp={layout.dp}"
    if gpus_per_node:
        title += f", {gpus_per_node} GPUs per node"
    if highlight is None:
        return title
    groups = _groups(layout, highlight)
    title = f"{title}\n{len(groups)} {highlight} groups of {len(groups[0])}"
    if gpus_per_node:
        crossing = groups_across_nodes(groups, gpus_per_node)
        title += (", each inside one node" if crossing == 0
                  else f", {crossing} of {len(groups)} cross nodes")
    return title


def draw_grid(layout: Layout, gpus_per_node: int | None = None, highlight: str | None = None,
              ax: Axes | None = None) -> Figure:
    """Ranks as boxes by (pp stage → column, dp replica → block, tp rank → row in the block).

    ``highlight``: "tp" | "dp" | "pp" | "embedding" colours each group of that kind its own colour.
    """
    rows = layout.dp * (layout.tp + BLOCK_GAP) - BLOCK_GAP
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * layout.pp + 1.6, 0.42 * rows + 1.3))
    for rank, colour in enumerate(_box_colours(layout, highlight)):
        x, y = _centre(layout, rank)
        ax.add_patch(Rectangle((x - BOX_WIDTH / 2, y - BOX_HEIGHT / 2), BOX_WIDTH, BOX_HEIGHT,
                               facecolor=colour, edgecolor="black", zorder=2, gid=f"rank {rank}"))
        ax.text(x, y, str(rank), ha="center", va="center", fontsize=10, weight="bold", zorder=3)
    if gpus_per_node:
        _shade_nodes(ax, layout, gpus_per_node)
    ax.set_xticks([s * COLUMN_STEP for s in range(layout.pp)],
                  [f"stage {s}" for s in range(layout.pp)])
    ax.set_yticks([_centre(layout, layout.rank_of(t, 0, d))[1]
                   for d in range(layout.dp) for t in range(layout.tp)],
                  [f"dp {d} · tp {t}" for d in range(layout.dp) for t in range(layout.tp)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlim(-COLUMN_STEP / 2, (layout.pp - 0.5) * COLUMN_STEP)
    ax.set_ylim(rows - 0.5 + 0.05, -0.5 - 0.45)  # rank 0 on top, room for the node labels
    ax.set_title(_title(layout, gpus_per_node, highlight), fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def draw_grid_groups(layout: Layout, gpus_per_node: int | None = None,
                     kinds: Sequence[str] = ("tp", "dp", "pp")) -> Figure:
    """The grid once per kind of group, side by side, each kind highlighted."""
    rows = layout.dp * (layout.tp + BLOCK_GAP) - BLOCK_GAP
    fig, axes = plt.subplots(1, len(kinds), figsize=(len(kinds) * (1.1 * layout.pp + 1.6),
                                                     0.42 * rows + 1.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        draw_grid(layout, gpus_per_node, kind, ax=ax)
    return fig


def explore_grid(world_size: int = 16, gpus_per_node: int = 8) -> None:
    """The ipywidgets explorer: every tp × pp × dp layout of ``world_size`` ranks, drawn."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    def update(layout: Layout, gpus_per_node: int, highlight: str) -> None:
        draw_grid(layout, gpus_per_node, None if highlight == "none" else highlight)
        plt.show()

    style = {"description_width": "initial"}
    layouts = [(f"tp={g.tp}, pp={g.pp}, dp={g.dp}", g) for g in all_layouts(world_size)]
    widgets.interact(
        update,
        layout=widgets.Dropdown(options=layouts, description="layout", style=style),
        gpus_per_node=widgets.IntSlider(value=gpus_per_node, min=1, max=world_size,
                                        description="GPUs per node", style=style),
        highlight=widgets.Dropdown(options=("none", *KINDS), value="tp", description="highlight",
                                   style=style),
    )
