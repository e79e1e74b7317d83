"""Checkers for notebook 07, PTD-P (2104.04473 §3, §4.1).

07.1 ★   the rank grid: which global ranks form each tp, dp, pp and embedding group;
07.2 ★★  the tied embedding: sum the two copies' gradients over the embedding group;
07.3 ★★★ predict the bytes a PTD-P step sends, by purpose, before measuring them.

07.3 measures real ``PTDP`` steps on 4 and 8 gloo ranks (once per process: the measurement does
not depend on the learner's answer) and compares the prediction purpose by purpose; where the
prediction matches a typical mistake (no ring factor, no scatter/gather, the vocabulary without
its padding, …) the hint names it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.model import GPTConfig
from megatron_edu.perf import parameters_per_rank, wire_bytes_by_group
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, Parallelism, PTDPOptions

__all__ = ["measured_bytes", "reference_bytes"]

TIMEOUT = 20.0  # seconds: a backstop; a deadlock is detected sooner (on_ranks)
KINDS = ("tp", "dp", "pp", "embedding")

# --- 07.1 ★ the rank grid ------------------------------------------------------------------------

GRID_LAYOUTS = ((2, 2, 2), (8, 4, 2), (1, 4, 2), (4, 1, 3), (2, 3, 1))  # (tp, pp, dp)


def _groups(layout: Layout) -> dict[str, list[list[int]]]:
    return {kind: getattr(layout, f"{kind}_groups")() for kind in KINDS}


def _as_set(groups: Any) -> set[tuple[int, ...]] | None:
    try:
        return {tuple(sorted(int(r) for r in g)) for g in groups}
    except (TypeError, ValueError):
        return None


def _shown(groups: list[list[int]], most: int = 4) -> str:
    text = ", ".join(str(list(g)) for g in groups[:most])
    return f"[{text}{', …' if len(groups) > most else ''}]"


@exercise("07.1", "the rank grid: tp, dp, pp and embedding groups",
          reference=(Layout.tp_groups, Layout.dp_groups, Layout.pp_groups,
                     Layout.embedding_groups),
          marks=(r"\w+\*dp\*tp\+\w+\*tp\+\w+",  # the numbering, as code
                 r"\{\w+\[0\],\w+\[-1\]\}"))  # a pp group's two ends
def _rank_groups(fn: Callable) -> str:
    for tp, pp, dp in GRID_LAYOUTS:
        layout = Layout(tp=tp, pp=pp, dp=dp)
        got, want = fn(tp, pp, dp), _groups(layout)
        name = f"tp={tp}, pp={pp}, dp={dp}"
        if not isinstance(got, dict) or set(KINDS) - set(got):
            missing = sorted(set(KINDS) - set(got)) if isinstance(got, dict) else list(KINDS)
            raise Hint(f"return a dict with the keys {', '.join(KINDS)} (missing: "
                       f"{', '.join(missing)}), each a list of groups of global ranks")
        for kind in KINDS:
            _check_groups(kind, _as_set(got[kind]), want, name, layout)
    return (f"{len(GRID_LAYOUTS)} layouts, up to {max(t * p * d for t, p, d in GRID_LAYOUTS)} "
            "ranks: every group right, tp fastest (inside a node), then dp, then pp")


def _check_groups(kind: str, got: set | None, want: dict, name: str, layout: Layout) -> None:
    expected = _as_set(want[kind])
    if got == expected:
        return
    if got is None:
        raise Hint(f"{name}: your {kind} groups should be a list of lists of global ranks")
    if kind == "tp":
        raise Hint(f"{name}: your tp groups are {_shown(sorted(got))}, expected "
                   f"{_shown(want['tp'])}: tp is the fastest coordinate, so each tensor-parallel "
                   "group is tp consecutive ranks — the GPUs of one node")
    for other in ("dp", "pp"):
        if other != kind and got == _as_set(want[other]):
            raise Hint(f"{name}: your {kind} groups are the {other} groups. Megatron numbers "
                       "ranks tp fastest, then dp, then pp: rank = pp_rank·(dp·tp) + "
                       "dp_rank·tp + tp_rank")
    if kind == "embedding" and layout.pp == 1:
        raise Hint(f"{name}: with pp = 1 the first stage is also the last, so each embedding "
                   f"group is a single rank: {_shown(want['embedding'])}")
    if kind == "embedding":
        raise Hint(f"{name}: your embedding groups are {_shown(sorted(got))}, expected "
                   f"{_shown(want['embedding'])}: the first and the last stage of each "
                   "pipeline group (they hold the two copies of the tied word embedding)")
    raise Hint(f"{name}: your {kind} groups are {_shown(sorted(got))}, expected "
               f"{_shown(want[kind])} (rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank)")


# --- 07.2 ★★ the tied embedding ------------------------------------------------------------------

TIED_LAYOUTS = ((1, 2, 2), (1, 4, 1))  # (tp, pp, dp), 4 ranks each
TIED_SHAPE = (8, 4)  # [V/t, h]: this rank's rows of E


def _tied_grad(rank: int) -> torch.Tensor:
    return torch.randn(TIED_SHAPE, generator=torch.Generator().manual_seed(rank))


def _run_tied(fn: Callable, tp: int, pp: int, dp: int) -> dict[str, Any]:
    grid = ParallelGrid(tp=tp, pp=pp, dp=dp)
    holds = grid.pp_rank in (0, grid.pp - 1)  # the first and the last stage hold a copy of E
    grad = _tied_grad(grid.rank) if holds else None
    with comm.record() as log:
        out = fn(None if grad is None else grad.clone(), grid)
    return dict(stage=grid.pp_rank, holds=holds, out=out, log=log)


@exercise("07.2", "the tied embedding: sum the two copies' gradients",
          reference=(PTDP._sum_tied_embedding_grads,),
          marks=(r"all_reduce_?\(\w+,\w+\.embedding_group",  # the answer's one call
                 r"(?:summed|gradients?)overthe\**embeddinggroup"))  # ... said in words
def _tied_embedding(fn: Callable) -> str:
    for tp, pp, dp in TIED_LAYOUTS:
        layout = Layout(tp=tp, pp=pp, dp=dp)
        results = on_ranks(layout.world_size, _run_tied, fn, tp, pp, dp, timeout=TIMEOUT,
                           may_deadlock=True, deadlock_advice="Here both copies of E (first "
                           "and last stage) must join the all-reduce, and no rank may wait for "
                           "a middle stage, which holds no copy: sum over grid.embedding_group "
                           "on the first and the last stage, and nowhere else")
        for rank, r in enumerate(results):
            _check_tied(r, rank, layout)
    return ("pp = 2 × dp = 2 and pp = 4: the first and the last stage of each pipeline hold "
            "the sum of the two parts (the serial ∇E), with one all-reduce over the embedding "
            "group; the middle stages take no part")


def _group_of(rank: int, groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if rank in g)


def _check_tied(r: dict[str, Any], rank: int, layout: Layout) -> None:
    name = f"tp={layout.tp}, pp={layout.pp}, dp={layout.dp}: rank {rank} (stage {r['stage']})"
    out = r["out"]
    if not r["holds"]:
        if out is not None:
            raise Hint(f"{name} holds no copy of E (a middle stage): return None there")
        if r["log"].events:
            raise Hint(f"{name} holds no copy of E but took part in a collective: only the "
                       "first and the last stage sum their gradients")
        return
    if not isinstance(out, torch.Tensor) or out.shape != TIED_SHAPE:
        raise Hint(f"{name} holds a copy of E: return its summed gradient, a tensor of shape "
                   f"{TIED_SHAPE} like the one it was given (got {type(out).__name__})")
    sums = {kind: sum(_tied_grad(q) for q in _group_of(rank, getattr(layout, f"{kind}_groups")())
                      if q in _holders(layout))
            for kind in ("embedding", "dp")}
    want = sums["embedding"]
    if torch.allclose(out, want, atol=1e-5):
        groups = sorted({e.group for e in r["log"].events})
        if groups and groups != ["embedding"]:
            raise Hint(f"{name}: the values are right, but you summed over the "
                       f"{' and '.join(groups)} group: here it holds the same ranks, but with "
                       "more stages a pipeline group holds the middle ones too, which have no "
                       "copy. Use grid.embedding_group")
        if r["log"].count("all_reduce", "embedding") != 1 or len(r["log"].events) != 1:
            raise Hint(f"{name}: the values are right, but the sum should be one all-reduce "
                       "over grid.embedding_group through megatron_edu.comm (counted: "
                       f"{len(r['log'].events)} collectives)")
        return
    if torch.allclose(out, _tied_grad(rank), atol=1e-5):
        raise Hint(f"{name} kept only its own part of ∇E: sum it with the other copy's over "
                   "grid.embedding_group (an all-reduce) — ∇E = ∇E(lookup, first stage) + "
                   "∇E(output layer, last stage)")
    if torch.allclose(out, want / 2, atol=1e-5):
        raise Hint(f"{name} holds half the sum: one matrix used twice has the SUM of the two "
                   "uses' gradients, not their mean")
    if layout.dp > 1 and torch.allclose(out, sums["dp"], atol=1e-5):
        raise Hint(f"{name} summed over the data-parallel group: those are the same stage of "
                   "other replicas. The two copies are the first and the last stage of one "
                   "pipeline: grid.embedding_group")
    raise Hint(f"{name}: the gradient differs from the sum of the two copies' parts by up to "
               f"{(out - want).abs().max().item():.3g}")


def _holders(layout: Layout) -> set[int]:
    return {r for g in layout.embedding_groups() for r in g}


# --- 07.3 ★★★ the bytes of a PTD-P step ----------------------------------------------------------

BYTES_CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=4, hidden=32, num_heads=4,
                         dropout=0.0)
BYTES_BATCH, BYTES_MICROBATCHES = 16, 2
BYTES_LAYOUTS = ((2, 2, 2), (1, 1, 4))  # (tp, pp, dp): every purpose; dp's ring factor at d = 4
PREDICTED = ("tp", "pp", "dp", "embedding")  # the scalars (loss, token count, norm) are left out
TOLERANCE = 0.01


def _measure_step(tp: int, pp: int, dp: int) -> comm.CommLog:
    grid = ParallelGrid(Layout(tp, pp, dp))
    trainer = PTDP(BYTES_CONFIG, grid, PTDPOptions(),
                   pipeline=PipelineConfig(num_microbatches=BYTES_MICROBATCHES))
    tokens = torch.randint(0, BYTES_CONFIG.vocab_size, (BYTES_BATCH, BYTES_CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    ids, labels = tokens[:, :-1].chunk(dp)[grid.dp_rank], tokens[:, 1:].chunk(dp)[grid.dp_rank]
    with comm.record() as log:
        trainer.train_step(ids, labels, lr=1e-3)
    return log


@functools.cache
def measured_bytes(tp: int, pp: int, dp: int) -> dict[str, int]:
    """Bytes all ranks put on the wire in one PTD-P step of BYTES_CONFIG, by purpose."""
    logs = on_ranks(tp * pp * dp, _measure_step, tp, pp, dp, timeout=300)
    return wire_bytes_by_group(logs)


def reference_bytes(config: GPTConfig, tp: int, pp: int, dp: int, batch: int, microbatches: int,
                    mistake: str = "") -> dict[str, float]:
    """The papers' counts, as this package communicates; ``mistake`` applies a typical error."""
    t, p, d, m = tp, pp, dp, microbatches
    b, s, h, layers = batch // (d * m), config.seq_len, config.hidden, config.num_layers
    act = 4 * b * s * h                                      # one fp32 [b, s, h]
    ring = (lambda g: 1.0) if mistake == "ring" else (lambda g: 2 * (g - 1) / g)
    half = (lambda g: 1.0 if g > 1 else 0.0) if mistake == "ring" else (lambda g: (g - 1) / g)
    per = {"per step": 1 / m}.get(mistake, 1.0)
    four = 6 if mistake == "recompute" else 4
    stage_layers = layers if mistake == "all layers" else layers // p
    sg = mistake != "no scatter/gather"
    extras = mistake != "paper only"
    if mistake == "no padding":  # the vocabulary as given, rounded only to a multiple of t
        config = replace(config, make_vocab_size_divisible_by=1)
    vocab = config.padded_vocab(t)
    ranks = t * p * d
    tp_bytes = ranks * stage_layers * four * m * ring(t) * act                # f and g
    if extras:
        tp_bytes += 2 * d * t * m * ring(t) * act          # embedding's g, output layer's f
        tp_bytes += d * t * m * (2 * ring(t) * 4 * b * s + half(t) * t * 4 * b * s)  # the loss
        if sg:
            tp_bytes += 2 * (p - 1) * d * t * m * half(t) * act      # §4.1's all-gathers
    pp_bytes = 2 * (p - 1) * d * m * act * (1 if sg else t)
    pp_bytes *= {"one direction": 0.5, "send and recv": 2}.get(mistake, 1)
    embedding = 2 * d * t * ring(2) * 4 * vocab * h // t if p > 1 else 0
    embedding *= 0.5 if mistake == "one copy" else 1
    split = Parallelism(Layout(tp=t, pp=p))
    dp_bytes = d * t * sum(ring(d) * 4 * parameters_per_rank(config, split, stage)
                           for stage in range(p)) if d > 1 else 0
    dp_bytes *= 1 / d if mistake == "one replica" else 1
    return dict(tp=tp_bytes * per, pp=pp_bytes * per, dp=dp_bytes, embedding=embedding)


