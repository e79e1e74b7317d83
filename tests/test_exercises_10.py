"""The checkers of notebook 10: the reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import math
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from helpers import failed, stub
from torch.utils.checkpoint import checkpoint

from megatron_edu import comm
from megatron_edu.course.exercises import check
from megatron_edu.model.attention import Recomputed
from megatron_edu.tensor_parallel.random import DropoutKey
from megatron_edu.tensor_parallel.sequence_parallel import sum_replicated_grads_

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def layer_bytes(s, b, h, a, t, sp, selective,
                sp_splits_10=True, elements=False, core_t=True, drop34=False):
    keep = 34 * s * b * h / t if sp and sp_splits_10 else (10 + 24 / t) * s * b * h
    core = 5 * a * s * s * b / (t if core_t else 1)
    total = (core if drop34 else keep) if selective else keep + core
    return total / 2 if elements else total


@pytest.mark.parametrize(("answer", "fragments"), [
    (layer_bytes, ()),
    (lambda *x: layer_bytes(*x, sp_splits_10=False), ("split t ways",)),
    (lambda *x: layer_bytes(*x, drop34=True), ("not the 34",)),
    (lambda *x: layer_bytes(*x, elements=True), ("elements",)),
    (lambda *x: layer_bytes(*x, core_t=False), ("not divided by t",)),
    (stub, ("not done yet",)),
])
def test_10_1_layer_bytes(answer, fragments):
    result = check("10.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


# --- 10.2 selective recomputation of the attention core ------------------------------------------

def selective_attention(attn, x, key, scale=True, recompute=True, causal=True, dropout="keyed",
                        whole=False):
    """The attention sublayer with its core under a checkpoint, or one typical mistake."""

    def sublayer(x):
        qkv = attn.qkv(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, attn.local_heads, 3, attn.head_dim).permute(3, 0, 2, 1,
                                                                            4).unbind(0)
        calls = []

        def core(q, k, v):
            calls.append(1)
            scores = q @ k.transpose(-2, -1) / (math.sqrt(attn.head_dim) if scale else 1)
            if causal:
                future = torch.ones(s, s, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            probs = scores.softmax(-1)
            if dropout == "torch":                   # the global generator's mask
                return F.dropout(probs, attn.core.dropout.p) @ v
            again = DropoutKey(key.step + 1, key.samples)   # "another key": a new one recomputed
            mask_key = key if dropout == "keyed" or calls == [1] else again
            return attn.core.dropout(probs, mask_key) @ v

        y = checkpoint(core, q, k, v, use_reentrant=False) if recompute and not whole else (
            core(q, k, v))
        return attn.proj(y.transpose(1, 2).reshape(b, s, -1))

    return checkpoint(sublayer, x, use_reentrant=False) if whole else sublayer(x)


@pytest.mark.parametrize(("answer", "fragments"), [
    (selective_attention, ()),
    (lambda a, x, k: selective_attention(a, x, k, recompute=False),
     ("18,688 more", "float32 [2, 4, 16, 16]", "bool [2, 4, 16, 16]", "checkpoint")),
    (lambda a, x, k: selective_attention(a, x, k, dropout="torch"), ("keyed one",)),
    (lambda a, x, k: selective_attention(a, x, k, dropout="another key"),
     ("drew another dropout mask",)),
    (lambda a, x, k: selective_attention(a, x, k, whole=True), ("full recomputation",)),
    (lambda a, x, k: selective_attention(a, x, k, scale=False), ("not scaled",)),
    (lambda a, x, k: selective_attention(a, x, k, causal=False), ("causal",)),
    (lambda a, x, k: a(x, None, k)[:, :-1], ("return the sublayer's output",)),
    (stub, ("not done yet",)),
], ids=["solution", "no-checkpoint", "torch-dropout", "another-key", "whole-sublayer",
        "no-scale", "not-causal", "wrong-shape", "stub"])
def test_10_2_selective_attention(answer, fragments):
    result = check("10.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def test_10_2_the_package_own_attention_recomputed_selectively_passes():
    """The package's own core under its own checkpoint: what Attention.forward does."""

    def package(attn, x, key):
        attn.core = Recomputed(attn.core)          # what recompute="selective" builds
        return attn(x, None, key)

    assert check("10.2", package).passed


# --- 10.3 the sequence-parallel layer norm's gradients -------------------------------------------

def sp_layer_norm(ln, x, dy, grid, reduce="sum"):
    """The rank's part of the sequence through the layer norm, its gradients summed over tp —
    or reduced as one typical mistake does."""
    t, r = grid.tp, grid.tp_rank
    y = ln(x.chunk(t, dim=1)[r])
    y.backward(dy.chunk(t, dim=1)[r])
    group = {"sum": grid.tp_group, "mean": grid.tp_group, "dp": grid.dp_group,
             "world": comm.world()}.get(reduce)
    for param in (ln.weight, ln.bias):
        if group is not None:
            comm.all_reduce_(param.grad, group)
        if reduce == "mean":
            param.grad /= t
    return y


def split_batch(ln, x, dy, grid):
    y = ln(x.chunk(grid.tp, dim=0)[grid.tp_rank])
    y.backward(dy.chunk(grid.tp, dim=0)[grid.tp_rank])
    sum_replicated_grads_([ln.weight.grad, ln.bias.grad], grid.tp_group)
    return y


def whole_sequence(ln, x, dy, grid):
    y = ln(x)
    y.backward(dy)
    return y


