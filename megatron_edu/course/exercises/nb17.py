"""Checkers for notebook 17, the capstone: PTD-P assembled from the package's pieces.

17.1 ★★   build one rank's share of a PTD-P run: its chunks, the schedule, the data-parallel
          wrapper, the optimizer (``Parts``)
17.2 ★★★  the PTD-P training step: the pipeline's forward-backward, the data-parallel sum, the
          tied embedding, the global norm, the update (2104.04473 §3)

Both run on 8 ranks, tp = 2 × pp = 2 × dp = 2 with 1F1B over m = 4 microbatches. 17.1 compares
what the learner built with what ``PTDP`` builds on the same rank: the stage's layers and their
tensor-parallel slices, the schedule, the group the gradients are summed over and whether they
are summed or averaged, the optimizer's weight-decay groups. 17.2 steps a ``PTDP``'s own parts
with the learner's step twice and compares every rank's losses, gradient norms and weights with
the serial model's, and each purpose's bytes with 2104.04473's counts
(``nb07.reference_bytes``). Typical wrong answers — the whole model on every rank, the gradients
averaged (divided by dp twice) or summed over the wrong group, weight decay on the layer norms;
the loss divided by the replica's own tokens, the replica's share returned as the loss, the
tied embedding's copies not summed, the embedding counted twice in the norm, a norm of this
rank's gradients only, no clipping, the gradients never zeroed, no scatter/gather — are named.

Dropout is off, to keep the step's arithmetic plain: with it on, every layout takes the serial
model's steps as well (each rank draws its part of the serial masks; tests/test_ptdp.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.course.exercises.nb07 import reference_bytes
from megatron_edu.data_parallel import DataParallel
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.optim import build_param_groups
from megatron_edu.perf import wire_bytes_by_group
from megatron_edu.pipeline.schedules import PipelineConfig, Schedule
from megatron_edu.ptdp import PTDP, PTDPOptions
from megatron_edu.tensor_parallel.random import DropoutKey

__all__ = ["CONFIG", "LAYOUT", "PIPELINE", "OPTIONS", "BATCH", "STEPS", "Parts", "batches",
           "serial_steps", "step_verdicts", "build_verdicts", "BUILT"]

CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=4, hidden=32, num_heads=4, dropout=0.0)
LAYOUT = Layout(tp=2, pp=2, dp=2)
PIPELINE = PipelineConfig("1f1b", microbatch=2, num_microbatches=4)
# clip below the serial norms, so that clipping acts; Adam's ε large enough that the rounding
# noise of a zero gradient (the key bias) stays noise (tests/test_ptdp.py)
OPTIONS = PTDPOptions(lr=1e-2, clip=0.5, eps=1e-4)
BATCH, STEPS = 16, 2       # dp · m · b = 2 · 4 · 2 sequences: 8 a replica, 2 a microbatch
PURPOSES = ("tp", "pp", "dp", "embedding")


@dataclass
class Parts:
    """One rank's share of a PTD-P run: what exercise 17.1 builds and 17.2 steps."""

    config: GPTConfig
    grid: ParallelGrid
    schedule: Schedule                  # the pipeline's schedule (every rank's list of actions)
    chunks: list[GPT]                   # this rank's model chunks (v of them), tp-split
    ddp: DataParallel                   # the gradients' buckets over the dp group
    optimizer: torch.optim.Optimizer    # AdamW over this rank's parameters
    options: PTDPOptions                # lr, clip, eps, … as the run was asked for


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (input ids, labels) [BATCH, s] of random tokens."""
    tokens = torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(17))
    return [(step[:, :-1], step[:, 1:].clone()) for step in tokens]


def serial_steps() -> dict[str, list]:
    """The serial model's STEPS steps with OPTIONS: losses, norms before clipping, the word
    embedding's gradient norm, and the weights after each step (names as ``full_state_dict``)."""
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(build_param_groups(model, OPTIONS.weight_decay),
                                  lr=OPTIONS.lr, betas=OPTIONS.betas, eps=OPTIONS.eps)
    out: dict[str, list] = {"loss": [], "norm": [], "embedding_norm": [], "weights": []}
    for step, (ids, labels) in enumerate(batches()):
        loss = model(ids, labels, dropout_key=DropoutKey.first(BATCH, step))
        loss.backward()
        out["embedding_norm"].append(model.embedding.word.weight.grad.norm().item())
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIONS.clip).item())
        optimizer.step()
        optimizer.zero_grad()
        out["loss"].append(loss.item())
        out["weights"].append({k: v.clone() for k, v in model.full_state_dict().items()})
    return out


