"""The pictures of notebook 08 draw what the cost model computes (drawing only, on Agg)."""

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from megatron_edu.course.viz.perf import (
    MIB,
    bubble_vs_dp,
    draw_activation_memory,
    draw_advisor_vs_table1,
    draw_bubble_vs_dp,
    draw_bubble_vs_microbatches,
    draw_forwards_in_flight,
    draw_memory_per_gpu,
    draw_split_sweep,
    draw_table1,
    draw_tp_sweep,
    show_advice,
    show_machine_mfu,
)
from megatron_edu.grid import Layout
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.perf import (
    GIB,
    activation_bytes_per_layer,
    best_per_split,
    megatron_core_activation_bytes,
    microbatch_tradeoff,
    predict,
    read_paper_table,
    table1_config,
)
from megatron_edu.perf.papers import PAPERS_DIR
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import Parallelism

SMALL = GPTConfig(vocab_size=1024, seq_len=128, num_layers=8, hidden=256, num_heads=8,
                  recompute="full")
GPUS, BATCH = 16, 32


@pytest.fixture(autouse=True)
def _agg_backend():
    plt.switch_backend("agg")  # draw only, no window
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def table1():
    return read_paper_table(PAPERS_DIR / "2104.04473_table1.csv")


def _bar_heights(ax) -> list[float]:
    return [patch.get_height() for patch in ax.patches]


# ---- the papers' tables ----


def test_table1_has_ten_rows_from_1_7b_to_1t(table1):
    assert [r["params_billion"] for r in table1][::9] == [1.7, 1008.0]


def test_a_text_column_stays_text():
    rows = read_paper_table("1909.08053_configs.csv")  # a bare name: in docs/papers
    assert {r["table"] for r in rows} == {"scaling", "gpt2_eval"}


def test_table1_config_is_the_rows_model_trained_with_full_recomputation(table1):
    assert table1_config(table1[-1]) == GPTConfig(vocab_size=51200, seq_len=2048,
                                                  num_layers=128, hidden=25600, num_heads=160,
                                                  recompute="full")


def test_megatron_cores_measured_bytes_are_read_per_mode():
    measured = megatron_core_activation_bytes()
    assert measured["selective", True] == 2_377_732 and len(measured) == 6


# ---- memory ----


def test_activation_bars_are_the_memory_model_in_mib():
    ax = draw_activation_memory(SMALL, microbatch=2, tp=4)
    expected = [activation_bytes_per_layer(replace(SMALL, sequence_parallel=sp, recompute=r), 2,
                                           tp=4) / MIB
                for sp in (False, True) for r in ("none", "selective", "full")]
    assert _bar_heights(ax) == pytest.approx(expected)


def test_forwards_in_flight_draws_one_line_per_schedule_over_every_stage():
    ax = draw_forwards_in_flight(p=4, m=16, v=2)
    assert [len(line.get_xdata()) for line in ax.lines] == [4, 4, 4]


def test_gpipe_holds_every_microbatch_on_every_stage():
    ax = draw_forwards_in_flight(p=4, m=16, v=2)
    assert list(ax.lines[0].get_ydata()) == [16] * 4


def test_memory_bars_stack_up_to_the_estimate():
    splits = [Parallelism(Layout(1, 2, 8), PipelineConfig(num_microbatches=4)),
              Parallelism(Layout(2, 4, 2), PipelineConfig(microbatch=2, num_microbatches=8))]
    predictions = [predict(SMALL, x) for x in splits]
    ax = draw_memory_per_gpu(predictions)
    heights = np.array(_bar_heights(ax)).reshape(4, len(splits)).sum(axis=0)
    totals = [p.memory.total / GIB for p in predictions]
    assert heights == pytest.approx(totals)


# ---- Table 1 and the advisor ----


