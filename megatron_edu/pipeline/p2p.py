"""Messages between pipeline stages, and the two ways of sending them: gloo's and NCCL's.

Every message crossing a stage boundary has one key, ``Message(kind, microbatch, stage)``: an
activation ("act") for virtual stage ``stage`` from the one before it, or a gradient ("grad") for
it from the one after. Chunk c of pipeline rank r is virtual stage c·p + r (2104.04473 §2.2.2),
so sender and receiver follow from the key, and with the interleaved schedule messages wrap from
the last rank to rank 0; ZB-V's V placement (``schedules.virtual_stage``, 2401.10241 §6) turns
at rank p − 1 instead, where stage p − 1 hands over to stage p on the same rank: that message is
``local`` and never touches the wire. A weight-gradient pass W (zero-bubble schedules) neither
receives nor sends.
Every rank knows every schedule (they are data), so every rank knows which messages it will send
and receive, in which order — nothing is negotiated at run time.

The engine asks a transport three things: ``send(message, tensor)`` after an action produced it,
``receive(message)`` before an action needs it, and ``at_point(i)`` before its i-th action (and
once after its last). Two transports answer:

**``MailboxTransport`` (gloo, CPU).** Sends start at once (``isend``) and each is released as soon
as it completes (gloo tells only a ``wait()``, so a helper thread waits for each in turn and drops
its tensor); each (kind, direction) has a two-rank channel of its own (``grid.p2p_channels``)
whose next receive is always posted in advance, so a message lands while the receiver computes
(bench (d): +0.6 % over the simulated bubble, was +1.9 % with blocking receives). A receiver takes
each channel's messages in the order the sender sends them and keeps early arrivals until their
action comes. Safe on gloo: a send completes into the peer's buffer without it, receives are plain
buffers posted on a channel that carries nothing else, and a schedule that ``check_schedule``
accepts reaches every receive.

**``BatchedTransport`` (NCCL, GPU).** NCCL needs more: a send and its receive are one kernel pair
that both sides must launch; a receive left posted spins on the GPU while the rank computes (and
NCCL documents that a device synchronisation, such as the caching allocator freeing memory, can
then deadlock); and an unbatched send or receive on a communicator not yet created makes one
lazily, where two ranks touching their channels in different orders each wait for the other.
So, as Megatron-LM's ``batch_isend_irecv`` p2p and ``torch.distributed.pipelining`` do, neighbours
exchange in **batches that match one to one**: at a fixed point of both their schedules, both
issue one ``batch_isend_irecv`` over the pipeline group (its communicator made eagerly, with the
group: ``device_id`` in ``launch``) holding the same messages in the same order, and wait for it
before computing on. Nothing stays posted across computation. Which messages go in which batch at
which point is decided before the step by ``exchange_plan``, a pure function of the schedule that
every rank computes alike (tests check both sides of every pair on every schedule).
The plan makes each batch an exchange between a rank that has just produced messages and a
neighbour standing between two actions — in 1F1B's steady state exactly Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs.

The scatter/gather optimisation (2104.04473 §4.1): with tensor parallelism the activation between
stages is replicated on the tp ranks, so each sends only its 1/tp slice and the receiver
all-gathers it over the fast intra-node tp group. Both transports share that wire format.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.pipeline.schedules import Action, Schedule, stage_location, virtual_stage

__all__ = ["Message", "messages_of", "messages_placed", "local", "Exchange", "exchange_plan",
           "format_plan", "MailboxTransport", "BatchedTransport", "make_transport", "LABELS"]

LABELS = {"act": "pp activation", "grad": "pp gradient"}  # as comm.record() names them


@dataclass(frozen=True)
class Message:
    """An activation for virtual stage ``stage`` ("act"), or the gradient of its output ("grad")."""

    kind: str
    microbatch: int
    stage: int  # the virtual stage that receives it

    def src(self, p: int, placement: str = "interleaved") -> int:
        """The pipeline rank that sends it: the stage before (act) or after (grad)."""
        return stage_location(self.stage + (-1 if self.kind == "act" else 1), p, placement)[0]

    def dst(self, p: int, placement: str = "interleaved") -> int:
        return stage_location(self.stage, p, placement)[0]


def messages_of(action: Action, rank: int, p: int, num_chunks: int,
                placement: str = "interleaved") -> tuple[Message | None, Message | None]:
    """(what ``action`` on pipeline rank ``rank`` receives, what it sends); None for neither.

    F of virtual stage s takes the activation of s (unless s is the first) and sends one to s+1
    (unless s is the last, which computes the loss); B takes the gradient of s's output (unless
    s is the last: it starts from the loss) and sends its input's gradient to s−1; W keeps to
    itself (the weights' gradient stays on the rank until the optimizer step).
    """
    stage, last = virtual_stage(rank, action.chunk, p, placement), num_chunks * p - 1
    mb = action.microbatch
    if action.kind == "F":
        return (Message("act", mb, stage) if stage > 0 else None,
                Message("act", mb, stage + 1) if stage < last else None)
    if action.kind == "B":
        return (Message("grad", mb, stage) if stage < last else None,
                Message("grad", mb, stage - 1) if stage > 0 else None)
    return None, None


def messages_placed(action: Action, rank: int, p: int, num_chunks: int,
                    placement: str = "interleaved") -> tuple[Message | None, Message | None]:
    """``messages_of``, given ``placement`` only when it is not the default: exercise 05.2 swaps
    in the learner's ``messages_of(action, rank, p, v)``, which knows no placement."""
    if placement == "interleaved":
        return messages_of(action, rank, p, num_chunks)
    return messages_of(action, rank, p, num_chunks, placement)


def local(message: Message, p: int, placement: str = "interleaved") -> bool:
    """Whether ``message`` stays on its rank: ZB-V's turn between stages p − 1 and p."""
    return message.src(p, placement) == message.dst(p, placement)


# --- the exchange plan: matched batches, decided before the step --------------------------------

@dataclass(frozen=True)
class Exchange:
    """One batch between this rank and pipeline rank ``peer``. Both issue it with the same
    ``messages``, in the same order (those the lower rank sends first, each direction in sending
    order); each side sends the messages whose source it is and receives the others."""

    peer: int
    messages: tuple[Message, ...]


Plan = list[list[list[Exchange]]]  # plan[rank][i]: the exchanges before rank's i-th action


def exchange_plan(schedule: Schedule, num_chunks: int = 1, placement: str = "interleaved"
                  ) -> Plan:
    """For every rank and every point of its list (before action i; i = len: after the last),
    the exchanges it runs there, such that the two sides of each pair issue matching batches in
    the same order and every rank receives each input before the action that needs it.

    Played like the simulator, but with rendezvous: each rank runs its actions until it holds
    unsent messages or waits for one; when no rank can move, every pair with messages pending
    exchanges all of them at the points where both stand. Each rank does its exchanges in that
    one global order, so the real run cannot deadlock: the earliest exchange not yet done always
    has both sides ready for it. A schedule that ``check_schedule`` accepts always has a plan.
    A ``local`` message (ZB-V's turn) is in its rank's hands as soon as it is produced.
    """
    p = len(schedule)
    plan: Plan = [[[] for _ in range(len(row) + 1)] for row in schedule]
    position = [0] * p
    inbox: list[set[Message]] = [set() for _ in range(p)]
    outbox: list[list[Message]] = [[] for _ in range(p)]
    while True:
        for rank in range(p):
            _run_until_blocked(schedule, rank, num_chunks, placement, position, inbox, outbox)
        pairs = sorted({tuple(sorted((r, m.dst(p, placement)))) for r in range(p)
                        for m in outbox[r]})
        if not pairs:
            stuck = [r for r in range(p) if position[r] < len(schedule[r])]
            if stuck:
                raise ValueError(f"deadlock: ranks {stuck} wait for messages nobody sends")
            return plan
        for a, b in pairs:
            messages = (tuple(m for m in outbox[a] if m.dst(p, placement) == b)
                        + tuple(m for m in outbox[b] if m.dst(p, placement) == a))
            for rank, peer in ((a, b), (b, a)):
                plan[rank][position[rank]].append(Exchange(peer, messages))
                outbox[rank] = [m for m in outbox[rank] if m not in messages]
            for m in messages:
                inbox[m.dst(p, placement)].add(m)


def format_plan(schedule: Schedule, num_chunks: int = 1, placement: str = "interleaved") -> str:
    """Each rank's actions with its exchanges between them: 'F0 [⇄1 send act0>1] F1 …'."""
    p, plan = len(schedule), exchange_plan(schedule, num_chunks, placement)
    lines = []
    for rank, row in enumerate(schedule):
        items = []
        for i, action in enumerate([*row, None]):
            for e in plan[rank][i]:
                ops = ", ".join(("send " if m.src(p, placement) == rank else "recv ")
                                + f"{m.kind}{m.microbatch}>{m.stage}" for m in e.messages)
                items.append(f"[⇄{e.peer} {ops}]")
            if action is not None:
                items.append(str(action))
        lines.append(f"rank {rank}: " + " ".join(items))
    return "\n".join(lines)


def _run_until_blocked(schedule: Schedule, rank: int, num_chunks: int, placement: str,
                       position: list[int], inbox: list[set[Message]],
                       outbox: list[list[Message]]) -> None:
    """Advance ``rank`` while it has nothing to send and has the input of its next action."""
    row, p = schedule[rank], len(schedule)
    while position[rank] < len(row) and not outbox[rank]:
        needs, sends = messages_placed(row[position[rank]], rank, p, num_chunks, placement)
        if needs is not None and needs not in inbox[rank]:
            return
        inbox[rank].discard(needs)
        if sends is not None:
            (inbox[rank].add if local(sends, p, placement) else outbox[rank].append)(sends)
        position[rank] += 1


# --- the wire: what goes on it, shared by both transports ----------------------------------------

class _Transport:
    """The wire format (dtype, and §4.1's 1/tp slice), the global ranks of neighbours, and the
    hand-over of ``local`` messages (ZB-V's turn), which never touch the wire."""

    def __init__(self, grid: ParallelGrid, shape: tuple[int, ...], dtype: torch.dtype,
                 scatter_gather: bool, placement: str) -> None:
        self.grid, self.dtype, self.scatter_gather = grid, dtype, scatter_gather
        self.placement = placement
        self.handed_over: dict[Message, torch.Tensor] = {}
        self.full_shape = torch.Size(shape)
        numel, parts = self.full_shape.numel(), grid.tp if scatter_gather else 1
        if numel % parts:
            raise ValueError(f"scatter/gather needs the activation ({numel} elements) to divide "
                             f"by tp={parts}")
        self.wire_numel = numel // parts

    def global_rank(self, pp_rank: int) -> int:
        return self.grid.rank_of(self.grid.tp_rank, pp_rank, self.grid.dp_rank)

    def to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The flat payload: the whole tensor, or this tp rank's slice (§4.1). A view: the
        tensor's memory stays alive until the send that holds it is released."""
        if tensor.dtype != self.dtype or tensor.shape != self.full_shape:
            raise ValueError(f"a pipeline message is {tuple(tensor.shape)} {tensor.dtype}, but "
                             f"the receiver expects {tuple(self.full_shape)} {self.dtype}")
        payload = tensor.detach().reshape(-1)
        return payload.chunk(self.grid.tp)[self.grid.tp_rank] if self.scatter_gather else payload

    def buffer(self) -> torch.Tensor:
        return torch.empty(self.wire_numel, dtype=self.dtype, device=self.grid.device)

    def from_wire(self, payload: torch.Tensor) -> torch.Tensor:
        if self.scatter_gather:
            payload = comm.all_gather(payload, self.grid.tp_group, dim=0, label="pp all-gather")
        return payload.view(self.full_shape)

    def local(self, message: Message) -> bool:
        return local(message, self.grid.pp, self.placement)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        """Send ``message`` on the wire, or hand it to this rank's next chunk (the same memory,
        detached: the sender's graph ends here, as if the tensor had crossed ranks)."""
        if self.local(message):
            self.handed_over[message] = tensor.detach()
        else:
            self.send_remote(message, tensor)

    def receive(self, message: Message) -> torch.Tensor:
        if self.local(message):
            return self.handed_over.pop(message)
        return self.receive_remote(message)


class MailboxTransport(_Transport):
    """gloo: sends start at once; each channel's next receive is posted in advance."""

    def __init__(self, schedule: Schedule, num_chunks: int, grid: ParallelGrid,
                 shape: tuple[int, ...], dtype: torch.dtype, scatter_gather: bool,
                 placement: str = "interleaved") -> None:
        super().__init__(grid, shape, dtype, scatter_gather, placement)
        if grid.pp > 1 and not grid.p2p_channels:
            raise ValueError("the mailbox transport needs grid.p2p_channels (made on gloo only)")
        p = grid.pp
        incoming = [m for r in range(p) for m in _sent_by(schedule, r, num_chunks, placement)
                    if m.dst(p, placement) == grid.pp_rank and not self.local(m)]
        # Each channel's messages in the sender's order: the order gloo matches them in.
        self.expected: dict[tuple[str, int], list[Message]] = {}
        for m in incoming:
            self.expected.setdefault(self._stream(m), []).append(m)
        self.posted: dict[tuple[str, int], tuple[Message, torch.Tensor, dist.Work]] = {}
        self.arrived: dict[Message, torch.Tensor] = {}
        self.sending = _SendReleaser()
        for channel in self.expected:
            self._post(channel)

    def _stream(self, message: Message) -> tuple[str, int]:
        """(channel, sender): the in-order stream ``message`` travels on. Its kind's channel —
        the grid has one per kind along the ring: activations forward, gradients back. Under the
        V placement both kinds go both ways between neighbours, and the grid has one channel per
        direction: both kinds then share it, in the sender's order."""
        p, src = self.grid.pp, message.src(self.grid.pp, self.placement)
        if self.placement == "interleaved":
            return message.kind, src
        dst = message.dst(p, self.placement)
        kinds = [k for k in LABELS
                 if (k, self.global_rank(src), self.global_rank(dst)) in self.grid.p2p_channels]
        return kinds[0], src

    def _channel(self, kind: str, src: int, dst: int) -> dist.ProcessGroup:
        return self.grid.p2p_channels[kind, self.global_rank(src), self.global_rank(dst)]

    def _post(self, channel: tuple[str, int]) -> None:
        """Post the receive of the channel's next expected message, if any is left."""
        if not self.expected[channel]:
            return
        kind, src = channel
        message, buffer = self.expected[channel].pop(0), self.buffer()
        work = comm.irecv(buffer, self.global_rank(src), LABELS[message.kind],
                          self._channel(kind, src, self.grid.pp_rank))
        self.posted[channel] = (message, buffer, work)

    def send_remote(self, message: Message, tensor: torch.Tensor) -> None:
        dst = message.dst(self.grid.pp, self.placement)
        kind, _ = self._stream(message)
        self.sending.add(*comm.isend(self.to_wire(tensor), self.global_rank(dst),
                                     LABELS[message.kind],
                                     self._channel(kind, self.grid.pp_rank, dst)))

    def receive_remote(self, message: Message) -> torch.Tensor:
        channel = self._stream(message)
        while message not in self.arrived:  # earlier messages of the channel wait for later
            earliest, buffer, work = self.posted.pop(channel)
            work.wait()
            self.arrived[earliest] = buffer
            self._post(channel)
        return self.from_wire(self.arrived.pop(message))

    def at_point(self, index: int) -> None:
        """Nothing to do between actions: receives are posted, sends released as they complete."""

    def finish(self) -> None:
        self.sending.finish()
        assert not self.posted and not self.handed_over, \
            "a message was expected that no action consumed"


class _SendReleaser:
    """Holds each gloo send's tensor until the send completes, then drops it. gloo reports a send
    complete only to ``wait()`` (``is_completed()`` stays False until then), and waiting here,
    between actions, could block on a peer that waits for us: a thread waits instead, in order."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._release, daemon=True)
        self.thread.start()

    def add(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.queue.put((work, tensor))

    def _release(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                item[0].wait()
            except BaseException as err:  # a peer died: reported by finish()
                self.error = err
            del item  # the tensor's last reference: its memory is freed now

    def finish(self) -> None:
        """Wait until every send has completed."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class BatchedTransport(_Transport):
    """NCCL: matched batches between neighbours at the points ``exchange_plan`` chose."""

    def __init__(self, schedule: Schedule, num_chunks: int, grid: ParallelGrid,
                 shape: tuple[int, ...], dtype: torch.dtype, scatter_gather: bool,
                 placement: str = "interleaved") -> None:
        super().__init__(grid, shape, dtype, scatter_gather, placement)
        self.points = exchange_plan(schedule, num_chunks, placement)[grid.pp_rank]
        self.outbox: dict[Message, torch.Tensor] = {}   # produced, not yet exchanged
        self.inbox: dict[Message, torch.Tensor] = {}    # exchanged, not yet consumed

    def send_remote(self, message: Message, tensor: torch.Tensor) -> None:
        self.outbox[message] = self.to_wire(tensor)

    def receive_remote(self, message: Message) -> torch.Tensor:
        return self.from_wire(self.inbox.pop(message))

    def at_point(self, index: int) -> None:
        for exchange in self.points[index]:
            self._exchange(exchange)

    def _exchange(self, exchange: Exchange) -> None:
        p, ops, received = self.grid.pp, [], {}
        for m in exchange.messages:
            if m.src(p, self.placement) == self.grid.pp_rank:
                ops.append(comm.P2POp("send", self.outbox.pop(m),
                                      self.global_rank(exchange.peer), LABELS[m.kind]))
            else:
                received[m] = self.buffer()
                ops.append(comm.P2POp("recv", received[m], self.global_rank(exchange.peer),
                                      LABELS[m.kind]))
        for work in comm.batch_isend_irecv(ops, self.grid.pp_group):
            work.wait()  # nothing stays posted while this rank computes
        self.inbox.update(received)

    def finish(self) -> None:
        assert not self.outbox and not self.inbox and not self.handed_over, \
            "the exchange plan left a message behind"


def _sent_by(schedule: Schedule, rank: int, num_chunks: int, placement: str
             ) -> Iterator[Message]:
    """The messages pipeline rank ``rank`` sends, in its order."""
    for action in schedule[rank]:
        _, sends = messages_placed(action, rank, len(schedule), num_chunks, placement)
        if sends is not None:
            yield sends


TRANSPORTS = {"mailbox": MailboxTransport, "batched": BatchedTransport}


def make_transport(name: str, schedule: Schedule, num_chunks: int, grid: ParallelGrid,
                   shape: tuple[int, ...], dtype: torch.dtype, scatter_gather: bool,
                   placement: str = "interleaved") -> MailboxTransport | BatchedTransport:
    """``name``: "mailbox", "batched", or "auto" — batched on NCCL, the mailbox elsewhere."""
    if name == "auto":
        name = "batched" if dist.get_backend() == "nccl" else "mailbox"
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of auto, {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name](schedule, num_chunks, grid, shape, dtype, scatter_gather, placement)
