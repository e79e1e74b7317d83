"""Messages between pipeline stages, and two transports for them: gloo's and NCCL's.

A message's key is ``stages.Message(kind, microbatch, stage)``; the ``StageMap`` says who sends
and receives it (or that it stays on its rank: ZB-V's turn), ``schedules.messages_of`` which
action. Schedules are data, so each rank knows all its messages in advance, in order. The engine
calls ``send(message, tensor)``, ``receive(message)`` and ``at_point(i)`` before action i (and
after the last).

**``MailboxTransport`` (gloo, CPU).** Sends start at once and a helper thread releases each as it
completes (gloo reports completion only to ``wait()``). Each (kind, direction) has its own channel
(``grid.p2p_channels``) whose next receive is always posted, so a message lands while the
receiver computes. Safe on gloo: a send completes without its receive, and a channel carries
nothing else.

**``BatchedTransport`` (NCCL, GPU).** On NCCL a send and its receive are one kernel pair both
sides must launch; a receive left posted spins on the GPU while the rank computes (and can
deadlock with a device synchronisation, such as the caching allocator freeing memory); a lazily
created communicator deadlocks ranks that reach it in different orders. So, as Megatron-LM does,
neighbours exchange in batches that match one to one: at a point of both schedules fixed by
``exchange_plan``, both issue one ``batch_isend_irecv`` (communicator made eagerly: ``device_id``
in ``launch``) with the same messages in the same order, and wait for it. In 1F1B's steady state
these are Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``. A batch
of sends only is not waited for before the next compute (Megatron-LM's ``overlap_p2p_comm``), but
at the next exchange or the end of the step. Both
transports share the wire format (``Whole``, or 2104.04473 §4.1's ``ScatterGather``).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.pipeline.schedules import Action, Meeting, MessagesOf, Schedule, messages_of, walk
from megatron_edu.pipeline.stages import Message, StageMap

__all__ = ["exchange_plan", "make_transport", "LABELS"]

LABELS = {"act": "pp activation", "grad": "pp gradient"}  # as comm.record() names them


# --- the exchange plan: matched batches, decided before the step --------------------------------
@dataclass(frozen=True)
class Exchange:
    """One batch with pipeline rank ``peer``: both sides issue the same ``messages`` in the same
    order (the lower rank's first); each sends those it is the source of, receives the rest."""

    peer: int
    messages: tuple[Message, ...]


Plan = tuple[tuple[tuple[Exchange, ...], ...], ...]  # plan[rank][i]: before rank's i-th action


def exchange_plan(schedule: Schedule, messages: MessagesOf = messages_of) -> Plan:
    """Per rank and point of its list (before action i; i = len: after the last), the exchanges
    it runs there: the meetings of ``schedules.walk``. Every rank runs them in the walk's one
    global order, so the earliest not yet done always has both sides ready: no deadlock (every
    schedule ``check_schedule`` accepts has a plan). Cached (the walk takes tens of ms at p = 8,
    m = 64), hence immutable."""
    return _plan(tuple(map(tuple, schedule)), schedule.stages, messages)


@lru_cache(maxsize=64)
def _plan(rows: tuple[tuple[Action, ...], ...], stages: StageMap, messages: MessagesOf) -> Plan:
    plan: list[list[list[Exchange]]] = [[[] for _ in range(len(row) + 1)] for row in rows]
    for event in walk(Schedule(rows, stages), messages):
        if isinstance(event, Meeting):
            (a, b), (at_a, at_b) = event.ranks, event.at
            plan[a][at_a].append(Exchange(b, event.messages))
            plan[b][at_b].append(Exchange(a, event.messages))
    return tuple(tuple(map(tuple, row)) for row in plan)


# --- the wire: what goes on it, shared by both transports ----------------------------------------
class Whole:
    """A message on the wire: the whole flat tensor."""

    def __init__(self, grid: ParallelGrid, numel: int) -> None:
        self.grid, self.numel = grid, numel

    def to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def from_wire(self, payload: torch.Tensor) -> torch.Tensor:
        return payload


class ScatterGather(Whole):
    """2104.04473 §4.1: an activation replicated over the tp ranks travels as each tp rank's
    1/tp slice, and the receiver all-gathers it over the fast intra-node tp group."""

    def __init__(self, grid: ParallelGrid, numel: int) -> None:
        if numel % grid.tp:
            raise ValueError(f"scatter/gather needs the activation ({numel} elements) to divide "
                             f"by tp={grid.tp}")
        super().__init__(grid, numel // grid.tp)

    def to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.chunk(self.grid.tp)[self.grid.tp_rank]

    def from_wire(self, payload: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(payload, self.grid.tp_group, dim=0, label="pp all-gather")


class _Transport:
    """The wire format (dtype; ``Whole`` or ``ScatterGather``), neighbours' global ranks, and the
    hand-over of ``local`` messages (ZB-V's turn), which never touch the wire."""

    def __init__(self, schedule: Schedule, grid: ParallelGrid, shape: tuple[int, ...],
                 dtype: torch.dtype, scatter_gather: bool, messages: MessagesOf) -> None:
        self.grid, self.dtype = grid, dtype
        self.stages, self.messages = schedule.stages, messages
        self.handed_over: dict[Message, torch.Tensor] = {}
        self.full_shape = torch.Size(shape)
        self.wire = WIRES[scatter_gather](grid, self.full_shape.numel())

    def global_rank(self, pp_rank: int) -> int:
        return self.grid.pp_group.ranks[pp_rank]

    def to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The flat payload (a view: the tensor's memory lives until its send is released)."""
        if tensor.dtype != self.dtype or tensor.shape != self.full_shape:
            raise ValueError(f"a pipeline message is {tuple(tensor.shape)} {tensor.dtype}, but "
                             f"the receiver expects {tuple(self.full_shape)} {self.dtype}")
        return self.wire.to_wire(tensor.detach().reshape(-1))

    def buffer(self) -> torch.Tensor:
        return torch.empty(self.wire.numel, dtype=self.dtype, device=self.grid.device)

    def from_wire(self, payload: torch.Tensor) -> torch.Tensor:
        return self.wire.from_wire(payload).view(self.full_shape)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        """Send ``message`` on the wire, or hand it to this rank's next chunk (the same memory,
        detached: the sender's graph ends here, as if the tensor had crossed ranks)."""
        if self.stages.is_local(message):
            self.handed_over[message] = tensor.detach()
        else:
            self.send_remote(message, tensor)

    def receive(self, message: Message) -> torch.Tensor:
        if self.stages.is_local(message):
            return self.handed_over.pop(message)
        return self.receive_remote(message)


WIRES = {False: Whole, True: ScatterGather}   # by ``scatter_gather``, chosen once a step


class MailboxTransport(_Transport):
    """gloo: sends start at once; each channel's next receive is posted in advance."""

    def __init__(self, schedule: Schedule, grid: ParallelGrid, shape: tuple[int, ...],
                 dtype: torch.dtype, scatter_gather: bool, messages: MessagesOf) -> None:
        super().__init__(schedule, grid, shape, dtype, scatter_gather, messages)
        sent = (messages(a, r, self.stages)[1] for r, row in enumerate(schedule) for a in row)
        incoming = [m for m in sent if m is not None and self.stages.receiver(m) == grid.pp_rank
                    and not self.stages.is_local(m)]
        if incoming and not grid.p2p_channels:
            raise ValueError("the mailbox transport needs grid.p2p_channels (made on gloo only)")
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
        """(channel, sender): the in-order stream of ``message``. The grid has one channel per kind
        along the ring; a message going the other way (ZB-V's chunk 1) shares its direction's."""
        src, dst = self.stages.sender(message), self.stages.receiver(message)
        kinds = [k for k in LABELS
                 if (k, self.global_rank(src), self.global_rank(dst)) in self.grid.p2p_channels]
        return (message.kind if message.kind in kinds else kinds[0]), src

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
        dst = self.stages.receiver(message)
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

    def __init__(self, schedule: Schedule, grid: ParallelGrid, shape: tuple[int, ...],
                 dtype: torch.dtype, scatter_gather: bool, messages: MessagesOf) -> None:
        super().__init__(schedule, grid, shape, dtype, scatter_gather, messages)
        self.points = exchange_plan(schedule, messages)[grid.pp_rank]
        self.outbox: dict[Message, torch.Tensor] = {}   # produced, not yet exchanged
        self.inbox: dict[Message, torch.Tensor] = {}    # exchanged, not yet consumed
        self.sending: list[dist.Work] = []              # batches of sends only, not waited

    def send_remote(self, message: Message, tensor: torch.Tensor) -> None:
        self.outbox[message] = self.to_wire(tensor)

    def receive_remote(self, message: Message) -> torch.Tensor:
        return self.from_wire(self.inbox.pop(message))

    def at_point(self, index: int) -> None:
        for exchange in self.points[index]:
            self._exchange(exchange)

    def _exchange(self, exchange: Exchange) -> None:
        ops, received = [], {}
        for m in exchange.messages:
            if self.stages.sender(m) == self.grid.pp_rank:
                ops.append(comm.P2POp("send", self.outbox.pop(m),
                                      self.global_rank(exchange.peer), LABELS[m.kind]))
            else:
                received[m] = self.buffer()
                ops.append(comm.P2POp("recv", received[m], self.global_rank(exchange.peer),
                                      LABELS[m.kind]))
        self._wait_for_sends()
        works = comm.batch_isend_irecv(ops, self.grid.pp_group)
        if received:                  # the next action reads them: wait (on NCCL, its stream)
            for work in works:
                work.wait()
        else:                         # only sends: compute on, as Megatron's overlap_p2p_comm
            self.sending += works
        self.inbox.update(received)

    def _wait_for_sends(self) -> None:
        """Wait for the send-only batches issued before: at the next exchange, in order, so
        that at most one batch per peer is in flight, or at the end of the step."""
        for work in self.sending:
            work.wait()
        self.sending.clear()

    def finish(self) -> None:
        self._wait_for_sends()
        assert not self.outbox and not self.inbox and not self.handed_over, \
            "the exchange plan left a message behind"


TRANSPORTS = {"mailbox": MailboxTransport, "batched": BatchedTransport}


def make_transport(name: str, schedule: Schedule, grid: ParallelGrid, shape: tuple[int, ...],
                   dtype: torch.dtype, scatter_gather: bool, messages: MessagesOf = messages_of
                   ) -> MailboxTransport | BatchedTransport:
    """``name``: "mailbox", "batched", or "auto" — batched on NCCL, the mailbox elsewhere.
    ``messages``: what each action receives and sends (``schedules.messages_of``)."""
    if name == "auto":
        name = "batched" if dist.get_backend() == "nccl" else "mailbox"
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of auto, {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name](schedule, grid, shape, dtype, scatter_gather, messages)
