"""Execute a pipeline schedule for real: model chunks, microbatches, messages (2104.04473 §2.2).

Each pipeline rank runs its list from ``schedules.py`` (F, B and, with the backward split, W:
2401.10241, ``backward.py``), receiving and sending what ``schedules.messages_of`` says through a
transport (``p2p.py``). The last virtual stage computes the loss.

**Memory.** 1F1B holds at most p microbatches' activations, not GPipe's m (§2.2.1), so nothing
here outlives what the schedule says: a send's tensor is released when the send completes, not at
the step's end; a sent output's values are freed (Megatron-LM's ``deallocate_output_tensor``),
keeping only its autograd node, which is why backward bypasses ``torch.autograd.backward``'s shape
check (``backward.backward``); a microbatch's kept input and output go with its B (or its W).
``PipelineResult.peak_boundary_tensors`` counts boundary tensors alive at once, by storage.

**The loss** is the token mean (labels ≠ −100) of the whole batch, across microbatches and, via
``num_tokens``, replicas: a mean of microbatch means would weight a padded microbatch like a full
one. **Dropout** masks are keyed by (seed, ``step``, global sample, layer), independent of the cut
into microbatches, stages or replicas (``random.py``). Every action's start and end is recorded
(``timing.Clock``): a measured timeline in the simulator's format.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPT, GPTConfig, build_model
from megatron_edu.model.gpt import IGNORE_INDEX
from megatron_edu.model.moe import aux_loss_scale
from megatron_edu.pipeline.backward import WeightPass, backward, backward_input
from megatron_edu.pipeline.p2p import make_transport
from megatron_edu.pipeline.schedules import Action, MessagesOf, Schedule, messages_of
from megatron_edu.pipeline.stages import StageMap
from megatron_edu.tensor_parallel.random import DropoutKey
from megatron_edu.timing import Clock

__all__ = ["build_chunks", "Batch", "RunSettings", "PipelineResult", "run_schedule"]


def build_chunks(config: GPTConfig, grid: ParallelGrid, stages: StageMap | None = None
                 ) -> list[GPT]:
    """This rank's model chunks: chunk c holds the contiguous layers of virtual stage
    ``stages.stage(pp_rank, c)`` — c·p + r, or ZB-V's V (default: one chunk, stage pp_rank)."""
    stages = stages or StageMap.plain(grid.pp)
    if stages.p != grid.pp:
        raise ValueError(f"the stage map has p = {stages.p} pipeline ranks, the grid "
                         f"pp = {grid.pp}")
    chunks = []
    for c in range(stages.v):
        stage = stages.stage(grid.pp_rank, c)
        chunks.append(build_model(config, grid, layers=stages.layers(stage, config.num_layers),
                                  first=stage == 0, last=stage == stages.num_stages - 1))
    return chunks


@dataclass(frozen=True)
class Batch:
    """One replica's [b, s] ids and labels of one step (only the first and last stage read them).
    ``step`` and the global index of ``first_sample`` key the dropout masks; ``num_tokens``: the
    target tokens the loss averages over, the global batch's under data parallelism (None: this
    batch's), a number or a tensor on the device (not read back: no host sync)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    step: int = 0
    first_sample: int = 0
    num_tokens: int | torch.Tensor | None = None


@dataclass(frozen=True)
class RunSettings:
    """How a step runs, beside what it computes. ``scatter_gather``: send 1/tp of an activation
    replicated over tp, all-gathered on receipt (2104.04473 §4.1). ``transport``: "auto", "batched"
    or "mailbox" (``p2p.py``). ``grad_sync(chunk, is_last)`` wraps each pass that accumulates
    weight gradients (B, or W when split): data parallelism communicates in a chunk's last (§2.1).
    ``loss_scale``: fp16 loss scaling of backward (the reported loss is unscaled). ``messages``:
    what each action receives and sends (exercise 05.2 passes the learner's). ``timeline``: time
    each action (on a GPU: a barrier, and events read back at the end: host syncs a training
    step does without)."""

    scatter_gather: bool = False
    transport: str = "auto"
    grad_sync: Callable[[int, bool], AbstractContextManager] | None = None
    loss_scale: float = 1.0
    messages: MessagesOf = messages_of
    timeline: bool = True


@dataclass
class PipelineResult:
    """This replica's loss (its share of the batch's token mean; equal on every pipeline rank),
    this rank's timeline, and the most stage-boundary tensors it held alive at once."""

    loss: torch.Tensor
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_boundary_tensors: int = 0


