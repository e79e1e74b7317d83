"""Checkpoints that survive crashes and change of layout.

A checkpoint is a folder ``OUT/checkpoints/step_000100/`` holding

* ``model_tp{t}_pp{p}.pt`` — written by data-parallel rank 0 of each (tp, pp) position: that
  rank's parameter shards and their AdamW moments, by parameter name, with the dimension each is
  split along (``tp_dim``). Only that rank copies them to the host: its dp (and cp) peers
  hold the same shards and copy nothing (else every GPU of a node copies the whole model). Under
  ZeRO-1 the moments are not in it: each rank d of the dp (× cp) group that shares the optimizer
  writes ``optim_tp{t}_pp{p}_dp{d}.pt``, the pieces of the moments it owns (each piece: a
  parameter name, its offset in the flattened shard, the two moments' values) — no rank ever
  gathers the whole state, and ZeRO-1's saving holds at every save. Everything is copied to the
  CPU one tensor at a time: the device never holds a second copy of the weights or the state.
* ``tokenizer.model`` — the sentencepiece model the run trained with (or ``tokenizer.json``, a
  Hugging Face one), so that the folder stands on its own (generation, export).
* ``meta.json`` — written last: step, model config, layout, training state (data sampler
  position, ...), Adam's step count, the size of every file above (checked on load) and an
  ``index`` of the shard files: for each parameter name, the pipeline stages whose files hold
  it (two for the tied embedding), its ``tp_dim``, the shape of its shards and how many tp
  ranks hold each of them (``replicas``: kv heads replicated when tp exceeds them).

**Atomic.** Ranks write into ``step_000100.tmp/``; after a barrier rank 0 writes ``meta.json``,
renames the folder in one step and then points ``OUT/checkpoints/latest`` at it (also by rename).
A crash at any moment leaves the previous checkpoint and ``latest`` as they were.

**Kept within bounds, written in the background.** ``keep_last=N``: once the new checkpoint is
published, rank 0 deletes all but the N newest (by step) — never the one just written, never the
one ``latest`` names — each renamed ``step_….deleted`` first, so that no half-deleted folder ever
bears a checkpoint's name. A save is two parts: the *host copy* of what each rank writes, on every
rank at once (``_snapshot``: the finiteness check, ZeRO-3's gather and ZeRO-1's step count are
collectives), and the *write* (the phases below). ``Writer`` writes at once; ``BackgroundWriter``
writes in a thread while training goes on, as torch.distributed.checkpoint's ``async_save``
does: its phases meet on a gloo group of their own, never interleaved with the training's
collectives. The next save, the end of training and a failure wait for it (``wait``); an error
in the background raises there — a write failure as the same ``CheckpointError``, anything else
with its traceback.

**Truthful.** Nothing is written unless every rank's weights and AdamW moments are finite
(``NonFiniteError``); a write that fails on any rank — a full disk, a quota — raises the same
``CheckpointError`` on all of them, naming the folder and the cause, and removes the partial
``.tmp`` folder: no rank waits at a barrier for one that gave up. ``checkpoint_bytes`` estimates
a checkpoint's size before a run starts.

**Reshardable, read in slices.** A checkpoint stores shards, yet loads into any other
tp × pp × dp — so a run saved at tp=2, pp=2 resumes at tp=1, pp=4 (2104.04473 trains at one
layout; a learner tries several) — and no rank ever builds a whole tensor. Think of the whole
tensor (the tp shards joined along ``tp_dim``, the vocabulary trimmed to ``vocab_size`` rows):
a rank at tp rank r holds its elements ``[r·n, (r+1)·n)`` along ``tp_dim``, n being its
shard's length (a part held by ``replicas`` ranks each: part r // replicas). Knowing from the
index which stage's files hold a name and how long the saved shards are, it memory-maps just
those files (opening one reads no tensor data) and copies out of the one or few saved shards
that intersect its range only the intersection (views of the mapped tensors); rows past the
vocabulary are padding, zeros, never read. Of a tensor saved more than once (not split over
tp; the tied embedding of the first and last stage) it reads the copy nearest to its own place
in the grid: its own file, on the same layout. Parameters and AdamW moments alike.
``_record_reads`` lists every slice copied (tests/test_checkpoint.py proves that a rank reads
only its own). ``load_full_model_state`` (export, generation) is the same read of the range
``[0, whole)`` of every tensor.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_edu import comm
from megatron_edu.cli import Parser
from megatron_edu.data.tokenizer import Tokenizer, tokenizer_name
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPTConfig, config_from_dict
from megatron_edu.model.transformer import OUTPUT_LAYER, WORD_EMBEDDING
from megatron_edu.perf.memory import parameters_per_rank
from megatron_edu.ptdp import PTDP, Parallelism

__all__ = ["save_checkpoint", "Writer", "BackgroundWriter", "load_checkpoint",
           "load_model_chunks", "read_metadata", "load_full_model_state",
           "resolve_checkpoint", "check_model", "export_hf", "Read",
           "CheckpointError", "NonFiniteError", "checkpoint_bytes", "withdraw_checkpoint",
           "TOKENIZER"]

FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
TOKENIZER = "tokenizer.model"   # a sentencepiece model; a Hugging Face one is tokenizer.json


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


# --- saving --------------------------------------------------------------------------------------

def save_checkpoint(out_dir: str | Path, step: int, trainer: PTDP,
                    state: dict[str, Any] | None = None, tokenizer: Path | None = None,
                    keep_last: int | None = None, writer: Writer | None = None) -> Path:
    """Save ``trainer`` after ``step`` optimizer steps (a collective: every rank calls it).

    ``state``: anything else a resumed run needs (the data sampler's position, ...), JSON-able.
    ``tokenizer``: a sentencepiece model, copied in so that the checkpoint stands on its own.
    ``keep_last``: then delete all but the newest so many checkpoints (module docstring).
    ``writer``: a ``Writer`` (the default: returns once the checkpoint is published) or a
    ``BackgroundWriter`` (returns once the host copy is taken; the same writer every save).

    Every rank agrees before anything is written that no weight or AdamW moment is NaN or inf
    (else a ``NonFiniteError``, nothing written), and after each phase that no rank's write
    failed: one rank's full disk raises the same ``CheckpointError`` on every rank — naming the
    folder and the cause — instead of leaving the others waiting at a barrier. Either way the
    previous checkpoint and ``latest`` stay as they were.
    """
    writer = writer or Writer()
    writer.wait()                        # the previous save first: one host copy at a time
    grid = trainer.grid
    final = Path(out_dir) / "checkpoints" / f"step_{step:06d}"
    if not _all_ranks(_finite(trainer), grid):
        raise NonFiniteError(f"checkpoint {final.name} not written: the weights or the "
                             f"optimizer state hold NaN or inf values")
    meta = {"format": FORMAT, "step": step, "config": dict(vars(trainer.config)),
            "layout": {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp,
                       **({"cp": grid.cp} if grid.cp > 1 else {}),
                       **({"ep": grid.ep} if grid.ep > 1 else {}),
                       "num_chunks": trainer.parallelism.chunks,
                       "zero": trainer.parallelism.zero},
            "state": json.loads(json.dumps(state or {})),    # as it is now, JSON-able
            "tokenizer": tokenizer_name(tokenizer) if tokenizer is not None else None}
    save = _Save(final, _snapshot(trainer), meta, tokenizer, keep_last, grid.rank == 0)
    writer.start(save.write)
    return final


class Writer:
    """Writes a checkpoint at once: ``save_checkpoint`` returns when it is published."""

    def start(self, write: Callable[[dist.ProcessGroup | None], None]) -> None:
        write(None)                                      # its phases on the default group

    def wait(self) -> None:
        """Nothing is ever in flight."""


class BackgroundWriter(Writer):
    """Writes a checkpoint in a thread while training goes on (``--async-save``). Made on every
    rank at the same point (its gloo group is a collective), used by every save of the run.
    The thread is not a daemon: an interpreter that exits still finishes the write."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")     # the phases' own: never the training's
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, write: Callable[[dist.ProcessGroup | None], None]) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._run, args=(write,), name="checkpoint writer")
        self.thread.start()

    def _run(self, write: Callable[[dist.ProcessGroup | None], None]) -> None:
        try:
            write(self.group)
        except BaseException as err:                     # raised again by wait()
            self.error = err

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error, with its traceback."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


