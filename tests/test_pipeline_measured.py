"""A measured timeline's costs feed the simulator: checked on timelines whose costs are known."""

from fractions import Fraction

import matplotlib.pyplot as plt

from megatron_edu.course.viz.pipeline import draw_measured_run
from megatron_edu.pipeline.schedules import make_schedule
from megatron_edu.pipeline.simulate import Timeline, measured_costs, simulate, simulate_measured

FORWARD, BACKWARD = [1, 1, 1.5, 1], [2, 2, 3, 2]  # rank 2 is slower: costs per rank survive


def test_measured_costs_of_a_simulation_are_its_per_rank_costs():
    timeline = simulate(make_schedule("1f1b", 4, 8), FORWARD, BACKWARD)
    assert measured_costs(timeline) == (FORWARD, BACKWARD)


def test_interleaved_chunk_times_are_scaled_to_whole_stages():
    timeline = simulate(make_schedule("interleaved", 4, 8, 2), 1, 2)  # each chunk: 1/2 and 1
    assert measured_costs(timeline) == ([1] * 4, [2] * 4)


def test_simulating_a_simulation_with_its_own_costs_reproduces_it():
    schedule = make_schedule("interleaved", 4, 8, 2)
    timeline = simulate(schedule, FORWARD, BACKWARD)
    assert simulate_measured(timeline) == timeline


def test_balanced_measured_costs_give_the_papers_bubble():
    schedule = make_schedule("1f1b", 4, 8)
    measured = Timeline([[(action, 4 * i, 4 * i + 3) for i, action in enumerate(row)]
                         for row in schedule], schedule.stages)  # every action 3 ms; waits free
    assert simulate_measured(measured).bubble_fraction == Fraction(3, 8)


def test_measured_run_is_drawn_above_its_simulation_on_one_time_axis():
    schedule = make_schedule("1f1b", 2, 4)
    measured = Timeline([[(action, 4 * i, 4 * i + 3) for i, action in enumerate(row)]
                         for row in schedule], schedule.stages)
    figure = draw_measured_run(measured, "1F1B")
    top, bottom = figure.axes
    plt.close(figure)
    assert top.get_xlim() == bottom.get_xlim() == (0, 31)  # the longer run: 8 actions, 4 apart
