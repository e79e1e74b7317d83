"""Execute a pipeline schedule for real: model chunks, microbatches, send/recv (2104.04473 §2.2).

Each pipeline rank walks its list of actions from ``schedules.py``:

* ``F(mb, c)``: take the microbatch's input — token ids on virtual stage 0, otherwise the
  activation received from the previous virtual stage — run model chunk ``c`` on it, keep input
  and output for the backward pass, and send the output on (the last virtual stage computes the
  loss instead).
* ``B(mb, c)``: backpropagate from the loss (last virtual stage) or from the gradient received
  from the next virtual stage, then send the input's gradient back.

Chunk c on rank r is virtual stage c·p + r (§2.2.2), so messages wrap from the last rank to rank
0 between chunks, and at p = 2 the "previous" and "next" rank are the same rank: activations and
gradients travel the same pair of ranks in both directions. The engine never guesses which
message is which. Every (kind, direction) has a channel of its own (``grid.p2p_channels``), and
every rank knows every schedule (they are data), so a receiver takes each channel's messages
**in the order the sender sends them**, keeping early arrivals until their action comes. Sends
are non-blocking and start as soon as their tensor exists; each channel's next receive is
posted in advance, so the message arrives while the receiver is still computing. In-order
matching per channel is what both gloo and NCCL guarantee (NCCL runs each channel's communicator
on its own stream, so a send waiting for its receiver never blocks traffic the other way), so
the same code runs on both; and a schedule that ``check_schedule`` accepts cannot deadlock here.

The scatter/gather optimisation (2104.04473 §4.1): with tensor parallelism the activation between
stages is replicated on the tp ranks, so each sends only its 1/tp slice and the receiver
all-gathers it over the fast intra-node tp group.

Every action's start and end time is recorded: the measured timeline, in the simulator's format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPT, GPTConfig, stage_layers
from megatron_edu.pipeline.schedules import Action, Schedule

__all__ = ["build_chunks", "PipelineResult", "run_schedule"]


def build_chunks(config: GPTConfig, grid: ParallelGrid, num_chunks: int = 1) -> list[GPT]:
    """This rank's model chunks: chunk c holds virtual stage c·p + r's contiguous layers."""
    config.validate(grid.tp, grid.pp, num_chunks)
    if num_chunks > 1 and grid.pp == 1:
        raise ValueError(f"{num_chunks} model chunks need a pipeline (pp ≥ 2): with one stage "
                         f"there is nothing to interleave")
    last_stage = num_chunks * grid.pp - 1
    chunks = []
    for c in range(num_chunks):
        stage = c * grid.pp + grid.pp_rank
        layers = stage_layers(config.num_layers, grid.pp, grid.pp_rank, num_chunks, c)
        chunk = GPT(config, grid, layers=layers, first=stage == 0, last=stage == last_stage)
        if last_stage > 0 and (chunk.first or chunk.last):
            _mark_tied_copy(chunk.embedding.word.weight, original=chunk.first)
        chunks.append(chunk)
    return chunks


def _mark_tied_copy(weight: nn.Parameter, original: bool) -> None:
    """The word embedding lives on the first and the last virtual stage (GPT-2 ties the output
    layer to it). ``shared_embedding``: ZeRO-1 gives it a bucket of its own, laid out alike on
    both stages; ``shared``: the global grad norm skips the copy, counting the original once."""
    weight.shared_embedding = True
    weight.shared = not original


@dataclass
class PipelineResult:
    """The mean loss over all microbatches (equal on every rank) and this rank's timeline."""

    loss: torch.Tensor
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


LABELS = {"act": "pp activation", "grad": "pp gradient"}  # the two kinds of message


@dataclass(frozen=True)
class _Message:
    kind: str  # "act" (forward, to the next virtual stage) or "grad" (backward, to the previous)
    microbatch: int
    stage: int  # the virtual stage that receives it


