"""The pictures of notebook 13 draw what they claim: what each rank holds per ZeRO stage, memory
measured beside the model, bytes per step against m, and a ZeRO-3 step's timeline (drawing only,
from made-up numbers)."""

import pytest

from megatron_edu.course.viz.zero import (
    MIXED_BYTES,
    draw_bytes_per_step,
    draw_memory_by_stage,
    draw_zero3_timeline,
    draw_zero_stages,
    gather_leads,
    held_per_param,
)
from megatron_edu.timing import UnitEvent
from tests.test_viz_dp import _agg_backend  # noqa: F401  (autouse: draw only, no window)
from tests.test_viz_dp import _bars as _patches

# --- what each rank holds -------------------------------------------------------------------------

@pytest.mark.parametrize(("stage", "held"), [(0, (2, 2, 12)), (1, (2, 2, 3)), (2, (2, 0.5, 3)),
                                             (3, (0.5, 0.5, 3))])
def test_a_stage_shards_the_optimizer_then_the_gradients_then_the_weights(stage, held):
    assert tuple(held_per_param(stage, 4).values()) == held


def test_figure_1_of_the_zero_paper_per_parameter():
    """7.5B parameters, 64 GPUs: 120, 31.4, 16.6 and 1.9 GB (1910.02054 Figure 1)."""
    totals = [7.5 * sum(held_per_param(stage, 64).values()) for stage in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_the_stages_picture_has_a_panel_per_stage_and_a_row_per_rank():
    fig = draw_zero_stages(dp=4)
    assert len(fig.axes) == 4
    assert all(len(ax.get_yticks()) == 4 for ax in fig.axes)


@pytest.mark.parametrize("stage", range(4))
def test_each_rank_fills_as_many_bytes_as_the_stage_holds(stage):
    ax = draw_zero_stages(dp=4).axes[stage]
    for rank in range(4):
        for part, held in held_per_param(stage, 4).items():
            (bar,) = _patches(ax, f"stage {stage} rank {rank} {part}")
            assert bar.get_width() == pytest.approx(held)


def test_a_rank_holds_its_own_slice_of_a_sharded_part():
    """Stage 3 at dp = 4: rank r's weights are the r-th quarter of the weights' 2 bytes."""
    ax = draw_zero_stages(dp=4).axes[3]
    starts = [_patches(ax, f"stage 3 rank {r} weights")[0].get_x() for r in range(4)]
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.5])
    assert len(_patches(ax, "not held")) == 4 * 3 * 3     # every rank: 3 others' slices, 3 parts


def test_the_stages_titles_say_the_bytes_per_rank():
    titles = [ax.get_title() for ax in draw_zero_stages(dp=4).axes]
    assert [t.splitlines()[1] for t in titles] == [f"{b:g} bytes/param per rank"
                                                  for b in (16, 7, 5.5, 4)]


def test_other_precisions_draw_their_own_widths():
    fp32 = {"weights": 4, "grads": 4, "optimizer": 8}
    ax = draw_zero_stages(dp=2, bytes_per_param=fp32).axes[0]
    assert _patches(ax, "stage 0 rank 1 optimizer")[0].get_width() == 8
    assert ax.get_xlim() == (0, sum(fp32.values()))
    assert sum(MIXED_BYTES.values()) == 16


# --- memory measured beside the model -------------------------------------------------------------

MEASURED = {0: {"weights": 4e6, "grads": 4e6, "optimizer": 8e6},
            3: {"weights": 1e6, "grads": 1e6, "optimizer": 2e6}}
MODEL = {0: {"weights": 4e6, "grads": 4e6, "optimizer": 8e6, "activations": 5e6},
         3: {"weights": 1e6, "grads": 1e6, "optimizer": 2.1e6, "activations": 5e6}}


