"""Pipeline schedules as data (2104.04473 §2.2): complete, dependency-valid, in Megatron's order."""

from fractions import Fraction

import pytest

from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    check_schedule,
    format_schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
)
from megatron_edu.pipeline.simulate import simulate
from megatron_edu.pipeline.stages import StageMap


def valid_sizes():
    """(name, p, m, v) for p in 1..8, m in p..4p, v in 1..4 where the schedule exists."""
    for p in range(1, 9):
        for m in range(p, 4 * p + 1):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            for v in range(2, 5):
                if m % p == 0:
                    yield "interleaved", p, m, v


def kinds(row):
    return "".join(action.kind for action in row)


def test_every_schedule_is_complete_ordered_and_deadlock_free():
    for name, p, m, v in valid_sizes():
        check_schedule(make_schedule(name, p, m, v))


def test_1f1b_with_fewer_microbatches_than_stages_is_valid():
    for p in range(2, 9):
        for m in range(1, p):
            check_schedule(one_f_one_b(p, m))


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert format_schedule(gpipe(2, 3)) == "rank 0: F0 F1 F2 B0 B1 B2\nrank 1: F0 F1 F2 B0 B1 B2"


def test_1f1b_matches_figure_4_top_on_rank_1():
    assert " ".join(map(str, one_f_one_b(4, 8)[1])) == (
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7")


@pytest.mark.parametrize("p, m", [(4, 8), (8, 8), (8, 3), (5, 12)])
def test_1f1b_warms_up_with_megatrons_count(p, m):
    for rank, row in enumerate(one_f_one_b(p, m)):
        warmup = min(p - rank - 1, m)  # Megatron-LM: num_warmup_microbatches
        assert kinds(row) == "F" * warmup + "FB" * (m - warmup) + "B" * warmup


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (2, 8, 4), (4, 4, 3), (8, 16, 2)])
def test_interleaved_warms_up_with_megatrons_count(p, m, v):
    for rank, row in enumerate(interleaved_one_f_one_b(p, m, v)):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)  # Megatron-LM, with interleaving
        assert kinds(row) == "F" * warmup + "FB" * (m * v - warmup) + "B" * warmup


def test_one_warmup_forward_per_hop_has_the_same_bubble_with_free_sends_and_holds_less():
    """The second forward per hop is slack for Megatron-LM's combined exchange (the docstring):
    with sends that cost nothing the leaner warm-up loses nothing, and a send's latency shows."""
    lean, megatron = (interleaved_one_f_one_b(4, 8, 2, warmup_per_hop=k) for k in (1, 2))
    assert lean != megatron and check_schedule(lean) is None
    assert simulate(lean).bubble_fraction == simulate(megatron).bubble_fraction == Fraction(3, 16)
    assert simulate(lean).peak_activations[0] < simulate(megatron).peak_activations[0]
    assert (simulate(lean, send_latency=0.1).bubble_fraction
            > simulate(megatron, send_latency=0.1).bubble_fraction)


def test_interleaved_forwards_take_groups_of_p_microbatches_through_each_chunk():
    forwards = [str(a) for a in interleaved_one_f_one_b(2, 4, 2)[0] if a.kind == "F"]
    assert forwards == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]


def test_interleaved_backwards_visit_the_chunks_in_reverse():
    backwards = [str(a) for a in interleaved_one_f_one_b(2, 4, 2)[0] if a.kind == "B"]
    assert backwards == ["B0.1", "B1.1", "B0", "B1", "B2.1", "B3.1", "B2", "B3"]


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_one_f_one_b(4, 8, 1) == one_f_one_b(4, 8)


def test_make_schedule_finds_each_schedule_by_name():
    assert [make_schedule("gpipe", 3, 6), make_schedule("1f1b", 3, 6),
            make_schedule("interleaved", 3, 6, 2)] == [
        gpipe(3, 6), one_f_one_b(3, 6), interleaved_one_f_one_b(3, 6, 2)]


