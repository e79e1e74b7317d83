"""Notebook 16's design-space pictures draw the numbers they are given (on Agg), with the
puzzles' limits; and the schedule space they are given for 16.1 has the papers' bubbles."""

from fractions import Fraction

import pytest

from megatron_edu.course.exercises import nb16
from megatron_edu.course.viz.design_space import (
    draw_interleaving_vs_m,
    draw_recompute_options,
    draw_schedule_space,
)
from megatron_edu.pipeline.schedules import SCHEDULES
from tests.test_viz_dp import _agg_backend  # noqa: F401  (autouse: draw only, no window)


def _artist(ax, gid):
    return next(a for a in ax.get_children() if a.get_gid() == gid)


def _bars(ax, label):
    return next(c for c in ax.containers if c.get_label() == label)


def test_the_schedule_space_has_every_schedule_and_the_papers_bubbles():
    points = nb16.schedule_space()
    assert {name for name, _ in points} == set(SCHEDULES)
    p, m = nb16.P1, nb16.M1
    assert points["gpipe", None] == (m, Fraction(p - 1, m))           # all m in flight
    assert points["1f1b", None] == (p, Fraction(p - 1, m))            # p in flight, same bubble
    for v in (2, 4, 8):                                               # (p − 1)/(v·m), p + (p−1)/v
        assert points["interleaved", v] == (p + Fraction(p - 1, v), Fraction(p - 1, v * m))


def test_the_schedule_picture_places_each_point_with_both_limits_and_the_corner():
    points = {("a", None): (Fraction(4), Fraction(3, 8)),
              ("b", 2): (Fraction(11, 2), Fraction(1, 8))}
    ax = draw_schedule_space(points, 5, Fraction(3, 20), "two schedules").axes[0]
    assert sorted(map(tuple, _artist(ax, "schedules").get_offsets().tolist())) == [
        (4.0, 0.375), (5.5, 0.125)]
    assert [t.get_text() for t in ax.texts] == ["a", "b v=2"]
    assert list(_artist(ax, "memory limit").get_xdata()) == [5, 5]
    assert list(_artist(ax, "bubble limit").get_ydata()) == [0.15, 0.15]
    corner = _artist(ax, "feasible").get_paths()[0].vertices
    assert corner[:, 0].max() == 5 and corner[:, 1].max() == pytest.approx(0.15)


def test_the_time_picture_draws_both_curves_and_the_second_minus_the_first():
    ms = [4, 8, 12, 16]
    fig = draw_interleaving_vs_m({"1f1b": [1.0, 2.0, 3.0, 4.0],
                                  "interleaved v=2": [0.9, 1.95, 3.05, 4.2]}, ms, "t")
    left, right = fig.axes
    assert list(_artist(left, "1f1b").get_xdata()) == ms
    assert list(_artist(right, "gap").get_ydata()) == pytest.approx([-100, -50, 50, 200])
    assert right.get_ylabel() == "interleaved v=2 − 1f1b (ms)"


def test_the_recompute_picture_draws_memory_and_flops_per_option_and_the_budget():
    options = {(mode, sp): (gib, flops) for (mode, sp), gib, flops in zip(
        [(m, sp) for m in ("none", "selective", "full") for sp in (False, True)],
        [95, 74, 72, 51, 47, 42], [0, 0, 2e15, 2e15, 60e15, 60e15], strict=True)}
    memory, flops = draw_recompute_options(options, 64, "t").axes
    assert [b.get_height() for b in _bars(memory, "with sequence parallelism")] == [74, 51, 42]
    assert [b.get_height() for b in _bars(flops, "without sequence parallelism")] == [0, 2, 60]
    assert list(_artist(memory, "budget").get_ydata()) == [64, 64]