def _run_each(describe: Callable, fns: list[Callable], timeout: float) -> list[list[dict]]:
    """On the 8 ranks of LAYOUT, in one launch: ``describe(grid, fn)`` for each of ``fns`` in
    turn; per function, every rank's record."""
    def ranks(fns):
        grid = ParallelGrid(LAYOUT)
        return [describe(grid, fn) for fn in fns]

    per_rank = on_ranks(LAYOUT.world_size, ranks, fns, timeout=timeout)
    return [[rank[i] for rank in per_rank] for i in range(len(fns))]


def _verdicts(judge: Callable[[list[dict]], str], runs: list[list[dict]]) -> list[str]:
    """``judge``'s sentence for each function's records, or the Hint it raised, in words."""
    verdicts = []
    for records in runs:
        try:
            verdicts.append(judge(records))
        except Hint as hint:
            verdicts.append(str(hint))
    return verdicts


# --- 17.1 ★★ the parts of one rank ---------------------------------------------------------------

def _decay(optimizer: torch.optim.Optimizer, chunks: list[GPT]) -> dict[str, float]:
    """Each parameter's weight decay in ``optimizer``, by name (absent: not optimised)."""
    names = {id(p): f"{c}.{n}" for c, chunk in enumerate(chunks)
             for n, p in chunk.named_parameters()}
    return {names.get(id(p), "?"): group["weight_decay"]
            for group in optimizer.param_groups for p in group["params"]}


def _describe_build(grid: ParallelGrid, build: Callable) -> dict:
    """On one rank: what the learner built, beside what ``PTDP`` builds from the same seed."""
    want = PTDP(CONFIG, grid, OPTIONS, pipeline=PIPELINE)
    parts = build(CONFIG, grid, OPTIONS, PIPELINE)
    got = {"rank": grid.rank, "coords": (grid.tp_rank, grid.pp_rank, grid.dp_rank)}
    got["type"] = type(parts).__name__
    if not all(hasattr(parts, k) for k in ("schedule", "chunks", "ddp", "optimizer")):
        return got
    got["schedule"] = [list(row) for row in parts.schedule] == [list(r) for r in want.schedule]
    chunks = list(parts.chunks)
    got["chunks"] = [{k: tuple(v.shape) for k, v in c.state_dict().items()} for c in chunks]
    got["want_chunks"] = [{k: tuple(v.shape) for k, v in c.state_dict().items()}
                          for c in want.chunks]
    got["same_values"] = (got["chunks"] == got["want_chunks"] and all(
        torch.equal(a, b) for c, w in zip(chunks, want.chunks, strict=True)
        for a, b in zip(c.state_dict().values(), w.state_dict().values(), strict=True)))
    ddp = parts.ddp
    got["ddp"] = isinstance(ddp, DataParallel)
    if got["ddp"]:
        got["group"], got["want_group"] = list(ddp.group.ranks), list(grid.dp_group.ranks)
        got["average"] = ddp.average
        got["ddp_params"] = len(ddp.params) == sum(1 for c in chunks for _ in c.parameters())
    got["decay"], got["want_decay"] = _decay(parts.optimizer, chunks), _decay(want.optimizer,
                                                                              want.chunks)
    group = parts.optimizer.param_groups[0] if parts.optimizer.param_groups else {}
    got["adam"] = (type(parts.optimizer).__name__, group.get("lr"), group.get("eps"))
    return got


