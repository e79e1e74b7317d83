"""Context parallelism: ring attention at cp = 2 and 4 against the serial causal attention
(output and dQ, dK, dV), the zig-zag split, the merge, the bytes of the ring, and its timeline
(recorded, simulated, and the costs notebook 12 fits from one to draw the other)."""

from itertools import pairwise

import pytest
import torch
from helpers import Launches

from megatron_edu import comm
from megatron_edu.context_parallel import (
    _pairs,
    causal_work,
    chunk_ids,
    each_head,
    merge,
    ring_attention,
    split,
    unsplit,
)
from megatron_edu.perf.ring import simulate_ring, step_pairs
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey
from megatron_edu.timing import record_ring

B, A, S, D = 2, 3, 16, 4
KEY = DropoutKey(step=5, samples=(4, 9))


def _dropout(p):
    return Dropout(p, seed=1, layer=2, site="attention probs").train()


def _serial(q, k, v, p):
    """The model's eager attention core (``attention.EagerCore``), its dropout keyed by KEY;
    k, v of fewer heads than q: each serves its group of query heads."""
    k, v = each_head(k, q), each_head(v, q)
    scores = q @ k.transpose(-2, -1) / D**0.5
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    return _dropout(p)(scores.masked_fill(future, float("-inf")).softmax(-1), KEY) @ v


def _inputs(kv_heads=A):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(B, heads, S, D, generator=gen)           # q, k, v, dO
            for heads in (A, kv_heads, kv_heads, A)]


def _ring_rank(zigzag, p, kv_heads=A):
    group = comm.world()
    q, k, v, grad = (split(x, group.rank, group.size, zigzag, dim=2) for x in _inputs(kv_heads))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with comm.record() as log:
        out = ring_attention(q, k, v, group, zigzag, _dropout(p), KEY)
        out.backward(grad)
    sends = [(e.label, e.peer, e.bytes) for e in log.select(op="send")]
    recvs = [(e.label, e.peer, e.bytes) for e in log.select(op="recv")]
    return out.detach(), q.grad, k.grad, v.grad, sends, recvs


RINGS = [(2, True, 0.0, A), (4, True, 0.0, A), (4, False, 0.0, A), (2, True, 0.3, A),
         (4, True, 0.3, A), (4, False, 0.3, A),
         (4, True, 0.3, 1)]   # (cp, zigzag, dropout, kv heads: 1 of 3, multi-query attention)


