"""The measurement helpers of notebook 15: the ring model, its fit, a timed all-reduce, and the
table its measurements are drawn in."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from megatron_edu.course.labs import (
    crossover_bytes,
    draw_table,
    fit_alpha_beta,
    ring_factors,
    ring_time,
    time_all_reduce,
)
from megatron_edu.launch import run


def test_ring_factors_match_notebook_00():
    assert ring_factors(2) == (2.0, 1.0)
    assert ring_factors(4) == (6.0, 1.5)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_fit_recovers_alpha_beta_exactly_without_noise(t):
    sizes = np.geomspace(4, 2**24, 6)
    alpha, beta = fit_alpha_beta(sizes, ring_time(sizes, t, 1e-5, 5e9), t)
    assert alpha == pytest.approx(1e-5, rel=1e-6)
    assert beta == pytest.approx(5e9, rel=1e-6)


def test_crossover_equalizes_the_two_terms():
    t, alpha, beta = 4, 2e-5, 3e9
    n = crossover_bytes(alpha, beta, t)
    lat, bw = ring_factors(t)
    assert lat * alpha == pytest.approx(bw * n / beta)


def _timed():
    return time_all_reduce([8, 4096], reps=2, warmup=1)


def test_time_all_reduce_returns_a_positive_median_per_size():
    for times in run(_timed, 2, backend="gloo"):
        assert len(times) == 2 and all(x > 0 for x in times)


def test_a_table_figure_holds_the_header_and_every_cell():
    fig = draw_table(["bytes", "t = 2 (ms)"], [["8", "0.543"], ["1,024", "0.661"]], "medians")
    (table,) = fig.axes[0].tables
    texts = [cell.get_text().get_text() for cell in table.get_celld().values()]
    assert sorted(texts) == sorted(["bytes", "t = 2 (ms)", "8", "0.543", "1,024", "0.661"])
    assert fig.axes[0].get_title() == "medians"
    plt.close(fig)
