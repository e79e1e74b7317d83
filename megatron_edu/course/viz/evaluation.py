"""Where a text's loss sits: per-token losses by the word piece they predict (1909.08053 §5.2).

A perplexity exponentiates one summed loss L divided by a count — of BPE tokens or of words.
``draw_token_losses`` draws the losses token by token, coloured by whether the token begins a
word or continues one, with the two means L / (N − 1) and L / (W − 1) that the per-token and the
per-word perplexities exponentiate.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["SPACE", "WORD_START", "WORD_REST", "piece_kinds", "draw_token_losses"]

SPACE, WORD_START, WORD_REST = 0, 1, 2          # what a BPE piece is, within the text
KIND_NAMES = {SPACE: "spaces and line breaks", WORD_START: "a word's first piece",
              WORD_REST: "a word's later pieces"}


def piece_kinds(pieces: Sequence[str]) -> np.ndarray:
    """[len(pieces)] int: SPACE for a piece of whitespace only, WORD_START for one whose first
    visible character begins a word (the text's first, or one after whitespace), WORD_REST for
    one that continues a word ("ist" of " l" + "ist", the "." after "items")."""
    kinds, before = [], " "                     # the character before the piece, in the text
    for piece in pieces:
        visible = piece.lstrip()
        if not visible:
            kinds.append(SPACE)
        else:
            starts = piece != visible or before.isspace()
            kinds.append(WORD_START if starts else WORD_REST)
        before = piece[-1:] or before
    return np.asarray(kinds, dtype=np.int64)


def draw_token_losses(losses: Sequence[float], kinds: Sequence[int], words: int, ax=None):
    """Per-token losses (nats) of targets 1 … N − 1, as bars coloured by ``kinds`` (of those
    targets), and the two means of their sum L: per token, L / (N − 1), and per word,
    L / (W − 1) for ``words`` = W — the logarithms of the two perplexities."""
    losses, kinds = np.asarray(losses, dtype=float), np.asarray(kinds)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(10, 3.5))
    total, n = losses.sum(), len(losses) + 1
    for kind, color in ((WORD_START, "tab:blue"), (WORD_REST, "tab:orange"), (SPACE, "0.7")):
        at = np.flatnonzero(kinds == kind) + 1
        ax.bar(at, losses[at - 1], width=0.8, color=color, label=KIND_NAMES[kind])
    ax.axhline(total / (n - 1), color="k", ls="--",
               label=f"per token: L / (N − 1) = {total / (n - 1):.2f}")
    ax.axhline(total / (words - 1), color="tab:red", ls="-",
               label=f"per word: L / (W − 1) = {total / (words - 1):.2f}")
    ax.set(xlabel="target token", ylabel="loss (nats)", xlim=(0, n),
           title=f"the same L = {total:.1f} nats, divided by N − 1 = {n - 1} tokens or by "
                 f"W − 1 = {words - 1} words")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig
