"""When did work run? Timestamps that mean the same on a CPU and on a GPU.

On a CPU an operation has finished when the call returns, so ``time.perf_counter()`` before and
after it times the work. On a GPU a call only *queues* kernels and returns at once: the CPU clock
would time the queueing, and a timeline drawn from it (pipeline actions, buckets overlapping
backward) would show the CPU racing ahead of the GPU. A CUDA event recorded on the stream is
stamped by the GPU when the stream reaches it — the time the work before it really finished.

``Clock.stamp()`` takes a timestamp of either kind; ``Clock.seconds(stamp)`` reads it back (for
an event: waiting for it), on the ``perf_counter`` scale in both cases — a GPU event is placed at
the perf_counter time of an origin event synchronised when the clock was made — so timelines from
either device, and CPU-side times such as a completion callback's, share one axis.

Observers use it beside the algorithms, which call no timer themselves. The data-parallel
stages tag their collectives with their bucket, and ``comm.record(TimedLog(clock))`` notes when
each was launched and done; the observers add what only hooks see:

* ``BucketTimer`` — per gradient bucket, when its last gradient arrived, when its collective was
  launched and done: the overlap notebook 06 draws;
* ``UnitTimer`` — per ZeRO-3 unit, its gathers, its forward and its backward: notebook 13's;
* ``record_ring`` — per ring-attention step, when it computed and when it waited for its
  exchanges: notebook 12's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Real

import torch

from megatron_edu import comm, context_parallel
from megatron_edu.data_parallel.zero3 import in_backward

__all__ = ["Clock", "TimedLog", "BucketTiming", "BucketTimer", "UnitEvent", "UnitTimer",
           "RingInterval", "RingLog", "record_ring"]

Stamp = float | torch.cuda.Event


class Clock:
    """Timestamps of the work queued on ``device``, read back in perf_counter seconds."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.origin_event = self._record() if self.cuda else None
        if self.origin_event is not None:
            self.origin_event.synchronize()
        self.origin = time.perf_counter()

    def stamp(self) -> Stamp:
        """Now, as the device sees it: after everything queued so far has run."""
        return self._record() if self.cuda else time.perf_counter()

    def seconds(self, stamp: Stamp) -> float:
        """The perf_counter time of ``stamp`` (waits for a CUDA event to complete)."""
        if isinstance(stamp, float):
            return stamp
        stamp.synchronize()
        return self.origin + self.origin_event.elapsed_time(stamp) / 1e3

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


@dataclass(frozen=True)
class BucketTiming:
    """When one bucket's communication ran (perf_counter seconds)."""

    index: int
    bytes: int
    ready_at: float     # its last gradient arrived (its launch time if one never did)
    launched_at: float
    done_at: float


