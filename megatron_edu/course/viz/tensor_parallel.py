"""Pictures of tensor parallelism: which rank holds which block of which matrix.

Reference: Shoeybi et al. 2019, arXiv 1909.08053 §3, Figure 3 (the MLP and self-attention split
across t ranks, with the conjugate operators f and g) and the vocabulary-parallel embedding and
cross entropy described at the end of §3.

Conventions in every picture: each rank has its tab10 colour; grey means "the whole tensor, on
every rank"; a stack of coloured copies means "each rank holds a different partial sum of the
same shape" (what g adds up); hatching marks vocabulary padding.

draw_mlp_split: Figure 3a — X, f, A split by columns, GeLU, B split by rows, partial sums, g.
draw_attention_split: Figure 3b — Q, K, V split by heads, attention per head, B by rows, g.
draw_qkv_layout: the fused qkv weight's row order, Hugging Face's and ours, split into t parts.
draw_embedding_split: the embedding table split by vocabulary ranges, and the logits it produces.
draw_params_per_rank: parameters held by one rank against t, for real model sizes.
show_split / explore: the notebook's static call and the ipywidgets explorer that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, Rectangle

from megatron_edu.model.config import GPTConfig

__all__ = ["draw_mlp_split", "draw_attention_split", "draw_qkv_layout", "draw_embedding_split",
           "draw_params_per_rank", "show_split", "explore"]

WHOLE = "#d9d9d9"       # a tensor every rank holds whole
FONT = 8
GAP = 0.55              # horizontal space for an arrow between two pictures
TEXT_GAP = 1.0          # … and for an arrow with words on it
BYTES_PER_PARAM = 16    # mixed-precision Adam: fp16 weight and grad, fp32 master, m, v (ZeRO §3.1)


def rank_colour(rank: int):
    """The colour every picture gives tensor-parallel rank ``rank``."""
    return plt.get_cmap("tab10")(rank % 10)


def _sub(name: str, i: int) -> str:
    """name with the subscript i, numbered from 0 like the ranks: A₀, A₁, …"""
    return name + "".join(chr(0x2080 + int(d)) for d in str(i))


def _blocks(ax: Axes, x: float, y: float, w: float, h: float, owners: Sequence[int | None],
            along: str = "cols", names: Sequence[str] | None = None) -> None:
    """A w×h matrix (lower-left corner x, y) cut into equal blocks along columns or rows,
    each coloured by the rank that holds it (None: every rank, grey). Row blocks run top down."""
    n = len(owners)
    for i, owner in enumerate(owners):
        if along == "cols":
            bx, by, bw, bh = x + i * w / n, y, w / n, h
        else:
            bx, by, bw, bh = x, y + h - (i + 1) * h / n, w, h / n
        colour = WHOLE if owner is None else rank_colour(owner)
        ax.add_patch(Rectangle((bx, by), bw, bh, facecolor=colour, edgecolor="white", lw=0.8))
        if names:
            ax.text(bx + bw / 2, by + bh / 2, names[i], ha="center", va="center", fontsize=FONT)
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="black", lw=1.2))


def _partials(ax: Axes, x: float, y: float, w: float, h: float, tp: int, name: str) -> None:
    """tp stacked copies of one shape: a different partial sum on each rank."""
    step = 0.08
    for r in reversed(range(tp)):
        ax.add_patch(Rectangle((x + r * step, y - r * step), w, h, facecolor=rank_colour(r),
                               edgecolor="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, name, ha="center", va="center", fontsize=FONT)


def _operator(ax: Axes, x: float, y: float, name: str) -> None:
    ax.add_patch(Circle((x, y), 0.22, facecolor="white", edgecolor="black", lw=1.2))
    ax.text(x, y, name, ha="center", va="center", fontsize=FONT + 3, style="italic")


def _arrow(ax: Axes, x0: float, x1: float, y: float, text: str = "") -> None:
    ax.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops=dict(arrowstyle="->", lw=1.0))
    if text:
        ax.text((x0 + x1) / 2, y + 0.12, text, ha="center", va="bottom", fontsize=FONT - 1)


def _caption(ax: Axes, x: float, y: float, text: str) -> None:
    ax.text(x, y - 0.15, text, ha="center", va="top", fontsize=FONT)


def _finish(ax: Axes, title: str, right: float, top: float = 2.4) -> Figure:
    ax.set_xlim(-0.3, right + 0.3)
    ax.set_ylim(-1.0, top)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=FONT + 2)
    return ax.figure


def _legend(ax: Axes, tp: int) -> None:
    handles = [Rectangle((0, 0), 1, 1, facecolor=rank_colour(r)) for r in range(tp)]
    handles.append(Rectangle((0, 0), 1, 1, facecolor=WHOLE))
    ax.legend(handles, [f"rank {r}" for r in range(tp)] + ["every rank"], loc="upper left",
              fontsize=FONT, ncol=tp + 1, frameon=False, bbox_to_anchor=(0.0, 1.02))


def _pipeline_end(ax: Axes, x: float, tp: int, out_name: str) -> float:
    """Partial sums, g, the summed output; returns the right edge."""
    _partials(ax, x, 0.2, 1.0, 1.2, tp, "Zᵢ")
    _caption(ax, x + 0.5, 0.2 - 0.08 * (tp - 1), "partial sums\n[b·s, h] each")
    x += 1.0 + 0.08 * (tp - 1)
    _operator(ax, x + 0.45, 0.8, "g")
    _arrow(ax, x, x + 0.23, 0.8)
    _arrow(ax, x + 0.67, x + 0.9, 0.8)
    _blocks(ax, x + 0.9, 0.2, 1.0, 1.2, [None], names=[out_name])
    _caption(ax, x + 1.4, 0.2, "all-reduced\n[b·s, h]")
    return x + 1.9


def draw_mlp_split(tp: int = 2, ax: Axes | None = None) -> Figure:
    """Figure 3a: Z = GeLU(X·A)·B with A split by columns and B by rows over ``tp`` ranks."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.2))
    ranks = list(range(tp))
    _blocks(ax, 0, 0.2, 1.0, 1.2, [None], names=["X"])
    _caption(ax, 0.5, 0.2, "input\n[b·s, h]")
    _operator(ax, 1.45, 0.8, "f")
    _arrow(ax, 1.0, 1.23, 0.8)
    _arrow(ax, 1.67, 1.9, 0.8)
    _blocks(ax, 1.9, 0.3, 2.0, 1.0, ranks, "cols", [_sub("A", r) for r in ranks])
    _caption(ax, 2.9, 0.3, "A [h, 4h]\nsplit by columns")
    _arrow(ax, 3.9, 3.9 + TEXT_GAP, 0.8, "GeLU(X·Aᵢ)")
    x = 3.9 + TEXT_GAP
    _blocks(ax, x, 0.2, 2.0, 1.2, ranks, "cols", [_sub("Y", r) for r in ranks])
    _caption(ax, x + 1.0, 0.2, "Y = GeLU(X·A)\n[b·s, 4h/t] per rank")
    _arrow(ax, x + 2.0, x + 2.0 + GAP, 0.8)
    x += 2.0 + GAP
    _blocks(ax, x, -0.2, 1.0, 2.0, ranks, "rows", [_sub("B", r) for r in ranks])
    _caption(ax, x + 0.5, -0.2, "B [4h, h]\nsplit by rows")
    _arrow(ax, x + 1.0, x + 1.0 + TEXT_GAP, 0.8, "Yᵢ·Bᵢ")
    right = _pipeline_end(ax, x + 1.0 + TEXT_GAP, tp, "Z")
    _legend(ax, tp)
    return _finish(ax, f"MLP split over t = {tp} ranks (1909.08053 Figure 3a)", right)