MISTAKES = {
    "ring": "you counted the size of each buffer, not what a rank sends: a ring all-reduce over "
            "g ranks sends 2(g − 1)/g of the buffer from every rank, an all-gather (g − 1)/g of "
            "its output",
    "per step": "you counted once per step: the layers' collectives (and the stage-to-stage "
                "messages) happen for each of the m microbatches of b = B/(dp·m) sequences",
    "recompute": "6 all-reduces per layer is Megatron's count with its (reentrant) activation "
                 "recomputation; PTDP does not recompute here: 2 forward + 2 backward per layer",
    "all layers": "each pipeline stage runs only its l/pp layers",
    "no scatter/gather": "with §4.1's scatter/gather each of the t ranks of a stage sends only "
                         "1/t of the activation (and the next stage all-gathers it over tp)",
    "paper only": "besides 4 all-reduces per layer, the tp group all-reduces in the embedding "
                  "(forward, first stage) and before the output layer (backward, last stage), "
                  "and all-gathers §4.1's slices at each stage boundary, in both directions",
    "no padding": "the embedding holds the vocabulary padded to a multiple of 128·tp "
                  "(config.padded_vocab(tp)), and its gradient is that size",
    "one direction": "activations go forward and their gradients come back: two messages per "
                     "microbatch per stage boundary",
    "send and recv": "a message's bytes are counted once, at the sender (a receive is the same "
                     "bytes)",
    "one copy": "both copies of E — on the first and the last stage of every pipeline, on each "
                "tp rank — send their part in the all-reduce",
    "one replica": "every one of the dp replicas all-reduces its gradients: sum over all ranks",
}

