"""The training pictures of notebook 09 draw what they claim: a resumed run on top of the run that
saved its checkpoint (drawing only)."""

import matplotlib.pyplot as plt
import pytest

from megatron_edu.course.viz.training import draw_resumed_runs

SAVED = [{"step": s, "loss": 6.0 - 0.1 * s} for s in range(1, 21)] + [{"step": 20, "val_loss": 4.1}]
RESUMED = {"tp=1 pp=4": [{"step": s, "loss": 6.0 - 0.1 * s} for s in range(16, 21)],
           "tp=4 pp=1": [{"step": s, "loss": 6.0 - 0.1 * s} for s in range(16, 21)]}


@pytest.fixture
def ax():
    plt.switch_backend("agg")  # draw only, no window
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_the_saved_run_is_drawn_from_before_steps_ahead_of_the_checkpoint(ax):
    draw_resumed_runs(SAVED, RESUMED, resume_step=15, before=5, ax=ax)
    assert list(ax.lines[0].get_xdata()) == list(range(10, 21))


def test_each_resumed_run_is_one_series_of_its_steps_labelled_by_layout(ax):
    draw_resumed_runs(SAVED, RESUMED, resume_step=15, before=5, ax=ax)
    series = {line.get_label(): list(line.get_xdata()) for line in ax.lines[1:3]}
    assert series == {"resumed at tp=1 pp=4": list(range(16, 21)),
                      "resumed at tp=4 pp=1": list(range(16, 21))}


def test_the_checkpoint_step_is_marked_by_a_vertical_line(ax):
    draw_resumed_runs(SAVED, RESUMED, resume_step=15, before=5, ax=ax)
    assert list(ax.lines[-1].get_xdata()) == [15, 15]
