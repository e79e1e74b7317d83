"""Notebook 16's design-space pictures draw what the puzzles' checkers judge by (drawing only, on
Agg): the same schedules' numbers, the same times, the same memory and FLOPs."""

import pytest

from megatron_edu.course.exercises import nb16
from megatron_edu.course.viz.design_space import (
    draw_interleaving_vs_m,
    draw_recompute_options,
    draw_schedule_space,
    schedule_points,
)
from megatron_edu.model.config import RECOMPUTE
from megatron_edu.perf import predict
from megatron_edu.pipeline.schedules import SCHEDULES, make_schedule
from tests.test_viz_dp import _agg_backend  # noqa: F401  (autouse: draw only, no window)


def _artist(ax, gid):
    return next(a for a in ax.get_children() if a.get_gid() == gid)


def _bars(ax, label):
    return next(c for c in ax.containers if c.get_label() == label)


def test_the_schedule_space_has_a_point_per_schedule_and_both_limits():
    fig = draw_schedule_space(nb16.P1, nb16.M1, nb16.MAX_STAGES_HELD, nb16.MAX_BUBBLE)
    ax = fig.axes[0]
    points = schedule_points(nb16.P1, nb16.M1)
    assert {name for name, _ in points} == set(SCHEDULES)
    for (name, v), (held, bubble) in points.items():  # the checker's numbers for each schedule
        timeline = nb16.play(make_schedule(name, nb16.P1, nb16.M1, v))
        assert (held, bubble) == (max(nb16.stages_held(timeline)), timeline.bubble_fraction)
    drawn = _artist(ax, "schedules").get_offsets()
    assert sorted(map(tuple, drawn.tolist())) == sorted((float(x), float(y))
                                                       for x, y in points.values())
    assert [t.get_text() for t in ax.texts] == [name + (f" v={v}" if v else "")
                                                for name, v in points]
    assert list(_artist(ax, "memory limit").get_xdata()) == [nb16.MAX_STAGES_HELD] * 2
    assert list(_artist(ax, "bubble limit").get_ydata()) == [float(nb16.MAX_BUBBLE)] * 2
    corner = _artist(ax, "feasible").get_paths()[0].vertices
    assert corner[:, 0].max() == nb16.MAX_STAGES_HELD
    assert corner[:, 1].max() == pytest.approx(float(nb16.MAX_BUBBLE))


def test_the_time_curves_have_a_point_per_m_and_cross_where_the_checker_says():
    ms = list(range(4, 65, 4))
    fig = draw_interleaving_vs_m(nb16.MODEL_39B, nb16.LAYOUT_16_3, nb16.ETHERNET_A100, ms)
    left, right = fig.axes
    for gid in ("1f1b", "interleaved v=2"):
        assert list(_artist(left, gid).get_xdata()) == ms
    gap = _artist(right, "gap").get_ydata()
    assert len(gap) == len(ms) and gap[0] < 0 < gap[-1]
    assert [g < 0 for g in gap] == [nb16.interleaving_wins(m) for m in ms]
    assert not any(str(nb16.crossover()) in t.get_text() for ax in fig.axes for t in ax.texts)


def test_the_recompute_bars_are_the_checkers_memory_and_flops():
    fig = draw_recompute_options(nb16.MODEL_76B, nb16.LAYOUT_76B, nb16.BUDGET_GIB)
    memory, flops = fig.axes
    options = nb16.recompute_options()
    model = predict(nb16.MODEL_76B, nb16.LAYOUT_76B).flops_per_iteration - options["full", False][1]
    for sp, label in ((False, "without sequence parallelism"),
                      (True, "with sequence parallelism")):
        gib, extra = ([bar.get_height() for bar in _bars(ax, label)] for ax in (memory, flops))
        assert gib == pytest.approx([options[r, sp][0] for r in RECOMPUTE])
        assert extra == pytest.approx([100 * options[r, sp][1] / model for r in RECOMPUTE])
    assert list(_artist(memory, "budget").get_ydata()) == [nb16.BUDGET_GIB] * 2
