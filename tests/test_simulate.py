"""The simulated pipeline bubble is the paper's formula, exactly (2104.04473 §2.2.1, §2.2.2)."""

from fractions import Fraction

import matplotlib
import pytest

from megatron_edu.perf.bubble import bubble_formula
from megatron_edu.pipeline.schedules import (
    Action,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
)
from megatron_edu.pipeline.simulate import Timeline, simulate

matplotlib.use("Agg")


def sizes(name, max_p=8):
    """(p, m, v) for p in 1..max_p, m in p..4p, v in 1..4 where `name` has a schedule."""
    for p in range(1, max_p + 1):
        for m in range(p, 4 * p + 1):
            for v in range(1, 5) if name == "interleaved" and m % p == 0 else [1]:
                yield p, m, v


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m(name):
    for p, m, _ in sizes(name):
        assert simulate(make_schedule(name, p, m)).bubble_fraction == Fraction(p - 1, m), (p, m)


def test_interleaved_bubble_is_p_minus_1_over_v_m():
    for p, m, v in sizes("interleaved"):
        timeline = simulate(interleaved_one_f_one_b(p, m, v))
        assert timeline.bubble_fraction == Fraction(p - 1, v * m), (p, m, v)


@pytest.mark.parametrize("forward_time, backward_time",
                         [(1, 1), (Fraction(1, 3), Fraction(5, 7)), (0.1, 0.3)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_bubble_does_not_depend_on_the_costs(name, forward_time, backward_time):
    for p, m, v in sizes(name, max_p=4):
        timeline = simulate(make_schedule(name, p, m, v), forward_time, backward_time)
        assert timeline.bubble_fraction == bubble_formula(name, p, m, v), (p, m, v)


def test_bubble_formula_states_the_papers_closed_forms():
    assert [bubble_formula("gpipe", 4, 8), bubble_formula("1f1b", 4, 8),
            bubble_formula("interleaved", 4, 8, 2)] == [Fraction(3, 8), Fraction(3, 8),
                                                        Fraction(3, 16)]


def test_1f1b_takes_m_plus_p_minus_1_slots():
    # t_id + t_pb = (m + p − 1)·(t_f + t_b), §2.2.1
    assert simulate(one_f_one_b(4, 8), 1, 2).total_time == (8 + 4 - 1) * 3


def test_interleaved_shrinks_the_ramp_by_v():
    # t_id + t_pb / v = (m + (p − 1)/v)·(t_f + t_b), §2.2.2
    assert simulate(interleaved_one_f_one_b(4, 8, 2), 1, 2).total_time == Fraction(57, 2)


def test_simulated_times_are_exact_fractions():
    action, start, end = simulate(interleaved_one_f_one_b(2, 2, 3)).ranks[0][1]
    assert (action, start, end) == (Action("F", 1), Fraction(1, 3), Fraction(2, 3))


def test_gpipe_holds_m_activations_on_every_rank():
    assert simulate(gpipe(4, 8)).peak_activations == [8, 8, 8, 8]


def test_1f1b_holds_p_minus_rank_activations():
    assert simulate(one_f_one_b(4, 8)).peak_activations == [4, 3, 2, 1]


def test_1f1b_with_few_microbatches_holds_at_most_m():
    assert simulate(one_f_one_b(8, 3)).peak_activations == [3, 3, 3, 3, 3, 3, 2, 1]


def test_1f1b_sends_two_messages_per_microbatch_per_stage_boundary():
    assert simulate(one_f_one_b(4, 8)).num_p2p_messages == 2 * 8 * (4 - 1)


def test_interleaved_sends_across_every_virtual_stage_boundary():
    # 2·m·(v·p − 1): about v times 1F1B's 2·m·(p − 1), §2.2.2
    assert simulate(interleaved_one_f_one_b(4, 8, 3)).num_p2p_messages == 2 * 8 * (3 * 4 - 1)


def test_send_latency_adds_to_the_bubble():
    assert simulate(one_f_one_b(4, 8), send_latency=0.5).bubble_fraction > Fraction(3, 8)


def test_latency_costs_more_chunks_more():
    # each microbatch crosses v·p − 1 boundaries, so v = 4 loses to v = 2 once sends are slow
    v2, v4 = (simulate(interleaved_one_f_one_b(4, 8, v), send_latency=0.3) for v in (2, 4))
    assert v4.bubble_fraction > v2.bubble_fraction


def test_a_slow_stage_widens_the_bubble():
    timeline = simulate(one_f_one_b(4, 8), forward_time=[1, 1, 2, 1], backward_time=[2, 2, 4, 2])
    assert timeline.bubble_fraction > Fraction(3, 8)


def test_the_slowest_stage_sets_the_pace():
    timeline = simulate(one_f_one_b(4, 8), forward_time=[1, 1, 2, 1], backward_time=[2, 2, 4, 2])
    assert timeline.total_time >= 8 * (2 + 4)


def test_per_rank_costs_must_have_one_entry_per_rank():
    with pytest.raises(ValueError, match="forward_time has 3 entries for 4 pipeline ranks"):
        simulate(one_f_one_b(4, 8), forward_time=[1, 1, 1])


def test_simulate_rejects_an_incomplete_schedule():
    schedule = one_f_one_b(2, 2)
    schedule[0].pop()
    with pytest.raises(ValueError, match="rank 0 is missing B1"):
        simulate(schedule)


def test_a_measured_timeline_gives_the_same_bubble():
    # as the engine records it: float seconds from an arbitrary clock origin
    simulated = simulate(one_f_one_b(4, 8))
    measured = Timeline([[(a, 100.0 + 0.01 * float(s), 100.0 + 0.01 * float(e)) for a, s, e in row]
                         for row in simulated.ranks], simulated.stages)
    assert measured.bubble_fraction == pytest.approx(3 / 8)


def test_draw_schedule_draws_one_box_per_action():
    from megatron_edu.course.viz.pipeline import draw_schedule

    ax = draw_schedule(simulate(interleaved_one_f_one_b(2, 4, 2)))
    assert len(ax.patches) == 2 * 2 * 4 * 2  # p ranks × {F, B} × m microbatches × v chunks


def test_measured_and_simulated_are_drawn_one_above_the_other():
    from megatron_edu.course.viz.pipeline import draw_measured_vs_simulated

    simulated = simulate(one_f_one_b(2, 2))
    measured = Timeline([[(a, 5.0 + float(s), 5.0 + float(e)) for a, s, e in row]
                         for row in simulated.ranks], simulated.stages)
    fig = draw_measured_vs_simulated(measured, simulated)
    assert [ax.get_title() for ax in fig.axes] == ["measured — bubble fraction 0.500",
                                                   "simulated — bubble fraction 0.500"]


def test_every_setting_of_the_explorer_sliders_gives_a_schedule():
    # the erratum: interleaved at p=6, m=8 printed an error instead of a chart
    from megatron_edu.course.viz.pipeline import EXPLORER, explorer_setting

    for name in EXPLORER["name"]:
        for p in EXPLORER["p"]:
            for m in EXPLORER["m"]:
                for v in EXPLORER["v"]:
                    drawn_m, drawn_v, note = explorer_setting(name, p, m, v)
                    schedule = make_schedule(name, p, drawn_m, drawn_v)  # never a ValueError
                    assert len(schedule) == p and (note == "") == (drawn_m == m)
                    assert m <= drawn_m < m + p


@pytest.mark.parametrize("name, p, m, v, ratio, latency", [
    ("interleaved", 6, 8, 2, 2.0, 0.0),     # the erratum's setting: m moves to 12
    ("interleaved", 7, 32, 2, 0.5, 1.0),    # m moves to 35, beyond the slider
    ("interleaved", 1, 1, 4, 4.0, 0.05),
    ("gpipe", 8, 32, 4, 4.0, 1.0),          # v is ignored by the one-chunk schedules
    ("1f1b", 8, 1, 1, 0.5, 0.0),            # m < p
])
def test_the_explorer_draws_every_corner_and_says_when_it_moved_m(name, p, m, v, ratio, latency,
                                                                  capsys):
    import matplotlib.pyplot as plt

    from megatron_edu.course.viz.pipeline import explorer_setting, show_explored

    plt.close("all")
    show_explored(name, p, m, v, ratio, latency)
    out = capsys.readouterr().out
    drawn_m = explorer_setting(name, p, m, v)[0]
    assert ("drawn with m = " in out) == (drawn_m != m)
    assert "simulated bubble" in out and len(plt.gcf().axes) == 1
    plt.close("all")