def run_schedule(schedule: Schedule, chunks: Sequence[nn.Module], grid: ParallelGrid,
                 batch: Batch, settings: RunSettings | None = None) -> PipelineResult:
    """Run this rank's list of ``schedule`` over ``chunks`` (``build_chunks``): one
    forward-backward of the batch; gradients accumulate in the chunks' parameters. A chunk is
    called as a GPT stage: ``chunk(x, dropout_key=key)`` returns the next stage's input, of
    ``chunk.boundary_shape(ids.shape)``; the last stage's ``chunk(x, labels, dropout_key=key,
    loss_reduction="sum")`` the summed token losses."""
    settings = settings or RunSettings()
    m = schedule.num_microbatches
    if batch.input_ids.shape[0] % m:
        raise ValueError(f"batch of {batch.input_ids.shape[0]} sequences does not split into "
                         f"{m} microbatches")
    if len(chunks) != schedule.stages.v:
        raise ValueError(f"{len(chunks)} chunks on this rank, but the schedule runs "
                         f"{schedule.stages.v} per rank ({schedule.stages})")
    ids = batch.input_ids.chunk(m)
    wire = make_transport(settings.transport, schedule, grid, chunks[0].boundary_shape(
        ids[0].shape), residual_dtype(chunks[0]), settings.scatter_gather, settings.messages)
    run = _Run(schedule, chunks, grid, batch, settings, wire)
    with aux_loss_scale(settings.loss_scale / run.num_tokens):  # as the loss's (experts' balance)
        return run.execute()