def test_table1_figure_has_two_bars_per_row_and_a_breakdown_per_row(table1):
    rows = table1[:3]
    preds = []
    for r in rows:
        tp = int(r["tensor_parallel"])
        dp = int(r["gpus"]) // tp
        pipeline = PipelineConfig(num_microbatches=int(r["batch"]) // dp)
        preds.append(predict(table1_config(r), Parallelism(Layout(tp, 1, dp), pipeline)))
    fig = draw_table1(rows, preds)
    assert (len(fig.axes[0].patches), len(fig.axes[1].patches)) == (2 * 3, 6 * 3)


def test_breakdown_shares_add_up_to_one(table1):
    row = table1[0]
    pipeline = PipelineConfig(microbatch=4, num_microbatches=int(row["batch"]) // 128)
    pred = predict(table1_config(row), Parallelism(Layout(dp=32), pipeline))
    fig = draw_table1([row], [pred])
    assert sum(_bar_heights(fig.axes[1])) == pytest.approx(1.0)


def test_advisor_figure_has_three_bars_per_row(table1):
    rows = table1[:2]
    preds = [predict(table1_config(r), Parallelism(Layout(dp=int(r["gpus"])), PipelineConfig(
        microbatch=4, num_microbatches=int(r["batch"] / r["gpus"] / 4)))) for r in rows]
    ax = draw_advisor_vs_table1(rows, preds, preds)
    assert len(ax.patches) == 3 * 2


def test_best_per_split_keys_match_their_splits():
    best = best_per_split(SMALL, BATCH, GPUS)
    assert all((p.parallelism.tp, p.parallelism.pp) == key for key, p in best.items())


def test_best_per_split_is_the_fastest_of_its_split():
    best = best_per_split(SMALL, BATCH, GPUS)[2, 4]
    rivals = [predict(SMALL, Parallelism(Layout(2, 4, 2), PipelineConfig(
        microbatch=b, num_microbatches=16 // b))).time.total for b in (1, 2, 4, 8, 16)]
    assert best.time.total <= min(rivals)


def test_best_per_split_prefers_a_slower_layout_that_fits(table1):
    row = table1[3]  # 18.4B on 256 GPUs at tp=4, pp=1: b=16 is fastest but needs 101 GiB
    best = best_per_split(table1_config(row), int(row["batch"]), int(row["gpus"]))[4, 1]
    assert best.memory.total <= 80 * GIB


def test_split_sweep_draws_one_line_per_tensor_parallel_size():
    ax = draw_split_sweep(SMALL, BATCH, GPUS)
    assert [line.get_label() for line in ax.lines if line.get_label().startswith("tp")] == [
        "tp=1", "tp=2", "tp=4", "tp=8"]


def test_split_sweep_fills_exactly_the_splits_that_fit(table1):
    trillion = table1_config(table1[-1])  # on 3072 GPUs only deep pipelines fit in 80 GiB
    fitting = sum(p.memory.total <= 80 * GIB
                  for p in best_per_split(trillion, 3072, 3072).values())
    ax = draw_split_sweep(trillion, 3072, 3072)
    filled = [m for m in ax.lines if m.get_marker() == "o" and m.get_markerfacecolor() != "white"]
    assert len(filled) == fitting


def test_show_advice_prints_the_best_layouts(capsys):
    show_advice(SMALL, BATCH, GPUS, top=3)
    assert capsys.readouterr().out.count("TFLOP/s per GPU") == 3


def test_show_advice_draws_the_splits_and_their_memory():
    show_advice(SMALL, BATCH, GPUS, top=3)
    assert len(plt.gcf().axes) == 2


# ---- the takeaways ----


def test_bubble_figure_draws_prediction_and_formula_for_each_schedule():
    ax = draw_bubble_vs_microbatches(SMALL, tp=1, pp=4, chunks=2, microbatch_counts=[4, 8, 16])
    assert len(ax.lines) == 4


def test_bubble_formula_line_is_p_minus_1_over_v_m():
    ax = draw_bubble_vs_microbatches(SMALL, tp=1, pp=4, chunks=2, microbatch_counts=[4, 8, 16])
    assert list(ax.lines[3].get_ydata()) == pytest.approx([3 / 8, 3 / 16, 3 / 32])


def test_tp_sweep_draws_one_line_per_batch():
    ax = draw_tp_sweep(SMALL, 16, batches=(16, 32), tps=(2, 4, 8))
    assert [len(line.get_xdata()) for line in ax.lines[:2]] == [3, 3]


def test_microbatch_tradeoff_has_three_curves_one_value_per_size():
    curves = microbatch_tradeoff(SMALL, 1, 4, BATCH, (1, 2, 4))
    assert [len(v) for v in curves.values()] == [3, 3, 3]


# ---- this machine ----


def _tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=128, seq_len=16, num_layers=1, hidden=32, num_heads=2,
                         dropout=0.0))


def test_machine_mfu_is_positive():
    assert show_machine_mfu(_tiny_gpt(), batch=2, rounds=2, matmul_size=64) > 0


def test_machine_mfu_restores_the_thread_count():
    threads = torch.get_num_threads()
    show_machine_mfu(_tiny_gpt(), batch=2, rounds=2, matmul_size=64)
    assert torch.get_num_threads() == threads


# ---- Fig. 6: the bubble against d ----


def test_bubble_vs_dp_is_n_minus_d_over_the_microbatches_per_batch():
    # (p − 1)/m with p = n/(t·d), m = B/(b·d): (n/t − d)/(B/b), every d that divides both
    assert bubble_vs_dp(32, 128) == {d: (32 - d) / 128 for d in (1, 2, 4, 8, 16, 32)}
    assert bubble_vs_dp(16, 8, tp=2) == {d: (8 - d) / 8 for d in (1, 2, 4, 8)}


def test_bubble_vs_dp_draws_one_falling_line_per_n_and_batch():
    ax = draw_bubble_vs_dp([32, 128], [32, 128])
    assert len(ax.lines) == 4
    for line in ax.lines:
        bubbles = list(line.get_ydata())
        assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > bubbles[-1]
