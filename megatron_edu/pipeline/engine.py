"""Execute a pipeline schedule for real: model chunks, microbatches, messages (2104.04473 §2.2).

Each pipeline rank walks its list of actions from ``schedules.py``:

* ``F(mb, c)``: take the microbatch's input — token ids on virtual stage 0, otherwise the
  activation received from the previous virtual stage — run model chunk ``c`` on it, keep what
  the backward pass needs, and send the output on (the last virtual stage computes the loss).
* ``B(mb, c)``: backpropagate from the loss (last virtual stage) or from the gradient received
  from the next virtual stage, then send the input's gradient back.
* ``W(mb, c)``, in a zero-bubble schedule (2401.10241): the weights' gradient. B then computes
  only the input's gradient and leaves W what it needs (``backward.py``); W accumulates into
  the parameters' ``.grad`` and sends nothing.

Which virtual stage chunk c of rank r holds is the schedule's ``StageMap`` (c·p + r, §2.2.2, or
ZB-V's V); what each action receives and sends is ``schedules.messages_of`` — the same data flow
that ``check_schedule`` and the simulator read. Messages go through a transport
(``p2p.py``): on gloo a mailbox with receives posted in advance, on NCCL batches that both
neighbours issue at the same point of their schedules — the engine asks the same three things of
either.

**Memory.** 1F1B exists to hold at most p microbatches' activations instead of GPipe's m (§2.2.1),
so nothing here may keep a microbatch alive longer than the schedule says:

* a sent tensor is released as soon as its send completes, not at the end of the step;
* a stage's output is freed once it is sent (Megatron-LM's ``deallocate_output_tensor``): only
  its autograd node is needed for backward, the values live on in the next stage. Its ``.data``
  becomes a one-element tensor, and backward then goes through autograd's engine directly
  (Megatron-LM's ``custom_backward``), since ``torch.autograd.backward`` would reject a gradient
  whose shape differs from the freed output's;
* what each microbatch keeps — its input (for the input's gradient) and its output's node — is
  dropped by its backward pass; with the backward split, what W needs lives until W.

``PipelineResult.peak_boundary_tensors`` counts how many tensors crossing a stage boundary were
alive at once (by their storage, so a freed output no longer counts); tests measure the peak
bytes, too.

**The loss** is the mean over target tokens (labels ≠ −100) of the whole batch — across
microbatches, and across data-parallel replicas when ``num_tokens`` counts theirs too — not a mean
of microbatch means, which would weight a padded microbatch like a full one: each microbatch adds
its summed token losses divided by that count.

**Dropout** masks are drawn from (seed, ``step``, global sample index, layer), so they do not
depend on how the batch is cut into microbatches, stages or replicas (``random.py``).

Every action's start and end is recorded (``timing.Clock``: CUDA events on a GPU): the measured
timeline, in the simulator's format.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPT, GPTConfig, build_model
from megatron_edu.model.gpt import IGNORE_INDEX
from megatron_edu.pipeline.backward import WeightPass, backward, backward_input
from megatron_edu.pipeline.p2p import make_transport
from megatron_edu.pipeline.schedules import Action, MessagesOf, Schedule, messages_of
from megatron_edu.pipeline.stages import StageMap
from megatron_edu.tensor_parallel.random import DropoutKey
from megatron_edu.timing import Clock

__all__ = ["build_chunks", "PipelineResult", "run_schedule"]


def build_chunks(config: GPTConfig, grid: ParallelGrid, stages: StageMap) -> list[GPT]:
    """This rank's model chunks: chunk c holds the contiguous layers of virtual stage
    ``stages.stage(pp_rank, c)`` — c·p + r, or ZB-V's V."""
    if stages.p != grid.pp:
        raise ValueError(f"the stage map has p = {stages.p} pipeline ranks, the grid "
                         f"pp = {grid.pp}")
    chunks = []
    for c in range(stages.v):
        stage = stages.stage(grid.pp_rank, c)
        chunks.append(build_model(config, grid, layers=stages.layers(stage, config.num_layers),
                                  first=stage == 0, last=stage == stages.num_stages - 1))
    return chunks


