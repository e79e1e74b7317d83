"""The checkers of notebook 15: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import sys

import cloudpickle
import numpy as np
import pytest
import torch.distributed as dist
from helpers import failed, stub

from megatron_edu import comm
from megatron_edu.course.exercises import check
from megatron_edu.course.labs import fit_alpha_beta

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 15.1 fit α and β -----------------------------------------------------------------------------

def no_ring_factors(sizes, times, t):
    (inv_beta, alpha) = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
    return alpha, 1 / inv_beta


def log_space(sizes, times, t):
    slope, icpt = np.polyfit(np.log(sizes), np.log(times), 1)
    return np.exp(icpt) / (2 * (t - 1)), 2 * (t - 1) / t / np.exp(icpt)


@pytest.mark.parametrize(("answer", "fragments"), [
    (fit_alpha_beta, ()),
    (no_ring_factors, ("without the ring's factors",)),
    (lambda s, T, t: fit_alpha_beta(s, T, t)[::-1], ("swapped",)),
    (lambda s, T, t: (fit_alpha_beta(s, T, t)[0], 1 / fit_alpha_beta(s, T, t)[1]), ("1/β",)),
    (lambda s, T, t: fit_alpha_beta([n / 4 for n in s], T, t), ("elements",)),
    (log_space, ("log T",)),
    (lambda s, T, t: 1.0, ("return a pair",)),
    (stub, ("not done yet",)),
])
def test_15_1_fit_alpha_beta(answer, fragments):
    result = check("15.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


# --- 15.2 naive data parallelism ------------------------------------------------------------------

def naive(model, group, divide=True, twice=False, via_comm=True, skip_none=False,
          frozen_too=False):
    for p in model.parameters():
        if not p.requires_grad and not frozen_too:
            continue
        if p.grad is None:
            if skip_none:
                continue
            p.grad = p.detach().new_zeros(p.shape)
        for _ in range(2 if twice else 1):
            if via_comm:
                comm.all_reduce_(p.grad, group)
            else:
                dist.all_reduce(p.grad)
        if divide:
            p.grad /= group.size


@pytest.mark.parametrize(("answer", "fragments"), [
    (naive, ()),
    (lambda m, g: naive(m, g, divide=False), ("divide by group.size",)),
    (lambda m, g: naive(m, g, twice=True), ("summed twice",)),
    (lambda m, g: naive(m, g, via_comm=False), ("megatron_edu.comm",)),
    (lambda m, g: naive(m, g, skip_none=True), ("no gradient was skipped",)),
    (lambda m, g: naive(m, g, frozen_too=True), ("not the frozen one",)),
    (stub, ("not done yet",)),
])
def test_15_2_naive_allreduce_grads(answer, fragments):
    result = check("15.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
