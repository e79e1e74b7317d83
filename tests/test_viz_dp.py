"""The pictures of notebooks 06 and 07 draw what they claim: buckets against backward, optimizer
state and memory per rank, and the bytes each layout sends, split by purpose (drawing only)."""

import matplotlib.pyplot as plt
import pytest

from megatron_edu.comm import CommEvent, CommLog
from megatron_edu.course.viz.data_parallel import (
    draw_bucket_timeline,
    draw_bytes_per_layout,
    draw_memory_per_rank,
    draw_optimizer_state,
    format_bytes,
    show_zero1_memory,
)
from megatron_edu.model import GPTConfig
from megatron_edu.perf import GIB, MemoryEstimate, wire_bytes_by_group
from megatron_edu.timing import BucketTiming

START = 10.0  # perf_counter seconds when backward started
BUCKETS = [BucketTiming(0, 4000, START + 0.010, START + 0.010, START + 0.030),
           BucketTiming(1, 2000, START + 0.040, START + 0.045, START + 0.050)]
RUNS = {"overlap=True": (START, START + 0.042, BUCKETS),
        "overlap=False": (START, START + 0.042, BUCKETS[:1])}
MODEL = GPTConfig(vocab_size=128, seq_len=32, num_layers=4, hidden=64, num_heads=8)


@pytest.fixture(autouse=True)
def _agg_backend():
    plt.switch_backend("agg")  # draw only, no window
    yield
    plt.close("all")


def _bars(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


# --- bytes, as links are rated ---------------------------------------------------------------

@pytest.mark.parametrize(("n", "text"), [(999, "999 B"), (1234, "1.23 kB"),
                                          (22_916_096, "22.9 MB"), (7.516e11, "752 GB")])
def test_bytes_are_written_in_decimal_units_with_three_digits(n, text):
    assert format_bytes(n) == text


# --- buckets against backward -----------------------------------------------------------------

def test_the_timeline_draws_one_panel_per_run():
    assert len(draw_bucket_timeline(RUNS).axes) == 2


def test_each_panel_has_a_backward_bar_and_one_bar_per_bucket():
    first, second = draw_bucket_timeline(RUNS).axes
    counts = [(len(_bars(ax, "backward")), len([p for p in ax.patches
                                                 if (p.get_gid() or "").startswith("bucket")]))
              for ax in (first, second)]
    assert counts == [(1, 2), (1, 1)]


def test_backward_runs_from_zero_to_its_end_in_milliseconds():
    backward = _bars(draw_bucket_timeline(RUNS).axes[0], "backward")[0]
    assert (backward.get_x(), backward.get_width()) == pytest.approx((0.0, 42.0))


def test_a_bucket_bar_runs_from_its_launch_to_its_completion():
    bar = _bars(draw_bucket_timeline(RUNS).axes[0], "bucket 1")[0]
    assert (bar.get_x(), bar.get_width()) == pytest.approx((45.0, 5.0))


# --- optimizer state and memory per rank ------------------------------------------------------

def test_optimizer_state_bars_are_the_measured_bytes_in_mb():
    ax = draw_optimizer_state({1: (4_000_000, 4_000_000), 4: (4_000_000, 1_000_008)})
    heights = [[bar.get_height() for bar in _bars(ax, name)] for name in ("plain DP", "ZeRO-1")]
    assert heights == [pytest.approx([4.0, 4.0]), pytest.approx([4.0, 1.000008])]


def test_memory_bars_stack_to_the_total_in_gib():
    estimates = {"a": MemoryEstimate(GIB, GIB, 6 * GIB, GIB // 2),
                 "b": MemoryEstimate(GIB, GIB, GIB, 0)}
    ax = draw_memory_per_rank(estimates)
    tops = [bar.get_y() + bar.get_height() for bar in _bars(ax, "activations")]
    assert tops == pytest.approx([8.5, 3.0])


def test_memory_capacity_is_drawn_as_a_line_at_its_gib():
    ax = draw_memory_per_rank({"a": MemoryEstimate(GIB, GIB, GIB, GIB)}, capacity=80 * GIB)
    assert [line.get_ydata()[0] for line in ax.lines] == [80.0]


def test_zero1_memory_draws_plain_and_zero1_at_each_dp():
    estimates = show_zero1_memory(MODEL, tp=2, pp=1, dps=[1, 2, 4], global_batch=8)
    assert list(estimates) == [f"dp={dp}\n{kind}" for dp in (1, 2, 4)
                               for kind in ("plain", "ZeRO-1")]


def test_zero1_memory_shrinks_only_the_optimizer_state():
    estimates = show_zero1_memory(MODEL, tp=1, pp=1, dps=[4], global_batch=8)
    plain, zero1 = estimates.values()
    assert (plain.weights, plain.grads, plain.optimizer // 4) == (
        zero1.weights, zero1.grads, zero1.optimizer)


def test_zero1_memory_rejects_a_layout_the_model_cannot_take():
    with pytest.raises(ValueError, match="num_heads = 8 is not divisible by the tensor-parallel"):
        show_zero1_memory(MODEL, tp=3, pp=1, dps=[1], global_batch=8)


# --- bytes per layout --------------------------------------------------------------------------

def _log(*events):
    return CommLog(list(events))


LOGS = [
    _log(CommEvent("all_reduce", "tp", 2, 100, "g forward"),        # 2·1/2·100 = 100 on the wire
         CommEvent("send", "p2p", 2, 40, "pp activation"),
         CommEvent("all_reduce", "dp", 4, 80, "dp grads"),          # 2·3/4·80 = 120
         CommEvent("all_reduce", "mp", 2, 4, "grad norm")),
    _log(CommEvent("recv", "p2p", 2, 40, "pp activation"),          # the same 40 bytes: not again
         CommEvent("all_gather", "tp", 2, 40, "pp all-gather"),     # 1/2·40 = 20
         CommEvent("all_reduce", "embedding", 2, 60, "embedding grads"),
         CommEvent("all_reduce", "dp", 2, 4, "dp loss")),
]


def test_wire_bytes_are_summed_over_ranks_by_purpose_per_step():
    assert wire_bytes_by_group(LOGS, steps=2) == {"tp": 60, "pp": 20, "dp": 60, "embedding": 30,
                                                  "scalars": 4}


def test_the_heatmap_labels_every_cell_that_sends_and_leaves_the_rest_blank():
    ax = draw_bytes_per_layout({"tp=2": {"tp": 1500, "pp": 0}, "pp=2": {"tp": 0, "pp": 20}})
    assert sorted(text.get_text() for text in ax.texts) == ["1.5 kB", "20 B"]
