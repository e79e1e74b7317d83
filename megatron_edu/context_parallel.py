"""Context parallelism: the sequence split across cp ranks, attention as a ring (megatron-core's
CP, torchtitan's, picotron's; ring attention, Liu et al. 2023, 2310.01889).

Sequence parallelism (2205.05198) leaves attention's [s, s] scores whole. Here a rank holds s/cp
tokens of every sequence, and in cp steps each rank's K, V block visits every rank, which attends
its queries to it while the next block is already on its way. No rank holds a whole row of
scores: block j gives o_j = softmax(q·k_jᵀ)·v_j and the log-sum-exp ℓ_j of its scores, and
partial results merge exactly, as flash attention's tiles do (``merge``):

    ℓ = log(e^ℓ₁ + e^ℓ₂),    o = e^(ℓ₁ − ℓ)·o₁ + e^(ℓ₂ − ℓ)·o₂.

**Zig-zag.** Under the causal mask, with cp consecutive parts the last rank attends to everything
and the first to its own part alone; with 2·cp chunks, rank i holding i and 2·cp − 1 − i
(megatron-core's and torchtitan's zig-zag), all do the same work (``causal_work``).

**Backward** (``_RingAttention.backward``) recomputes the scores block by block from the saved ℓ,
as flash attention does. dQ stays local; the partial sums of a block's dK, dV travel the ring
behind it and reach its owner after cp − 1 hops. Bytes sent per rank and layer (``comm.record``:
"cp kv", "cp dkv"): forward 2·(cp − 1) blocks of [b, a, s/cp, d] (K and V), backward twice that.
The exchanges go through one driver, ``_Ring``, which ``timing.record_ring()`` observes
(``perf.ring.simulate_ring`` plays the same steps on paper).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from megatron_edu import comm
from megatron_edu.comm import CommGroup, P2POp
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey

__all__ = ["chunk_ids", "parts_held", "positions_of", "each_head", "split", "unsplit",
           "causal_work", "merge", "ring_attention", "observers"]


def chunk_ids(rank: int, cp: int, zigzag: bool = True) -> tuple[int, int]:
    """The two of the 2·cp chunks ``rank`` holds: i and 2·cp − 1 − i (zig-zag), or 2i and 2i + 1."""
    return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)


def parts_held(cp_group: CommGroup, t: int = 1, r: int = 0) -> tuple[tuple[int, int], ...]:
    """The parts (r, n) of a sequence (part r of n) a rank holds, in order: its zig-zag chunks of
    2·cp (``chunk_ids``); under sequence parallelism over t ranks, r of t, and under both, SP
    splits each of the cp rank's two chunks into t: tp rank r holds its pieces 2r and 2r + 1."""
    if cp_group.size == 1:
        return ((r, t),)
    chunks = chunk_ids(cp_group.rank, cp_group.size)
    return tuple((chunks[k // t] * t + k % t, 2 * cp_group.size * t) for k in (2 * r, 2 * r + 1))


def positions_of(parts: tuple[tuple[int, int], ...], whole: int, offset: int,
                 device: torch.device) -> torch.Tensor:
    """The positions of a rank's ``parts`` ((r, n): part r of n, in order) of a sequence of
    ``whole`` tokens starting at ``offset``: its zig-zag chunks, and under sequence
    parallelism its pieces of them (``parts_held``)."""
    seq = torch.arange(offset, offset + whole, device=device)
    return torch.cat([seq.chunk(n)[r] for r, n in parts])


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
    """(query chunk, key chunk, their ids) of each pair the causal mask leaves: key ≤ query."""
    return [(a, b, (qc, kc)) for a, qc in enumerate(mine) for b, kc in enumerate(theirs)
            if kc <= qc]


def _dropout_scale(dropout: Dropout | None, key: DropoutKey | None, heads: int, chunks: tuple,
                   c: int, cp: int, device: torch.device) -> torch.Tensor | float:
    """The kept/(1 − p) factors of one chunk pair of the probabilities [b, heads, c, c]: the
    serial model's mask (element h·s² + query·s + key, h the global head), recomputed in the
    backward pass as flash attention replays its generator."""
    if dropout is None or not dropout.training or dropout.p == 0.0:
        return 1.0
    s, pos = 2 * cp * c, torch.arange(c, device=device)
    first = dropout.parts[0][0] * heads                  # this tp rank's first head
    h = torch.arange(first, first + heads, device=device)
    rows = h[:, None, None] * s + chunks[0] * c + pos[:, None]
    return dropout.keep_at(key, rows * s + chunks[1] * c + pos) * (1.0 / (1.0 - dropout.p))


def each_head(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[b, g, t, d] → [b, a, t, d] for q's a heads: each kv head for each query head of its group
    (grouped-query attention; a view when g = a). Cores expand inside themselves, so that the
    ring carries and recomputation keeps g heads, not a."""
    b, g, t, d = kv.shape
    return kv[:, :, None].expand(b, g, q.shape[1] // g, t, d).reshape(b, q.shape[1], t, d)


def _per_group(grad: torch.Tensor, g: int) -> torch.Tensor:
    """``each_head``'s backward: [b, a, t, d] → [b, g, t, d], summed over each group's heads."""
    return grad.unflatten(1, (g, -1)).sum(2)


def _exchange(group: CommGroup, send: torch.Tensor, label: str) -> tuple[list, torch.Tensor]:
    """Start sending ``send`` to the next rank of the ring and receiving the previous one's."""
    r, cp = group.rank, group.size
    received = torch.empty_like(send)
    works = comm.batch_isend_irecv([P2POp("send", send, group.ranks[(r + 1) % cp], label),
                                    P2POp("recv", received, group.ranks[(r - 1) % cp], label)],
                                   group)
    return works, received


# --- the ring: its driver, and attention over it -------------------------------------------------
observers: list = []   # timing.RingLog's of active ``record_ring`` blocks (as comm's record)


class _Ring:
    """This rank's exchanges: while the caller computes with its block, the block goes on to the
    next rank and the previous rank's arrives (one ``batch_isend_irecv`` a step: on NCCL one group
    call, matched on both sides). Each step's compute and wait is shown to the ``observers``."""

    def __init__(self, group: CommGroup, backward: bool) -> None:
        self.group, self.backward = group, backward
        self.extra: list = []          # the step's other sends (``send_on``): works, tensors

    def blocks(self, block: torch.Tensor, label: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(step, the block to compute with), cp times: this rank's own block first."""
        for step in range(self.group.size - 1):
            began = _now()
            works, incoming = _exchange(self.group, block, label)
            yield step, block
            self._finish(step, began, works)
            block = incoming
        began = _now()
        yield self.group.size - 1, block
        self._finish(self.group.size - 1, began, [])

    def send_on(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Send ``tensor`` on this step; the previous rank's arrives in the result, by next step."""
        works, received = _exchange(self.group, tensor, label)
        self.extra.append((works, tensor))                   # alive until sent
        return received

    def _finish(self, step: int, began: list, works: list) -> None:
        computed = _note(began, self.backward, step, "compute")
        pending = works + [w for sent, _ in self.extra for w in sent]
        self.extra = []
        if pending:                                    # (the forward's last step sends none)
            for work in pending:
                work.wait()
            _note(computed, self.backward, step, "wait")


def _now() -> list:
    """Now, on each observer's clock ([] when none is)."""
    return [log.clock.stamp() for log in observers]


def _note(since: list, backward: bool, step: int, kind: str) -> list:
    """Show [since, now) as ``kind`` of ``step`` to each observer; returns now."""
    now = _now()
    for log, t0, t1 in zip(observers, since, now, strict=False):  # one opened mid-phase: next
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
        out, lse = [None, None], [None, None]
        ring = _Ring(group, backward=False)            # the travelling block [2, b, g, s/cp, d]
        for step, kv in ring.blocks(torch.stack([k, v]), "cp kv"):
            theirs = chunk_ids((r - step) % cp, cp, zigzag)
            ks, vs = each_head(kv[0], q).chunk(2, 2), each_head(kv[1], q).chunk(2, 2)
            for a, b, ids in _pairs(mine, theirs):
                scores = _scores(qs[a], ks[b], ids[0] == ids[1])
                block_lse = scores.logsumexp(-1, keepdim=True)
                kept = _dropout_scale(dropout, key, heads, ids, c, cp, q.device)
                block_out = ((scores - block_lse).exp() * kept) @ vs[b]
                out[a], lse[a] = ((block_out, block_lse) if out[a] is None
                                  else merge(out[a], lse[a], block_out, block_lse))
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
        own, travelling = None, torch.zeros_like(torch.stack([k, v]))  # a block's partial sums
        ring = _Ring(group, backward=True)
        for step, kv in ring.blocks(torch.stack([k, v]), "cp kv"):
            theirs = chunk_ids((r - step) % cp, cp, zigzag)
            ks, vs = each_head(kv[0], q).chunk(2, 2), each_head(kv[1], q).chunk(2, 2)
            dkv = torch.zeros(2, *q.shape, dtype=kv.dtype, device=kv.device)  # per query head
            dks, dvs = dkv[0].chunk(2, 2), dkv[1].chunk(2, 2)
            for a, b, ids in _pairs(mine, theirs):
                p = (_scores(qs[a], ks[b], ids[0] == ids[1]) - lses[a]).exp()
                kept = _dropout_scale(dropout, key, heads, ids, c, cp, q.device)
                dvs[b].add_((p * kept).transpose(-2, -1) @ dos[a])
                ds = p * ((dos[a] @ vs[b].transpose(-2, -1)) * kept - ds_row[a]) * scale
                dqs[a].add_(ds @ ks[b])
                dks[b].add_(ds.transpose(-2, -1) @ qs[a])
            dkv = _per_group(dkv.flatten(0, 1), k.shape[1]).unflatten(0, (2, -1))  # kv heads
            if step == 0:
                own = dkv                              # the owner's part waits for the others'
            else:                                      # the others' sum moves on, one hop
                travelling = ring.send_on(travelling + dkv, "cp dkv")
        own = own + travelling                         # the block's sum from the other cp − 1
        return dq, own[0], own[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                   zigzag: bool = True, dropout: Dropout | None = None,
                   key: DropoutKey | None = None) -> torch.Tensor:
    """dropout(softmax(q·kᵀ/√d, causal))·v over the whole sequence, each rank holding its part
    (``split``) of q [b, heads, s/cp, d] and of k, v [b, kv heads, s/cp, d] (grouped-query
    attention: the ring carries the kv heads only); returns this rank's part of the output.
    ``dropout`` (in training, with ``key``): on the probabilities, the serial model's masks."""
    if q.shape[2] % 2:
        raise ValueError(f"a rank holds two chunks of the sequence: {q.shape[2]} tokens is odd")
    return _RingAttention.apply(q, k, v, group, zigzag, dropout, key)
