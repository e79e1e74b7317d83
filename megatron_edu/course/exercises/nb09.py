"""Checkers of notebook 09, the end-to-end GPT: drawing the next token, and resuming a run in
another layout.

09.1  ``sample_next(logits, temperature, top_k, generator)``: the temperature and top-k draw of
      ``megatron_edu.generate.sample``, checked by its frequencies over thousands of draws;
09.2  on 2 ranks: build a PTD-P trainer at tp=1 × pp=2, load a checkpoint saved at tp=2 × pp=1
      by a tiny run made here, restore the data sampler, take two steps; their losses must be
      the ones the original layout takes. Each typical mistake (no load, a fresh sampler, the
      weights without the optimizer's moments, the checkpoint's layout instead of the new one)
      gives losses or a communication count of its own, which the hint names. Its reference
      is ``train``'s ``_resume`` (load the checkpoint, restore the sampler): the rest of
      ``train`` is the whole training loop, whose lines (``with trainer.gathered():``, ``for
      chunk in trainer.chunks:``) are the package's vocabulary, not this answer.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.generate import sample
from megatron_edu.train import _resume

__all__ = ["ResumeRun"]


# --- 09.1 temperature and top-k ------------------------------------------------------------------

# 12 logits in an order where the most likely tokens are not the first ids: 7, 2, 10, 4, ...
_LOGITS = torch.tensor([-1.0, -2.5, 2.5, -0.5, 1.0, -3.0, -2.0, 3.0, 0.0, -1.5, 2.0, 0.5])


def _draw(fn: Callable[..., Any], n: int, temperature: float, top_k: int | None,
          seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(n):
        token = fn(_LOGITS.clone(), temperature, top_k, generator)
        if isinstance(token, torch.Tensor) and token.numel() == 1:
            token = token.item()
        if isinstance(token, (np.integer, float)) and float(token).is_integer():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool):
            raise Hint(f"sample_next should return the token id as an int, got "
                       f"{type(token).__name__}: {token!r} (int(tensor) converts one)")
        if not 0 <= token < len(_LOGITS):
            raise Hint(f"you returned {token}, not a token id: there are {len(_LOGITS)} logits")
        draws.append(token)
    return draws


def _probabilities(temperature: float, top_k: int | None) -> torch.Tensor:
    logits = _LOGITS / temperature
    if top_k is not None:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)


def _distance(draws: list[int], probs: torch.Tensor) -> float:
    """Total variation distance between the draws' frequencies and ``probs``."""
    counts = Counter(draws)
    freq = torch.tensor([counts[i] / len(draws) for i in range(len(probs))])
    return 0.5 * (freq - probs).abs().sum().item()


@exercise("09.1", "the next token, drawn with temperature and top-k", reference=(sample,),
          marks=(r"topk\([^)]*\)\.values\[-1\]", r"softmax\(top-4logits/0\.5\)"))
def _sample_next(fn: Callable[..., Any]) -> str:
    first, again = _draw(fn, 40, 1.0, None, seed=5), _draw(fn, 40, 1.0, None, seed=5)
    if first != again:
        raise Hint("two generators seeded alike gave different tokens: draw with the generator "
                   "passed in (torch.multinomial(probs, 1, generator=generator)), so that one "
                   "seed gives one text on every layout")
    if len(set(_draw(fn, 200, 1.0, None))) == 1:
        raise Hint("every draw is the same token: that is greedy decoding (the argmax); draw "
                   "from softmax(logits / temperature) with torch.multinomial")
    top3 = set(_LOGITS.topk(3).indices.tolist())
    drawn = set(_draw(fn, 600, 1.0, 3))
    if not drawn <= top3:
        if drawn <= {0, 1, 2}:
            raise Hint(f"with top_k=3 you drew ids {sorted(drawn)}: positions within the top k, "
                       f"not token ids (the top 3 are {sorted(top3)}) — map the draw back "
                       f"through the indices that topk returns")
        raise Hint(f"with top_k=3 you drew {sorted(drawn - top3)}, not among the 3 most likely "
                   f"tokens {sorted(top3)}: set the other logits to -inf before the softmax")
    draws = _draw(fn, 3000, 0.5, 4)
    candidates = {
        "right": _probabilities(0.5, 4),
        "your draws follow softmax(logits) at temperature 1: the temperature has no effect — "
        "divide the logits by it before the softmax (dividing the probabilities changes "
        "nothing once they are normalised)": _probabilities(1.0, 4),
        "you multiplied the logits by the temperature: divide them (T < 1 sharpens the "
        "distribution, T > 1 flattens it)": _probabilities(2.0, 4),
    }
    distances = {name: _distance(draws, probs) for name, probs in candidates.items()}
    nearest = min(distances, key=distances.get)
    if nearest != "right" or distances["right"] > 0.05:
        raise Hint(nearest if nearest != "right" else
                   f"with temperature 0.5 and top_k=4 your draws' frequencies are "
                   f"{distances['right']:.2f} (total variation) from softmax(top-4 logits / "
                   f"0.5)")
    return ("the same tokens for the same seed, never outside the top k, and over 3000 draws "
            "at temperature 0.5 the frequencies of softmax(top-4 logits / 0.5)")


