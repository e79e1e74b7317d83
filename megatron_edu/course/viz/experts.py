"""Pictures of a mixture of experts: the router's balance, the load per expert as a run trains,
the dispatch over expert-parallel ranks step by step, and the choices a capacity keeps.

References: Fedus et al. 2021, *Switch Transformers*, arXiv 2101.03961 §2.2 (the capacity
ceil(cf · tokens / E) and the auxiliary loss E · Σ_i f_i · P_i, eq. 4); Lepikhin et al. 2020,
*GShard*, arXiv 2006.16668 §2.2 (capacity, the balance loss, the all-to-all dispatch).

Conventions: each expert has its pastel colour (Set2's, its grey swapped for a purple); each rank
its tab10 colour (the rank a token lives on outlines its boxes); a dropped choice is grey and
crossed.

balance: each expert's share f_i of the k·T choices, its mean probability P_i, and E · Σ f_i·P_i.
skewed_logits: router logits that prefer the low-numbered experts by ``skew``.
draw_balance / explore_balance: choices per expert against a capacity, f_i beside P_i, the loss;
    the notebook's static call and the ipywidgets explorer that calls it.
draw_load: each run's load per expert of one layer over its steps (a heatmap), and its balance
    loss per step.
Strip / draw_dispatch: the dispatch's steps, one strip each, a row of boxes per rank.
draw_kept: a sequence's choices, coloured by expert, under several capacity rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from megatron_edu.course.viz.tensor_parallel import rank_colour

__all__ = ["expert_colour", "balance", "skewed_logits", "draw_balance", "explore_balance",
           "draw_load", "Strip", "draw_dispatch", "draw_kept"]

DROPPED = "#bdbdbd"      # a choice no expert takes
EXPERT_COLOURS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494",
                  "#bc80bd")  # Set2, its grey (the dropped choices') swapped for Set3's purple
FONT = 8


def expert_colour(expert: int) -> str:
    """The colour every picture gives expert ``expert`` (eight, then again)."""
    return EXPERT_COLOURS[expert % len(EXPERT_COLOURS)]


# --- the router's balance ----------------------------------------------------------------------

def balance(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Of router logits [T, E] with top-k routing: f [E], each expert's share of the k·T
    choices; P [E], its mean probability; and the balance loss E · Σ_i f_i · P_i (Switch eq. 4),
    1 when the probabilities are uniform."""
    probs = logits.float().softmax(-1)
    ids = probs.topk(k, dim=-1).indices
    f = F.one_hot(ids, logits.shape[-1]).sum((0, 1)) / ids.numel()
    p = probs.mean(0)
    return f, p, logits.shape[-1] * float((f * p).sum())


def skewed_logits(skew: float, tokens: int = 64, experts: int = 8, seed: int = 0) -> torch.Tensor:
    """Logits [tokens, experts]: standard normal noise plus ``skew`` · (1 … −1) across the
    experts, so that a larger skew sends more tokens to the low-numbered experts."""
    noise = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return noise + skew * torch.linspace(1, -1, experts)


