"""Context parallelism: the sequence split across cp ranks, attention as a ring (megatron-core's
CP, torchtitan's and picotron's; ring attention, 2310.01889).

Sequence parallelism (2205.05198) splits only the layer norms and dropouts: attention still sees
every token, and its [s, s] scores grow with the square of the context. Context parallelism
splits everything. A rank holds s/cp tokens of every sequence — its queries, keys and values —
and attention, where every query needs every earlier key, becomes a ring: in cp steps each rank's
K, V block visits every rank, which attends its own queries to it, while the next block is
already on its way (``batch_isend_irecv``: on NCCL one group call, matched on both sides).

**Online softmax.** No rank ever holds a whole row of scores. Attending to block j gives a
partial output o_j = softmax(q·k_jᵀ)·v_j and the log-sum-exp ℓ_j of its scores; two partial
results merge exactly, as flash attention's tiles do (``merge``):

    ℓ = log(e^ℓ₁ + e^ℓ₂),    o = e^(ℓ₁ − ℓ)·o₁ + e^(ℓ₂ − ℓ)·o₂.

**Load balance (zig-zag).** Under the causal mask a query sees only earlier keys: split the
sequence into cp consecutive parts and the last rank attends to everything while the first
attends to its own part alone. Split it instead into 2·cp chunks and give rank i chunks i and
2·cp − 1 − i (megatron-core's and torchtitan's zig-zag): every rank holds one early and one late
chunk, and all do the same work (``causal_work``). The ring computes chunk against chunk:
a later key chunk is skipped (wholly masked), the diagonal chunk masked causally, an earlier one
attended in full.

**Backward** (hand-written, ``_RingAttention.backward``): each rank recomputes its scores block by
block from the saved ℓ (flash attention's backward) — dQ stays local; dK, dV of a block are summed
by the ranks it visited. Its owner keeps its own part; the partial sums of the other ranks travel
the ring behind the K, V block, one hop per step, and reach the owner after cp − 1 hops. Bytes
sent per rank and layer (``comm.record``, label "cp kv" / "cp dkv"): forward 2·(cp − 1) blocks of
[b, a, s/cp, d] (K and V, cp − 1 hops), backward twice that (K, V again and their gradients).

**Timeline.** ``record_ring()`` notes, on this rank, when each step of each pass computed and when
it waited for its exchanges (``timing.Clock``: on a GPU as the device ran them); with no block
active the ring pays one list test per phase. ``simulate_ring`` plays the same steps on paper from
two costs — a chunk pair's compute and a block's hop — so the two can be drawn side by side.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Real

import torch

from megatron_edu import comm
from megatron_edu.comm import CommGroup, P2POp
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey
from megatron_edu.timing import Clock, Stamp

__all__ = ["chunk_ids", "split", "unsplit", "causal_work", "merge", "ring_attention",
           "step_pairs", "RingInterval", "RingLog", "record_ring", "RingTimeline",
           "simulate_ring"]


def chunk_ids(rank: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The two of the sequence's 2·cp chunks that ``rank`` holds: i and 2·cp − 1 − i (zig-zag),
    or 2i and 2i + 1 (consecutive parts)."""
    return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)


def split(x: torch.Tensor, rank: int, cp: int, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's part of the whole sequence ``x`` (along ``dim``: its two chunks, in order)."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"context parallelism splits the sequence into 2·cp = {2 * cp} chunks: "
                         f"the length {x.shape[dim]} is not a multiple of {2 * cp}")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, zigzag)], dim)


def unsplit(parts: list[torch.Tensor], zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]``: rank r's) — ``split``'s inverse."""
    cp = len(parts)
    chunks: list[torch.Tensor] = [torch.empty(0)] * (2 * cp)
    for rank, part in enumerate(parts):
        for i, chunk in zip(chunk_ids(rank, cp, zigzag), part.chunk(2, dim), strict=True):
            chunks[i] = chunk
    return torch.cat(chunks, dim)


def causal_work(rank: int, cp: int, zigzag: bool = True) -> float:
    """Chunk pairs ``rank`` computes under the causal mask (a diagonal pair counts ½): zig-zag
    gives every rank 2·cp; consecutive parts give rank i 4i + 2."""
    return sum(q + 0.5 for q in chunk_ids(rank, cp, zigzag))  # q earlier chunks, half its own


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
          lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results over disjoint key sets → the result over both (exact).
    ``lse`` [..., s, 1]: the log-sum-exp of each query's scores over its keys (finite)."""
    lse = torch.logaddexp(lse1, lse2)
    return (lse1 - lse).exp() * o1 + (lse2 - lse).exp() * o2, lse


