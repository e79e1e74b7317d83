"""Measurement helpers for notebook 15's labs: time a collective, fit the ring α–β model, show
what was measured as a picture (``draw_table``: a run's times change from run to run, so the
notebook draws them, and the text it prints — which nbval compares — says only what was timed).

The ring all-reduce model of notebook 00 §4 (1909.08053 §3; Thakur et al. 2005):
T(n) = 2(t−1)·α + 2(t−1)/t · n/β, with n the message in bytes, α the latency of one ring step
and β the bandwidth. It is linear in (α, 1/β), so ordinary least squares on the times fits it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from megatron_edu import comm

__all__ = ["ring_factors", "ring_time", "fit_alpha_beta", "crossover_bytes", "time_all_reduce",
           "naive_allreduce_grads", "draw_table"]


def ring_factors(t: int) -> tuple[float, float]:
    """(latency factor, bandwidth factor) of a ring all-reduce on t ranks: 2(t−1), 2(t−1)/t."""
    return 2.0 * (t - 1), 2.0 * (t - 1) / t


def ring_time(n: float | np.ndarray, t: int, alpha: float, beta: float) -> float | np.ndarray:
    """The model's all-reduce time (s) of n bytes on t ranks: 2(t−1)·α + 2(t−1)/t · n/β."""
    a, b = ring_factors(t)
    return a * alpha + b * np.asarray(n, dtype=float) / beta


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], t: int) -> tuple[float, float]:
    """(α in s, β in bytes/s): least squares of T = 2(t−1)·α + 2(t−1)/t · n/β on the times
    themselves (linear in α and 1/β), n in bytes."""
    a, b = ring_factors(t)
    n = np.asarray(sizes, dtype=float)
    design = np.stack([np.full_like(n, a), b * n], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.asarray(times, dtype=float), rcond=None)
    return float(alpha), float(1.0 / inv_beta)


def crossover_bytes(alpha: float, beta: float, t: int) -> float:
    """n* where the latency and bandwidth terms are equal: 2(t−1)·α = 2(t−1)/t · n*/β, n* = tαβ."""
    return t * alpha * beta


def time_all_reduce(sizes: Sequence[int], reps: int = 5, warmup: int = 2) -> list[float]:
    """On every rank of the world: the median time (s) of an all-reduce of each size in bytes
    (fp32), after ``warmup`` untimed ones; a barrier before each so every rank starts together."""
    group = comm.world()
    medians = []
    for size in sizes:
        x = torch.ones(max(1, size // 4))
        samples = []
        for i in range(warmup + reps):
            torch.distributed.barrier()
            start = time.perf_counter()
            comm.all_reduce_(x, group, "lab 1")
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    return medians


def naive_allreduce_grads(model: torch.nn.Module, group: comm.CommGroup) -> None:
    """Data parallelism at its simplest (2104.04473 §2.1): after backward, one all-reduce per
    parameter, then a division by dp — every ``.grad`` becomes the replicas' average. A
    parameter that got no gradient is all-reduced as zeros, so every rank issues the same
    collectives in the same order; a frozen one is skipped."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce_(p.grad, group, "dp naive")
        p.grad /= group.size


def draw_table(columns: Sequence[str], rows: Sequence[Sequence[str]], title: str) -> Figure:
    """A table of already formatted cells as a figure: one header row, then ``rows``."""
    fig, ax = plt.subplots(figsize=(1.6 * len(columns), 0.3 * (len(rows) + 1) + 0.5))
    ax.axis("off")
    table = ax.table(cellText=[list(r) for r in rows], colLabels=list(columns), loc="center",
                     cellLoc="right")
    table.scale(1, 1.2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