def _judge_build(r: dict) -> None:
    """Raise the Hint for the first thing rank ``r`` built otherwise than PTDP."""
    at = f"rank {r['rank']} (tp, pp, dp = {r['coords']})"
    if "schedule" not in r:
        raise Hint(f"build returned a {r['type']}: return Parts(config, grid, schedule, chunks, "
                   "ddp, optimizer, options)")
    if not r["schedule"]:
        raise Hint("the schedule is not the pipeline's: pipeline.make_schedule(grid.pp) gives the "
                   "1F1B lists of this run (m = 4), and its stages are where the chunks live")
    if r["chunks"] != r["want_chunks"]:
        got = sum(math.prod(s) for c in r["chunks"] for s in c.values())
        want = sum(math.prod(s) for c in r["want_chunks"] for s in c.values())
        whole = got > want
        raise Hint(f"{at} holds {len(r['chunks'])} chunk(s) of {got:,} numbers; its share is "
                   f"{len(r['want_chunks'])} chunk(s) of {want:,}"
                   + (" — the whole model, or a whole stage, on every rank" if whole else "")
                   + ": build_chunks(config, grid, schedule.stages) builds this rank's stage, "
                     "its layers split over the tp ranks (notebooks 01–03)")
    if not r["same_values"]:
        raise Hint(f"{at}: the chunks have the right shapes but other weights — build them with "
                   "build_chunks from the config itself (its seed gives every layout the serial "
                   "model's weights)")
    if not r["ddp"]:
        raise Hint("parts.ddp should be a DataParallel over the chunks: it holds the gradients "
                   "in buckets and sums them over the replicas (notebook 06)")
    if r["group"] != r["want_group"]:
        raise Hint(f"{at} sums its gradients over ranks {r['group']}; the replicas holding the "
                   f"same weights are its data-parallel group {r['want_group']} (grid.dp_group)")
    if not r["ddp_params"]:
        raise Hint(f"{at}: DataParallel does not hold every parameter of the chunks — wrap all "
                   "of them (DataParallel(chunks, …))")
    if r["average"]:
        raise Hint("DataParallel averages: each replica's loss is already its share of the "
                   "global batch's token mean (its tokens' losses over the global count), so the "
                   "replicas' gradients must be summed — average=False — or they are divided by "
                   "dp twice")
    if r["decay"] != r["want_decay"]:
        wrong = sorted(k for k in r["want_decay"] if r["decay"].get(k) != r["want_decay"][k])
        missing = [k for k in wrong if k not in r["decay"]]
        raise Hint((f"{at}: {len(missing)} parameters not optimised ({missing[0]}, …)"
                    if missing else
                    f"{at}: {wrong[0]} and {len(wrong) - 1} others have weight decay "
                    f"{r['decay'][wrong[0]]}, expected {r['want_decay'][wrong[0]]}")
                   + ": build_param_groups(chunks, options.weight_decay) — biases and layer "
                     "norms take none")
    if r["adam"] != ("AdamW", OPTIONS.lr, OPTIONS.eps):
        raise Hint(f"the optimizer is {r['adam'][0]} with lr {r['adam'][1]}, ε {r['adam'][2]}: "
                   f"AdamW with the options' lr ({OPTIONS.lr}), betas and eps ({OPTIONS.eps})")


BUILT = ("every one of the 8 ranks holds its stage's layers split over tp, with the serial "
         "model's weights; the layout's 1F1B schedule; its gradients summed (not averaged) over "
         "its dp group; AdamW with no decay on biases and layer norms — as PTDP builds")


def _judge_builds(records: list[dict]) -> str:
    for r in records:
        _judge_build(r)
    return BUILT


def build_verdicts(builds: list[Callable]) -> list[str]:
    """Each build function's verdict (the Hint's text, or BUILT), all in one launch."""
    return _verdicts(_judge_builds, _run_each(_describe_build, builds, timeout=120))


@exercise("17.1", "one rank's parts of a PTD-P run",
          reference=(PTDP.__init__,),
          marks=(r"average=False",                            # the gradients summed, not averaged
                 r"DataParallel\(chunks,grid\.dp_group"),      # over the dp group
          taught=("chunks = build_chunks(config, grid, schedule.stages)",))  # notebook 05
def check_build(build) -> str:
    """build(config, grid, options, pipeline) → Parts, on 8 ranks, against what PTDP builds."""
    return _judge_builds(_run_each(_describe_build, [build], timeout=120)[0])