@dataclass
class _Save:
    """One checkpoint's write, from its host copy: ``files`` (this rank's, by name) and ``meta``
    (all but the index and the sizes); ``rank0`` prepares, publishes and prunes."""

    final: Path
    files: dict[str, Any]
    meta: dict[str, Any]
    tokenizer: Path | None
    keep_last: int | None
    rank0: bool

    @property
    def staging(self) -> Path:
        return self.final.with_suffix(".tmp")

    def write(self, group: dist.ProcessGroup | None) -> None:
        """The phases (``_Phases``) on ``group``; on a failure the partial folder is removed."""
        phases, staging = _Phases(self.final, group), self.staging
        try:
            phases.run(self._prepare, self.rank0)
            phases.run(lambda: [torch.save(obj, staging / name)
                                for name, obj in self.files.items()], bool(self.files))
            phases.run(self._publish, self.rank0)
        except CheckpointError:
            if self.rank0:
                shutil.rmtree(staging, ignore_errors=True)  # give the space back
            raise

    def _prepare(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)    # the leftovers of a crashed save
        self.staging.mkdir(parents=True)

    def _publish(self) -> None:
        staging, root = self.staging, self.final.parent
        if self.tokenizer is not None:
            shutil.copyfile(self.tokenizer, staging / tokenizer_name(self.tokenizer))
        meta = {**self.meta, **_describe(staging, self.meta["layout"]["pp"]),
                "files": {f.name: f.stat().st_size for f in sorted(staging.iterdir())}}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        if self.final.exists():                            # saving the same step again
            shutil.rmtree(self.final)
        os.replace(staging, self.final)
        _write_atomically(root / "latest", self.final.name)
        if self.keep_last is not None:
            _prune(root, self.keep_last, self.final)


