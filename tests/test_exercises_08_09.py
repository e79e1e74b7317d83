"""The checkers of notebooks 08 and 09: each reference solution passes, each typical mistake gets
the hint that names it, a stub gets "not done yet", a deadlock the deadlock message."""

import dataclasses
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from helpers import failed, stub

from megatron_edu.checkpoint import load_checkpoint, load_model_chunks, read_metadata
from megatron_edu.course.exercises import check
from megatron_edu.course.exercises.nb08 import (
    DGX_H200_DATASHEET,
    TRILLION,
    _formula,
    measured_layer_flops,
)
from megatron_edu.data import BatchSampler
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.model import GPTConfig
from megatron_edu.perf import Hardware, advise, num_parameters
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---------------------------------------------------------------------------------------------
# 08.1 the parameters of a GPT
# ---------------------------------------------------------------------------------------------


def gpt_parameters(layers, hidden, vocab, seq_len, ffn_hidden):
    h, f = hidden, ffn_hidden
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return layers * per_layer + (vocab + seq_len) * h + 2 * h


def test_08_1_the_solution_passes():
    result = check("08.1", gpt_parameters)
    assert result.passed, result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda l, h, v, s, f: num_parameters(l, h, v, s),                 # the paper's formula
     ("final layer norm", "h → 4h → h")),
    (lambda l, h, v, s, f: gpt_parameters(l, h, v, s, f) + v * h,      # an untied output layer
     ("output layer is counted apart",)),
    (lambda l, h, v, s, f: gpt_parameters(l, h, v, s, f) - s * h - l * (5 * h + f),
     ("position embeddings", "biases are missing")),
    (lambda l, h, v, s, f: gpt_parameters(l, h, v, s, f) + 7, ("off by +7",)),
    (lambda l, h, v, s, f: "many", ("should be a number",)),
], ids=["paper-formula", "untied", "positions-and-biases", "unexplained", "not-a-number"])
def test_08_1_typical_mistakes_get_their_hint(answer, fragments):
    assert failed(check("08.1", answer), *fragments)


def test_08_1_stub_is_not_done_yet():
    assert failed(check("08.1", stub), "not done yet")


# ---------------------------------------------------------------------------------------------
# 08.2 the FLOPs of a SwiGLU + GQA layer
# ---------------------------------------------------------------------------------------------


def layer_flops(b, s, h, a, kv, f, gated):
    return _formula(b, s, h, a, kv, f, gated)


def test_08_2_the_reference_formula_is_what_flop_counter_measures():
    for shape in [(2, 16, 64, 8, 2, 192, True), (1, 8, 32, 4, 4, 128, False)]:
        assert measured_layer_flops(*shape) == _formula(*shape)


def test_08_2_the_solution_passes():
    result = check("08.2", layer_flops)
    assert result.passed, result.message
    assert "11%" in result.message  # GQA on a Llama-2-70B layer: the KV cache is its gain


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda *args: layer_flops(*args) // 3, ("forward pass only",)),
    (lambda *args: layer_flops(*args) * 4 // 3, ("recomputed forward",)),
    (lambda b, s, h, a, kv, f, g: layer_flops(b, s, h, a, kv, f, False), ("gated=True", "gate")),
    (lambda b, s, h, a, kv, f, g: layer_flops(b, s, h, a, a, f, g), ("shrink with kv_heads",)),
    (lambda b, s, h, a, kv, f, g: layer_flops(b, s, h, a, kv, f, g)      # scores shrink too
     - 3 * 4 * b * s * s * (h - kv * (h // a)), ("per query head",)),
    (lambda b, s, h, a, kv, f, g: layer_flops(b, s, h, a, kv, 4 * h, g), ("whatever ffn is",)),
], ids=["forward-only", "recompute", "not-gated", "no-gqa", "gqa-scores", "ffn-4h"])
def test_08_2_typical_mistakes_get_their_hint(answer, fragments):
    assert failed(check("08.2", answer), *fragments)


def test_08_2_stub_is_not_done_yet():
    assert failed(check("08.2", stub), "not done yet")


# ---------------------------------------------------------------------------------------------
# 08.3 the advisor on a DGX H200 cluster
# ---------------------------------------------------------------------------------------------

GB = 10**9


def h200_plan(hw=DGX_H200_DATASHEET, advise_on=None):
    return hw, advise(TRILLION, 3072, 3072, advise_on or hw)[0][0]


def test_08_3_the_solution_passes_and_says_what_memory_buys():
    result = check("08.3", h200_plan)
    assert result.passed, result.message
    assert "pp=32 where the A100s needed pp=64" in result.message


@pytest.mark.parametrize(("hardware", "fragments"), [
    (dict(memory_bytes=141), ("in GB, not bytes",)),
    (dict(memory_bytes=141 * 2**30), ("decimal",)),
    (dict(intra_node_bandwidth=900 * GB), ("both directions",)),
    (dict(inter_node_bandwidth=50 * GB), ("all 8 adapters together",)),
    (dict(inter_node_bandwidth=8 * 400 * GB), ("gigabits",)),
    (dict(peak_flops=1979e12), ("sparsity",)),
], ids=["memory-GB", "memory-GiB", "nvlink-both-ways", "one-adapter", "bits", "sparse-peak"])
def test_08_3_wrong_datasheet_units_get_their_hint(hardware, fragments):
    wrong = dataclasses.replace(DGX_H200_DATASHEET, **hardware)
    assert failed(check("08.3", lambda: (wrong, None)), *fragments)


def test_08_3_the_selene_layout_is_named():
    from megatron_edu.perf import SELENE_A100

    result = check("08.3", lambda: h200_plan(advise_on=SELENE_A100))
    assert failed(result, "advisor's pick on Selene")


def test_08_3_a_lone_hardware_asks_for_the_pair():
    assert failed(check("08.3", lambda: DGX_H200_DATASHEET), "return a pair")
    assert isinstance(DGX_H200_DATASHEET, Hardware)


def test_08_3_stub_is_not_done_yet():
    assert failed(check("08.3", stub), "not done yet")


# ---------------------------------------------------------------------------------------------
# 09.1 the next token
# ---------------------------------------------------------------------------------------------


def sample_next(logits, temperature, top_k, generator):
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def top_k_positions(logits, temperature, top_k, generator):
    if top_k is None:
        return sample_next(logits, temperature, top_k, generator)
    values, _ = (logits / temperature).topk(top_k)
    return int(torch.multinomial(values.softmax(-1), 1, generator=generator))


def test_09_1_the_solution_passes():
    result = check("09.1", sample_next)
    assert result.passed, result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda logits, t, k, g: int(logits.argmax()), ("greedy",)),
    (lambda logits, t, k, g: int(torch.multinomial(logits.softmax(-1), 1)), ("generator",)),
    (top_k_positions, ("positions within the top k",)),
    (lambda logits, t, k, g: sample_next(logits, t, None, g), ("not among the 3 most likely",)),
    (lambda logits, t, k, g: sample_next(logits, 1.0, k, g), ("temperature has no effect",)),
    (lambda logits, t, k, g: sample_next(logits * t * t, t, k, g), ("multiplied the logits",)),
    (lambda logits, t, k, g: "a", ("as an int",)),
], ids=["greedy", "global-rng", "top-k-positions", "no-top-k", "no-temperature",
        "times-temperature", "not-an-int"])