# --- 17.2 ★★★ the step ---------------------------------------------------------------------------

def _parts(grid: ParallelGrid) -> Parts:
    """A PTDP's own parts (17.2 checks the step alone)."""
    t = PTDP(CONFIG, grid, OPTIONS, pipeline=PIPELINE)
    return Parts(CONFIG, grid, t.schedule, t.chunks, t.ddp, t.optimizer, OPTIONS)


def _steps(grid: ParallelGrid, step: Callable) -> dict:
    """This rank's STEPS steps with the learner's ``step``: what it returned, its comm logs, the
    gradients left after each step, its weights after each step."""
    parts, b = _parts(grid), BATCH // grid.dp
    mine = slice(grid.dp_rank * b, (grid.dp_rank + 1) * b)
    out: dict = {"returned": [], "logs": [], "left": [], "weights": []}
    for iteration, (ids, labels) in enumerate(batches()):
        with comm.record() as log:
            out["returned"].append(step(parts, ids[mine], labels[mine], OPTIONS.lr, iteration))
        out["logs"].append(log)
        out["left"].append(max((p.grad.abs().max().item() for c in parts.chunks
                                for p in c.parameters() if p.grad is not None), default=0.0))
        weights = {}
        for chunk in parts.chunks:
            weights.update(chunk.full_state_dict())
        out["weights"].append(weights)
    return out


def _pair(returned, rank: int) -> tuple[float, float]:
    if not (isinstance(returned, tuple | list) and len(returned) == 2):
        raise Hint(f"rank {rank}: return (loss, grad_norm) — the step's loss over the global "
                   "batch and the gradient norm before clipping")
    try:
        return float(returned[0]), float(returned[1])
    except (TypeError, ValueError, RuntimeError):
        raise Hint(f"rank {rank}: the loss and the norm should be numbers, got "
                   f"{type(returned[0]).__name__} and {type(returned[1]).__name__}") from None


def _bytes(records: list[dict], step: int) -> dict[str, int]:
    return wire_bytes_by_group([r["logs"][step] for r in records])


def _near(x: float, y: float, tol: float = 1e-4) -> bool:
    return abs(x - y) <= tol * max(1.0, abs(y))


def _judge_bytes(got: dict[str, int], want: dict[str, float]) -> None:
    """The collectives a step must make, from the bytes of each purpose (``perf.traffic``)."""
    if got["dp"] == 0:
        raise Hint("no gradient crossed the data-parallel group: the replicas never summed "
                   "their gradients — parts.ddp.finish_grad_sync() after the pipeline (and "
                   "RunSettings(grad_sync=lambda chunk, last: parts.ddp.sync(last)) to start the "
                   "buckets during the last backward)")
    if got["embedding"] == 0:
        raise Hint("the tied embedding's two copies (on the first and the last stage) were not "
                   "summed: all-reduce their gradients over grid.embedding_group, as exercise "
                   "07.2, before the norm and the update")
    if got["pp"] == LAYOUT.tp * want["pp"]:
        raise Hint(f"{got['pp']:,} bytes between stages, {LAYOUT.tp}× 2104.04473 §4.1's: each "
                   "tp rank sends its whole activation — RunSettings(scatter_gather=True) (each "
                   "sends 1/t, the next stage all-gathers)")


def _judge_loss(at: str, loss: float, serial: float, losses: list[float]) -> None:
    if max(losses) - min(losses) > 1e-6 * abs(serial):
        raise Hint(at + f"the ranks return different losses ({min(losses):.4f} … "
                   f"{max(losses):.4f}): each is this replica's share of the global mean "
                   f"{serial:.4f} — sum it over grid.dp_group")
    if _near(loss, serial * LAYOUT.dp):
        raise Hint(at + f"the loss is {loss:.4f}, {LAYOUT.dp}× the global mean {serial:.4f}: "
                   "each replica divided its tokens' losses by its own token count — all-reduce "
                   "the count over grid.dp_group and give it as the Batch's num_tokens, so that "
                   "each replica's loss is its share")
    if not _near(loss, serial):
        raise Hint(at + f"the loss {loss:.4f} is not the serial model's {serial:.4f} with the "
                   "same weights: the loss is the sum of every target token's loss over the "
                   "global batch's count — the Batch's num_tokens, the count all-reduced over "
                   "grid.dp_group")