def test_memory_bars_stack_the_three_parts_in_mb():
    ax = draw_memory_by_stage(MEASURED, MODEL)
    tops = [bar.get_y() + bar.get_height() for bar in _patches(ax, "measured optimizer")]
    assert tops == pytest.approx([16.0, 4.0])
    model_tops = [bar.get_y() + bar.get_height() for bar in _patches(ax, "model optimizer")]
    assert model_tops == pytest.approx([16.0, 4.1])


def test_the_peak_is_a_tick_at_its_mb():
    ax = draw_memory_by_stage(MEASURED, MODEL, peaks={0: 20e6, 3: 9e6})
    (ticks,) = [c for c in ax.collections if c.get_gid() == "peak"]
    assert [y for _, y in ticks.get_offsets()] == pytest.approx([20.0, 9.0])


# --- bytes per step -------------------------------------------------------------------------------

def test_bytes_per_step_are_drawn_in_halves_against_m():
    sent = {0: {1: 200.0, 4: 200.0}, 3: {1: 300.0, 4: 1200.0}}
    ax = draw_bytes_per_step(sent, unit=100.0)
    lines = {line.get_gid(): line for line in ax.lines}
    assert list(lines["stage 3"].get_xdata()) == [1, 4]
    assert list(lines["stage 3"].get_ydata()) == pytest.approx([3.0, 12.0])
    assert list(lines["stage 0"].get_ydata()) == pytest.approx([2.0, 2.0])


# --- a ZeRO-3 step's timeline ---------------------------------------------------------------------

T = 100.0  # perf_counter seconds when the step began
EVENTS = [  # a root (unit 0) around two blocks, each gathered for its forward and its backward
    UnitEvent(0, "gather", T, T + 0.001),
    UnitEvent(1, "gather", T + 0.0005, T + 0.002),
    UnitEvent(1, "forward", T + 0.002, T + 0.010),
    UnitEvent(2, "gather", T + 0.003, T + 0.011),
    UnitEvent(2, "forward", T + 0.011, T + 0.020),
    UnitEvent(0, "forward", T + 0.001, T + 0.021),
    UnitEvent(2, "gather", T + 0.022, T + 0.023),
    UnitEvent(2, "backward", T + 0.023, T + 0.040),
    UnitEvent(1, "gather", T + 0.024, T + 0.041),
    UnitEvent(1, "backward", T + 0.041, T + 0.060),
    UnitEvent(0, "backward", T + 0.021, T + 0.062),
]


def test_gather_leads_are_how_early_the_next_gather_was_launched():
    leads = gather_leads(EVENTS)
    assert [(kind, unit, nxt) for kind, unit, nxt, _ in leads] == [("forward", 1, 2),
                                                                 ("backward", 2, 1)]
    assert [lead for *_, lead in leads] == pytest.approx([0.007, 0.016])


def test_a_gather_launched_after_the_pass_ended_has_a_negative_lead():
    late = [e if (e.unit, e.kind, e.start) != (2, "gather", T + 0.003)
            else UnitEvent(2, "gather", T + 0.0105, T + 0.011) for e in EVENTS]
    assert gather_leads(late)[0][3] == pytest.approx(-0.0005)


class _Bucket:
    def __init__(self, index):
        self.index = index


def test_the_timeline_draws_every_event_on_its_unit_in_ms():
    scatters = [(2, T + 0.038, T + 0.040)]
    ax = draw_zero3_timeline(EVENTS, scatters, ["root", "block 0", "block 1"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["root", "block 0", "block 1"]
    (forward,) = _patches(ax, "unit 1 forward")
    assert (forward.get_x(), forward.get_width()) == pytest.approx((2.0, 8.0))
    assert len(_patches(ax, "unit 2 gather")) == 2
    (scatter,) = _patches(ax, "unit 2 reduce-scatter")
    assert (scatter.get_x(), scatter.get_width()) == pytest.approx((38.0, 2.0))
    assert forward.get_y() + forward.get_height() / 2 == pytest.approx(1.0)   # on unit 1's row