@dataclass
class PipelineResult:
    """This replica's loss (its share of the batch's token mean; equal on every pipeline rank),
    this rank's timeline, and the most stage-boundary tensors it held alive at once."""

    loss: torch.Tensor
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_boundary_tensors: int = 0


def run_schedule(
    schedule: Schedule,
    chunks: Sequence[nn.Module],
    grid: ParallelGrid,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    hidden: int,
    *,
    scatter_gather: bool = False,
    grad_sync: Callable[[int, bool], AbstractContextManager] | None = None,
    transport: str = "auto",
    num_tokens: int | None = None,
    step: int = 0,
    first_sample: int = 0,
    loss_scale: float = 1.0,
    sequence_parts: int = 1,
    messages: MessagesOf = messages_of,
) -> PipelineResult:
    """Run this rank's list of ``schedule`` over ``chunks``: one forward-backward of the batch.

    ``chunks`` are called as GPT stages are: ``chunk(x, dropout_key=key)`` returns the next
    stage's input [b, s, hidden] (in the parameters' dtype), and on the last virtual stage
    ``chunk(x, labels, dropout_key=key, loss_reduction="sum")`` the summed token losses.
    ``input_ids`` and ``labels`` are this data-parallel replica's batch [b, s] (every pipeline
    rank may pass it; only the first and last stage read it), cut into the schedule's microbatches.
    Gradients accumulate in the chunks' parameters. ``num_tokens``: the target tokens the loss
    is averaged over (default: this batch's; PTD-P passes the global batch's).
    ``grad_sync(chunk, is_last_backward)`` wraps every pass that accumulates weight gradients —
    each B, or each W when the schedule has W actions: a data-parallel wrapper launches its
    all-reduces only in each chunk's last one (§2.1). ``transport``: "auto"
    (batched on NCCL, mailbox on gloo), "batched" or "mailbox" (``p2p.py``). ``step`` and
    ``first_sample`` (the global index of this batch's first sequence) key the dropout masks.
    ``loss_scale``: backward starts from the loss times this (fp16's loss scaling; the reported
    loss is not scaled). ``sequence_parts``: the stages exchange 1/parts of each sequence
    (sequence parallelism over tp: each tp rank sends its own part, so §4.1's scatter/gather
    has nothing left to save). ``messages``: what each action receives and sends (exercise
    05.2 passes the learner's). Where the chunks live is the schedule's own ``stages``, which
    ``build_chunks`` built them by.
    """
    m = schedule.num_microbatches
    if input_ids.shape[0] % m:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences does not split into "
                         f"{m} microbatches")
    if input_ids.shape[1] % sequence_parts:
        raise ValueError(f"{input_ids.shape[1]} tokens do not split into {sequence_parts} parts")
    shape = (input_ids.shape[0] // m, input_ids.shape[1] // sequence_parts, hidden)
    if len(chunks) != schedule.stages.v:
        raise ValueError(f"{len(chunks)} chunks on this rank, but the schedule runs "
                         f"{schedule.stages.v} per rank ({schedule.stages})")
    wire = make_transport(transport, schedule, grid, shape, _boundary_dtype(chunks),
                          scatter_gather, messages)
    if num_tokens is None:
        num_tokens = int((labels != IGNORE_INDEX).sum())
    return _Run(schedule, chunks, grid, wire, input_ids.chunk(m), labels.chunk(m), grad_sync,
                step, first_sample, num_tokens, loss_scale, messages).execute()


def _boundary_dtype(chunks: Sequence[nn.Module]) -> torch.dtype:
    """The dtype of activations between stages: the residual stream's, the parameters' (fp32
    under autocast: Megatron-LM's ``fp32_residual_connection``); checked on every message."""
    return next(chunks[0].parameters()).dtype


class _Run:
    """One step of one rank: its actions, what each microbatch keeps, and the losses."""

    def __init__(self, schedule, chunks, grid, wire, ids, targets, grad_sync, step, first_sample,
                 num_tokens, loss_scale, messages) -> None:
        self.schedule, self.chunks, self.grid, self.wire = schedule, chunks, grid, wire
        self.ids, self.targets, self.grad_sync = ids, targets, grad_sync
        self.step, self.first_sample, self.num_tokens = step, first_sample, num_tokens
        self.loss_scale, self.messages, self.stages = loss_scale, messages, schedule.stages
        self.split = schedule.splits_backward  # B is the input gradient only; W the weights'
        self.kept: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.weight_passes: dict[tuple[int, int], WeightPass] = {}
        self.weight_passes_left = [len(ids)] * len(chunks)  # B's, or W's when split: per chunk
        self.losses: list[torch.Tensor] = []
        self.boundary = _LiveTensors()

    def execute(self) -> PipelineResult:
        actions = self.schedule[self.grid.pp_rank]
        clock = Clock(self.grid.device)
        if self.grid.pp > 1:
            dist.barrier(group=self.grid.pp_group.pg)  # a common time origin for the timeline
        origin, stamps = clock.stamp(), []
        for i, action in enumerate(actions):
            self.wire.at_point(i)
            receives, sends = self.messages(action, self.grid.pp_rank, self.stages)
            x = self.wire.receive(receives) if receives is not None else None
            start = clock.stamp()
            out = {"F": self._forward, "B": self._backward, "W": self._weights}[action.kind](
                action, x)
            stamps.append((action, start, clock.stamp()))
            if sends is not None:
                self.wire.send(sends, out)
                _free_output(out)
        self.wire.at_point(len(actions))
        self.wire.finish()
        zero = clock.seconds(origin)
        timeline = [(a, clock.seconds(s) - zero, clock.seconds(e) - zero) for a, s, e in stamps]
        return PipelineResult(self._loss(), timeline, self.boundary.peak)

    def _forward(self, action: Action, x: torch.Tensor | None) -> torch.Tensor:
        mb, c = action.microbatch, action.chunk
        stage = self.stages.stage(self.grid.pp_rank, c)
        last = stage == self.stages.num_stages - 1
        if x is None:
            x = self.ids[mb]                                   # virtual stage 0: token ids
        else:
            self.boundary.add(x)
            x.requires_grad_(torch.is_grad_enabled())
        b = len(self.ids[mb])
        key = DropoutKey(self.step, tuple(range(self.first_sample + mb * b,
                                                self.first_sample + (mb + 1) * b)))
        if last:   # its share of the token mean: Σ token losses / all target tokens
            out = self.chunks[c](x, self.targets[mb], dropout_key=key, loss_reduction="sum")
            out = out / self.num_tokens
            self.losses.append(out.detach())
            out = out * self.loss_scale  # backward from the scaled loss (fp16)
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
        return self.grad_sync(chunk, last) if self.grad_sync else nullcontext()

    def _loss(self) -> torch.Tensor:
        """The last stage's sum of microbatch shares, shared with every pipeline rank."""
        loss = (torch.stack(self.losses).sum().float() if self.losses else
                torch.zeros((), dtype=torch.float32, device=self.grid.device))
        return comm.all_reduce(loss, self.grid.pp_group, label="pp loss")


# --- freeing a sent output (backward.py's passes still work after it) -----------------------------

def _free_output(out: torch.Tensor) -> None:
    """Free the values of a stage's output once sent; keep the tensor for its autograd node.

    Safe only for a tensor that owns its memory and that autograd did not save: the stage's
    last operation is a residual add, which saves nothing (Megatron-LM asserts the same).
    """
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
