"""The checkers of notebooks 00–02: each reference solution passes, each typical wrong answer gets
its own hint, a student stub is "not done yet", and a deadlocking ring is named a deadlock.

The answers below are what a learner would write in the notebook; they travel to the ranks by
value, as a notebook cell's functions do.
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import marked, stub

from megatron_edu import comm
from megatron_edu.course.exercises import EXERCISES, Hint, check, checking
from megatron_edu.course.exercises.checking import _stub_message, on_ranks

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def verdict(exercise, fn, *expected, passed=False):
    """Check ``fn``; assert the outcome and that the message says each expected phrase."""
    result = check(exercise, fn)
    assert result.passed is passed, result
    for phrase in expected:
        assert phrase in result.message, result
    assert repr(result).startswith(("✓" if passed else "✗") + f" {exercise} ")
    return result


def test_the_exercises_of_notebooks_00_to_02_are_registered():
    assert {"00.1", "00.2", "00.3", "01.1", "01.2", "01.3", "02.1", "02.2"} <= set(EXERCISES)


# --- 00.1 an all-gather from one all-reduce ------------------------------------------------------

def gather_by_all_reduce(x, group):
    n = x.numel()
    buffer = torch.zeros(group.size * n, dtype=x.dtype)
    buffer[group.rank * n:(group.rank + 1) * n] = x
    return comm.all_reduce(buffer, group)


def gather_next_slot(x, group):
    n, slot = x.numel(), (group.rank + 1) % group.size
    buffer = torch.zeros(group.size * n, dtype=x.dtype)
    buffer[slot * n:(slot + 1) * n] = x
    return comm.all_reduce(buffer, group)


def gather_not_zeroed(x, group):
    return comm.all_reduce(x.repeat(group.size), group)


def gather_with_all_gather(x, group):
    return comm.all_gather(x, group)


def test_00_1_the_solution_passes_and_names_the_cost():
    verdict("00.1", gather_by_all_reduce, "72 bytes", "comm.all_gather", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (gather_next_slot, ["slot 0 holds rank 3's x", "group.rank"]),
    (gather_not_zeroed, ["sum of ranks 0, 1, 2, 3", "must be zero"]),
    (gather_with_all_gather, ["all_gather", "exactly one comm.all_reduce"]),
    (stub, ["not done yet"]),
], ids=["wrong-slot", "not-zeroed", "all-gather", "stub"])
def test_00_1_typical_mistakes_get_their_hint(answer, phrases):
    verdict("00.1", answer, *phrases)


# --- 00.2 the grid's coordinates -----------------------------------------------------------------

def coords(rank, tp, pp, dp):
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def coords_dp_fastest(rank, tp, pp, dp):
    return (rank // dp) % tp, rank // (tp * dp), rank % dp


def coords_tp_dp_pp(rank, tp, pp, dp):
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def coords_pp_stride_tp_pp(rank, tp, pp, dp):
    return rank % tp, rank // (tp * pp), (rank // tp) % dp


def test_00_2_the_solution_passes():
    verdict("00.2", coords, "tp fastest, then dp, then pp", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (coords_dp_fastest, ["dp fastest, then tp, then pp", "rank = pp_rank·(dp·tp)"]),
    (coords_tp_dp_pp, ["in the order (tp_rank, dp_rank, pp_rank)"]),
    (coords_pp_stride_tp_pp, ["your pp_rank is rank // tp·pp", "pp_rank = rank // tp·dp"]),
    (stub, ["not done yet"]),
], ids=["dp-fastest", "tuple-order", "pp-stride", "stub"])
def test_00_2_typical_mistakes_get_their_hint(answer, phrases):
    verdict("00.2", answer, *phrases)


# --- 00.3 the ring all-reduce --------------------------------------------------------------------

def _ring(x, group, *, blocking=False, add_in_gather=False, gather_from_own=False):
    t, r = group.size, group.rank
    right, left = group.ranks[(r + 1) % t], group.ranks[(r - 1) % t]
    chunks = [chunk.clone() for chunk in x.chunk(t)]
    for step in range(2 * (t - 1)):
        reducing = step < t - 1
        k = step % (t - 1)
        send = (r - k) % t if reducing or gather_from_own else (r + 1 - k) % t
        receive = (send - 1) % t
        if blocking:  # every rank sends first: nobody is receiving
            comm.send(chunks[send], right)
            incoming = comm.recv(torch.empty_like(chunks[receive]), left)
        else:
            work, _ = comm.isend(chunks[send], right)
            incoming = comm.recv(torch.empty_like(chunks[receive]), left)
            work.wait()
        add = reducing or add_in_gather
        chunks[receive] = chunks[receive] + incoming if add else incoming
    return torch.cat(chunks)


def ring(x, group):
    return _ring(x, group)


def ring_adds_twice(x, group):
    return _ring(x, group, add_in_gather=True)


def ring_gathers_from_own_chunk(x, group):
    return _ring(x, group, gather_from_own=True)


def ring_blocking(x, group):
    return _ring(x, group, blocking=True)


def ring_of_whole_tensors(x, group):
    t, r = group.size, group.rank
    total, passing = x.clone(), x.clone()
    for _ in range(t - 1):
        work, _ = comm.isend(passing, group.ranks[(r + 1) % t])
        passing = comm.recv(torch.empty_like(passing), group.ranks[(r - 1) % t])
        work.wait()
        total += passing
    return total


def test_00_3_the_solution_passes_with_the_rings_message_count():
    verdict("00.3", ring, "6 messages of 8 bytes", "2(t − 1)/t · n", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (ring_adds_twice, ["2 times", "in the all-gather phase replace your chunk"]),
    (ring_gathers_from_own_chunk, ["missing rank(s) 1, 2, 3", "(r + 1) mod t"]),
    (ring_of_whole_tensors, ["3 messages of the whole tensor", "(t − 1)·n"]),
    (stub, ["not done yet"]),
], ids=["adds-twice", "gather-off-by-one", "whole-tensors", "stub"])
def test_00_3_typical_mistakes_get_their_hint(answer, phrases):
    verdict("00.3", answer, *phrases)


def test_00_3_a_ring_of_blocking_sends_is_named_a_deadlock():
    # detected ("using no CPU"), not waited out to RING_TIMEOUT ("did not finish within 20 s")
    verdict("00.3", ring_blocking, "did not finish: they sat blocked, using no CPU", "a deadlock",
            "start the send with comm.isend")


def _recv_from_each_other():
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def test_where_a_deadlock_cannot_be_seen_the_timeout_names_it():  # not Linux: no CPU times
    with pytest.raises(Hint, match=r"ranks \[0, 1\] did not finish within 1 s: a deadlock\? "
                                   r"Every send needs a matching recv"):
        on_ranks(2, _recv_from_each_other, timeout=1)


# --- 01.1 which slice each rank keeps ------------------------------------------------------------

def shards(fc_weight, fc_bias, proj_weight, proj_bias, rank, t):
    return (fc_weight.chunk(t, dim=0)[rank], fc_bias.chunk(t)[rank],
            proj_weight.chunk(t, dim=1)[rank], proj_bias)


def shards_by_stored_columns(fc_weight, fc_bias, proj_weight, proj_bias, rank, t):
    return (fc_weight.chunk(t, dim=1)[rank], fc_bias.chunk(t)[rank],
            proj_weight.chunk(t, dim=0)[rank], proj_bias)


def shards_split_proj_bias(fc_weight, fc_bias, proj_weight, proj_bias, rank, t):
    return (*shards(fc_weight, fc_bias, proj_weight, proj_bias, rank, t)[:3],
            proj_bias.chunk(t)[rank])


def shards_of_the_next_rank(fc_weight, fc_bias, proj_weight, proj_bias, rank, t):
    return shards(fc_weight, fc_bias, proj_weight, proj_bias, (rank + 1) % t, t)


def test_01_1_the_solution_passes():
    verdict("01.1", shards, "proj.bias whole", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (shards_by_stored_columns, ["fc.weight along its columns (dim 1)", "[out, in]"]),
    (shards_split_proj_bias, ["proj.bias is not split", "after g"]),
    (shards_of_the_next_rank, ["rank 0 kept slice 1 of fc.weight"]),
    (stub, ["not done yet"]),
], ids=["stored-columns", "split-bias", "next-rank", "stub"])
def test_01_1_typical_mistakes_get_their_hint(answer, phrases):
    verdict("01.1", answer, *phrases)


# --- 01.2 f and g as autograd functions ----------------------------------------------------------

class MyF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad, ctx.group), None


class MyG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FWithoutNone(MyF):
    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad, ctx.group)


class GIdentity(MyG):
    @staticmethod
    def forward(ctx, x, group):
        return x.clone()


class GBothWays(MyG):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad, ctx.group), None


class FStub(MyF):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("exercise 01.2: your code here")


class GStub(MyG):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("exercise 01.2: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 01.2: your code here")


def test_a_stub_class_or_pair_is_not_done_without_starting_ranks(monkeypatch):
    monkeypatch.setattr(checking, "run", None)          # a launch would raise: none may start
    result = check("01.2", (GStub, GStub))             # as the student notebook's stubs are
    assert not result.passed and "not done yet" in result.message
    assert _stub_message((FStub, MyG)) is None          # half done: the checker runs it


def test_01_2_the_solution_passes_with_one_all_reduce_each_way():
    verdict("01.2", (MyF, MyG), "1 all-reduce forward and 1 backward", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    ((MyG, MyF), ["f's forward all-reduced x", "belongs in the backward pass"]),
    ((FWithoutNone, MyG), ["incorrect number of gradients", "(grad, None)"]),
    ((MyF, GIdentity), ["g's forward returned rank 0's partial sum"]),
    ((MyF, GBothWays), ["g's backward all-reduced the gradient", "identity"]),
    ((FStub, MyG), ["not done yet"]),
    (MyF, ["as a pair"]),
], ids=["swapped", "no-None", "g-identity", "g-both-ways", "stub", "one-class"])
def test_01_2_typical_mistakes_get_their_hint(answer, phrases):
    verdict("01.2", answer, *phrases)


# --- 01.3 the tensor-parallel MLP ----------------------------------------------------------------

def _mlp(x, fc_weight, fc_bias, proj_weight, proj_bias, group, *, use_f=True, bias_before_g=False,
         rank=None, gelu="tanh", reduce=comm.g):
    t = group.size
    r = group.rank if rank is None else rank
    fc_w, fc_b = fc_weight.chunk(t, dim=0)[r], fc_bias.chunk(t)[r]
    proj_w = proj_weight.chunk(t, dim=1)[r]
    y = F.gelu(F.linear(comm.f(x, group) if use_f else x, fc_w, fc_b), approximate=gelu)
    if bias_before_g:
        return reduce(F.linear(y, proj_w, proj_bias), group)
    return reduce(F.linear(y, proj_w), group) + proj_bias


def tp_mlp(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group)


def tp_mlp_without_f(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group, use_f=False)


def tp_mlp_bias_before_g(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group, bias_before_g=True)


def tp_mlp_rank_0_slices(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group, rank=0)


def tp_mlp_exact_gelu(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group, gelu="none")


def tp_mlp_plain_all_reduce(x, w1, b1, w2, b2, group):
    return _mlp(x, w1, b1, w2, b2, group, reduce=comm.all_reduce)


def test_01_3_the_solution_passes():
    verdict("01.3", tp_mlp, "equal the package's serial MLP", "1 backward", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (tp_mlp_without_f, ["comm.f", "all-reduces the gradient"]),
    (tp_mlp_bias_before_g, ["(t − 1)·proj.bias", "add it once, after g"]),
    (tp_mlp_rank_0_slices, ["rank 1 computed with rows 0…7 of fc.weight", "here 8…15"]),
    (tp_mlp_exact_gelu, ['approximate="tanh"']),
    (tp_mlp_plain_all_reduce, ["no backward rule", "use comm.g"]),
    (stub, ["not done yet"]),
], ids=["no-f", "bias-before-g", "rank-0-slices", "exact-gelu", "plain-all-reduce", "stub"])
def test_01_3_typical_mistakes_get_their_hint(answer, phrases):
    verdict("01.3", answer, *phrases)


# --- 02.1 the per-head qkv layout ----------------------------------------------------------------

def per_head(c_attn, heads):
    h = c_attn.shape[0]
    return c_attn.t().reshape(3, heads, h // heads, h).transpose(0, 1).reshape(3 * h, h)


def qkv_order_kept(c_attn, heads):
    return c_attn.t().contiguous()


def not_transposed(c_attn, heads):
    h = c_attn.shape[0]
    return c_attn.reshape(3, heads, h // heads, h).transpose(0, 1).reshape(3 * h, h)


def hugging_face_shape(c_attn, heads):
    return c_attn


def interleaved_by_dim(c_attn, heads):
    h = c_attn.shape[0]
    return c_attn.t().reshape(3, heads, h // heads, h).permute(1, 2, 0, 3).reshape(3 * h, h)


def test_02_1_the_solution_passes_and_runs_as_whole_heads():
    verdict("02.1", per_head, "rank 0: heads 0–1; rank 1: heads 2–3",
            "equals Hugging Face's attention", passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (qkv_order_kept, ["q | k | v order", "rank 0 would hold every head's query"]),
    (not_transposed, ["not a column of c_attn", "transpose first"]),
    (hugging_face_shape, ["[h, 3h]", "[out, in]"]),
    (interleaved_by_dim, ["row 1 of your tensor is the key of head 0, dim 0",
                          "the query of head 0, dim 1"]),
    (stub, ["not done yet"]),
], ids=["qkv-order", "no-transpose", "hf-shape", "interleaved", "stub"])
def test_02_1_typical_mistakes_get_their_hint(answer, phrases):
    verdict("02.1", answer, *phrases)


# --- 02.2 attention on this rank's heads ---------------------------------------------------------

def _attention(x, qkv_weight, proj_weight, heads, group, *, causal=True, blocks=False,
               rank=None, scale=None, reduce=True):
    b, s, h = x.shape
    t = group.size
    r = group.rank if rank is None else rank
    n, d = heads // t, h // heads
    qkv = F.linear(comm.f(x, group), qkv_weight[r * 3 * n * d:(r + 1) * 3 * n * d])
    if blocks:  # q | k | v read from the per-head shard: the typical slip
        q, k, v = (z.view(b, s, n, d).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
    else:
        q, k, v = qkv.view(b, s, n, 3, d).permute(3, 0, 2, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    y = y.transpose(1, 2).reshape(b, s, n * d)
    out = F.linear(y, proj_weight[:, r * n * d:(r + 1) * n * d])
    return comm.g(out, group) if reduce else out


def attention(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group)


def attention_not_causal(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group, causal=False)


def attention_qkv_blocks(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group, blocks=True)


def attention_without_g(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group, reduce=False)


def attention_rank_0_heads(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group, rank=0)


def attention_scaled_by_hidden(x, qkv_weight, proj_weight, heads, group):
    return _attention(x, qkv_weight, proj_weight, heads, group, scale=x.shape[-1] ** -0.5)


def test_02_2_the_solution_passes():
    verdict("02.2", attention, "equal the package's serial Attention", "the 2 + 2 per layer",
            passed=True)


@pytest.mark.parametrize("answer, phrases", [
    (attention_not_causal, ["causal mask is missing"]),
    (attention_qkv_blocks, ["three blocks (q | k | v)", "view(b, s, heads/t, 3, h_d)"]),
    (attention_without_g, ["partial output of its own heads", "comm.g"]),
    (attention_rank_0_heads, ["rank 1 computed with rows 0…23 of qkv.weight"]),
    (attention_scaled_by_hidden, ["1/√h", "1/√h_d"]),
    (stub, ["not done yet"]),
], ids=["not-causal", "qkv-blocks", "no-g", "rank-0-heads", "scale-h", "stub"])
def test_02_2_typical_mistakes_get_their_hint(answer, phrases):
    verdict("02.2", answer, *phrases)


# --- the marks: what gives each answer away, seen where the first edition showed it -------------

# Each exercise's marks (``@exercise(marks=)``) against the text that revealed its answer before
# the exercise in the second edition (spaces removed, as ``megatron_edu/course/reveals.py`` reads
# it), and against text of the same notebooks that gives nothing away.
REVEALED = {
    "00.1": ["Give each rank's `x` a slot of its own in a buffer of t·n zeros"],
    "00.2": ["return rank % tp, rank // (tp * dp), (rank // tp) % dp", "tp_rank = rank mod tp"],
    "00.3": ["at step k, rank r sends chunk (r − k) mod t", "into its chunk (r − k − 1) mod t",
             "rank r holds the complete sum of chunk (r + 1) mod t"],
    "01.1": ["A: 64 of its 128 output rows", "B: 64 of its 128 input columns"],
    "01.2": ["return all_reduce(grad, ctx.group, \"f backward\"), None"],
    "01.3": ["compute g(GeLU(f(x)·A_i + a_i)·B_i) + b with comm.f"],
    "02.1": ["name the axes with a `reshape` ([3, heads, d, h])"],
    "02.2": ["q, k, v = qkv.permute(2, 3, 0, 1, 4).split([n, 1, 1], dim=1)"],
}
HARMLESS = [
    "The neighbours are `group.ranks[(r + 1) % t]` and `group.ranks[(r - 1) % t]`",
    "rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank",
    "A is split by columns — its output features — and B by rows — its input features",
    "Figure 3a: g(GeLU(f(X)·A_i)·B_i), 1 all-reduce forward and 1 backward",
    "view the projection's 3h/t outputs per head, [b, s, a/t, 3, h_d]",
]


@pytest.mark.parametrize("exercise", sorted(REVEALED))
def test_the_marks_see_what_gave_the_answer_away_and_not_the_prompts_that_remain(exercise):
    assert all(marked(exercise, text) for text in REVEALED[exercise]), exercise
    assert not any(marked(exercise, text) for text in HARMLESS), exercise