@pytest.mark.parametrize(("cp", "zigzag", "p", "g"), RINGS)
def test_ring_attention_equals_serial_attention_and_its_gradients(cp, zigzag, p, g):
    """Grouped-query attention too: the ring carries the g kv heads, not the A query heads,
    and each kv head's gradient sums its group's."""
    q, k, v, grad = (x.requires_grad_() for x in _inputs(g))
    out = _serial(q, k, v, p)
    out.backward(grad.detach())
    results = LAUNCHES[f"ring-{cp}-{zigzag}-{p}-{g}"]
    for i, expected in enumerate([out, q.grad, k.grad, v.grad]):
        got = unsplit([r[i] for r in results], zigzag, dim=2)
        torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-5)

    block = B * g * (S // cp) * D * 4                 # one of K, V on one rank, fp32 bytes
    for rank, (*_, sends, recvs) in enumerate(results):
        nxt, prev = (rank + 1) % cp, (rank - 1) % cp
        assert sum(b for label, _, b in sends if label == "cp kv") == 2 * 2 * (cp - 1) * block
        assert sum(b for label, _, b in sends if label == "cp dkv") == 2 * (cp - 1) * block
        assert {peer for _, peer, _ in sends} == {nxt} and {peer for _, peer, _ in recvs} == {prev}
        # every send is matched, in order, by the next rank's receive of the same bytes
        assert [(lab, b) for lab, _, b in sends] == [(lab, b) for lab, _, b in results[nxt][5]]


def test_the_zigzag_split_gives_every_rank_the_same_causal_work():
    for cp in (2, 4, 8):
        assert sorted(i for r in range(cp) for i in chunk_ids(r, cp)) == list(range(2 * cp))
        assert {causal_work(r, cp) for r in range(cp)} == {2 * cp}
        naive = [causal_work(r, cp, zigzag=False) for r in range(cp)]
        assert naive == [4 * r + 2 for r in range(cp)]          # the last rank: (2cp − 1)×
    x = torch.arange(16.0).view(1, 16)
    parts = [split(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and torch.equal(unsplit(parts), x)
    with pytest.raises(ValueError, match="2·cp = 8 chunks: the length 12"):
        split(torch.ones(1, 12), 0, 4)


def test_merging_two_key_blocks_is_the_softmax_over_both():
    gen = torch.Generator().manual_seed(0)
    scores, v = torch.randn(5, 8, generator=gen), torch.randn(8, 3, generator=gen)
    parts = []
    for cols in (slice(0, 3), slice(3, 8)):
        lse = scores[:, cols].logsumexp(-1, keepdim=True)
        parts += [(scores[:, cols] - lse).exp() @ v[cols], lse]
    out, lse = merge(*parts)
    torch.testing.assert_close(out, scores.softmax(-1) @ v)
    torch.testing.assert_close(lse, scores.logsumexp(-1, keepdim=True))


# --- the ring's timeline: recorded and simulated ------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_the_simulated_ring_computes_the_pairs_the_code_computes(cp, zigzag):
    pairs = [[len(_pairs(chunk_ids(r, cp, zigzag), chunk_ids((r - k) % cp, cp, zigzag)))
              for k in range(cp)] for r in range(cp)]
    assert [[step_pairs(r, k, cp, zigzag) for k in range(cp)] for r in range(cp)] == pairs
    # a diagonal pair is computed whole: two of them per rank, each ½ of causal_work's count
    assert [sum(row) for row in pairs] == [causal_work(r, cp, zigzag) + 1 for r in range(cp)]
    if zigzag:                                 # every rank alike at every step: 3, then 2s
        assert all(row == [3] + [2] * (cp - 1) for row in pairs)
    for backward in (False, True):
        ring = simulate_ring(cp, pair_time=1, hop_time=0, zigzag=zigzag, backward=backward)
        assert ring.busy == [sum(row) for row in pairs]
        assert ring.makespan == max(ring.busy)           # free hops: the busiest rank paces it
        assert max(ring.busy) == (2 * cp + 1 if zigzag else 4 * cp - 1)   # the last rank's
    # a hop longer than a step's compute shows: forward max(3, h) + (cp − 2)·max(2, h) + 2
    for hop in (1, 3):
        ring = simulate_ring(cp, 1, hop, zigzag=True)
        assert ring.makespan == max(3, hop) + (cp - 2) * max(2, hop) + 2


def _recorded_rank(zigzag):
    group = comm.world()
    q, k, v, grad = (split(x, group.rank, group.size, zigzag, dim=2) for x in _inputs())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with record_ring() as log:
        ring_attention(q, k, v, group, zigzag).backward(grad)
    before = list(log.stamps)
    ring_attention(q, k, v, group, zigzag).backward(grad)     # no block active: nothing noted
    assert log.stamps == before
    return log.intervals


@pytest.mark.parametrize("zigzag", [True, False])
def test_the_recorder_notes_each_step_of_both_passes_as_the_simulation_plays_them(zigzag):
    cp = 2
    for rank, intervals in enumerate(LAUNCHES[f"recorded-{zigzag}"]):
        for backward in (False, True):
            steps = {i.step for i in intervals if i.backward == backward}
            assert steps == set(range(cp))
        simulated = (simulate_ring(cp, 1, 0, zigzag).ranks[rank]
                     + simulate_ring(cp, 1, 0, zigzag, backward=True).ranks[rank])
        kinds = [(i.backward, i.step, i.kind) for i in intervals]
        assert kinds == [(i.backward, i.step, i.kind) for i in simulated]
        for i, j in pairwise(intervals):                    # in order, none overlapping
            assert i.start <= i.end <= j.start


def test_the_costs_fitted_from_a_timeline_are_those_it_was_simulated_with():
    import matplotlib.pyplot as plt

    from megatron_edu.course.viz.context_parallel import (
        draw_ring_timelines,
        fit_ring_costs,
        simulate_ring_step,
    )

    plt.switch_backend("agg")
    steps = {z: simulate_ring_step(4, 0.25, 0.5, 0.125, z) for z in (False, True)}
    assert fit_ring_costs({z: t.ranks for z, t in steps.items()}) == (0.25, 0.5)
    assert steps[True].makespan == 9 * 0.25 + 9 * 0.5 + 3 * 0.125   # the dK, dV hops exposed
    fig = draw_ring_timelines({"zig-zag": steps[True].ranks}, {"zig-zag": steps[True]})
    bars = [p.get_gid() for p in fig.axes[0].patches]
    assert bars.count("backward compute 3") == 4 and bars.count("forward wait 3") == 0
    plt.close(fig)


# --- the GPT with a cp dimension ----------------------------------------------------------------


def _gpt_rank(tp, cp, dropout, recompute, sp=False):
    from megatron_edu.grid import Layout, ParallelGrid
    from megatron_edu.model import GPT
    from megatron_edu.tensor_parallel.sequence_parallel import sum_replicated_grads_
    from tests.helpers import batch, tiny_config

    grid = ParallelGrid(Layout(tp=tp, cp=cp))
    config = tiny_config(dropout=dropout, recompute=recompute, sequence_parallel=sp)
    model = GPT(config, grid).train()
    ids, labels = batch(config, b=2, s=16)
    ids, labels = (split(x, grid.cp_rank, cp) for x in (ids, labels))
    loss = model(ids, labels, dropout_key=KEY)
    loss.backward()
    if sp:                                   # each tp rank's part of the replicated ones
        sum_replicated_grads_([p.grad for p in model.parameters() if p.tp_dim is None],
                              grid.tp_group)
    for p in model.parameters():             # each cp rank's gradient is of its tokens' mean
        comm.all_reduce_(p.grad, grid.cp_group)   # the mean of the cp ranks' means: the serial
        p.grad /= cp
    loss = comm.all_reduce(loss.detach(), grid.cp_group) / cp
    return loss, model.full_state_dict(grads=True)


GPTS = [(1, 2, 0.0, "none", False), (1, 4, 0.1, "none", False), (2, 2, 0.1, "selective", True),
        (1, 2, 0.1, "full", False)]   # (tp, cp, dropout, recompute, sequence parallel)


@pytest.mark.parametrize(("tp", "cp", "dropout", "recompute", "sp"), GPTS)
def test_a_context_parallel_gpt_equals_the_serial_gpt(tp, cp, dropout, recompute, sp):
    """Positions, the embedding's and residual dropouts of each rank's chunks (under sequence
    parallelism each tp rank's part of them), attention as a ring: the loss and every gradient
    equal the serial model's, dropout on (the same masks, at tp = 2 too)."""
    serial = LAUNCHES[f"gpt-serial-{dropout}"][0]
    results = LAUNCHES[f"gpt-{tp}-{cp}-{dropout}-{recompute}-{sp}"]
    for loss, grads in results:
        torch.testing.assert_close(loss, serial[0], rtol=0, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, serial[1][name], rtol=0, atol=1e-5, msg=name)


# --- the runs above: one launch per world size --------------------------------------------------

LAUNCHES = Launches({  # name -> (world size, function, arguments)
    **{f"ring-{cp}-{zigzag}-{p}-{g}": (cp, _ring_rank, (zigzag, p, g))
       for cp, zigzag, p, g in RINGS},
    **{f"recorded-{zigzag}": (2, _recorded_rank, (zigzag,)) for zigzag in (True, False)},
    **{f"gpt-serial-{dropout}": (1, _gpt_rank, (1, 1, dropout, "none")) for dropout in (0.0, 0.1)},
    **{f"gpt-{'-'.join(map(str, case))}": (case[0] * case[1], _gpt_rank, case) for case in GPTS},
})
