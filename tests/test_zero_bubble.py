"""Zero-bubble schedules as data (Qi et al. 2023, arXiv 2401.10241): the backward split into B
(input gradient) and W (weight gradient); their orders, their checker, their bubble and memory."""

from fractions import Fraction
from functools import partial

import pytest

from megatron_edu.perf.bubble import bubble_size_formula
from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    check_schedule,
    format_schedule,
    make_schedule,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
    zero_bubble_v,
)
from megatron_edu.pipeline.simulate import simulate
from megatron_edu.pipeline.stages import StageMap

ZB = ["zb-h1", "zb-h2", "zb-v"]


def zb_sizes(name, max_p=6):
    """(p, m) for p in 1..max_p and m in 1..3p: fewer microbatches than stages included."""
    for p in range(1, max_p + 1):
        for m in range(1, 3 * p + 1):
            yield p, m


# --- the orders, written out -------------------------------------------------------------------

# 2401.10241 Figure 3 (top), ZB-H1 with p = 4, m = 8: 1F1B's warm-up; rank r runs each W r
# backward passes after its B (the rule of PyTorch's ScheduleInterleavedZeroBubble, whose
# num_1f1b_microbatches is the rank), so the last rank keeps its W's for 1F1B's idle tail.
ZB_H1_4_8 = """\
rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
rank 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
rank 2: F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"""

# Figure 3 (bottom), ZB-H2 with p = 4, m = 8: rank r warms up with 2(p − r − 1) forwards and
# delays its W's by 2r backward passes — 2p − 1 microbatches in flight on every rank.
ZB_H2_4_8 = """\
rank 0: F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7
rank 1: F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 W0 F7 B3 W1 B4 W2 B5 W3 B6 W4 B7 W5 W6 W7
rank 2: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 W0 F7 B5 W1 B6 W2 B7 W3 W4 W5 W6 W7
rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7"""

# §6, ZB-V with p = 2, m = 4 (".1": chunk 1, which comes back up the ranks): the
# phases of PyTorch's ScheduleZBVZeroBubble, 2(p − r) − 1 F⁰ first, then F¹ B¹ W¹ from the turn.
ZB_V_2_4 = """\
rank 0: F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 B2.1 W2.1 B1 W1 F3.1 B3.1 W3.1 \
B2 W2 B3 W3
rank 1: F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 F3 B1 W1 F3.1 B2.1 W2.1 B2 B3.1 \
B3 W2 W3.1 W3"""


@pytest.mark.parametrize("build, p, m, expected", [
    (zero_bubble_h1, 4, 8, ZB_H1_4_8),
    (zero_bubble_h2, 4, 8, ZB_H2_4_8),
    (zero_bubble_v, 2, 4, ZB_V_2_4),
], ids=["zb-h1", "zb-h2", "zb-v"])
def test_each_rank_runs_the_papers_order(build, p, m, expected):
    assert format_schedule(build(p, m)) == expected


def test_zb_h1_is_1f1b_with_each_backward_split_and_its_w_moved():
    for p in range(1, 7):
        for m in range(1, 3 * p):
            without_w = [[a for a in row if a.kind != "W"] for row in zero_bubble_h1(p, m)]
            assert without_w == one_f_one_b(p, m), (p, m)


@pytest.mark.parametrize("name", ZB)
def test_every_zero_bubble_schedule_is_complete_ordered_and_deadlock_free(name):
    for p, m in zb_sizes(name):
        check_schedule(make_schedule(name, p, m))


# --- the V placement ---------------------------------------------------------------------------


