"""Checkers for notebook 15 (measurement labs: the ring α–β model fitted; data parallelism's
all-reduces counted).

15.1 ★★   fit α (latency per ring step) and β (bandwidth) of T(n) = 2(t−1)·α + 2(t−1)/t · n/β
15.2 ★    data parallelism's naive gradient sync: one all-reduce per parameter, averaged

15.1 is checked in this process on synthetic times made from known α, β with 1 % noise, for
several t; the typical mistakes — the ring factors left out, α and β swapped, 1/β returned, sizes
in elements, a fit in log space — are named. 15.2 runs on 2 gloo ranks against the serial
full-batch gradient and counts the all-reduces through ``comm``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.course.labs import fit_alpha_beta, naive_allreduce_grads, ring_time

__all__ = ["DP", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

DP = 2
TIMEOUT = 30.0
ALPHA, BETA = 25e-6, 3e9                      # 25 µs per step, 3 GB/s: a shared-memory gloo ring
SIZES = np.geomspace(8, 16 * 2**20, 8)       # bytes


def _near(got: float, want: float, rtol: float = 0.1) -> bool:
    return bool(np.isfinite(got)) and abs(got - want) <= rtol * abs(want)


@exercise("15.1", "fit α and β of the ring all-reduce model", reference=(fit_alpha_beta,),
          marks=(r"2\(t[−-]1\)and2\(t[−-]1\)/t·n",    # the design matrix's two columns
                 r"linearin(thetwounknowns)?α",          # T linear in α and 1/β
                 r"coefficientis1/β"))                   # the fit's second coefficient
def check_fit_alpha_beta(fn) -> str:
    """fn(sizes, times, t) on synthetic ring times from known α and β (1 % noise), t = 2, 4, 8."""
    rng = np.random.default_rng(0)
    for t in (2, 4, 8):
        times = ring_time(SIZES, t, ALPHA, BETA) * (1 + 0.01 * rng.standard_normal(len(SIZES)))
        got = fn(list(SIZES), list(times), t)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise Hint("return a pair (α, β): α in seconds, β in bytes per second")
        alpha, beta = (float(v) for v in got)
        if _near(alpha, ALPHA) and _near(beta, BETA):
            continue
        lat, bw = 2 * (t - 1), 2 * (t - 1) / t
        if _near(alpha, BETA) and _near(beta, ALPHA):
            raise Hint("α and β are swapped: return (α, β) — α the latency (seconds, small), "
                       "β the bandwidth (bytes per second, large)")
        if _near(alpha, ALPHA) and _near(beta, 1 / BETA):
            raise Hint("the second value is 1/β, seconds per byte: the least-squares "
                       "coefficient of n is 1/β; return its inverse, the bandwidth in bytes/s")
        if _near(alpha, ALPHA) and _near(beta, BETA / 4):
            raise Hint("β is 4× too small: the sizes are already in bytes — do not convert them "
                       "to fp32 elements (n/4) before fitting")
        if _near(alpha, lat * ALPHA) and _near(beta, BETA / bw):
            raise Hint(f"at t = {t} α is {lat:g}× and β {1 / bw:.3g}× the true values: you fitted "
                       "T = α + n/β without the ring's factors. The model is "
                       "T = 2(t−1)·α + 2(t−1)/t · n/β: regress on the columns 2(t−1) and "
                       "2(t−1)/t·n")
        raise Hint(f"at t = {t} the fit gives α = {alpha:.3g} s, β = {beta:.3g} B/s; the times "
                   f"were made from α = {ALPHA:g} s, β = {BETA:g} B/s. Fit T itself by linear "
                   "least squares in (α, 1/β) — a fit of log T weights the small messages' "
                   "relative errors and is biased, and T is not a power law of n")
    return (f"recovered α = {ALPHA * 1e6:g} µs and β = {BETA / 1e9:g} GB/s within 10 % from "
            "noisy synthetic times on t = 2, 4 and 8 ranks")


class _Tiny(nn.Module):
    """Two layers, an unused parameter (no grad after backward) and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.unused = nn.Parameter(torch.ones(3))
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone()
            for name, p in model.named_parameters() if p.requires_grad}


def _naive_rank(fn, x: torch.Tensor):
    group = comm.world()
    torch.manual_seed(0)
    model = _Tiny()
    shard = x.chunk(group.size)[group.rank]
    model(shard).square().mean().backward()
    with comm.record() as log:
        fn(model, group)
    return _grads(model), log.count("all_reduce"), log.total_bytes("all_reduce")


@exercise("15.2", "naive data parallelism: one all-reduce per parameter",
          reference=(naive_allreduce_grads,),
          marks=(r"all-reducedaszeros",                  # the parameter without a gradient
                 r"divideby`?group\.size"),               # the average: the sum over the ranks
          taught=("for p in model.parameters():",       # generic: notebook 12's loop, 05's
                  "p.grad = torch.zeros_like(p)"))       # zero gradients
def check_naive_allreduce_grads(fn) -> str:
    """fn(model, group) on 2 ranks: the serial full-batch gradient, one all-reduce a parameter."""
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    serial = _Tiny()
    serial(x).square().mean().backward()
    want = _grads(serial)
    want["unused"] = torch.zeros(3)
    n_params = len(want)
    for grads, count, _ in on_ranks(DP, _naive_rank, fn, x, timeout=TIMEOUT):
        if count == 0:
            raise Hint("no all-reduce went through megatron_edu.comm: call "
                       "comm.all_reduce_(p.grad, group) (torch.distributed directly is not "
                       "recorded, and the lab counts the messages)")
        if count == 2 * n_params:
            raise Hint(f"{count} all-reduces for {n_params} parameters: each gradient is summed "
                       "twice — one all-reduce per parameter, then divide by group.size")
        if count < n_params and grads.get("unused") is None:
            raise Hint("the parameter that got no gradient was skipped: every rank must issue "
                       "the same all-reduces in the same order (a rank whose data did use it "
                       "would hang); give it a zero gradient and all-reduce it too, as "
                       "DataParallel does — skip only parameters with requires_grad False")
        if count != n_params:
            raise Hint(f"{count} all-reduces, expected {n_params}: one per parameter that "
                       "requires a gradient (not the frozen one)")
        for name, g in want.items():
            got = grads.get(name)
            if got is None:
                raise Hint(f"{name}.grad is None after the sync: give it a zero gradient")
            if torch.allclose(got, DP * g, atol=1e-6) and g.abs().max() > 0:
                raise Hint(f"{name}.grad is {DP}× the serial gradient: the all-reduce sums the "
                           "replicas' gradients — divide by group.size to average them")
            if not torch.allclose(got, g, atol=1e-6):
                diff = (got - g).abs().max().item()
                raise Hint(f"{name}.grad differs from the serial full-batch gradient by "
                           f"up to {diff:.3g}")
    return (f"on {DP} ranks: {n_params} all-reduces (one per parameter that needs a gradient, "
            "the unused one as zeros, the frozen one skipped), gradients equal to the serial "
            "full-batch gradient")