def draw_balance(logits: torch.Tensor, k: int, capacity_factor: float = 0.0) -> Figure:
    """Left: the choices each expert receives, and with ``capacity_factor`` cf > 0 its capacity
    C = ceil(cf · k·T / E), the choices above it dropped (grey). Right: f_i beside P_i; the
    title gives the balance loss and the share of choices dropped."""
    tokens, experts = logits.shape
    f, p, loss = balance(logits, k)
    counts = (f * k * tokens).round().long().tolist()
    capacity = math.ceil(capacity_factor * k * tokens / experts) if capacity_factor else None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 2.8))
    for e, n in enumerate(counts):
        kept = n if capacity is None else min(n, capacity)
        left.bar(e, kept, color=expert_colour(e), edgecolor="0.3", gid=f"kept {e}")
        if n > kept:
            left.bar(e, n - kept, bottom=kept, color=DROPPED, edgecolor="0.3", hatch="xx",
                     gid=f"dropped {e}")
    left.axhline(k * tokens / experts, color="0.4", ls=":", label="uniform: k·T/E")
    dropped = sum(max(0, n - capacity) for n in counts) if capacity else 0
    if capacity:
        left.axhline(capacity, color="tab:red", lw=1.2, label=f"capacity C = {capacity}")
    left.set(xlabel="expert", ylabel="choices received", xticks=range(experts),
             title=f"{tokens} tokens × k = {k}: {k * tokens} choices")
    left.legend(fontsize=FONT, loc="upper right")
    width = 0.4
    right.bar(np.arange(experts) - width / 2, f.numpy(), width, color="0.35", label="f_i: share "
              "of the choices")
    right.bar(np.arange(experts) + width / 2, p.numpy(), width, color="0.75", label="P_i: mean "
              "probability")
    right.axhline(1 / experts, color="0.4", ls=":", label="1/E")
    right.set(xlabel="expert", xticks=range(experts), ylim=(0, max(0.55, float(f.max()) * 1.1)),
              title=f"balance loss E·Σ f_i·P_i = {loss:.2f}" + (
                  f"; {dropped / (k * tokens):.0%} of the choices dropped" if capacity else ""))
    right.legend(fontsize=FONT, loc="upper right")
    fig.tight_layout()
    return fig