def _scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """q·kᵀ/√d for one chunk pair; the diagonal pair causally masked (query i sees keys ≤ i)."""
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _pairs(mine: tuple[int, int], theirs: tuple[int, int]):
    """(local query chunk, block key chunk, their chunk ids) for each pair the causal mask
    leaves: the key chunk not later than the query chunk (the same one: the diagonal)."""
    return [(a, b, (qc, kc)) for a, qc in enumerate(mine) for b, kc in enumerate(theirs)
            if kc <= qc]


def _dropout_scale(dropout: Dropout | None, key: DropoutKey | None, heads: int, chunks: tuple,
                   c: int, cp: int, device: torch.device) -> torch.Tensor | float:
    """The kept/(1 − p) factors of one chunk pair of the probabilities [b, heads, c, c]: the
    serial model's mask there (element h·s² + query·s + key of each sample; recomputed in the
    backward pass, as flash attention replays its generator)."""
    if dropout is None or not dropout.training or dropout.p == 0.0:
        return 1.0
    s, pos = 2 * cp * c, torch.arange(c, device=device)
    rows = torch.arange(heads, device=device)[:, None, None] * s + chunks[0] * c + pos[:, None]
    return dropout.keep_at(key, rows * s + chunks[1] * c + pos) * (1.0 / (1.0 - dropout.p))


def _exchange(group: CommGroup, send: torch.Tensor, label: str) -> tuple[list, torch.Tensor]:
    """Start sending ``send`` to the next rank of the ring and receiving the previous one's."""
    r, cp = group.rank, group.size
    received = torch.empty_like(send)
    works = comm.batch_isend_irecv([P2POp("send", send, group.ranks[(r + 1) % cp], label),
                                    P2POp("recv", received, group.ranks[(r - 1) % cp], label)],
                                   group)
    return works, received


def _wait(works: list) -> None:
    for work in works:
        work.wait()


# --- the ring's timeline: recorded (record_ring) -------------------------------------------------

@dataclass(frozen=True)
class RingInterval:
    """One phase of one ring step on one rank: ``kind`` "compute" (from the step's start — its
    exchange posted — until it waits) or "wait" (for its exchanges: forward steps 0 … cp − 2,
    every backward step). Seconds (perf_counter) when recorded, cost units when simulated."""

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


_ring_logs: list[RingLog] = []   # as comm's: a module list, seen by autograd's backward threads


@contextmanager
def record_ring(device: torch.device | str = "cpu") -> Iterator[RingLog]:
    """Record when this rank's ring attention computes and waits, inside the block."""
    log = RingLog(Clock(device))
    _ring_logs.append(log)
    try:
        yield log
    finally:
        _ring_logs.remove(log)


def _now() -> list[Stamp]:
    """Now, on each active ``record_ring``'s clock ([] when none is)."""
    return [log.clock.stamp() for log in _ring_logs]


