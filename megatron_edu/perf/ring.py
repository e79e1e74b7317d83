"""Ring attention on paper (context parallelism, ``context_parallel.py``): each rank's steps
played with fixed costs — a chunk pair's compute and a block's hop — as ``pipeline.simulate``
plays a schedule. Notebook 12 draws it beside the ring measured by ``timing.record_ring``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from megatron_edu.context_parallel import _pairs, chunk_ids
from megatron_edu.timing import RingInterval

__all__ = ["step_pairs", "RingTimeline", "simulate_ring"]


def step_pairs(rank: int, step: int, cp: int, zigzag: bool = True) -> int:
    """The chunk pairs ``rank`` computes at ``step`` (``_pairs``: a diagonal pair is computed
    whole, then masked — a full pair of work). Zig-zag: 3 at step 0, then 2 on every rank."""
    return len(_pairs(chunk_ids(rank, cp, zigzag), chunk_ids((rank - step) % cp, cp, zigzag)))


@dataclass(frozen=True)
class RingTimeline:
    """The ring on paper: ranks[r] rank r's phases (``RingInterval``s, as ``record_ring`` notes
    them); hops[r] the (start, end) of each block rank r sent to rank r + 1, in order."""

    ranks: list[list[RingInterval]]
    hops: list[list[tuple[Real, Real]]]

    @property
    def makespan(self) -> Real:
        """From the first start to the last end, over all ranks."""
        return (max(row[-1].end for row in self.ranks)
                - min(row[0].start for row in self.ranks))

    @property
    def ends(self) -> list[Real]:
        """When each rank is done (where its next pass can start)."""
        return [row[-1].end for row in self.ranks]

    @property
    def busy(self) -> list[Real]:
        """Per rank, the time it computed."""
        return [sum(i.end - i.start for i in row if i.kind == "compute") for row in self.ranks]


def simulate_ring(cp: int, pair_time: Real, hop_time: Real, zigzag: bool = True,
                  backward: bool = False, start: Real | Sequence[Real] = 0) -> RingTimeline:
    """One pass of ring attention played with fixed costs (``pipeline.simulate``'s idea).

    At step k rank r computes ``step_pairs`` × ``pair_time``. A hop — a block from rank r to
    r + 1, ``hop_time`` long — starts when both ends have posted it (``batch_isend_irecv``, as
    gloo and NCCL pair a send with its receive): the K, V block at the start of step k (steps
    0 … cp − 2), in the backward pass also the dK, dV partial sums after the compute (steps
    1 … cp − 1). Step k + 1 starts when rank r's compute and the hops it sends and receives at
    step k are done. ``start``: when each rank begins (one number, or one per rank)."""
    begin = list(start) if isinstance(start, Sequence) else [start] * cp
    ranks: list[list[RingInterval]] = [[] for _ in range(cp)]
    hops: list[list[tuple[Real, Real]]] = [[] for _ in range(cp)]
    for step in range(cp):
        done = [begin[r] + step_pairs(r, step, cp, zigzag) * pair_time for r in range(cp)]
        posted = ([begin] if step < cp - 1 else []) + ([done] if backward and step > 0 else [])
        ends = list(done)
        for at in posted:
            for r in range(cp):
                nxt = (r + 1) % cp
                sent = max(at[r], at[nxt])            # once the sender and the receiver posted
                hops[r].append((sent, sent + hop_time))
                ends[r], ends[nxt] = max(ends[r], sent + hop_time), max(ends[nxt], sent + hop_time)
        for r in range(cp):
            ranks[r].append(RingInterval(backward, step, "compute", begin[r], done[r]))
            if step < cp - 1 or backward:
                ranks[r].append(RingInterval(backward, step, "wait", done[r], ends[r]))
        begin = ends
    return RingTimeline(ranks, hops)
