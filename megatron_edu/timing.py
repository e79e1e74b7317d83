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
"""

from __future__ import annotations

import time

import torch

__all__ = ["Clock", "Stamp"]

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