def _note(since: list[Stamp], backward: bool, step: int, kind: str) -> list[Stamp]:
    """Note [since, now) as ``kind`` of ``step`` with each active log; returns now."""
    if not _ring_logs:
        return since
    now = _now()
    for log, t0, t1 in zip(_ring_logs, since, now, strict=False):  # one opened mid-phase: next
        log.stamps.append((backward, step, kind, t0, t1))
    return now


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to the whole sequence's keys, by the ring."""

    @staticmethod
    def forward(ctx, q, k, v, group: CommGroup, zigzag: bool, dropout: Dropout | None,
                key: DropoutKey | None):
        r, cp = group.rank, group.size
        heads, c = q.shape[1], q.shape[2] // 2
        mine = chunk_ids(r, cp, zigzag)
        qs = q.chunk(2, 2)
        out: list = [None, None]
        lse: list = [None, None]
        kv = torch.stack([k, v])                       # the travelling block [2, b, a, s/cp, d]
        for step in range(cp):
            began = _now()                             # record_ring: when this step computed
            if step < cp - 1:                          # the next block is on its way meanwhile
                works, incoming = _exchange(group, kv, "cp kv")
            theirs = chunk_ids((r - step) % cp, cp, zigzag)
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            for a, b, ids in _pairs(mine, theirs):
                scores = _scores(qs[a], ks[b], ids[0] == ids[1])
                block_lse = scores.logsumexp(-1, keepdim=True)
                kept = _dropout_scale(dropout, key, heads, ids, c, cp, q.device)
                block_out = ((scores - block_lse).exp() * kept) @ vs[b]
                out[a], lse[a] = ((block_out, block_lse) if out[a] is None
                                  else merge(out[a], lse[a], block_out, block_lse))
            computed = _note(began, False, step, "compute")
            if step < cp - 1:
                _wait(works)
                _note(computed, False, step, "wait")
                kv = incoming
        out, lse = torch.cat(out, 2), torch.cat(lse, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag, ctx.dropout, ctx.key = group, zigzag, dropout, key
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, zigzag, dropout, key = ctx.group, ctx.zigzag, ctx.dropout, ctx.key
        r, cp = group.rank, group.size
        heads, c = q.shape[1], q.shape[2] // 2
        mine = chunk_ids(r, cp, zigzag)
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs, dos, lses = q.chunk(2, 2), grad_out.chunk(2, 2), lse.chunk(2, 2)
        ds_row = (grad_out * out).sum(-1, keepdim=True).chunk(2, 2)  # D = rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(2, 2)
        kv, own, travelling = torch.stack([k, v]), None, None
        for step in range(cp):
            works, began = [], _now()
            if step < cp - 1:
                works, incoming = _exchange(group, kv, "cp kv")
            theirs = chunk_ids((r - step) % cp, cp, zigzag)
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            dkv = torch.zeros_like(kv)                 # this rank's part of the block's dK, dV
            dks, dvs = dkv[0].chunk(2, 2), dkv[1].chunk(2, 2)
            for a, b, ids in _pairs(mine, theirs):
                p = (_scores(qs[a], ks[b], ids[0] == ids[1]) - lses[a]).exp()
                kept = _dropout_scale(dropout, key, heads, ids, c, cp, q.device)
                dvs[b].add_((p * kept).transpose(-2, -1) @ dos[a])
                ds = p * ((dos[a] @ vs[b].transpose(-2, -1)) * kept - ds_row[a]) * scale
                dqs[a].add_(ds @ ks[b])
                dks[b].add_(ds.transpose(-2, -1) @ qs[a])
            if step == 0:
                own = dkv                              # the owner's part waits for the others'
            else:                                      # the others' sum moves on, one hop
                travelling = dkv if travelling is None else travelling + dkv
                sent, partial = _exchange(group, travelling, "cp dkv")
                works += sent
            computed = _note(began, True, step, "compute")
            _wait(works)
            _note(computed, True, step, "wait")
            if step < cp - 1:
                kv = incoming
            if step > 0:
                travelling = partial
        if cp > 1:
            own = own + travelling                     # the block's sum from the other cp − 1
        return dq, own[0], own[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                   zigzag: bool = True, dropout: Dropout | None = None,
                   key: DropoutKey | None = None) -> torch.Tensor:
    """dropout(softmax(q·kᵀ/√d, causal))·v over the whole sequence, each rank holding its part
    (``split``) of q, k, v [b, heads, s/cp, d]; returns this rank's part of the output.
    ``dropout`` (in training, with ``key``): on the probabilities, the serial model's masks."""
    if q.shape[2] % 2:
        raise ValueError(f"a rank holds two chunks of the sequence: {q.shape[2]} tokens is odd")
    return _RingAttention.apply(q, k, v, group, zigzag, dropout, key)


# --- the ring's timeline: simulated (simulate_ring) ----------------------------------------------

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