def _judge_norm(at: str, norm: float, serial: float, embedding: float, exchanged: bool) -> None:
    if _near(norm, math.hypot(serial, embedding), 1e-3):
        raise Hint(at + f"the norm {norm:.4f} counts the tied embedding twice (the serial "
                   f"model's is {serial:.4f}): pass the last stage's copy as tied_copies, so "
                   "the norm counts the one matrix once")
    if not _near(norm, serial, 1e-3):
        raise Hint(at + f"the norm {norm:.4f} is not the global one {serial:.4f}"
                   + (": clip_grad_norm_(parameters, options.clip, grid, tied_copies) counts "
                      "each parameter once — the replicated ones on tp rank 0" if exchanged else
                      ": no rank exchanged its squares — pass grid to clip_grad_norm_, which "
                      "sums them over the tp and pp ranks"))


def _judge_update(step: int, records: list[dict], serial: dict) -> None:
    if any(rec["left"][step] > 0 for rec in records):
        raise Hint(f"after step {step} the gradients are still there: the next step adds to "
                   "them — parts.ddp.zero_grad() after the update (it zeroes the buckets)")
    for r, rec in enumerate(records):
        for name, value in rec["weights"][step].items():
            diff = (value - serial["weights"][step][name]).abs().max().item()
            if diff > 1e-5:
                raise Hint(f"rank {r}: after step {step}, {name} differs from the serial model's "
                           f"by {diff:.2g}: the update — clip the gradients to options.clip, "
                           "then parts.optimizer.step()")


def _judge_steps(records: list[dict], serial: dict) -> str:
    """Raise the Hint naming the first mistake the ranks' records show, step by step: the
    collectives, then every rank's loss and norm, then the weights after the update."""
    want = reference_bytes(CONFIG, LAYOUT.tp, LAYOUT.pp, LAYOUT.dp, BATCH,
                           PIPELINE.num_microbatches)
    for step in range(STEPS):
        _judge_bytes(_bytes(records, step), want)
        exchanged = bool(records[0]["logs"][step].select(label="grad norm"))
        pairs = [_pair(rec["returned"][step], r) for r, rec in enumerate(records)]
        for r, (loss, norm) in enumerate(pairs):
            at = f"rank {r}, step {step}: "
            _judge_loss(at, loss, serial["loss"][step], [x for x, _ in pairs])
            _judge_norm(at, norm, serial["norm"][step], serial["embedding_norm"][step], exchanged)
        _judge_update(step, records, serial)
    got = _bytes(records, 0)
    for purpose in PURPOSES:
        if abs(got[purpose] - want[purpose]) > 0.01 * want[purpose]:
            raise Hint(f"{got[purpose]:,} {purpose} bytes in a step, 2104.04473's count is "
                       f"{want[purpose]:,.0f}: a collective added or left out")
    loss = ", ".join(f"{x:.4f}" for x in serial["loss"])
    return (f"on 8 ranks (tp 2 × pp 2 × dp 2, 1F1B, m = 4): losses {loss} and norms equal "
            "the serial model's, every weight equal after each step; bytes per step "
            + ", ".join(f"{p} {got[p]:,}" for p in PURPOSES) + " — the papers' counts")


def step_verdicts(steps: list[Callable]) -> list[str]:
    """Each step function's verdict (the Hint's text, or the success sentence), one launch."""
    serial = serial_steps()
    return _verdicts(lambda records: _judge_steps(records, serial),
                     _run_each(_steps, steps, timeout=180))


@exercise("17.2", "the PTD-P training step", reference=(PTDP.train_step, PTDP._run),
          marks=(r"parts\.ddp\.sync\(last\)",                 # the buckets in the last backward
                 r"stage'scopyoftheembeddingpassedas"))       # the norm counts the tied one once
def check_step(step) -> str:
    """step(parts, input_ids, labels, lr, iteration) → (loss, norm), twice on 8 ranks, against
    the serial model."""
    return _judge_steps(_run_each(_steps, [step], timeout=180)[0], serial_steps())