class _Run:
    """One step of one rank: its actions, what each microbatch keeps, and the losses."""

    def __init__(self, schedule: Schedule, chunks: Sequence[nn.Module], grid: ParallelGrid,
                 batch: Batch, settings: RunSettings, wire) -> None:
        self.schedule, self.chunks, self.grid, self.wire = schedule, chunks, grid, wire
        self.batch, self.settings, self.stages = batch, settings, schedule.stages
        m = schedule.num_microbatches
        self.ids, self.targets = batch.input_ids.chunk(m), batch.labels.chunk(m)
        self.num_tokens = ((batch.labels != IGNORE_INDEX).sum() if batch.num_tokens is None
                           else batch.num_tokens)
        self.split = schedule.splits_backward  # B is the input gradient only; W the weights'
        self.kept: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.weight_passes: dict[tuple[int, int], WeightPass] = {}
        self.weight_passes_left = [m] * len(chunks)  # B's, or W's when split: per chunk
        self.losses: list[torch.Tensor] = []
        self.boundary = _LiveTensors()

    def execute(self) -> PipelineResult:
        actions = self.schedule[self.grid.pp_rank]
        clock = _Stopwatch(self.grid) if self.settings.timeline else _NoStopwatch()
        for i, action in enumerate(actions):
            self.wire.at_point(i)
            receives, sends = self.settings.messages(action, self.grid.pp_rank, self.stages)
            x = self.wire.receive(receives) if receives is not None else None
            start = clock.stamp()
            out = {"F": self._forward, "B": self._backward, "W": self._weights}[action.kind](
                action, x)
            clock.note(action, start)
            if sends is not None:
                self.wire.send(sends, out)
                _free_output(out)
        self.wire.at_point(len(actions))
        self.wire.finish()
        return PipelineResult(self._loss(), clock.timeline(), self.boundary.peak)

    def _forward(self, action: Action, x: torch.Tensor | None) -> torch.Tensor:
        mb, c = action.microbatch, action.chunk
        stage = self.stages.stage(self.grid.pp_rank, c)
        last = stage == self.stages.num_stages - 1
        if x is None:
            x = self.ids[mb]                                   # virtual stage 0: token ids
        else:
            self.boundary.add(x)
            x.requires_grad_(torch.is_grad_enabled())
        b, first = len(self.ids[mb]), self.batch.first_sample
        key = DropoutKey(self.batch.step, tuple(range(first + mb * b, first + (mb + 1) * b)))
        if last:   # its share of the token mean: Σ token losses / all target tokens
            out = self.chunks[c](x, self.targets[mb], dropout_key=key, loss_reduction="sum")
            out = out / self.num_tokens
            self.losses.append(out.detach())
            out = out * self.settings.loss_scale  # backward from the scaled loss (fp16)
        else:
            out = self.chunks[c](x, dropout_key=key)
            self.boundary.add(out)
        if torch.is_grad_enabled():
            self.kept[mb, c] = (x if stage > 0 else None, out)
        return out

    def _backward(self, action: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The whole backward pass, or (zero bubble) the input's gradient only."""
        key = (action.microbatch, action.chunk)
        x, out = self.kept.pop(key)
        if grad is not None:
            self.boundary.add(grad)
        if self.split:
            x_grad, self.weight_passes[key] = backward_input(out, grad, x)
        else:
            with self._sync(action.chunk):
                backward(out, grad)
            x_grad = x.grad if x is not None else None
        if x_grad is not None:
            self.boundary.add(x_grad)
        return x_grad

    def _weights(self, action: Action, _: None) -> None:
        """W (zero bubble): the weights' gradient of a microbatch whose B has run."""
        with self._sync(action.chunk):
            self.weight_passes.pop((action.microbatch, action.chunk)).run()

    def _sync(self, chunk: int) -> AbstractContextManager:
        """``grad_sync`` around a pass that accumulates weight gradients; says if it is the
        chunk's last (a data-parallel wrapper then launches its all-reduces)."""
        self.weight_passes_left[chunk] -= 1
        last = self.weight_passes_left[chunk] == 0
        sync = self.settings.grad_sync
        return sync(chunk, last) if sync else nullcontext()

    def _loss(self) -> torch.Tensor:
        """The last stage's sum of microbatch shares, shared with every pipeline rank."""
        loss = (torch.stack(self.losses).sum().float() if self.losses else
                torch.zeros((), dtype=torch.float32, device=self.grid.device))
        return comm.all_reduce(loss, self.grid.pp_group, label="pp loss")


def residual_dtype(chunk: nn.Module) -> torch.dtype:
    """The residual stream's dtype, so the messages' between stages: autocast's compute dtype
    (bf16: half the bytes of fp32, as Megatron-LM sends), else the parameters'."""
    param = next(chunk.parameters())
    return comm.compute_dtype(param.device.type, param.dtype)


class _Stopwatch:
    """Each action's start and end on a common origin (a barrier of the pipeline ranks): for
    the timelines of notebooks 04–05 and the bubble benchmark, not for training steps."""

    def __init__(self, grid: ParallelGrid) -> None:
        self.clock = Clock(grid.device)
        comm.barrier(grid.pp_group)
        self.origin, self.stamps = self.clock.stamp(), []

    def stamp(self):
        return self.clock.stamp()

    def note(self, action: Action, start) -> None:
        self.stamps.append((action, start, self.clock.stamp()))

    def timeline(self) -> list[tuple[Action, float, float]]:
        """(action, start, end) in seconds from the origin (reads a GPU's events back)."""
        zero = self.clock.seconds(self.origin)
        return [(a, self.clock.seconds(s) - zero, self.clock.seconds(e) - zero)
                for a, s, e in self.stamps]


class _NoStopwatch:
    """No timeline asked for: nothing recorded, nothing synchronised."""

    def stamp(self) -> None:
        return None

    def note(self, action: Action, start: None) -> None:
        pass

    def timeline(self) -> list[tuple[Action, float, float]]:
        return []


def _free_output(out: torch.Tensor) -> None:
    """Free a sent stage output's values, keeping the tensor for its autograd node. Safe only for
    a tensor that owns its memory and autograd did not save: a stage ends in a residual add, which
    saves nothing (Megatron-LM asserts the same)."""
    if not out.requires_grad:
        return  # no backward will come (evaluation): nothing is kept anyway
    if out._base is not None:
        raise ValueError("a stage's output must not be a view: its memory could not be freed")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


class _LiveTensors:
    """How many registered tensors still hold memory (counted by storage, freed ones drop)."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.storages or storage.nbytes() == 0:
            return
        self.storages.add(key)
        self.peak = max(self.peak, len(self.storages))
        weakref.finalize(storage, self.storages.discard, key)