def head_owners(heads: int, tp: int) -> list[int]:
    """The tp rank that computes each head: contiguous groups of heads/tp."""
    return [i // (heads // tp) for i in range(heads)]


def draw_attention_split(tp: int = 2, heads: int = 4, ax: Axes | None = None) -> Figure:
    """Figure 3b: Q, K, V projections split by heads, attention per head, output B by rows."""
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.2))
    owners = head_owners(heads, tp)
    _blocks(ax, 0, 0.2, 1.0, 1.2, [None], names=["X"])
    _caption(ax, 0.5, 0.2, "input\n[b·s, h]")
    _operator(ax, 1.45, 0.8, "f")
    _arrow(ax, 1.0, 1.23, 0.8)
    _arrow(ax, 1.67, 1.9, 0.8)
    for k, name in enumerate("QKV"):
        _blocks(ax, 1.9 + 1.1 * k, 0.3, 1.0, 1.0, owners, "cols", [f"{i}" for i in range(heads)])
        ax.text(1.9 + 1.1 * k + 0.5, 1.35, f"W_{name}", ha="center", va="bottom", fontsize=FONT)
    _caption(ax, 3.45, 0.3, "[h, h] each, one column block per head\nhead i on rank i·t/heads")
    x = 1.9 + 3.3
    _arrow(ax, x, x + 1.4, 0.8, "softmax(QKᵀ/√d)V\nper head")
    x += 1.4
    _blocks(ax, x, 0.2, 1.0, 1.2, owners, "cols", [f"{i}" for i in range(heads)])
    _caption(ax, x + 0.5, 0.2, "heads' outputs\n[b·s, h/t] per rank")
    _arrow(ax, x + 1.0, x + 1.0 + GAP, 0.8)
    x += 1.0 + GAP
    _blocks(ax, x, -0.2, 1.0, 2.0, owners, "rows", [_sub("B", i) for i in range(heads)])
    _caption(ax, x + 0.5, -0.2, "B [h, h]\nsplit by rows")
    _arrow(ax, x + 1.0, x + 1.0 + GAP, 0.8)
    right = _pipeline_end(ax, x + 1.0 + GAP, tp, "Z")
    _legend(ax, tp)
    return _finish(ax, f"Self-attention, {heads} heads over t = {tp} ranks "
                       "(1909.08053 Figure 3b)", right)


