"""When each gradient bucket was ready, launched and done — the overlap notebook 06 draws.

Measurement beside the algorithm: ``DataParallel`` tells a ``BucketTimer`` three moments per
bucket, and nothing in the bucket algorithm depends on them. Times come from ``timing.Clock``
(CUDA events on a GPU, where a CPU clock would time kernel launches) on the perf_counter scale;
completion is the moment the collective's future resolves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_edu.timing import Clock, Stamp

__all__ = ["BucketTiming", "BucketTimer"]


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
        self.launched[index] = (self.clock.stamp(), _completion_time(work))

    def collect(self, sizes: list[int]) -> list[BucketTiming]:
        """Every bucket's timing (call after waiting for all); resets for the next step."""
        timings = []
        for index, nbytes in enumerate(sizes):
            launched, done = self.launched.pop(index)
            ready = self.ready.pop(index, launched)
            timings.append(BucketTiming(index, nbytes, self.clock.seconds(ready),
                                        self.clock.seconds(launched), done.wait()))
        return timings


def _completion_time(work: dist.Work | None) -> torch.futures.Future:
    """A future whose value is the time the collective completed (now, if it is done)."""
    if work is None:
        done = torch.futures.Future()
        done.set_result(time.perf_counter())
        return done
    return work.get_future().then(lambda _: time.perf_counter())
