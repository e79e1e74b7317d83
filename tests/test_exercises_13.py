"""The checkers of notebook 13: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import sys

import cloudpickle
import pytest
import torch
from helpers import failed, marked, stub

from megatron_edu import comm
from megatron_edu.course.exercises import check

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 13.1 what a rank holds -----------------------------------------------------------------------

def held_bytes(stage, psi, d, bytes_per_param, sharded_from=None):
    sharded_from = sharded_from or {"optimizer": 1, "grads": 2, "weights": 3}
    return {part: psi * nbytes / (d if stage >= sharded_from[part] else 1)
            for part, nbytes in bytes_per_param.items()}


def only_its_own_part(stage, psi, d, per_param):
    own = {"optimizer": 1, "grads": 2, "weights": 3}
    return {p: psi * b / (d if own[p] == stage else 1) for p, b in per_param.items()}


@pytest.mark.parametrize(("answer", "fragments"), [
    (held_bytes, ()),
    (only_its_own_part, ("cumulative",)),
    (lambda s, psi, d, b: held_bytes(s, psi, d, b, {"weights": 1, "grads": 2, "optimizer": 3}),
     ("wrong order",)),
    (lambda s, psi, d, b: {p: psi * v / d for p, v in b.items()}, ("plain data parallelism",)),
    (lambda s, psi, d, b: {p: psi * v for p, v in b.items()}, ("nothing is divided",)),
    (lambda s, psi, d, b: held_bytes(s, 1, d, b), ("bytes per parameter",)),
    (lambda s, psi, d, b: sum(held_bytes(s, psi, d, b).values()), ("return a dict",)),
    (stub, ("not done yet",)),
])
def test_13_1_held_bytes(answer, fragments):
    result = check("13.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def test_13_1_reports_figure_1_of_the_zero_paper():
    assert "120, 31.4, 16.6, 1.88 GB" in check("13.1", held_bytes).message


# --- 13.2 a ZeRO-3 layer --------------------------------------------------------------------------

def zero3_linear(gather_dim=0, save_whole=False, reduce="reduce_scatter", regather=True,
                 divide=False, return_whole=False):
    """A Zero3Linear with one of the typical mistakes switched on."""

    class Zero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, group):
            weight = comm.all_gather(shard, group, dim=gather_dim)
            ctx.save_for_backward(x, weight if save_whole else shard)
            ctx.group = group
            return x @ weight.T

        @staticmethod
        def backward(ctx, grad):
            x, kept = ctx.saved_tensors
            group = ctx.group
            weight = comm.all_gather(kept, group, dim=0) if regather and not save_whole else kept
            if regather and save_whole:
                comm.all_gather(kept.chunk(group.size)[group.rank], group, dim=0)
            grad_weight = grad.T @ x
            if reduce == "reduce_scatter":
                mine = comm.reduce_scatter(grad_weight, group, dim=0)
            elif reduce == "all_reduce":
                mine = comm.all_reduce(grad_weight, group)
                mine = mine if return_whole else mine.chunk(group.size)[group.rank]
            else:                                    # no reduction: this rank's batch only
                mine = grad_weight.chunk(group.size)[group.rank]
            return grad @ weight, mine / group.size if divide else mine, None

    return Zero3Linear


class OwnShardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, group):
        ctx.save_for_backward(x, shard)
        return x @ shard.T

    @staticmethod
    def backward(ctx, grad):
        x, shard = ctx.saved_tensors
        return grad @ shard, grad.T @ x, None


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, group):
        raise NotImplementedError("exercise 13.2: your code here")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("exercise 13.2: your code here")


@pytest.mark.parametrize(("answer", "fragments"), [
    (zero3_linear(), ()),
    (zero3_linear(save_whole=True, regather=False), ("gathered nothing",)),
    (zero3_linear(save_whole=True), ("saved a tensor of the whole weight",)),
    (zero3_linear(reduce="none"), ("its own dW", "reduce_scatter")),
    (zero3_linear(reduce="all_reduce"), ("all-reduces",)),
    (zero3_linear(reduce="all_reduce", return_whole=True), ("shape",)),
    (zero3_linear(divide=True), ("divided by d",)),
    (zero3_linear(gather_dim=-1), ("dim 0",)),
    (OwnShardOnly, ("own shard only",)),
    (lambda x, shard, group: x, ("pass the class",)),
    (Stub, ("not done yet",)),
])
def test_13_2_zero3_linear(answer, fragments):
    result = check("13.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


# --- 13.3 the bytes of a step ---------------------------------------------------------------------

def dp_bytes(stage, grad_bytes, d, m, halves=None, ring=True):
    halves = halves or {0: 2, 1: 2, 2: m + 1, 3: 3 * m}
    return halves[stage] * ((d - 1) / d if ring else 1) * grad_bytes


@pytest.mark.parametrize(("answer", "fragments"), [
    (dp_bytes, ()),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, ring=False), ("ring's factor",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2 * m, 1: 2 * m, 2: m + 1, 3: 3 * m}),
     ("only accumulate",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2, 1: 3, 2: m + 1, 3: 3 * m}),
     ("two halves of one all-reduce",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2, 1: 2, 2: 2, 3: 3 * m}), ("ZeRO-1's count",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2, 1: 2, 2: m + 1, 3: 2 * m}),
     ("twice per microbatch",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2, 1: 2, 2: m + 1, 3: 3}), ("one microbatch's",)),
    (lambda s, g, d, m: dp_bytes(s, g, d, m, {0: 2, 1: 2, 2: m + 1, 3: 3 * m + 1}),
     ("gathers nothing after the update",)),
    (lambda s, g, d, m: str(dp_bytes(s, g, d, m)), ("return a number",)),
    (stub, ("not done yet",)),
])
def test_13_3_dp_bytes_per_step(answer, fragments):
    result = check("13.3", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


# --- the marks: the answer as the notebook states it, which no cell may show before the exercise

@pytest.mark.parametrize(("exercise", "text"), [
    ("13.1", "| 1, P_os | the optimizer state | 2Ψ + 2Ψ + KΨ/d |"),
    ("13.1", "At d = 4 the 16 bytes per parameter become 7 under stage 1"),
    ("13.1", "Figure 1 gives 120, 31.4, 16.6 and 1.9 GB per GPU"),
    ("13.1", "stages 1, 2 and 3 cut them to 4 + 12/d, 2 + 14/d and 16/d"),
    ("13.3", "plain DP and ZeRO-1 **2** at every m; ZeRO-2 **m + 1**; ZeRO-3 **3m**"),
    ("13.3", "With m microbatches ZeRO-2 sends m + 1 halves and ZeRO-3 3m."),
    ("13.3", "reduce-scattered once: 3(d − 1)/d · 4Ψ, **1.5×**"),
])
def test_13_marks_see_the_answer_as_the_notebook_writes_it(exercise, text):
    assert marked(exercise, text)


@pytest.mark.parametrize(("exercise", "text"), [
    ("13.1", "a 16-bit weight (2 bytes), a 16-bit gradient (2) and K = 12 bytes"),
    ("13.1", "Mixed-precision Adam keeps 16Ψ bytes (ZeRO §3.1)"),
    ("13.3", "A ring all-reduce of G bytes over d ranks sends 2(d − 1)/d · G from each rank"),
    ("13.3", "The checker tries d = 1 … 8 and m = 1 … 8."),
])
def test_13_marks_pass_over_the_prompts_and_what_is_not_the_answer(exercise, text):
    assert not marked(exercise, text)