def explore_balance(tokens: int = 64, experts: int = 8) -> None:
    """The ipywidgets explorer: how strongly the router prefers the first experts, k and the
    capacity factor (0: dropless); ``draw_balance`` draws it."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    def update(skew: float, k: int, capacity_factor: float) -> None:
        draw_balance(skewed_logits(skew, tokens, experts), k, capacity_factor)
        plt.show()

    widgets.interact(update,
                     skew=widgets.FloatSlider(min=0.0, max=3.0, step=0.25, value=1.0),
                     k=widgets.SelectionSlider(options=[1, 2, 4], value=2),
                     capacity_factor=widgets.SelectionSlider(options=[0.0, 1.0, 1.25, 2.0],
                                                             value=1.0, description="cf"))


# --- the load as a run trains ----------------------------------------------------------------

def draw_load(runs: Mapping[str, Sequence[Mapping]], layer: int) -> Figure:
    """Per run (its log.jsonl records), a heatmap of layer ``layer``'s choices per expert at each
    step as a share of the step's choices; then every run's balance loss (``moe_aux``) per step."""
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.2 * (len(runs) + 1), 2.9))
    for ax, (name, records) in zip(axes, runs.items(), strict=False):
        steps = [r for r in records if "moe_load" in r]
        load = np.array([r["moe_load"][layer] for r in steps], dtype=float)
        share = load / load.sum(1, keepdims=True)
        image = ax.imshow(share.T, aspect="auto", cmap="magma", vmin=0, vmax=0.5,
                          extent=(0.5, len(steps) + 0.5, load.shape[1] - 0.5, -0.5))
        ax.set(xlabel="step", ylabel="expert", yticks=range(load.shape[1]),
               title=f"{name}: layer {layer}'s load")
        axes[-1].plot([r["step"] for r in steps], [r["moe_aux"] for r in steps], label=name)
    fig.colorbar(image, ax=list(axes[:-1]), label="share of the step's choices")
    axes[-1].axhline(1, color="0.4", ls=":", label="1: uniform probabilities")
    axes[-1].set(xlabel="step", title="balance loss E·Σ f_i·P_i, the layers' mean")
    axes[-1].legend(fontsize=FONT)
    return fig


# --- the dispatch, step by step ------------------------------------------------------------------

@dataclass(frozen=True)
class Strip:
    """One step of the dispatch: per rank, its rows as (token, expert) in order, and the
    segments they fall into, (label, rows) each, drawn as brackets under them."""

    title: str
    rows: Sequence[Sequence[tuple[int, int]]]
    segments: Sequence[Sequence[tuple[str, int]]]


def draw_dispatch(strips: Sequence[Strip], tokens_per_rank: int) -> Figure:
    """A strip per step, a row of boxes per rank: each box a row the rank holds, named by its
    token (t3) and filled with its expert's colour, outlined in the colour of the rank the token
    lives on; brackets below name the segments (where each goes, or which expert takes it)."""
    ranks = len(strips[0].rows)
    width = max(len(rows) for strip in strips for rows in strip.rows)
    fig, ax = plt.subplots(figsize=(0.62 * width + 3.2, 1.05 * ranks * len(strips) + 0.4))
    y = 0.0
    for strip in reversed(strips):
        for rank in reversed(range(ranks)):
            _draw_row(ax, y, strip.rows[rank], strip.segments[rank], tokens_per_rank)
            ax.text(-0.3, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=FONT,
                    color=rank_colour(rank))
            y += 1.05
        ax.text(-3.0, y - 0.05, strip.title, ha="left", va="bottom", fontsize=9,
                fontweight="bold")
        y += 0.55
    ax.set(xlim=(-3.1, width + 0.2), ylim=(-0.6, y))
    ax.axis("off")
    return fig


def _draw_row(ax: Axes, y: float, rows: Sequence[tuple[int, int]],
              segments: Sequence[tuple[str, int]], tokens_per_rank: int) -> None:
    for i, (token, expert) in enumerate(rows):
        ax.add_patch(plt.Rectangle((i + 0.04, y), 0.92, 0.62, facecolor=expert_colour(expert),
                                   edgecolor=rank_colour(token // tokens_per_rank), lw=2,
                                   gid="row"))
        ax.text(i + 0.5, y + 0.31, f"t{token}\ne{expert}", ha="center", va="center",
                fontsize=6.5, linespacing=0.95)
    start = 0
    for label, size in segments:
        if size:
            ax.plot([start + 0.08, start + size - 0.08], [y - 0.06] * 2, color="0.3", lw=1)
            ax.text(start + size / 2, y - 0.1, label, ha="center", va="top", fontsize=6.5)
        start += size


# --- what a capacity keeps -------------------------------------------------------------------

def draw_kept(ids: torch.Tensor, kept: Mapping[str, torch.Tensor]) -> Figure:
    """A sequence's choices ``ids`` [s, k], one row per rule in ``kept`` (name → [s, k] bool):
    each choice a box named and coloured by its expert, grey and crossed (×e) where the rule drops
    it, outlined in red where the rule decides otherwise than the first."""
    s, k = ids.shape
    first = next(iter(kept.values()))
    fig, ax = plt.subplots(figsize=(0.42 * s * k / 2 + 2.6, 0.75 * len(kept) + 0.5))
    for row, keep in enumerate(kept.values()):
        y = len(kept) - 1 - row
        for t in range(s):
            for j in range(k):
                x = t + j * 0.48
                colour = expert_colour(int(ids[t, j])) if keep[t, j] else DROPPED
                other = bool(keep[t, j] != first[t, j])
                ax.add_patch(plt.Rectangle((x, y), 0.44, 0.6, facecolor=colour,
                                           edgecolor="tab:red" if other else "0.5",
                                           lw=2 if other else 0.6,
                                           gid="differs" if other else "same"))
                ax.text(x + 0.22, y + 0.3, ("" if keep[t, j] else "×") + str(int(ids[t, j])),
                        ha="center", va="center", fontsize=6.5)
    ax.set(xlim=(-0.1, s), ylim=(-0.2, len(kept)))
    ax.set_xticks(np.arange(s) + 0.46, [str(t) for t in range(s)], fontsize=7)
    ax.set_yticks([len(kept) - 0.7 - row for row in range(len(kept))], list(kept), fontsize=FONT)
    ax.tick_params(length=0)
    ax.set_xlabel("token (its k choices side by side, each named by its expert)", fontsize=FONT)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
