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

``BucketTimer`` uses it beside the data-parallel algorithm: ``DataParallel`` tells it three moments
per gradient bucket (ready, launched, done — on a GPU, an event behind the collective on its
stream), the overlap notebook 06 draws; nothing in the bucket algorithm depends on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Clock", "Stamp", "BucketTiming", "BucketTimer"]

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


class BucketTimer:
    """Collects ``BucketTiming``s for one optimizer step of a ``DataParallel``."""

    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self.ready: dict[int, Stamp] = {}
        self.launched: dict[int, tuple[Stamp, torch.futures.Future]] = {}

    def on_ready(self, index: int) -> None:
        """A gradient of bucket ``index`` arrived (the last one's time is kept)."""
        self.ready[index] = self.clock.stamp()

    def on_launch(self, index: int, work: dist.Work | None) -> None:
        """Bucket ``index``'s collective started (``work`` None: it ran synchronously)."""
        self.launched[index] = (self.clock.stamp(), _completion_time(work, self.clock))

    def on_wait(self, index: int) -> None:
        """Bucket ``index``'s collective was waited for: its completion, if its work has no
        future to tell it (gloo's reduce-scatter)."""
        launched, done = self.launched[index]
        if done is None:
            self.launched[index] = (launched, _completion_time(None, self.clock))

    def collect(self, sizes: list[int]) -> list[BucketTiming]:
        """Every bucket's timing (call after waiting for all); resets for the next step."""
        timings = []
        for index, nbytes in enumerate(sizes):
            launched, done = self.launched.pop(index)
            ready = self.ready.pop(index, launched)
            timings.append(BucketTiming(index, nbytes, self.clock.seconds(ready),
                                        self.clock.seconds(launched),
                                        self.clock.seconds(done.wait())))
        return timings


def _completion_time(work: dist.Work | None, clock: Clock) -> torch.futures.Future | None:
    """A future whose value stamps the collective's completion (now, if it ran synchronously).

    On NCCL the future completes when the work is *queued*, not done, and its callback runs on
    the current stream made to wait for the communication stream (``torch.futures.Future.then``):
    a CUDA event recorded there completes when the all-reduce does — a CPU clock would give the
    launch time. On gloo the callback runs when the work is done, and the CPU clock is right.
    """
    if work is None:
        done = torch.futures.Future()
        done.set_result(clock.stamp())
        return done
    try:
        future = work.get_future()
    except RuntimeError:   # a work without a future: stamped when waited for (``on_wait``)
        return None
    return future.then(lambda _: clock.stamp())