PURPOSE_HELP = {
    "tp": "on every rank: 4 all-reduces of [b, s, h] per layer per microbatch, the embedding's "
          "and the output layer's, §4.1's all-gathers, and the loss's small [b, s] ones",
    "pp": "one [b, s, h] activation per microbatch across each of the pp − 1 stage boundaries, "
          "and its gradient back, 1/t of it from each tp rank",
    "dp": "each rank all-reduces the gradients of its own parameters once per step "
          "(parameters_per_rank(config, Parallelism(Layout(tp=tp, pp=pp)), stage) of its "
          "stage)",
    "embedding": "the first and the last stage of each pipeline all-reduce their copy's "
                 "[V_padded/t, h] gradient (only when pp > 1)",
}


@exercise("07.3", "predict the bytes of a PTD-P step, by purpose",
          marks=(r"4,593,664", r"3,504,128"))  # section 5's tp and dp bytes at tp=2 pp=2 dp=2
def _predict_bytes(fn: Callable) -> str:
    for tp, pp, dp in BYTES_LAYOUTS:
        got = fn(BYTES_CONFIG, tp, pp, dp, BYTES_BATCH, BYTES_MICROBATCHES)
        if not isinstance(got, dict) or set(PREDICTED) - set(got):
            raise Hint(f"return a dict with the keys {', '.join(PREDICTED)}: the bytes all ranks "
                       "put on the wire in one step, for each purpose")
        want = measured_bytes(tp, pp, dp)
        for purpose in PREDICTED:
            _check_purpose(purpose, float(got[purpose]), want[purpose], (tp, pp, dp))
    shown = ", ".join(f"tp={t} pp={p} dp={d}" for t, p, d in BYTES_LAYOUTS)
    return (f"your formulas give, within {TOLERANCE:.0%}, the tp, pp, dp and embedding bytes "
            f"that comm.record() measured in real PTD-P steps ({shown})")


def _check_purpose(purpose: str, got: float, want: int, layout: tuple[int, int, int]) -> None:
    if abs(got - want) <= TOLERANCE * want + 0.5:
        return
    tp, pp, dp = layout
    name = f"tp={tp} pp={pp} dp={dp}"
    if want == 0:
        raise Hint(f"{name} sends no {purpose} bytes (you predicted {got:,.0f}): with "
                   f"{purpose if purpose != 'embedding' else 'pp'} = 1 there is nothing to "
                   "exchange")
    said = f"{name}: your {purpose} bytes are {got / want:.3g}× the measured {want:,}"
    args = (BYTES_CONFIG, tp, pp, dp, BYTES_BATCH, BYTES_MICROBATCHES)
    for mistake, why in MISTAKES.items():
        alternative = reference_bytes(*args, mistake=mistake)[purpose]
        if abs(alternative - want) > TOLERANCE * want and \
                abs(got - alternative) <= TOLERANCE * want + 0.5:
            raise Hint(f"{said}: {why}")
    raise Hint(f"{said} (you predicted {got:,.0f}). {purpose}: {PURPOSE_HELP[purpose]}")