# --- 09.2 resume in another layout -------------------------------------------------------------

@dataclass(frozen=True)
class ResumeRun:
    """What the run that saved the checkpoint was: its model, data and optimisation."""

    config: Any                 # a megatron_edu.model.GPTConfig
    dataset: Any                # a megatron_edu.data.TokenDataset
    global_batch: int           # B, sequences per step
    micro_batch: int            # b, sequences per microbatch
    seed: int                   # the data sampler's seed
    lr: float                   # a constant learning rate
    saved_at: int               # the step the checkpoint holds


_ORIGINAL = (2, 1)              # tp, pp of the run that saved
_RESUMED = (1, 2)               # tp, pp the learner resumes at
RESUME_TIMEOUT = 60.0           # seconds for the learner's two steps (a deadlock: sooner)


def _make_run(folder: Path) -> ResumeRun:
    from megatron_edu.data import TokenDataset
    from megatron_edu.model import GPTConfig

    config = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=32, num_heads=4,
                       dropout=0.0, seed=7)
    tokens = np.random.default_rng(0).integers(0, 100, size=48 * 16 + 1).astype(np.uint16)
    np.save(folder / "tokens.npy", tokens)
    return ResumeRun(config, TokenDataset(folder / "tokens.npy", 16), global_batch=8,
                     micro_batch=2, seed=3, lr=3e-3, saved_at=3)


