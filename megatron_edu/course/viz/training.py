"""The loss curve of a training run (``OUT/log.jsonl``) against the no-learning baseline."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

__all__ = ["draw_loss_curve", "draw_resumed_runs"]


def draw_loss_curve(records: list[dict], unigram_entropy: float | None = None,
                    path: str | Path | None = None, ax=None):
    """Training loss per step, validation loss at its steps, and the unigram entropy: the loss
    of a model that knows only token frequencies. Saved to ``path`` when given."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, label="training loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, color="grey", ls="--", label="unigram entropy (no learning)")
    ax.set(xlabel="optimizer step", ylabel="cross entropy (nats)", title="GPT training")
    ax.legend()
    if path is not None:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig


def draw_resumed_runs(records: list[dict], resumed: dict[str, list[dict]], resume_step: int,
                      before: int = 10, ax=None):
    """The training loss of the run that saved the checkpoint, from ``before`` steps ahead of
    ``resume_step`` on, and on top of it each run resumed from that checkpoint (by label, e.g.
    another tp × pp layout): a correct resume continues the same curve."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(9, 3.5))
    first = resume_step - before
    saved = [(r["step"], r["loss"]) for r in records if "loss" in r and r["step"] >= first]
    ax.plot(*zip(*saved, strict=True), "k-", lw=1.5, label="the run that saved it")
    for (label, run), marker in zip(resumed.items(), "ox^sdv", strict=False):
        steps = [(r["step"], r["loss"]) for r in run if "loss" in r]
        ax.plot(*zip(*steps, strict=True), marker, ls="none", mfc="none", ms=8,
                label=f"resumed at {label}")
    ax.axvline(resume_step, color="grey", ls=":", label=f"checkpoint (step {resume_step})")
    ax.set(xlabel="optimizer step", ylabel="training loss (nats)",
           title="resuming from a checkpoint in another layout")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: the curve fills the axes
    fig.tight_layout()
    return fig