def test_the_v_placement_goes_down_the_ranks_and_back_up():
    stages = StageMap(4, 2, "v")
    assert [stages.location(s) for s in range(8)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert all(stages.stage(*stages.location(s)) == s for s in range(8))
    assert (stages.first_rank, stages.last_rank) == (0, 0)


def test_zb_v_is_not_valid_under_the_interleaved_placement():
    # the same lists, read as chunk c on rank r = stage c·p + r, wait for what never comes
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(Schedule(zero_bubble_v(4, 8), StageMap(4, 2, "interleaved")))


# --- the checker knows W ---------------------------------------------------------------------


def test_check_rejects_a_weight_pass_before_its_backward():
    schedule = zero_bubble_h1(2, 4)
    row = schedule[0]
    b, w = row.index(Action("B", 0)), row.index(Action("W", 0))
    row[b], row[w] = row[w], row[b]
    with pytest.raises(ValueError, match=r"dependency violation: rank 0 runs W0 \(position 2\) "
                                         r"before B0 \(position 3\)"):
        check_schedule(schedule)


def test_check_rejects_a_missing_weight_pass():
    schedule = zero_bubble_h2(4, 8)
    schedule[3].remove(Action("W", 5))
    with pytest.raises(ValueError, match="rank 3 is missing W5"):
        check_schedule(schedule)


def test_a_backward_waits_for_the_next_stages_b_never_for_its_w():
    # rank 1 keeps every W to the very end: rank 0's B's still run, so nothing deadlocks
    schedule = zero_bubble_h1(2, 4)
    schedule[1] = ([a for a in schedule[1] if a.kind != "W"]
                   + [a for a in schedule[1] if a.kind == "W"])
    check_schedule(schedule)
    # but stage 0's B0 needs stage 1's B0, which waits for F1, which rank 0 runs after B0
    f, b, w = (partial(Action, kind) for kind in "FBW")
    schedule = Schedule([[f(0), b(0), f(1), b(1), w(0), w(1)],
                         [f(1), f(0), b(0), b(1), w(0), w(1)]], StageMap(2, 1, "interleaved"))
    with pytest.raises(ValueError, match="rank 0 waits at B0 for B0 on rank 1; "
                                         "rank 1 waits at F1 for F1 on rank 0"):
        check_schedule(schedule)


@pytest.mark.parametrize("build, message", [
    (lambda: make_schedule("zb-v", 4, 8, 1), "two model chunks per rank; got v=1"),
    (lambda: make_schedule("zb-h1", 4, 8, 2), "one model chunk per rank; got v=2"),
])
def test_bad_zero_bubble_arguments_name_the_numbers(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --- the bubble: 2401.10241 §2.3, Table 2, reproduced exactly ----------------------------------

COSTS = [(1, 1, 1), (2, 3, 1), (3, 4, 2), (Fraction(1, 3), Fraction(2, 3), Fraction(1, 4))]


@pytest.mark.parametrize("t_f, t_b, t_w", COSTS)
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
def test_simulated_bubble_size_is_table_2s_formula(name, t_f, t_b, t_w):
    # Table 2 assumes t_W ≤ t_F and, for ZB-H2, m ≥ 2p − 1 microbatches
    for p in range(2, 7):
        for m in range(2 * p - 1, 3 * p + 1):
            timeline = simulate(make_schedule(name, p, m), t_f, t_b, weight_time=t_w)
            assert timeline.bubble_size == bubble_size_formula(name, p, t_f, t_b, t_w), (p, m)


def test_zb_h1_bubble_is_a_third_of_1f1bs_when_f_b_and_w_cost_the_same():
    sizes = [simulate(make_schedule(name, 4, 8), 1, 1, weight_time=1).bubble_size
             for name in ("1f1b", "zb-h1", "zb-h2")]
    assert sizes == [9, 3, 0]  # (p − 1)·3, (p − 1)·1, 0


def test_1f1b_pays_b_plus_w_for_its_whole_backward():
    # a schedule without W actions runs the whole backward as B: t_B + t_W
    timeline = simulate(one_f_one_b(4, 8), 1, 2, weight_time=1)
    assert timeline.total_time == (8 + 4 - 1) * (1 + 2 + 1)


@pytest.mark.parametrize("p, m", [(2, 3), (4, 7), (4, 12), (6, 11)])
def test_zb_v_has_no_bubble_when_f_b_and_w_cost_the_same(p, m):
    timeline = simulate(zero_bubble_v(p, m), 1, 1, weight_time=1)
    assert timeline.bubble_size == 0


# --- the memory: microbatches held from F to W -------------------------------------------------


def test_zb_h1_holds_1f1bs_peak_on_every_rank():
    assert simulate(zero_bubble_h1(4, 8), 1, 1, weight_time=1).peak_activations == [4] * 4
    assert max(simulate(one_f_one_b(4, 8)).peak_activations) == 4


def test_zb_h2_holds_2p_minus_1_microbatches():
    assert simulate(zero_bubble_h2(4, 8), 1, 1, weight_time=1).peak_activations == [7] * 4


def test_zb_v_holds_2p_half_stage_chunks_as_1f1b_holds_p_whole_stages():
    timeline = simulate(zero_bubble_v(4, 8), 1, 1, weight_time=1)
    assert timeline.peak_activations == [8] * 4  # each chunk is half a stage's layers


def test_zb_v_sends_nothing_at_its_turn():
    # 2·m·(2p − 1) stage boundaries crossed, minus the two at the turn on rank p − 1, per mb
    timeline = simulate(zero_bubble_v(4, 8))
    assert timeline.num_p2p_messages == 2 * 8 * (2 * 4 - 2)


# --- the pictures ------------------------------------------------------------------------------


def test_the_gantt_chart_draws_w_darker_than_b():
    import matplotlib
    matplotlib.use("Agg")
    from megatron_edu.course.viz.pipeline import _colour, draw_schedule

    ax = draw_schedule(simulate(zero_bubble_h1(4, 8), 1, 1, weight_time=1))
    assert len(ax.patches) == 4 * 8 * 3  # one box per F, B and W
    assert sum(_colour(0, "W")[:3]) < sum(_colour(0, "B")[:3]) < sum(_colour(0, "F")[:3])
    assert "weight gradient" in ax.get_xlabel()


def test_memory_against_bubble_puts_h1_at_1f1bs_memory_and_h2_at_no_bubble():
    import matplotlib
    matplotlib.use("Agg")
    from megatron_edu.course.viz.pipeline import draw_memory_vs_bubble

    ax = draw_memory_vs_bubble(4, 12)  # t_F = t_B = t_W = 1
    points = {line.get_gid(): tuple(line.get_xydata()[0]) for line in ax.lines}
    assert points == {"1f1b": (4, 9), "zb-h1": (4, 3), "zb-h2": (7, 0), "zb-v": (4, 0)}


@pytest.mark.parametrize("name", ZB)
def test_the_explorer_draws_the_zero_bubble_schedules_with_t_w(name, capsys):
    import matplotlib
    import matplotlib.pyplot as plt
    matplotlib.use("Agg")
    from megatron_edu.course.viz.pipeline import show_explored

    show_explored(name, 4, 8, 1, ratio=1.0, latency=0.0, weight=1.0)
    plt.close("all")
    printed = capsys.readouterr().out
    if name != "zb-v":
        size = float(bubble_size_formula(name, 4, 1, 1, 1))  # 3 for ZB-H1, 0 for ZB-H2
        assert "bubble size (2401.10241" in printed and f"Table 2's = {size:.3g}" in printed
    assert "peak activations per rank" in printed


# --- the split backward on the benchmark's sleeping stage ----------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_the_benchmarks_sleeping_stage_splits_into_b_and_w(first):
    """bench (d) sleeps t_f in B and t_f in W: B must return the input's gradient without
    touching the weights, W must give them the whole backward's gradients."""
    import torch

    from bench.bubble import SleepStage
    from megatron_edu.pipeline.backward import backward, backward_input

    stage = SleepStage(4, first=first, last=False, forward_s=0.0)
    x = torch.arange(6).view(2, 3) if first else torch.randn(2, 3, 4, requires_grad=True)
    grad = torch.randn(2, 3, 4)
    backward(stage(x), grad)
    whole = [p.grad.clone() for p in stage.parameters()]
    x_grad = None if first else x.grad.clone()
    stage.zero_grad(set_to_none=True)

    x = x if first else x.detach().requires_grad_(True)
    got, weight_pass = backward_input(stage(x), grad, None if first else x)
    assert all(p.grad is None for p in stage.parameters())
    weight_pass.run()
    for p, expected in zip(stage.parameters(), whole, strict=True):
        torch.testing.assert_close(p.grad, expected)
    if not first:
        torch.testing.assert_close(got, x_grad)