def draw_qkv_layout(heads: int = 4, tp: int = 2, ax: Axes | None = None) -> Figure:
    """The 3h output rows of the fused qkv weight, coloured by the rank whose head they belong
    to, in Hugging Face's order (q | k | v) and in ours (per head); black bars: where a split
    into tp equal contiguous parts cuts."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.2))
    owners = head_owners(heads, tp)
    hf = [(kind, i) for kind in "qkv" for i in range(heads)]
    ours = [(kind, i) for i in range(heads) for kind in "qkv"]
    width = 3 * heads
    for y, order, label in ((1.2, hf, "Hugging Face c_attn: q | k | v"),
                            (0.0, ours, "megatron-edu qkv: per head")):
        _blocks(ax, 0, y, width, 0.8, [owners[i] for _, i in order], "cols",
                [f"{kind}{i}" for kind, i in order])
        ax.text(-0.2, y + 0.4, label, ha="right", va="center", fontsize=FONT)
        for r in range(1, tp):
            ax.plot([r * width / tp] * 2, [y - 0.1, y + 0.9], color="black", lw=3)
    ax.set_xlim(-6.5, width + 0.3)
    ax.set_ylim(-0.3, 2.3)
    ax.axis("off")
    ax.set_title(f"Rows of the fused qkv weight, {heads} heads, split into t = {tp} parts "
                 "(colour: the rank that needs them)", fontsize=FONT + 2)
    return ax.figure


def draw_embedding_split(vocab_size: int, padded_vocab: int, tp: int,
                         ax: Axes | None = None) -> Figure:
    """The embedding table [V_padded, h] cut into tp contiguous vocabulary ranges (top), and the
    logits [b·s, V_padded/t] each rank computes with its range (bottom); padding hatched."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 3.0))
    width, rows = 10.0, padded_vocab // tp
    scale = width / padded_vocab
    for y, label in ((1.4, "embedding table\n[V_padded, h]ᵀ"), (0.0, "logits\n[b·s, V_padded/t]")):
        _blocks(ax, 0, y, width, 0.8, list(range(tp)), "cols",
                [f"ids {r * rows}–{(r + 1) * rows - 1}" for r in range(tp)])
        pad = padded_vocab - vocab_size
        if pad:
            ax.add_patch(Rectangle((vocab_size * scale, y), pad * scale, 0.8, fill=False,
                                   hatch="///", edgecolor="black", lw=0))
        ax.text(-0.2, y + 0.4, label, ha="right", va="center", fontsize=FONT)
    if padded_vocab > vocab_size:
        ax.text(width, 2.3, f"hatched: padding {vocab_size}–{padded_vocab - 1} (zero rows; "
                f"logits −inf)", ha="right", va="bottom", fontsize=FONT)
    ax.text(width / 2, -0.25, "per token, 3 numbers cross ranks: max, Σ exp, the target's logit "
            "— never the V logits", ha="center", va="top", fontsize=FONT)
    ax.set_xlim(-3.0, width + 0.3)
    ax.set_ylim(-0.7, 2.7)
    ax.axis("off")
    ax.set_title(f"Vocabulary {vocab_size} padded to {padded_vocab}, split over t = {tp} ranks",
                 fontsize=FONT + 2)
    return ax.figure