def _snapshot(trainer: PTDP) -> dict[str, Any]:
    """This rank's files, by name, copied to the host: its model file if it writes one
    (data-parallel rank 0 of its place; the cp ranks hold the same weights too), and under
    ZeRO-1 its pieces of the moments. Every rank calls it: the step count (ZeRO-1) and the
    gathering (ZeRO-3) are collectives."""
    grid = trainer.grid
    place = f"tp{grid.tp_rank}_pp{grid.pp_rank}"
    adam_step, files = _adam_step(trainer), {}
    with trainer.gathered():                              # ZeRO-3: whole for a moment
        if grid.dp_rank == grid.cp_rank == 0:
            files[f"model_{place}.pt"] = _local_shards(trainer, adam_step, experts=False)
        if grid.edp_group.rank == 0 and trainer.has_experts:  # each ep rank's experts
            files[f"experts_{place}_ep{grid.ep_group.rank}.pt"] = _local_shards(
                trainer, adam_step, experts=True)
    if trainer.ddp.shards_optimizer:                      # ZeRO-1 shards over dp × cp
        files[f"optim_{place}_dp{grid.dp_cp_group.rank}.pt"] = _optimizer_pieces(trainer)
    return files


def _prune(root: Path, keep: int, written: Path) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``root`` by step, never ``written`` nor
    the one ``latest`` names: each renamed ``….deleted`` (one step), then removed. A deletion
    that fails is a warning: the new checkpoint is already safe."""
    steps = sorted((p for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name)),
                   key=lambda p: int(p.name.removeprefix("step_")))
    latest = (root / "latest").read_text().strip()
    spared = {p.name for p in steps[len(steps) - keep:]} | {written.name, latest}
    for old in [p for p in steps if p.name not in spared] + sorted(root.glob("step_*.deleted")):
        gone = old if old.suffix == ".deleted" else old.with_name(f"{old.name}.deleted")
        try:
            if gone != old:
                shutil.rmtree(gone, ignore_errors=True)
                os.replace(old, gone)
            shutil.rmtree(gone)
        except OSError as err:
            print(f"warning: cannot delete the old checkpoint {old}: {_write_failure(err)}",
                  file=sys.stderr)


class NonFiniteError(CheckpointError):
    """A checkpoint was not written: the weights or the optimizer state are not finite."""


def _finite(trainer: PTDP) -> bool:
    """Are this rank's weights and AdamW moments (under ZeRO-1 its shard of them) finite?"""
    states = trainer.optimizer.state.values()
    tensors = [*trainer.ddp.held_params(), *(s[k] for s in states for k in MOMENTS if k in s)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _all_ranks(ok: bool, grid: ParallelGrid) -> bool:
    """True on every rank if ``ok`` is true on every rank (one all-reduce)."""
    bad = torch.tensor(float(not ok), device=grid.device)
    return comm.all_reduce(bad, comm.world(), "checkpoint check").item() == 0


class _Phases:
    """A save's phases, each ended by every rank learning whether any rank's part failed (an
    all-gather of the errors over ``group``, which is also the barrier between phases)."""

    def __init__(self, final: Path, group: dist.ProcessGroup | None = None) -> None:
        self.root, self.final, self.group = final.parent, final, group

    def run(self, action, mine: bool) -> None:
        """``action()`` if ``mine``; then a CheckpointError on every rank if any rank failed."""
        error = None
        if mine:
            try:
                action()
            except (OSError, RuntimeError) as err:
                error = _write_failure(err)
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            rank, cause = failed[0]
            raise CheckpointError(f"cannot write checkpoint {self.final.name} in {self.root}: "
                                  f"{cause} (rank {rank}); {self._previous()}")

    def _previous(self) -> str:
        latest = self.root / "latest"
        if not latest.exists():
            return "no earlier checkpoint was saved"
        return f"the previous checkpoint {latest.read_text().strip()} is intact and latest " \
               f"still names it"


def _write_failure(err: BaseException) -> str:
    """What a failed write says: lack of space (ENOSPC, a full quota, or torch.save's zip writer
    failing as the disk fills: ``unexpected pos``, ``file write failed``) in so many words."""
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return "no space left on the device"
    if isinstance(err, OSError) and err.errno == errno.EDQUOT:
        return "the disk quota is exceeded"
    if isinstance(err, RuntimeError) and any(s in str(err) for s in ("unexpected pos",
                                                                     "file write failed")):
        return f"a write failed, most likely the disk is full (torch.save: {text})"
    return text


def checkpoint_bytes(config: GPTConfig, parallelism: Parallelism) -> int:
    """About how many bytes one checkpoint of this model and split takes: every (tp, pp)
    position's parameters, fp32, and their two AdamW moments — 12 bytes a parameter, the
    vocabulary padding and the tied embedding's second copy included; every expert, whatever
    ep holds on one rank."""
    every_expert = dataclasses.replace(
        parallelism, layout=dataclasses.replace(parallelism.layout, ep=1))
    params = sum(parameters_per_rank(config, every_expert, stage)
                 for stage in range(parallelism.pp))
    return 12 * parallelism.tp * params


def withdraw_checkpoint(out_dir: str | Path, step: int, previous: Path | None) -> None:
    """Take back the checkpoint of ``step``, whose weights turned out to diverge: rename its
    folder ``step_N.diverged`` (kept to look at, never loaded) and point ``latest`` at
    ``previous`` if that is in the same folder, else remove ``latest``. Rank 0 alone."""
    root = Path(out_dir) / "checkpoints"
    folder = root / f"step_{step:06d}"
    kept = folder.with_name(f"{folder.name}.diverged")
    shutil.rmtree(kept, ignore_errors=True)
    os.replace(folder, kept)
    if previous is not None and previous.resolve().parent == root.resolve() \
            and previous.exists():                 # not deleted by keep_last
        _write_atomically(root / "latest", previous.name)
    else:
        (root / "latest").unlink(missing_ok=True)


def saved_tensors(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter,
                                                                   int | None]]:
    """(name, parameter, i) of every tensor a checkpoint keeps: each parameter (i None), but each
    expert of a stack [E/ep, …] on its own, ``{name}.{global id}`` (i: its place in the stack),
    so that a checkpoint holds the same tensors at any ep."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.expert_ids is None:
                yield name, p, None
            else:
                yield from ((f"{name}.{e}", p, i) for i, e in enumerate(p.expert_ids))


def _local_shards(trainer: PTDP, adam_step: float, experts: bool) -> dict[str, Any]:
    """This rank's parameter shards by name (vocabulary padding included) — the dense ones, or
    its ``experts`` — and, unless ZeRO-1 shards them over dp (``_optimizer_pieces``), their AdamW
    moments, each copied to the CPU on its own."""
    states = {} if trainer.ddp.shards_optimizer else trainer.optimizer.state
    params, moments, tp_dims, replicas = {}, {}, {}, {}
    for name, p, i in saved_tensors(trainer.chunks):
        if (i is not None) != experts:
            continue
        params[name], tp_dims[name], replicas[name] = (_on_cpu(_part(p, i)), _tp_dim(p, i),
                                                       p.tp_replicas)
        if p in states:
            moments[name] = {k: _on_cpu(_part(states[p][k], i)) for k in MOMENTS}
    return {"params": params, "moments": moments, "tp_dim": tp_dims, "tp_replicas": replicas,
            "adam_step": adam_step}


def _part(tensor: torch.Tensor, i: int | None) -> torch.Tensor:
    """A saved tensor's values: the parameter's (or moment's), or its expert i's."""
    return tensor if i is None else tensor[i]


def _tp_dim(p: torch.nn.Parameter, i: int | None) -> int | None:
    return p.tp_dim if i is None else p.tp_dim - 1


def _optimizer_pieces(trainer: PTDP) -> dict[str, Any]:
    """ZeRO-1: the pieces of the moments this dp rank owns, by parameter name: [(offset in the
    flattened parameter shard, {moment: values}), ...]."""
    names = {p: name for chunk in trainer.chunks for name, p in chunk.named_parameters()}
    pieces: dict[str, list] = {}
    for piece in trainer.optimizer.pieces:
        state = trainer.optimizer.state.get(piece.tensor)
        if state:
            for name, offset, span in _by_expert(names[piece.param], piece):
                pieces.setdefault(name, []).append(
                    (offset, {k: _on_cpu(state[k][span[0]:span[1]]) for k in MOMENTS}))
    return {"pieces": pieces}


def _by_expert(name: str, piece) -> Iterator[tuple[str, int, tuple[int, int]]]:
    """A ZeRO-1 piece as saved tensors hold it: (name, offset in it, [lo, hi) of the piece), cut
    at expert boundaries for a stack of experts (``saved_tensors``)."""
    p, n = piece.param, piece.tensor.numel()
    if p.expert_ids is None:
        yield name, piece.offset, (0, n)
        return
    each = p.numel() // len(p.expert_ids)            # (not p[0]: ZeRO-3 frees the weights)
    at, end = piece.offset, piece.offset + n
    while at < end:
        i, stop = at // each, min(end, (at // each + 1) * each)
        yield f"{name}.{p.expert_ids[i]}", at - i * each, (at - piece.offset, stop - piece.offset)
        at = stop


def _adam_step(trainer: PTDP) -> float:
    """AdamW's step count (0 before the first step). Under ZeRO-1 a dp rank may own no piece,
    hence no state: the count comes from the ranks that have one (a collective over dp × cp)."""
    steps = [float(s["step"]) for s in trainer.optimizer.state.values() if "step" in s]
    if not trainer.ddp.shards_optimizer:
        return max(steps, default=0.0)
    mine = torch.tensor([float(bool(steps)), max(steps, default=0.0)], dtype=torch.float64,
                        device=trainer.grid.device)
    have, total = comm.all_reduce(mine, trainer.grid.dp_cp_group, "dp adam step").tolist()
    return total / have if have else 0.0


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` (on a GPU, a device-to-host copy: no second copy on the GPU)."""
    return tensor.detach().to("cpu", copy=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- finding and checking ------------------------------------------------------------------------

def resolve_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """A checkpoint folder from itself, a run's output folder, or its ``checkpoints/`` folder:
    the latest one there, or the one of ``step``."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if step is not None:
            if (candidate / f"step_{step:06d}" / "meta.json").exists():
                return candidate / f"step_{step:06d}"
            continue
        if (candidate / "meta.json").exists():
            return candidate
        if (candidate / "latest").exists():
            return candidate / (candidate / "latest").read_text().strip()
    if step is not None:
        raise CheckpointError(f"no checkpoint of step {step} in {path}")
    raise CheckpointError(f"no checkpoint at {path}: expected a folder with meta.json, or a run "
                          f"folder whose checkpoints/latest names one")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, after checking that every file it lists is complete."""
    path = resolve_checkpoint(path)
    meta_file = path / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"corrupt checkpoint: cannot read {meta_file}: {err}") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: format {meta.get('format')!r}, this code reads "
                              f"format {FORMAT}")
    for name, size in meta["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"incomplete checkpoint: {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"corrupt checkpoint: {file} has {file.stat().st_size} bytes, "
                                  f"{size} were written")
    meta["path"] = str(path)
    if meta["tokenizer"] is not None:
        meta["tokenizer"] = str(path / meta["tokenizer"])
    return meta


def _load(file: Path) -> Any:
    """A shard file, memory-mapped: its tensors are read from disk only where sliced."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # a truncated or overwritten file: name it
        raise CheckpointError(f"corrupt checkpoint file {file}: {err}") from err


def _describe(path: Path, pp: int) -> dict[str, Any]:
    """The ``index`` of a checkpoint's shard files and Adam's step count, from tp rank 0's files
    of every stage (memory-mapped: only their pickled structure is read, no tensor data):
    ``file``, the name of the files holding a tensor, {tp} and {pp} to fill."""
    index: dict[str, dict[str, Any]] = {}
    for stage in range(pp):
        experts = sorted(path.glob(f"experts_tp0_pp{stage}_ep*.pt"))
        for file in [path / f"model_tp0_pp{stage}.pt", *experts]:
            saved = _load(file)
            template = file.name.replace("_tp0_", "_tp{tp}_").replace(f"_pp{stage}", "_pp{pp}")
            for name, tensor in saved["params"].items():
                entry = index.setdefault(name, {
                    "stages": [], "tp_dim": saved["tp_dim"][name], "file": template,
                    "replicas": saved.get("tp_replicas", {}).get(name, 1),
                    "shard": list(tensor.shape)})
                entry["stages"].append(stage)            # two for the tied embedding
    return {"index": index, "adam_step": saved["adam_step"]}


# --- loading: each rank reads only its slices ----------------------------------------------------

@dataclass(frozen=True)
class Read:
    """One slice copied out of a shard file: ``span`` = elements [lo, hi) along ``tp_dim`` of
    the whole tensor (None: a tensor not split over tp, read whole); ``numel`` elements."""

    file: str
    name: str
    kind: str                        # "param", "exp_avg" or "exp_avg_sq"
    span: tuple[int, int] | None
    numel: int


_active_reads: list[list[Read]] = []


@contextmanager
def _record_reads() -> Iterator[list[Read]]:
    """Record every slice this process copies out of shard files inside the block."""
    log: list[Read] = []
    _active_reads.append(log)
    try:
        yield log
    finally:
        _active_reads.remove(log)


class _Shards:
    """A checkpoint's shard files, each memory-mapped on first use, and the slicing of them.

    ``grid``: the reader's place, to pick of a tensor saved twice or more the copy nearest to it
    (the saved tp rank and stage at its relative position: its own on the same layout).
    """

    def __init__(self, meta: dict[str, Any], grid: ParallelGrid | None = None) -> None:
        self.path, self.vocab = Path(meta["path"]), meta["config"]["vocab_size"]
        self.tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
        layout = meta["layout"]
        self.zero = layout.get("zero", int(layout.get("zero1", False)))  # then so many optim_…
                                                   # files per place:
        self.owners = layout["dp"] * layout.get("cp", 1)   # the ranks sharing the optimizer
        described = meta if "index" in meta else _describe(self.path, pp)
        self.index, self.adam_step = described["index"], described["adam_step"]
        for entry in self.index.values():           # an index from before kv replicas, experts
            entry.setdefault("replicas", 1)
            entry.setdefault("file", "model_tp{tp}_pp{pp}.pt")
        self.near_tp = 0 if grid is None else grid.tp_rank * self.tp // grid.tp
        self.near_pp = 0 if grid is None else grid.pp_rank * pp // grid.pp
        self._files: dict[str, dict[str, Any]] = {}

    def read(self, name: str, kind: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill ``out`` with the elements [start, start + n) along ``tp_dim`` of the whole
        tensor ``name`` (its parameter or a moment, ``kind``), copied from the saved tp shards
        that intersect that range; zeros past the vocabulary (padding)."""
        entry = self._entry(name)
        d, stage = entry["tp_dim"], self._stage(entry)
        if d is None:                      # not split: every tp shard is a whole copy
            self._copy(out, self.near_tp, 1, stage, name, kind)
            return out
        m, n, r = entry["shard"][d], out.shape[d], entry["replicas"]  # saved, wanted lengths
        stop = max(start, min(start + n, self._length(name, entry)))
        for k in range(self.tp // r):                        # saved part k: [k·m, (k+1)·m),
            lo, hi = max(start, k * m), min(stop, (k + 1) * m)      # held by tp rank k·r
            if lo < hi:
                self._copy(out.narrow(d, lo - start, hi - lo), k, r, stage, name, kind,
                           (d, lo, hi))
        out.narrow(d, stop - start, start + n - stop).zero_()  # vocabulary padding
        return out

    def whole(self, name: str) -> torch.Tensor:
        """The parameter ``name`` whole, vocabulary trimmed: the range [0, whole) of it."""
        entry = self._entry(name)
        shape = list(entry["shard"])
        if entry["tp_dim"] is not None:
            shape[entry["tp_dim"]] = self._length(name, entry)
        like = self._saved(entry["file"].format(tp=0, pp=self._stage(entry)), name, "param")
        return self.read(name, "param", like.new_empty(shape))

    def _length(self, name: str, entry: dict[str, Any]) -> int:
        """The whole tensor's length along ``tp_dim``: the saved shards' sum, but the
        vocabulary's ``vocab_size`` rows (the padding of the saved layout trimmed)."""
        if name in (WORD_EMBEDDING, OUTPUT_LAYER):
            return self.vocab
        return entry["shard"][entry["tp_dim"]] * self.tp // entry["replicas"]

    def _stage(self, entry: dict[str, Any]) -> int:
        """Of the saved stages holding a tensor, the one nearest to the reader's."""
        return min(entry["stages"], key=lambda stage: abs(stage - self.near_pp))

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self.index:
            raise CheckpointError(f"checkpoint {self.path} holds no parameter {name}")
        return self.index[name]

    def _copy(self, out: torch.Tensor, part: int, replicas: int, stage: int, name: str,
              kind: str, piece: tuple[int, int, int] | None = None) -> None:
        """Copy saved part ``part`` (tp rank part·replicas's shard) into ``out``: whole, or
        ``piece`` = (dim, lo, hi), the range [lo, hi) of the whole tensor, inside that part."""
        file = self._entry(name)["file"].format(tp=part * replicas, pp=stage)
        saved = self._saved(file, name, kind, f"tp{part * replicas}_pp{stage}")
        if piece is not None:
            d, lo, hi = piece
            saved = saved.narrow(d, lo - part * saved.shape[d], hi - lo)  # a view: no read
        out.copy_(saved)                                     # reads these pages only
        for log in _active_reads:
            log.append(Read(file, name, kind, None if piece is None else piece[1:],
                            saved.numel()))

    def _saved(self, file: str, name: str, kind: str, place: str = "") -> torch.Tensor:
        if kind != "param" and self.zero:
            return self._assembled(place, name, kind)
        try:
            saved = self._file(file)
            return saved["params"][name] if kind == "param" else saved["moments"][name][kind]
        except KeyError:
            raise CheckpointError(f"corrupt checkpoint file {self.path / file}: it holds no "
                                  f"{kind} of {name}") from None

    def _assembled(self, place: str, name: str, kind: str) -> torch.Tensor:
        """A ZeRO-1 checkpoint's moment of the shard saved at ``place`` (tp…_pp…), put together
        from the pieces every dp (× cp) rank saved of it (one saved shard, never a whole tensor)."""
        out = torch.zeros(self._entry(name)["shard"]).view(-1)
        for d in range(self.owners):
            for offset, moments in self._file(f"optim_{place}_dp{d}.pt")["pieces"].get(name, []):
                out[offset:offset + moments[kind].numel()] = moments[kind].view(-1)
        return out.view(self._entry(name)["shard"])

    def _file(self, file: str) -> dict[str, Any]:
        if file not in self._files:
            self._files[file] = _load(self.path / file)
        return self._files[file]


def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter whole (tp shards joined, vocabulary padding trimmed), by name: for one
    process that needs the whole model (export to Hugging Face)."""
    shards = _Shards(read_metadata(path))
    return {name: shards.whole(name) for name in shards.index}


def load_checkpoint(path: str | Path, trainer: PTDP) -> dict[str, Any]:
    """Load a checkpoint into ``trainer`` (any layout); return its metadata (step, state).

    Each rank reads only the slices of the shard files that its parameters and their moments
    hold. The trainer's step count comes back too: it keys the dropout masks with each
    sample's index (``tensor_parallel/random.py``), the only randomness of a step, so a resumed
    run continues bit for bit — on another layout as well, up to rounding (and, at another tp,
    the attention-probability masks, which are seeded per tp rank).
    """
    meta = read_metadata(path)
    check_model(meta, trainer.config)
    with trainer.gathered():                           # ZeRO-3: each keeps its shard
        by_param = _read_chunks(_Shards(meta, trainer.grid), trainer.chunks, trainer.grid,
                                moments=True)
    _load_optimizer(trainer, by_param)
    trainer.iteration = meta["step"]
    return meta


def load_model_chunks(path: str | Path, chunks: list[torch.nn.Module],
                      grid: ParallelGrid) -> dict[str, Any]:
    """Load a checkpoint's parameters into this rank's model chunks (any layout, reading only
    their slices: evaluation, generation); return its metadata."""
    meta = read_metadata(path)
    check_model(meta, chunks[0].config)
    _read_chunks(_Shards(meta, grid), chunks, grid, moments=False)
    return meta


@torch.no_grad()
def _read_chunks(shards: _Shards, chunks, grid: ParallelGrid,
                 moments: bool) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Fill every parameter of ``chunks`` with its slice; with ``moments``, return their
    AdamW states (none if the checkpoint was saved before the first step)."""
    tp_rank = grid.tp_group.rank
    by_param: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for name, p, i in saved_tensors(chunks):
        d = _tp_dim(p, i)
        start = 0 if d is None else tp_rank // p.tp_replicas * p.shape[p.tp_dim]
        shards.read(name, "param", _part(p, i), start)
        if moments and shards.adam_step and p.requires_grad:   # (an expert bias: no moments)
            state = by_param.setdefault(p, {k: torch.empty_like(p) for k in MOMENTS})
            for k in MOMENTS:
                shards.read(name, k, _part(state[k], i), start)
            state["step"] = torch.tensor(shards.adam_step)
    return by_param


def _load_optimizer(trainer: PTDP, by_param: dict) -> None:
    if not by_param:
        return                                   # saved before the first step
    if trainer.ddp.shards_optimizer:
        trainer.optimizer.load_param_states(by_param)
    else:
        for p, state in by_param.items():
            trainer.optimizer.state[p] = state


def check_model(meta: dict[str, Any], config: GPTConfig) -> None:
    """Raise a CheckpointError naming every size in which the checkpoint's model differs."""
    saved = config_from_dict(meta["config"])
    kinds = (type(saved).__name__, type(config).__name__)
    if kinds[0] != kinds[1]:
        raise CheckpointError(f"checkpoint {meta['path']} holds a {kinds[0]}, not a {kinds[1]}")
    shape = ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "ffn_hidden")
    diff = {k: (getattr(saved, k), getattr(config, k)) for k in shape
            if getattr(saved, k) != getattr(config, k)}
    if diff:
        raise CheckpointError(f"checkpoint {meta['path']} holds another model: " + ", ".join(
            f"{k} {a} in the checkpoint vs {b} here" for k, (a, b) in diff.items()))



# --- export --------------------------------------------------------------------------------------

def export_hf(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write a checkpoint (any layout) as a Hugging Face directory, GPT-2 or Llama, tokenizer
    included: a sentencepiece tokenizer.model, and the same as a fast tokenizer.json
    (``Tokenizer.save_hf``; a run's tokenizer.json as it is) that ``AutoTokenizer`` and
    ``pipeline("text-generation")`` load, its bos, eos and pad ids written into config.json.

    ``out_dir`` must be new or an empty folder, or ``force``: then files there of the same
    names are overwritten. A FileExistsError otherwise, before anything is read or written.
    """
    from megatron_edu.hf import save_hf
    from megatron_edu.model import BertConfig, build_model

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file: export-hf writes a folder (give a new or "
                              f"an empty one)")
    held = len(list(out_dir.iterdir())) if out_dir.is_dir() else 0
    if held and not force:
        entries = "1 entry" if held == 1 else f"{held} entries"
        raise FileExistsError(f"{out_dir} is not empty ({entries}): give a new or an empty "
                              f"folder, or pass --force to write into it")
    meta = read_metadata(checkpoint)
    config = config_from_dict(meta["config"])
    if type(config) is BertConfig:
        raise CheckpointError(f"{meta['path']} holds a BertConfig: a GPT exports as Hugging "
                              f"Face GPT-2, a Llama as Llama, a BERT not at all")
    model = build_model(config)
    model.load_full_state_dict(load_full_model_state(checkpoint))
    save_hf(model, out_dir)
    if meta["tokenizer"] is not None:
        tokenizer = Tokenizer.load(meta["tokenizer"])
        tokenizer.save_hf(out_dir, config.seq_len)
        hf = json.loads((out_dir / "config.json").read_text())
        hf.update({f"{name}_token_id": i if i >= 0 else None for name, i in (
            ("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id))})
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_edu.checkpoint export-hf RUN_OR_CHECKPOINT OUT_DIR [--force]; the exit
    status: 0, 2 when refused (no such checkpoint, OUT a file or not empty), 1 when a write
    fails."""
    parser = Parser(prog="python -m megatron_edu.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export-hf", help="write a Hugging Face GPT-2 directory")
    export.add_argument("checkpoint", help="a run folder (its latest checkpoint) or a checkpoint")
    export.add_argument("out", help="the directory to write: new or empty")
    export.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        print(f"wrote {export_hf(args.checkpoint, args.out, args.force)}")
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: cannot write {args.out}: {_write_failure(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
