"""Checkers for notebook 12 (context parallelism: ring attention, the zig-zag split).

12.1 ★    the online-softmax merge of two key blocks' partial results
12.2 ★    the zig-zag chunk assignment (which two of the 2·cp chunks a rank holds)
12.3 ★★   one ring step: send this rank's block to the next rank, receive the previous one's
12.4 ★★★  ring attention's backward, dK and dV: each rank's part for the visiting K, V block,
          added to the partial sums travelling with the block to its owner

12.1 and 12.2 are checked in this process against ``megatron_edu.context_parallel``; 12.3 and
12.4 run on 4 gloo ranks, 12.3 counting the sends and receives through ``comm``, 12.4 against
autograd of the serial causal attention. Typical wrong answers — the partial outputs added
without rescaling, the maximum taken instead of the log-sum-exp, the consecutive split, the ring
turned the wrong way; partial sums kept on the rank or sent against the block, the causal skip
missed, a block's own log-sum-exp, a missing 1/√h_d — are named.
"""

from __future__ import annotations

import math

import torch

from megatron_edu import comm
from megatron_edu.context_parallel import (
    _exchange,
    _RingAttention,
    causal_work,
    chunk_ids,
    merge,
)
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


@exercise("12.1", "the online-softmax merge of two key blocks", reference=(merge,),
          marks=(r"e\^\((ℓ|lse)[₁₂_\w]*[−-](ℓ|lse)\)",      # o's weights: e^(ℓ₁ − ℓ)·o₁
                 r"log\(e\^(ℓ|lse)",                        # ℓ = log(e^ℓ₁ + e^ℓ₂)
                 r"\((l|lse)\w*1-(l|lse)\)\.exp\(\)\*o",    # (l1 - lse).exp() * o1
                 r"logaddexp\((l|lse)\w*1,(l|lse)\w*2\)"))  # torch.logaddexp(l1, l2)
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


@exercise("12.2", "the zig-zag chunk assignment", reference=(chunk_ids,),
          marks=(r"2[·*]cp[−-]1[−-][a-z(]",                 # chunks i and 2·cp − 1 − i
                 r"holdspositions\[0,1,14,15\]"))           # split's rank 0 at cp = 4
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


# --- 12.4 ★★★ ring attention's backward: dK, dV travelling with their block ----------------------

TOKENS, HEAD = 4, 8                                    # per rank; the head size h_d
_TURNS = (1, -1, 0)              # the sums sent on with the block, against it, or kept
_MISTAKES = {
    "later blocks": "rank r added a part for the block of a later rank (owner > r): under the "
                    "causal mask its queries see none of those keys, so that part is zero — skip "
                    "the block",
    "diagonal unmasked": "the rank's own block (owner = r) needs the causal mask inside it: query "
                         "i sees keys ≤ i (masked_fill the upper triangle of S with −inf)",
    "diagonal skipped": "the rank's own block (owner = r) was skipped: its queries see its keys up "
                        "to themselves — compute it, masked",
    "local lse": "the probabilities were normalised over the visiting block's keys alone (its "
                 "own log-sum-exp): P is the forward's, exp(S − ℓ) with ℓ the log-sum-exp over "
                 "every key the query sees — the lse passed in",
    "unscaled scores": "S = Q·Kᵀ was not scaled by 1/√h_d before exp(S − ℓ): ℓ is the log-sum-exp "
                       "of the scaled scores",
    "unscaled dS": f"dK is √h_d = {math.sqrt(HEAD):.3g}× too large and dV is right: dS = "
                   "P ∘ (dO·Vᵀ − D) carries the 1/√h_d of the scores, dS = P ∘ (dO·Vᵀ − D)/√h_d",
}
_TRAVEL = {
    0: "the partial sums stayed on the rank that computed them: its result is the sum of its "
       "own parts for every block it saw. A block's dK, dV sum the parts of every rank whose "
       "queries see its keys: add this rank's part to the sums that arrived with the block and "
       "send them on with it, to rank r + 1",
    -1: "the partial sums went to rank r − 1 while the blocks go to r + 1: parted from their "
        "block, each rank's part was added to another block's sums. Send them the way the block "
        "travels — to rank r + 1, receiving from r − 1",
}