def test_action_prints_chunk_only_when_nonzero():
    assert [str(Action("F", 3)), str(Action("B", 3, 1))] == ["F3", "B3.1"]


# --- check_schedule rejects broken schedules ----------------------------------------------------


def test_check_rejects_a_missing_action():
    schedule = one_f_one_b(4, 8)
    schedule[0].remove(Action("B", 7))
    with pytest.raises(ValueError, match="rank 0 is missing B7"):
        check_schedule(schedule)


def test_check_rejects_a_duplicated_action():
    schedule = one_f_one_b(4, 8)
    schedule[2].insert(5, Action("F", 2))
    with pytest.raises(ValueError, match="rank 2 is unexpected or duplicated F2"):
        check_schedule(schedule)


def test_a_schedule_rejects_a_chunk_its_stage_map_does_not_have():
    with pytest.raises(ValueError, match=r"F0.1 names chunk 1, but each rank holds 1 chunk"):
        Schedule(interleaved_one_f_one_b(2, 4, 2), StageMap(2, 1, "interleaved"))


def test_a_schedule_carries_its_stage_map():
    assert one_f_one_b(4, 8).stages == StageMap(4, 1, "interleaved")
    assert interleaved_one_f_one_b(4, 8, 2).stages == StageMap(4, 2, "interleaved")
    assert make_schedule("zb-v", 4, 8).stages == StageMap(4, 2, "v")


def test_check_rejects_a_backward_before_its_own_forward():
    schedule = one_f_one_b(4, 8)
    row = schedule[3]
    row[0], row[1] = row[1], row[0]  # B0 before F0 on the last rank
    with pytest.raises(ValueError, match=r"dependency violation: rank 3 runs B0 \(position 0\) "
                                         r"before F0 \(position 1\)"):
        check_schedule(schedule)


def test_check_rejects_a_deadlocking_order():
    # rank 0 waits for B0 before sending F1; rank 1 waits for F1 before doing F0 and B0
    schedule = Schedule([[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                         [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]],
                        StageMap(2, 1, "interleaved"))
    with pytest.raises(ValueError, match="deadlock: no rank can progress; rank 0 waits at B0 for "
                                         "B0 on rank 1; rank 1 waits at F1 for F1 on rank 0"):
        check_schedule(schedule)


# --- bad arguments name the numbers -------------------------------------------------------------


@pytest.mark.parametrize("build, message", [
    (lambda: gpipe(0, 4), "num_stages must be at least 1, got 0"),
    (lambda: one_f_one_b(4, 0), "num_microbatches must be at least 1, got 0"),
    (lambda: interleaved_one_f_one_b(4, 8, 0), "num_chunks must be at least 1, got 0"),
    (lambda: interleaved_one_f_one_b(4, 6, 2), "num_microbatches=6, num_stages=4"),
    (lambda: make_schedule("zigzag", 4, 8), "unknown schedule 'zigzag'"),
    (lambda: make_schedule("1f1b", 4, 8, 2), "one model chunk per rank; got v=2"),
    (lambda: make_schedule("interleaved", 4, 8), "needs its number of chunks per rank"),
    (lambda: Action("X", 0), "kind must be 'F', 'B' or 'W', got 'X'"),
    (lambda: StageMap(4, 0, "interleaved"), "needs v ≥ 1, got 0"),
    (lambda: StageMap(4, 2, "zigzag"), "unknown placement 'zigzag'"),
    (lambda: Schedule([[]], StageMap(2, 1, "interleaved")), "needs 2 ranks, got 1"),
])
def test_bad_arguments_raise_value_error_naming_the_numbers(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_check_schedule_takes_a_schedule_not_bare_lists():
    with pytest.raises(TypeError, match="wrap the lists as Schedule"):
        check_schedule([[Action("F", 0), Action("B", 0)]])