@pytest.mark.parametrize(("answer", "fragments"), [
    (sp_layer_norm, ()),
    (lambda *a: sp_layer_norm(*a, reduce="none"), ("own s/2 positions", "grid.tp_group")),
    (lambda *a: sp_layer_norm(*a, reduce="mean"), ("averaged", "sum them")),
    (lambda *a: sp_layer_norm(*a, reduce="dp"), ("data-parallel group",)),
    (lambda *a: sp_layer_norm(*a, reduce="world"), ("every rank",)),
    (split_batch, ("dim 1",)),
    (whole_sequence, ("the whole sequence",)),
    (stub, ("not done yet",)),
], ids=["solution", "not-reduced", "averaged", "dp-group", "world", "batch-split", "whole",
        "stub"])
def test_10_3_sp_layer_norm(answer, fragments):
    result = check("10.3", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


# --- 10.4 sequence parallelism's column layer ----------------------------------------------------

def sp_linear(gather_dim=1, save_whole=False, regather=True, reduce="reduce_scatter", part="own",
              scatter_dim=1, reduce_weight=False, hang=False):
    """A SequenceParallelLinear with one of the typical mistakes switched on."""

    class SequenceParallelLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, group):
            whole = x if gather_dim is None else comm.all_gather(x, group, dim=gather_dim)
            ctx.save_for_backward(whole if save_whole else x, weight)
            ctx.group = group
            return F.linear(whole, weight)

        @staticmethod
        def backward(ctx, grad):
            kept, weight = ctx.saved_tensors
            group = ctx.group
            t, r = group.size, group.rank
            mine = kept.chunk(t, dim=1)[r] if save_whole else kept
            x = comm.all_gather(mine, group, dim=1) if regather else kept
            dy = grad if x.shape[1] == grad.shape[1] else grad.chunk(t, dim=1)[r]
            grad_weight = dy.flatten(0, 1).T @ x.flatten(0, 1)
            if reduce_weight:
                grad_weight = comm.all_reduce(grad_weight, group)
            partial = grad @ weight                                   # [b, s, in]
            if reduce == "reduce_scatter":
                dx = comm.reduce_scatter(partial, group, dim=scatter_dim)
            elif reduce == "twice":
                dx = comm.reduce_scatter(comm.all_reduce(partial, group), group, dim=1)
            elif reduce == "all_gather":
                dx = comm.all_gather(partial, group, dim=1)
            else:                                                     # all_reduce, or none
                summed = comm.all_reduce(partial, group) if reduce == "all_reduce" else partial
                dx = {"whole": summed, "own": summed.chunk(t, dim=1)[r],
                      "other": summed.chunk(t, dim=1)[t - 1 - r]}[part]
            if hang and r == 0:                                       # rank 0 alone: a deadlock
                comm.all_gather(mine, group, dim=1)
            return dx, grad_weight, None

    return SequenceParallelLinear


class NoGradientForTheGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        return sp_linear().forward(ctx, x, weight, group)

    @staticmethod
    def backward(ctx, grad):
        return sp_linear().backward(ctx, grad)[:2]


class StubFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        raise NotImplementedError("exercise 10.4: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 10.4: your code here")


@pytest.mark.parametrize(("answer", "fragments"), [
    (sp_linear(), ()),
    (sp_linear(gather_dim=None), ("own s/t positions only", "dim=1")),
    (sp_linear(gather_dim=0), ("dim 0, the batch",)),
    (sp_linear(gather_dim=-1), ("gathered along the hidden size, dim 2", "gather dim 1")),
    (sp_linear(reduce="all_reduce", part="whole"), ("(2, 8, 4)", "an all-reduce where a "
                                                    "reduce-scatter belongs")),
    (sp_linear(reduce="none", part="whole"), ("the whole sequence's, not reduced",)),
    (sp_linear(reduce="all_reduce"), ("backward all-reduces", "twice a reduce-scatter's bytes")),
    (sp_linear(reduce="all_gather"), ("(2, 16, 4): gathered in backward", "conjugate")),
    (sp_linear(reduce="none"), ("its own partial gradient, not summed",)),
    (sp_linear(scatter_dim=-1), ("the hidden size, dim 2",)),
    (sp_linear(reduce="twice"), ("2× too large", "summed twice")),
    (sp_linear(reduce="all_reduce", part="other"), ("rank 0's gradient of x is rank 1's part",)),
    (sp_linear(regather=False), ("its own s/t positions only", "gather x again")),
    (sp_linear(reduce_weight=True), ("was all-reduced", "no sum")),
    (sp_linear(save_whole=True, regather=False), ("gathered nothing", "t× the input's memory")),
    (sp_linear(save_whole=True), ("saved the whole sequence's input [b, s, in] = (2, 8, 4)",)),
    (sp_linear(hang=True), ("did not finish", "deadlock")),
    (NoGradientForTheGroup, ("(dx, dweight, None)",)),
    (lambda x, weight, group: x, ("pass the class itself",)),
    (StubFunction, ("not done yet",)),
], ids=["solution", "no-gather", "batch-gathered", "hidden-gathered", "all-reduced-whole",
        "not-reduced-whole", "all-reduced", "gathered-in-backward", "not-reduced",
        "hidden-scattered", "summed-twice", "other-rank", "no-regather", "weight-all-reduced",
        "whole-kept", "whole-saved", "deadlock", "no-group-gradient", "function", "stub"])
def test_10_4_sp_linear(answer, fragments):
    result = check("10.4", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