def _attention_inputs() -> list[torch.Tensor]:
    """q, k, v, dO [s, d] of one head, the whole sequence; ℓ [s, 1] the forward's log-sum-exp
    of each query's causal scores, and D = rowsum(dO ∘ O) [s, 1]."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, do = (torch.randn(CP * TOKENS, HEAD, generator=gen) for _ in range(4))
    scores = _masked(q @ k.T / math.sqrt(HEAD), True)
    out = scores.softmax(-1) @ v
    return [q, k, v, do, scores.logsumexp(-1, keepdim=True), (do * out).sum(-1, keepdim=True)]


def _masked(scores: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """The causal mask of a block of queries against the keys at the same positions."""
    if not diagonal:
        return scores
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))


def _serial_dkv() -> list[torch.Tensor]:
    """Autograd's dK, dV of the serial causal attention, each rank's block [2, n, d]."""
    q, k, v, do, _, _ = _attention_inputs()
    k, v = k.requires_grad_(), v.requires_grad_()
    (_masked(q @ k.T / math.sqrt(HEAD), True).softmax(-1) @ v).backward(do)
    return list(torch.stack([k.grad, v.grad]).chunk(CP, 1))


def _part(r: int, b: int, mistake: str | None) -> torch.Tensor:
    """Rank r's part of block b's dK, dV [2, n, d] — or what ``mistake`` makes of it."""
    q, k, v, do, lse, delta = (x.chunk(CP)[i] for x, i in zip(
        _attention_inputs(), (r, b, b, r, r, r), strict=True))
    skipped = b > r if mistake != "later blocks" else False
    if skipped or (mistake == "diagonal skipped" and b == r):
        return torch.zeros(2, TOKENS, HEAD)
    scale = 1.0 if mistake == "unscaled scores" else 1 / math.sqrt(HEAD)
    scores = _masked(q @ k.T * scale, b == r and mistake != "diagonal unmasked")
    p = (scores - (scores.logsumexp(-1, keepdim=True) if mistake == "local lse" else lse)).exp()
    ds = p * (do @ v.T - delta) / (1.0 if mistake == "unscaled dS" else math.sqrt(HEAD))
    return torch.stack([ds.T @ q, p.T @ do])


def _travelled(mistake: str | None, turn: int) -> list[torch.Tensor]:
    """Each rank's result after CP steps when its partial sums go ``turn`` ranks on at each step
    (1: with the block; −1: against it; 0: kept on the rank)."""
    held = [torch.zeros(2, TOKENS, HEAD) for _ in range(CP)]
    for step in range(CP):
        held = [held[r] + _part(r, (r - step) % CP, mistake) for r in range(CP)]
        held = [held[(r - turn) % CP] for r in range(CP)]
    return held


def _ring_dkv_rank(fn):
    group = comm.world()
    r = group.rank
    q, k, v, do, lse, delta = (x.chunk(CP)[r] for x in _attention_inputs())
    kv, dkv = torch.stack([k, v]), torch.zeros(2, TOKENS, HEAD)
    for step in range(CP):
        dkv = fn(q, do, lse, delta, kv, dkv, (r - step) % CP, group)
        if not (isinstance(dkv, torch.Tensor) and dkv.shape == kv.shape):
            return dkv
        if step < CP - 1:                             # the block goes on to the next rank
            works, kv = _exchange(group, kv, "cp kv")
            for work in works:
                work.wait()
    return dkv


@exercise("12.4", "ring attention's backward: dK, dV travelling with their block",
          reference=(_RingAttention.backward,))
def check_ring_dkv(fn) -> str:
    """fn(q, do, lse, delta, kv, dkv, owner, group) each of CP steps on CP ranks, the checker
    moving the K, V blocks; every rank's last result against autograd's dK, dV of its block."""
    results = on_ranks(CP, _ring_dkv_rank, fn, timeout=TIMEOUT, may_deadlock=True)
    want = _serial_dkv()
    for rank, got in enumerate(results):
        if not (isinstance(got, torch.Tensor) and got.shape == (2, TOKENS, HEAD)):
            raise Hint(f"rank {rank} returned {type(got).__name__} "
                       f"{list(getattr(got, 'shape', []))}: return the partial sums that "
                       f"arrive, a tensor [2, n, h_d] = {[2, TOKENS, HEAD]} (dK, dV stacked)")
    if all(torch.allclose(g, w, atol=1e-5) for g, w in zip(results, want, strict=True)):
        return (f"on {CP} ranks ({TOKENS} tokens each, in order) every rank's dK and dV equal "
                "autograd's of the serial causal attention: each block's partial sums travelled "
                "with it around the ring and reached its owner, summed over every rank whose "
                "queries see its keys")
    if all(torch.allclose(g.flip(0), w, atol=1e-5) for g, w in zip(results, want, strict=True)):
        raise Hint("dK and dV are right but swapped: stack them as [dK, dV], as kv is [K, V]")
    for mistake in (None, *_MISTAKES):
        for turn in _TURNS:
            if (mistake, turn) != (None, 1) and all(torch.allclose(g, w, atol=1e-4)
                   for g, w in zip(results, _travelled(mistake, turn), strict=True)):
                raise Hint("; and ".join(hint for hint in (_TRAVEL.get(turn), _MISTAKES.get(
                    mistake)) if hint))
    rank = next(r for r, (g, w) in enumerate(zip(results, want, strict=True))
                if not torch.allclose(g, w, atol=1e-5))
    diff = (results[rank] - want[rank]).abs().amax((1, 2))
    raise Hint(f"rank {rank}'s dK differs from autograd's by up to {diff[0]:.3g}, its dV by up to "
               f"{diff[1]:.3g}: P = exp(S − ℓ) with S = Q·Kᵀ/√h_d (causal on the own block, later "
               "blocks skipped), dV += Pᵀ·dO, dS = P ∘ (dO·Vᵀ − D)/√h_d, dK += dSᵀ·Q")
