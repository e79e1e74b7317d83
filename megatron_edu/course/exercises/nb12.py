"""Checkers for notebook 12 (context parallelism: ring attention, the zig-zag split).

12.1 ★    the online-softmax merge of two key blocks' partial results
12.2 ★    the zig-zag chunk assignment (which two of the 2·cp chunks a rank holds)
12.3 ★★   one ring step: send this rank's block to the next rank, receive the previous one's

12.1 and 12.2 are checked in this process against ``megatron_edu.context_parallel``; 12.3 runs
on 4 gloo ranks and counts the sends and receives through ``comm``. Typical wrong answers — the
partial outputs added without rescaling, the maximum taken instead of the log-sum-exp, the
consecutive split, the ring turned the wrong way — are named.
"""

from __future__ import annotations

import torch

from megatron_edu import comm
from megatron_edu.context_parallel import _exchange, causal_work, chunk_ids, merge
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks

__all__ = ["CP", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

CP = 4
TIMEOUT = 30.0


def _blocks(seed: int = 0):
    """Scores [3, 7] split 3 | 4 over the keys, values [7, 2], and each block's (o, lse)."""
    gen = torch.Generator().manual_seed(seed)
    scores, v = torch.randn(3, 7, generator=gen) * 3, torch.randn(7, 2, generator=gen)
    parts = []
    for cols in (slice(0, 3), slice(3, 7)):
        lse = scores[:, cols].logsumexp(-1, keepdim=True)
        parts += [(scores[:, cols] - lse).exp() @ v[cols], lse]
    return scores, v, parts


@exercise("12.1", "the online-softmax merge of two key blocks", reference=(merge,))
def check_merge(fn) -> str:
    """fn(o1, lse1, o2, lse2) against the softmax over both blocks' keys, computed whole."""
    scores, v, parts = _blocks()
    got = fn(*parts)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise Hint("return a tuple (o, lse): the merged output and its log-sum-exp")
    o, lse = got
    want_o, want_lse = merge(*parts)
    if not isinstance(lse, torch.Tensor) or lse.shape != want_lse.shape:
        raise Hint(f"lse should be a tensor of shape {tuple(want_lse.shape)} (one per query)")
    if torch.allclose(lse, torch.maximum(parts[1], parts[3])):
        raise Hint("lse is the larger of the two log-sum-exps; the merged one is "
                   "log(e^lse1 + e^lse2) — torch.logaddexp")
    if not torch.allclose(lse, want_lse, atol=1e-5):
        raise Hint("lse is not log(e^lse1 + e^lse2), the log-sum-exp over both blocks' keys")
    if not isinstance(o, torch.Tensor) or o.shape != want_o.shape:
        raise Hint(f"o should be a tensor of shape {tuple(want_o.shape)}")
    if torch.allclose(o, parts[0] + parts[2], atol=1e-5):
        raise Hint("o is o1 + o2: each block's output was normalised by its own keys only; "
                   "weight each by its share of the total, e^(lse_i − lse)")
    if not torch.allclose(o, scores.softmax(-1) @ v, atol=1e-5):
        raise Hint("o is not softmax over all keys · v: weight o_i by e^(lse_i − lse), where lse "
                   "is the merged log-sum-exp")
    return ("o and lse equal the softmax over both blocks' keys (3 + 4), computed whole — and "
            "neither block ever saw the other's scores")


@exercise("12.2", "the zig-zag chunk assignment", reference=(chunk_ids,))
def check_zigzag(fn) -> str:
    """fn(rank, cp) against ``chunk_ids`` at cp = 1, 2, 4, 8; the work it gives each rank."""
    for cp in (1, 2, 4, 8):
        got = [tuple(fn(r, cp)) for r in range(cp)]
        want = [chunk_ids(r, cp) for r in range(cp)]
        if got == [chunk_ids(r, cp, zigzag=False) for r in range(cp)] and cp > 1:
            raise Hint(f"at cp = {cp} rank r gets chunks 2r and 2r + 1: consecutive parts, where "
                       f"the last rank does {causal_work(cp - 1, cp, False):g} chunk pairs of "
                       f"causal work to rank 0's {causal_work(0, cp, False):g}; pair an early "
                       "chunk with a late one")
        if sorted(i for ids in got for i in ids) != list(range(2 * cp)):
            raise Hint(f"at cp = {cp} the ranks' chunks {got} are not 0 … {2 * cp - 1}, each "
                       "once")
        if [tuple(sorted(g)) for g in got] != [tuple(sorted(w)) for w in want]:
            work = [sum(i + 0.5 for i in ids) for ids in got]
            raise Hint(f"at cp = {cp} the ranks' causal work (chunk pairs) is {work}: not equal; "
                       "rank i should hold chunk i and its mirror image")
        if got != want:
            raise Hint(f"at cp = {cp}: the right chunks, in the wrong order — give them in "
                       "sequence order (the earlier chunk first)")
    return ("rank i holds chunks i and 2·cp − 1 − i at cp = 1, 2, 4, 8: every rank does 2·cp "
            "chunk pairs of causal work (consecutive parts: from 2 to 4·cp − 2)")


def _ring_step_rank(fn):
    group = comm.world()
    block = torch.full((2, 3), float(group.rank))
    with comm.record() as log:
        got = fn(block, group)
    return got, [(e.op, e.peer) for e in log.events], block


@exercise("12.3", "one ring step: send to the next rank, receive from the previous",
          reference=(_exchange,))
def check_ring_step(fn) -> str:
    """fn(block, group) on 4 ranks: the previous rank's block received, one send and one recv."""
    results = on_ranks(CP, _ring_step_rank, fn, timeout=TIMEOUT)
    for rank, (got, events, block) in enumerate(results):
        nxt, prev = (rank + 1) % CP, (rank - 1) % CP
        if not isinstance(got, torch.Tensor) or got.shape != (2, 3):
            raise Hint(f"rank {rank} returned {type(got).__name__}; return the received block, "
                       "a tensor of the block's shape")
        if not torch.equal(block, torch.full((2, 3), float(rank))):
            raise Hint(f"rank {rank}'s own block changed: receive into a new buffer "
                       "(torch.empty_like), not into the block being sent")
        if torch.equal(got, torch.full((2, 3), float(nxt))):
            raise Hint(f"rank {rank} holds rank {nxt}'s block: the ring turned backwards — send "
                       "to rank + 1, receive from rank − 1")
        if not torch.equal(got, torch.full((2, 3), float(prev))):
            raise Hint(f"rank {rank} should hold rank {prev}'s block after one step")
        if sorted(events) != [("recv", prev), ("send", nxt)]:
            raise Hint(f"rank {rank} made {events or 'no calls'} through comm; one step is one "
                       f"send to {nxt} and one receive from {prev}, together in "
                       "comm.batch_isend_irecv")
    return (f"on {CP} ranks each rank sent its block to the next and received the previous "
            "one's, one send and one receive in one batch — cp − 1 such steps bring every block "
            "to every rank")