class _Mailbox:
    """Receives each channel's messages in the order they are sent (see the module docstring)."""

    def __init__(self, schedule: Schedule, num_chunks: int, grid: ParallelGrid, shape, dtype,
                 scatter_gather: bool) -> None:
        self.grid, self.dtype, self.scatter_gather = grid, dtype, scatter_gather
        self.full_shape = torch.Size(shape)
        self.wire_shape = self._wire_shape(shape, grid.tp if scatter_gather else 1)
        self.expected = {(peer, kind): [m for m in _outgoing(schedule, peer, num_chunks,
                                                             to=grid.pp_rank) if m.kind == kind]
                         for peer in range(grid.pp) for kind in LABELS}
        self.arrived: dict[_Message, torch.Tensor] = {}
        self.pending_sends: list = []
        # Each channel's next message is always awaited with a posted receive, so that it lands
        # while this rank computes (a channel's stream carries nothing else: safe on NCCL too).
        self.posted: dict[tuple[int, str], tuple[_Message, torch.Tensor, dist.Work]] = {}
        for peer, kind in self.expected:
            self._post(peer, kind)

    @staticmethod
    def _wire_shape(shape, parts: int) -> torch.Size:
        numel = torch.Size(shape).numel()
        if numel % parts:
            raise ValueError(f"scatter/gather needs the activation ({numel} elements) to divide "
                             f"by tp={parts}")
        return torch.Size([numel // parts])

    def send(self, tensor: torch.Tensor, to_pp_rank: int, kind: str) -> None:
        payload = tensor.detach().reshape(-1)
        if self.scatter_gather:  # §4.1: this tp rank's slice only
            payload = payload.chunk(self.grid.tp)[self.grid.tp_rank]
        dst = self.grid.rank_of(self.grid.tp_rank, to_pp_rank, self.grid.dp_rank)
        channel = self.grid.p2p_channels[kind, self.grid.rank, dst]
        self.pending_sends.append(comm.isend(payload, dst, LABELS[kind], channel))

    def _post(self, from_pp_rank: int, kind: str) -> None:
        """Post the receive of the channel's next expected message, if any is left."""
        queue = self.expected[from_pp_rank, kind]
        if not queue:
            return
        src = self.grid.rank_of(self.grid.tp_rank, from_pp_rank, self.grid.dp_rank)
        buffer = torch.empty(self.wire_shape, dtype=self.dtype, device=self.grid.device)
        work = comm.irecv(buffer, src, LABELS[kind], self.grid.p2p_channels[kind, src,
                                                                            self.grid.rank])
        self.posted[from_pp_rank, kind] = (queue.pop(0), buffer, work)

    def receive(self, message: _Message, from_pp_rank: int) -> torch.Tensor:
        while message not in self.arrived:  # earlier messages of the channel are kept for later
            earliest, buffer, work = self.posted.pop((from_pp_rank, message.kind))
            work.wait()
            self.arrived[earliest] = buffer
            self._post(from_pp_rank, message.kind)
        payload = self.arrived.pop(message)
        if self.scatter_gather:
            payload = comm.all_gather(payload, self.grid.tp_group, dim=0, label="pp all-gather")
        return payload.view(self.full_shape)

    def finish(self) -> None:
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
        assert not self.posted, "a message was expected that no action consumed"


def _outgoing(schedule: Schedule, sender: int, num_chunks: int, to: int):
    """The messages pipeline rank ``sender`` sends to pipeline rank ``to``, in its order."""
    p = len(schedule)
    for action in schedule[sender]:
        stage = action.chunk * p + sender
        if action.kind == "F" and stage < num_chunks * p - 1 and (stage + 1) % p == to:
            yield _Message("act", action.microbatch, stage + 1)
        if action.kind == "B" and stage > 0 and (stage - 1) % p == to:
            yield _Message("grad", action.microbatch, stage - 1)


def run_schedule(
    schedule: Schedule,
    chunks: Sequence[nn.Module],
    grid: ParallelGrid,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    num_microbatches: int,
    hidden: int,
    *,
    scatter_gather: bool = False,
    grad_sync: Callable[[int, bool], AbstractContextManager] | None = None,
) -> PipelineResult:
    """Run this rank's list of ``schedule`` over ``chunks``: one forward-backward of the batch.

    ``input_ids`` and ``labels`` are this data-parallel replica's batch [b, s] (every pipeline
    rank may pass it; only the first and last stage read it), cut into ``num_microbatches``.
    Gradients accumulate in the chunks' parameters (the loss is the microbatch mean, so they equal
    the full batch's). ``grad_sync(chunk, is_last_backward)`` wraps every backward pass: a
    data-parallel wrapper launches its all-reduces only in each chunk's last one (§2.1).
    """
    p, v, m = grid.pp, len(chunks), num_microbatches
    if input_ids.shape[0] % m:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences does not split into "
                         f"{m} microbatches")
    ids, targets = input_ids.chunk(m), labels.chunk(m)
    mb, seq = ids[0].shape
    dtype = next(chunks[0].parameters()).dtype
    mailbox = _Mailbox(schedule, v, grid, (mb, seq, hidden), dtype, scatter_gather)
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    backwards_left = [m] * v
    losses = []
    timeline = []
    if grid.pp > 1:
        dist.barrier(group=grid.pp_group.pg)  # a common time origin for the timeline
    origin = time.perf_counter()
    for action in schedule[grid.pp_rank]:
        stage, c = action.chunk * p + grid.pp_rank, action.chunk
        if action.kind == "F":
            x = (ids[action.microbatch] if stage == 0 else
                 mailbox.receive(_Message("act", action.microbatch, stage),
                                 (stage - 1) % p).requires_grad_())
            start = time.perf_counter()
            out = chunks[c](x, targets[action.microbatch] if stage == v * p - 1 else None)
            if stage == v * p - 1:
                losses.append(out.detach())
                out = out / m  # the step's loss is the mean over microbatches
            else:
                mailbox.send(out, (stage + 1) % p, "act")
            saved[action.microbatch, c] = (x if stage > 0 else None, out)
        else:
            x, out = saved.pop((action.microbatch, c))
            grad = (None if stage == v * p - 1 else
                    mailbox.receive(_Message("grad", action.microbatch, stage),
                                    (stage + 1) % p))
            start = time.perf_counter()
            backwards_left[c] -= 1
            with (grad_sync(c, backwards_left[c] == 0) if grad_sync else nullcontext()):
                torch.autograd.backward(out, grad)
            if stage > 0:
                mailbox.send(x.grad, (stage - 1) % p, "grad")
        timeline.append((action, start - origin, time.perf_counter() - origin))
    mailbox.finish()
    return PipelineResult(_mean_loss(losses, grid, dtype), timeline)


def _mean_loss(losses: list[torch.Tensor], grid: ParallelGrid, dtype) -> torch.Tensor:
    """The last stage's mean microbatch loss, shared with every pipeline rank (for printing)."""
    loss = (torch.stack(losses).mean() if losses else
            torch.zeros((), dtype=dtype, device=grid.device))
    return comm.all_reduce(loss, grid.pp_group, label="pp loss")
