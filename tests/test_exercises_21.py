"""Notebook 21's checkers (dynamic loss scaling over 4 ranks; bias + GeLU as one fused kernel):
the answer passes, each mistake of the catalogue below is named in words, a stub is "not done
yet"."""

import math
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from helpers import stub, verdict

from megatron_edu import comm

# The answers below travel to the ranks by value, as a notebook cell's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])




# --- 21.1 one step of dynamic loss scaling --------------------------------------------------------

def loss_scaling(grads, scale, good_steps, group, growth_interval, min_scale, *, agree=True,
                 finite=True, floor=True, grow_every_step=False, grow_before=False,
                 count_skipped=False, unscale="old", restart=True, sum_grads=False):
    """One step of dynamic loss scaling, or one typical mistake."""
    old = scale
    if sum_grads:
        for g in grads:
            comm.all_reduce_(g, group)
    found = (sum((~g.isfinite()).sum() for g in grads) if finite
             else sum(g.isinf().sum() for g in grads)).float()
    overflow = (comm.all_reduce(found, group) if agree else found).item() > 0
    if grow_before:                                   # counted before the overflow is looked at
        good_steps += 1
        if good_steps == growth_interval:
            scale, good_steps = scale * 2, 0
    if overflow:
        halved = max(scale / 2, min_scale) if floor else scale / 2
        return False, halved, good_steps + 1 if count_skipped else 0
    if not grow_before:
        good_steps += 1
        if grow_every_step or good_steps == growth_interval:
            scale, good_steps = scale * 2, 0 if restart else good_steps
    if unscale:
        for g in grads:
            g.div_(old if unscale == "old" else scale)
    return True, scale, good_steps


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda *a: loss_scaling(*a, finite=False), ("NaN", "isfinite")),
    (lambda *a: loss_scaling(*a, floor=False), ("below min_scale",)),
    (lambda *a: loss_scaling(*a, grow_every_step=True), ("doubled after 1 good step",)),
    (lambda *a: loss_scaling(*a, grow_before=True), ("it grew, then halved",)),
    (lambda *a: loss_scaling(*a, count_skipped=True), ("counted as good",)),
    (lambda *a: loss_scaling(*a, unscale=None), ("still multiplied by S",)),
    (lambda *a: loss_scaling(*a, unscale="new"), ("divided by the new scale",)),
    (lambda *a: loss_scaling(*a, restart=False), ("restart it at 0",)),
    (lambda *a: (True, a[1]), ("triple",)),
    (stub, ("not done yet",)),
])
def test_21_1_mistakes_found_on_one_rank(answer, fragments):
    verdict("21.1", answer, *fragments)


@pytest.mark.parametrize(("answer", "fragments"), [
    (loss_scaling, ()),
    (lambda *a: loss_scaling(*a, agree=False), ("rank 2 skipped", "decided alone", "drift",
                                                "all-reduce")),
    (lambda *a: loss_scaling(*a, sum_grads=True), ("summed over the group",)),
])
def test_21_1_on_four_ranks(answer, fragments):
    verdict("21.1", answer, *fragments)


# --- 21.2 bias + GeLU as one fused kernel ---------------------------------------------------------

def tanh_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def bias_gelu(y, bias):
    return tanh_gelu((y + bias.to(y.dtype)).float()).to(y.dtype)


@pytest.mark.parametrize(("answer", "fragments"), [
    (bias_gelu, ()),
    (lambda y, b: (0.5 * (x := (y + b.to(y.dtype)).float()) * (1 + torch.erf(x / math.sqrt(2)))
                   ).to(y.dtype), ("exact GeLU", "tanh")),
    (lambda y, b: tanh_gelu(y.float()).to(y.dtype), ("bias is missing",)),
    (lambda y, b: tanh_gelu((y + b.to(y.dtype)).float()), ("return y's dtype",)),
    (lambda y, b: tanh_gelu(y + b.to(y.dtype)), ("each bf16 operation", "rounds once")),
    (lambda y, b: tanh_gelu(y.float() + b).to(y.dtype), ("added in fp32",)),
    (lambda y, b: F.gelu(y + b.to(y.dtype), approximate="tanh"), ("F.gelu",)),
    (lambda y, b: tanh_gelu(y.add_(b.to(y.dtype)).float()).to(y.dtype), ("in place",)),
    (lambda y, b: bias_gelu(y, b).detach(), ("no gradient",)),
    (stub, ("not done yet",)),
])
def test_21_2_bias_gelu(answer, fragments):
    verdict("21.2", answer, *fragments)