class TimedLog(comm.CommLog):
    """A ``comm.CommLog`` that also notes when each call was made and when its work was done:
    ``comm.record(TimedLog(clock))``. An asynchronous call is done when its future completes —
    on NCCL the future completes when the work is queued and its callback runs on a stream made
    to wait for the collective (``Future.then``): an event recorded there completes with it;
    gloo runs the callback when it is done. A gloo work without a future (reduce-scatter, send,
    receive) is stamped when it is waited for."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.times = clock, []

    def add(self, event: comm.CommEvent, work):
        self.events.append(event)
        made, done = self.clock.stamp(), torch.futures.Future()
        self.times.append((made, done))
        if work is None:                                   # it ran synchronously
            done.set_result(made)
            return None
        try:
            self.times[-1] = (made, work.get_future().then(lambda _: self.clock.stamp()))
            return work
        except RuntimeError:
            return _StampedWork(work, done, self.clock)

    def interval(self, event: comm.CommEvent) -> tuple[float, float]:
        """When ``event``'s call was made and when its work was done, in perf_counter seconds
        (waits for the work). Found by identity: two calls alike (a block's gather forward and
        again backward) are equal events."""
        made, done = self.times[next(i for i, e in enumerate(self.events) if e is event)]
        return self.clock.seconds(made), self.clock.seconds(done.wait())


class _StampedWork:
    """A work that stamps ``done`` when ``wait()`` returns (gloo's works without a future)."""

    def __init__(self, work, done: torch.futures.Future, clock: Clock) -> None:
        self.work, self.done, self.clock = work, done, clock

    def wait(self) -> bool:
        self.work.wait()
        if not self.done.done():
            self.done.set_result(self.clock.stamp())
        return True


class BucketTimer:
    """The buckets of a data-parallel stage (``data_parallel.STAGES``), step by step::

        timer = BucketTimer(ddp)
        with timer.step():          # a step's backward passes and ddp.finish_grad_sync()
            ...
        timer.timeline              # that step's BucketTiming of each bucket (its last collective)

    Its own gradient hooks (which run before the stage's, as a gradient is made) stamp each
    bucket's last arrival; a ``TimedLog`` sees the bucket collectives ("dp grads", tagged with
    the bucket's index)."""

    def __init__(self, ddp) -> None:
        self.clock = Clock(ddp.buckets[0].device)
        self.timeline: list[BucketTiming] = []
        self._ready: dict[int, Stamp] = {}
        for bucket in ddp.buckets:
            for p in bucket.params:
                p.register_hook(lambda grad, i=bucket.index: self._arrived(i, grad))

    def _arrived(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        self._ready[index] = self.clock.stamp()
        return grad

    @contextmanager
    def step(self) -> Iterator[None]:
        self._ready.clear()
        with comm.record(TimedLog(self.clock)) as log:
            yield
        last = {e.tag: e for e in log.select(label="dp grads")}        # per bucket, its last
        self.timeline = []
        for index, event in sorted(last.items()):
            launched, done = log.interval(event)
            ready = self.clock.seconds(self._ready[index]) if index in self._ready else launched
            self.timeline.append(BucketTiming(index, event.bytes, ready, launched, done))


@dataclass(frozen=True)
class UnitEvent:
    """When unit ``unit`` (its index in forward order; 0: the chunk's root) did ``kind``:
    "gather" (launched → done), "forward" or "backward" (perf_counter seconds)."""

    unit: int
    kind: str
    start: float
    end: float


class UnitTimer:
    """A ZeRO-3 stage's units (``data_parallel.ZeRO3``), step by step, as ``BucketTimer``::

        with timer.step(): ...      # then timer.events: every UnitEvent of the step

    Its module hooks, registered after the sharding's, stamp each unit's forward (from when its
    gather is done) and the start of its backward; the backward ends when its bucket's
    reduce-scatter is launched. The gathers ("dp params gather") and the reduce-scatters ("dp
    grads", ``scatters``: (unit, launched, done)) are the tagged collectives a ``TimedLog``
    sees. A forward run again inside backward (recomputation) is not one."""

    def __init__(self, zero3) -> None:
        sharding = zero3.sharding
        self.clock = Clock(zero3.buckets[0].device)
        self.unit_of = sharding.unit_of
        self.events: list[UnitEvent] = []
        self.scatters: list[tuple[int, float, float]] = []
        self._began: dict[tuple[str, int], Stamp] = {}
        self._stamps: list[tuple[int, str, Stamp, Stamp]] = []
        for i, (module, _) in enumerate(sharding.units):
            module.register_forward_pre_hook(lambda m, args, i=i: self._begin("forward", i))
            module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    def _begin(self, kind: str, i: int) -> None:
        if not in_backward():
            self._began[kind, i] = self.clock.stamp()

    def _after_forward(self, i: int, output) -> None:
        if ("forward", i) not in self._began:          # recomputed inside backward
            return
        self._stamps.append((i, "forward", self._began.pop(("forward", i)), self.clock.stamp()))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._backward_began(i, grad))

    def _backward_began(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        self._began["backward", i] = self.clock.stamp()
        return grad

    @contextmanager
    def step(self) -> Iterator[None]:
        self._stamps, self._began = [], {}
        with comm.record(TimedLog(self.clock)) as log:
            yield
        seconds = self.clock.seconds
        self.events = [UnitEvent(i, kind, seconds(a), seconds(b)) for i, kind, a, b in self._stamps]
        for event in log.select(label="dp params gather"):
            self.events.append(UnitEvent(self.unit_of[event.tag], "gather", *log.interval(event)))
        self.scatters = [(self.unit_of[e.tag], *log.interval(e))
                         for e in log.select(label="dp grads")]
        for unit, launched, _ in self.scatters:
            began = self._began.pop(("backward", unit), None)
            if began is not None:
                self.events.append(UnitEvent(unit, "backward", seconds(began), launched))


@dataclass(frozen=True)
class RingInterval:
    """One phase of one ring-attention step on one rank: ``kind`` "compute" (from the step's
    start — its exchange posted — until it waits) or "wait" (for its exchanges: forward steps
    0 … cp − 2, every backward step). Seconds (perf_counter) when recorded, cost units when
    simulated (``perf.ring.simulate_ring``)."""

    backward: bool
    step: int
    kind: str
    start: Real
    end: Real


@dataclass
class RingLog:
    """The ring's phases on this rank while a ``record_ring()`` block was active, in order."""

    clock: Clock
    stamps: list[tuple[bool, int, str, Stamp, Stamp]] = field(default_factory=list)

    @property
    def intervals(self) -> list[RingInterval]:
        """The phases in perf_counter seconds (on a GPU: waits for their events)."""
        return [RingInterval(backward, step, kind, self.clock.seconds(t0), self.clock.seconds(t1))
                for backward, step, kind, t0, t1 in self.stamps]


@contextmanager
def record_ring(device: torch.device | str = "cpu") -> Iterator[RingLog]:
    """Record when this rank's ring attention computes and waits, inside the block: an observer
    of the ring's exchange driver (``context_parallel._Ring``); with none active the ring pays
    one list test per phase."""
    log = RingLog(Clock(device))
    context_parallel.observers.append(log)
    try:
        yield log
    finally:
        context_parallel.observers.remove(log)