def draw_params_per_rank(configs: dict[str, GPTConfig], tps: Sequence[int] = (1, 2, 4, 8),
                         device_gb: float = 32.0) -> Figure:
    """Parameters one tensor-parallel rank holds against t, one panel per model; dashes mark the
    ideal P/t, the dotted line how many parameters' training state (16 bytes each with
    mixed-precision Adam) fits a ``device_gb`` GPU, activations aside."""
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.4), squeeze=False)
    fits = device_gb * 1e9 / BYTES_PER_PARAM / 1e9
    for k, (ax, (name, config)) in enumerate(zip(axes[0], configs.items(), strict=True)):
        held = [config.num_parameters(t) / 1e9 for t in tps]
        whole = held[0] * tps[0]
        xs = range(len(tps))
        ax.bar(xs, held, 0.6, color=plt.get_cmap("Set2")(k))
        ax.hlines([whole / t for t in tps], [x - 0.3 for x in xs], [x + 0.3 for x in xs],
                  colors="black", linestyles="dashed", lw=1)
        ax.axhline(fits, color="grey", linestyle="dotted")
        for x, n in zip(xs, held, strict=True):
            ax.text(x, n, f"{n:.3g} B\n{n * BYTES_PER_PARAM:.3g} GB", ha="center", va="bottom",
                    fontsize=FONT - 1)
        ax.set_xticks(list(xs), [f"t = {t}" for t in tps])
        ax.set_ylim(0, max(max(held), fits) * 1.3)
        ax.set_title(name, fontsize=FONT + 2)
    axes[0][0].set_ylabel("parameters per rank (billions)")
    fig.suptitle(f"One tensor-parallel rank's parameters (dashes: P/t; dotted: what fits "
                 f"{device_gb:g} GB with Adam)", fontsize=FONT + 2)
    fig.tight_layout()
    return fig


PICTURES = ("mlp", "attention", "qkv layout", "embedding")


def show_split(picture: str, tp: int, heads: int = 8) -> None:
    """Draw one of ``PICTURES`` for ``tp`` ranks (attention pictures with ``heads`` heads)."""
    if picture == "mlp":
        draw_mlp_split(tp)
    elif picture == "attention":
        draw_attention_split(tp, heads)
    elif picture == "qkv layout":
        draw_qkv_layout(heads, tp)
    elif picture == "embedding":
        config = GPTConfig(vocab_size=100, make_vocab_size_divisible_by=8)
        draw_embedding_split(config.vocab_size, config.padded_vocab(tp), tp)
    else:
        raise ValueError(f"unknown picture {picture!r}; choose from {PICTURES}")
    plt.show()


def explore() -> None:
    """The ipywidgets explorer: which picture, how many ranks, how many heads."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    widgets.interact(show_split,
                     picture=widgets.Dropdown(options=PICTURES, value="mlp"),
                     tp=widgets.SelectionSlider(options=[1, 2, 4, 8], value=2, description="t"),
                     heads=widgets.SelectionSlider(options=[8, 16], value=8))