def _trainer(run: ResumeRun, tp: int, pp: int):
    from megatron_edu.grid import Layout, ParallelGrid
    from megatron_edu.pipeline import PipelineConfig
    from megatron_edu.ptdp import PTDP, PTDPOptions

    grid = ParallelGrid(Layout(tp, pp))  # dp = 1: tp · pp fills the ranks
    pipeline = PipelineConfig(microbatch=run.micro_batch,
                              num_microbatches=run.global_batch // run.micro_batch)
    return PTDP(run.config, grid, PTDPOptions(lr=run.lr), pipeline=pipeline)


def _sampler(run: ResumeRun, trainer):
    from megatron_edu.data import BatchSampler

    grid = trainer.grid
    return BatchSampler(len(run.dataset), run.global_batch, grid.dp_rank, grid.dp, run.seed)


def _steps(run: ResumeRun, trainer, sampler, n: int) -> list[float]:
    return [trainer.train_step(*run.dataset.batch(next(sampler)), run.lr).loss
            for _ in range(n)]


def _original_run(run: ResumeRun, folder: Path) -> dict[str, list[float]]:
    """On every rank, at the original layout: train, save, continue; and the losses that each
    typical mistake would give instead (from the same checkpoint)."""
    from megatron_edu.checkpoint import (
        load_checkpoint,
        load_model_chunks,
        read_metadata,
        save_checkpoint,
    )

    trainer = _trainer(run, *_ORIGINAL)
    sampler = _sampler(run, trainer)
    _steps(run, trainer, sampler, run.saved_at)
    path = save_checkpoint(folder, run.saved_at, trainer, {"sampler": sampler.state_dict()})
    losses = {"right": _steps(run, trainer, sampler, 2)}

    def resumed(load: str, restore_sampler: bool) -> list[float]:
        trainer = _trainer(run, *_ORIGINAL)
        if load == "all":
            load_checkpoint(path, trainer)
        elif load == "weights":
            load_model_chunks(path, trainer.chunks, trainer.grid)
        sampler = _sampler(run, trainer)
        if restore_sampler:
            sampler.load_state_dict(read_metadata(path)["state"]["sampler"])
        return _steps(run, trainer, sampler, 2)

    losses["fresh sampler"] = resumed("all", restore_sampler=False)
    losses["not loaded"] = resumed("none", restore_sampler=True)
    losses["not loaded, fresh sampler"] = resumed("none", restore_sampler=False)
    losses["weights only"] = resumed("weights", restore_sampler=True)
    return losses


def _learner_rank(fn: Callable[..., Any], checkpoint: Path, tp: int, pp: int,
                  run: ResumeRun) -> tuple[Any, int, int]:
    """The learner's function on this rank; its result and the communication it made."""
    with comm.record() as log:
        losses = fn(checkpoint, tp, pp, run)
    if isinstance(losses, (list, tuple)):
        losses = [x.item() if isinstance(x, torch.Tensor) else x for x in losses]
    return losses, log.count("all_reduce", group="tp"), log.count("send")


_MISTAKES = {
    "fresh sampler": "your steps read the batches of steps 1 and 2, not {next}: restore the data "
                     "sampler's position — sampler.load_state_dict(meta['state']['sampler']), "
                     "meta being what load_checkpoint returns",
    "not loaded": "your losses are those of the untrained model: build the trainer, then "
                  "load_checkpoint(checkpoint, trainer) — it fills every rank's new shards",
    "not loaded, fresh sampler": "your losses are those of the untrained model on the batches "
                                 "of steps 1 and 2: load_checkpoint(checkpoint, trainer) after "
                                 "building the trainer, then restore the data sampler from the "
                                 "metadata it returns (meta['state']['sampler'])",
    "weights only": "your first step is right and the second is not: the weights were loaded "
                    "without the AdamW moments (and step count) — load_checkpoint restores both, "
                    "load_model_chunks only the weights",
}


def _equal(a: list[float], b: list[float], atol: float = 1e-4) -> bool:
    return all(abs(x - y) <= atol for x, y in zip(a, b, strict=True))


@functools.cache
def _reference() -> tuple[ResumeRun, Path, dict[str, list[float]]]:
    """The tiny run, its checkpoint and its losses: made once per process (deterministic), in a
    folder removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix="megatron_edu_ex09_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    run = _make_run(folder)
    reference = on_ranks(2, _original_run, run, folder, timeout=120)[0]
    return run, folder / "checkpoints" / f"step_{run.saved_at:06d}", reference


@exercise("09.2", "resume a run in another layout", reference=(_resume,),
          marks=(r"\.load_state_dict\(meta\[.state.\]\[.sampler.\]\)",))
def _resume_in_another_layout(fn: Callable[..., Any]) -> str:
    run, checkpoint, reference = _reference()
    results = on_ranks(2, _learner_rank, fn, checkpoint, *_RESUMED, run,
                       timeout=RESUME_TIMEOUT, may_deadlock=True)
    losses, tp_all_reduces, sends = results[0]
    if not (isinstance(losses, list) and len(losses) == 2
            and all(isinstance(x, float) and math.isfinite(x) for x in losses)):
        raise Hint(f"return the losses of the two steps as a list of two floats "
                   f"(StepResult.loss), got {losses!r}")
    if any(r[0] != losses for r in results):
        raise Hint(f"the ranks return different losses ({[r[0] for r in results]}): return "
                   f"StepResult.loss, which every rank holds alike")
    if tp_all_reduces or not sends:
        raise Hint(f"your steps made {tp_all_reduces} tensor-parallel all-reduces and {sends} "
                   f"pipeline sends: that is not tp=1 × pp=2 (no tp all-reduce, activations "
                   f"sent between 2 stages) — build the grid with the layout "
                   f"you are given, not the checkpoint's tp=2 × pp=1")
    right = reference["right"]
    if _equal(losses, right):
        return (f"at tp=1 × pp=2 your steps {run.saved_at + 1} and {run.saved_at + 2} give the "
                f"losses of the tp=2 × pp=1 run that saved the checkpoint, within 1e-4: weights, "
                f"AdamW moments and data position all carried over")
    for mistake, hint in _MISTAKES.items():
        if _equal(losses, reference[mistake]):
            raise Hint(hint.format(next=f"{run.saved_at + 1} and {run.saved_at + 2}"))
    raise Hint(f"your losses {losses[0]:.5f}, {losses[1]:.5f} differ from the original "
               f"layout's {right[0]:.5f}, {right[1]:.5f}: the same model config, the global "
               f"batch cut into microbatches of run.micro_batch, the learning rate run.lr?")