def test_09_1_typical_mistakes_get_their_hint(answer, fragments):
    assert failed(check("09.1", answer), *fragments)


def test_09_1_stub_is_not_done_yet():
    assert failed(check("09.1", stub), "not done yet")


# ---------------------------------------------------------------------------------------------
# 09.2 resume in another layout (2 ranks)
# ---------------------------------------------------------------------------------------------


def resume(checkpoint, tp, pp, run, load="all", restore_sampler=True, grid_tp=None):
    tp, pp = (grid_tp, 1) if grid_tp is not None else (tp, pp)
    grid = ParallelGrid(Layout(tp, pp))
    pipeline = PipelineConfig(microbatch=run.micro_batch,
                              num_microbatches=run.global_batch // run.micro_batch)
    trainer = PTDP(run.config, grid, PTDPOptions(lr=run.lr), pipeline=pipeline)
    meta = (load_checkpoint(checkpoint, trainer) if load == "all" else
            load_model_chunks(checkpoint, trainer.chunks, grid) if load == "weights" else
            read_metadata(checkpoint))
    sampler = BatchSampler(len(run.dataset), run.global_batch, grid.dp_rank, grid.dp, run.seed)
    if restore_sampler:
        sampler.load_state_dict(meta["state"]["sampler"])
    return [trainer.train_step(*run.dataset.batch(next(sampler)), run.lr).loss for _ in range(2)]


def test_09_2_the_solution_passes():
    result = check("09.2", resume)
    assert result.passed, result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda c, tp, pp, run: resume(c, tp, pp, run, restore_sampler=False),
     ("batches of steps 1 and 2", "load_state_dict")),
    (lambda c, tp, pp, run: resume(c, tp, pp, run, load="weights"),
     ("without the AdamW moments",)),
    (lambda c, tp, pp, run: resume(c, tp, pp, run, load="none"), ("untrained model",)),
    (lambda c, tp, pp, run: resume(c, tp, pp, run, grid_tp=2),
     ("tensor-parallel all-reduces", "not the checkpoint's tp=2")),
    (lambda c, tp, pp, run: resume(c, tp, pp, dataclasses.replace(
        run, config=GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=64,
                              num_heads=4))),
     ("CheckpointError", "hidden 32 in the checkpoint vs 64 here")),
], ids=["fresh-sampler", "weights-only", "not-loaded", "checkpoint-layout", "wrong-config"])
def test_09_2_typical_mistakes_get_their_hint(answer, fragments):
    assert failed(check("09.2", answer), *fragments)


def test_09_2_stub_is_not_done_yet():
    assert failed(check("09.2", stub), "not done yet")


def receive_what_nobody_sends(checkpoint, tp, pp, run):
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    return [0.0, 0.0]


def test_09_2_a_deadlock_is_named():
    assert failed(check("09.2", receive_what_nobody_sends), "did not finish", "using no CPU",
                  "deadlock")
