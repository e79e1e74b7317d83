"""Megatron's answers to activation memory (2104.04473 §3.5, §4.2; 1909.08053; 2205.05198):
recomputation, sequence parallelism, fp16 loss scaling, fused operations — each equal to the plain
model, each saving what the formula says (measured)."""

import copy
import dataclasses
import math

import pytest
import torch
from helpers import Launches, tiny_config

from megatron_edu import comm
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.model import GPT, GPTConfig, compile_blocks
from megatron_edu.optim import DynamicLossScale
from megatron_edu.perf import activation_bytes_per_layer, megatron_core_activation_bytes
from megatron_edu.perf.measure import layer_activation_bytes
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions
from megatron_edu.tensor_parallel.random import DropoutKey
from megatron_edu.tensor_parallel.sequence_parallel import sum_replicated_grads_

DROPOUT = tiny_config(dropout=0.2)  # seq 16, 2 layers, hidden 32, 4 heads


def _batch(b=4, s=16, seed=0):
    ids = torch.randint(0, 100, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _step(config, tp):
    """Loss, every gradient (whole), and the collectives of one forward-backward at tp."""
    grid = ParallelGrid(tp=tp)
    model = GPT(config, grid)
    with comm.record() as log:
        loss = model(*_batch(), dropout_key=DropoutKey(3, (4, 5, 6, 7)))
        loss.backward()
    if config.sequence_parallel:  # each rank saw 1/t of the sequence: sum the replicated grads
        sum_replicated_grads_([p.grad for p in model.parameters() if p.tp_dim is None],
                              grid.tp_group)
    return loss.item(), model.full_state_dict(grads=True), log.summary()


def _same(a, b, atol=1e-6):
    assert a[0] == pytest.approx(b[0], abs=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients_with_dropout_on(recompute):
    _same(LAUNCHES[f"tp2-{recompute}"][0], LAUNCHES["tp2-none"][0])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_sequence_parallel_equals_plain_tensor_parallel_with_dropout_on(recompute):
    _same(LAUNCHES[f"sp-{recompute}"][0], LAUNCHES["tp2-none"][0], atol=1e-5)


def test_sequence_parallel_turns_each_all_reduce_into_an_all_gather_and_a_reduce_scatter():
    _, _, plain = LAUNCHES["tp2-none"][0]
    _, _, split = LAUNCHES["sp-none"][0]
    layers, bsh = DROPOUT.num_layers, 4 * 16 * 32 * 4          # b·s·h fp32 bytes
    # per layer: g after attention and after the MLP → reduce-scatters; f before them →
    # all-gathers; plus the embedding's g and the output layer's f
    assert plain[("all_reduce", "tp", "g forward")] == (2 * layers + 1, (2 * layers + 1) * bsh)
    assert split[("reduce_scatter", "tp", "reduce_scatter_seq forward")] == (
        2 * layers + 1, (2 * layers + 1) * bsh)
    assert split[("all_gather", "tp", "all_gather_seq forward")] == (
        2 * layers + 1, (2 * layers + 1) * bsh)
    # backward: the conjugates, plus one more all-gather per column layer (its input was not kept)
    assert split[("reduce_scatter", "tp", "all_gather_seq backward")][0] == 2 * layers + 1
    assert split[("all_gather", "tp", "reduce_scatter_seq backward")][0] == 2 * layers + 1
    assert split[("all_gather", "tp", "all_gather_seq regather")][0] == 2 * layers + 1
    assert not any(op == "all_reduce" and label in ("g forward", "f backward")
                   for op, _, label in split)


def _ptdp_losses(config, tp, pp, steps=3):
    grid = ParallelGrid(Layout(tp=tp, pp=pp))
    trainer = PTDP(config, grid, PTDPOptions(lr=1e-2, eps=1e-4),
                   pipeline=PipelineConfig(num_microbatches=2))
    losses = [trainer.train_step(*_batch(4, seed=step), 1e-2).loss for step in range(steps)]
    params = {}
    for chunk in trainer.chunks:
        params.update(chunk.full_state_dict())
    return losses, params


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_sequence_parallel_and_recompute_in_a_pipeline_take_the_plain_steps(recompute):
    plain, mine = LAUNCHES["pipeline-plain"], LAUNCHES[f"pipeline-sp-{recompute}"]
    for (losses, params), (ref_losses, ref_params) in zip(mine, plain, strict=True):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)


# --- what each saves, measured beside 2205.05198's formula ---------------------------------------

SHAPE = GPTConfig(vocab_size=512, seq_len=128, num_layers=2, hidden=256, num_heads=8,
                  dropout=0.1)   # megatron-core's measured layer (its csv's header): b = 2
MEGATRON_CORE_TP2 = megatron_core_activation_bytes()  # docs/papers, measured at tp = 2


def _measured():
    grid = ParallelGrid(tp=torch.distributed.get_world_size())   # at tp = every rank
    return {(rc, sp): layer_activation_bytes(
        dataclasses.replace(SHAPE, recompute=rc, sequence_parallel=sp), grid.tp_group, 2)
        for rc in ("none", "selective", "full") for sp in (False, True)}


@pytest.fixture(scope="module")
def measured():
    return {tp: LAUNCHES[f"measured-tp{tp}"][0] for tp in (1, 2, 4)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_layer_saves_what_the_formula_says_within_5_percent(measured, tp):
    for (rc, sp), got in measured[tp].items():
        config = dataclasses.replace(SHAPE, recompute=rc, sequence_parallel=sp)
        predicted = activation_bytes_per_layer(config, 2, tp=tp, bytes_per_value=4)
        assert predicted <= got <= 1.05 * predicted, (tp, rc, sp, got, predicted)


def test_a_layer_saves_no_more_than_megatron_cores_own(measured):
    assert len(MEGATRON_CORE_TP2) == 6
    for cell, theirs in MEGATRON_CORE_TP2.items():
        assert measured[2][cell] <= theirs, cell


def _context_parallel_measured():
    grid = ParallelGrid(Layout(cp=2))
    return {(rc, p): layer_activation_bytes(dataclasses.replace(SHAPE, recompute=rc, dropout=p),
                                            grid.tp_group, 2, grid.cp_group)
            for rc in ("none", "selective", "full") for p in (0.0, 0.1)}


def test_a_context_parallel_layer_saves_exactly_what_the_formula_says():
    """cp = 2 (2310.01889): each rank's [b, s/2, h] through a Block whose attention is the ring.
    Measured, fp32, it is ``activation_bytes_per_layer(cp=2)`` to the byte — the ring's output
    and log-sum-exp where the scores were, no [s, s] tensor at all (at cp = 1 the causal mask is
    one more) — plus what the paper rounds away: each layer norm's per-token mean and 1/std
    (2 fp32). Selective recomputation keeps the same (the ring keeps no scores to drop)."""
    b, stats = 2, 2 * 2 * 2 * (SHAPE.seq_len // 2) * 4
    for ranks in LAUNCHES["measured-cp2"]:
        for (rc, p), got in ranks.items():
            config = dataclasses.replace(SHAPE, recompute=rc, dropout=p)
            formula = activation_bytes_per_layer(config, b, cp=2, bytes_per_value=4)
            assert got == formula + (0 if rc == "full" else stats), (rc, p, got, formula)


def test_each_technique_saves_memory(measured):
    m = measured[4]
    assert m["full", True] < m["full", False] < m["selective", True] < m["selective", False] \
        < m["none", False]
    assert m["none", True] < m["none", False]


# --- fp16: dynamic loss scaling -------------------------------------------------------------------

def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_clean_steps():
    scale = DynamicLossScale(scale=8.0, growth_interval=2)
    history = []
    for overflow in (False, True, False, False, False):
        scale.update(overflow)
        history.append(scale.scale)
    assert history == [8.0, 4.0, 4.0, 8.0, 8.0]


def _fp16_steps(bad_rank):
    """fp16 autocast on CPU, PTD-P at tp=2 × dp=2: step 1 overflows on one rank only."""
    grid = ParallelGrid(tp=2, dp=2)
    trainer = PTDP(tiny_config(), grid, PTDPOptions(loss_scaling=True))
    trainer.loss_scale.growth_interval = 2
    unscale = trainer._sum_tied_embedding_grads

    def overflow_once():
        unscale()
        if trainer.iteration == 1 and grid.rank == bad_rank:
            trainer.chunks[0].blocks["0"].mlp.fc.weight.grad.view(-1)[0] = float("inf")

    trainer._sum_tied_embedding_grads = overflow_once
    results = []
    for step in range(5):
        ids, labels = _batch(4, seed=step)
        mine = slice(2 * grid.dp_rank, 2 * grid.dp_rank + 2)
        with torch.autocast("cpu", dtype=torch.float16):
            result = trainer.train_step(ids[mine], labels[mine], 1e-3)
        results.append((result.skipped, result.loss_scale, math.isfinite(result.loss)))
    return results


def test_an_fp16_overflow_on_one_rank_skips_the_step_everywhere_and_halves_the_scale():
    for results in LAUNCHES["fp16-overflow-on-rank-3"]:
        assert results == [(False, 65536.0, True), (True, 65536.0, True),
                           (False, 32768.0, True), (False, 32768.0, True),
                           (False, 65536.0, True)]


# --- the runs on several ranks above: one launch per world size ---------------------------------

RECOMPUTE = ("none", "selective", "full")
PIPELINE = dataclasses.replace(DROPOUT, num_layers=4)


def _with(config, **changes):
    return dataclasses.replace(config, **changes)


LAUNCHES = Launches({  # name -> (world size, function, arguments)
    **{f"tp2-{rc}": (2, _step, (_with(DROPOUT, recompute=rc), 2)) for rc in RECOMPUTE},
    **{f"sp-{rc}": (2, _step, (_with(DROPOUT, sequence_parallel=True, recompute=rc), 2))
       for rc in RECOMPUTE},
    "pipeline-plain": (4, _ptdp_losses, (PIPELINE, 2, 2)),
    **{f"pipeline-sp-{rc}": (4, _ptdp_losses, (_with(PIPELINE, sequence_parallel=True,
                                                     recompute=rc), 2, 2)) for rc in RECOMPUTE},
    **{f"measured-tp{tp}": (tp, _measured, ()) for tp in (1, 2, 4)},
    "measured-cp2": (2, _context_parallel_measured, ()),
    "fp16-overflow-on-rank-3": (4, _fp16_steps, (3,)),
})


# --- fused operations -----------------------------------------------------------------------------

@pytest.mark.parametrize(("dropout", "attention"), [(0.0, "fused"), (0.2, "eager")])
def test_fused_operations_equal_the_unfused_ones(dropout, attention):
    """The fused bias kernels draw the unfused path's masks (bias+dropout+add takes
    ``Dropout.keep``'s mask); the fused attention core, whose dropout is the device's, equals the
    eager one without dropout."""
    config = tiny_config(dropout=dropout)
    reference = GPT(config)
    fused = GPT(dataclasses.replace(config, fused=True, attention=attention))
    ids, labels = _batch()
    losses = [model(ids, labels, dropout_key=DropoutKey(3, (4, 5, 6, 7)))
              for model in (reference, fused)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
    for (name, a), (_, b) in zip(reference.named_parameters(), fused.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0, msg=name)


def _saved_by_attention(attention):
    """The shapes a GPT's forward saves for backward (dropout 0: the fused core's CPU kernel)."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        GPT(tiny_config(attention=attention))(*_batch())
    return shapes


def test_the_fused_attention_core_saves_no_scores_matrix():
    """The eager core keeps softmax(q·kᵀ) for backward, [b, a, s, s]: 2104.04473's 5as²b term,
    ~25–30 MFU points on a GPU in fp32 softmax traffic. The fused one (flash attention) keeps q, k,
    v, its output and a row statistic, and recomputes the rest in backward."""
    b, s = 4, 16
    scores = b * tiny_config().num_heads * s * s

    def score_sized(shapes):
        return [shape for shape in shapes if shape[-2:] == (s, s) and math.prod(shape) >= scores]

    assert score_sized(_saved_by_attention("eager"))            # what the hook would catch
    assert score_sized(_saved_by_attention("fused")) == []


def test_compiled_blocks_equal_the_eager_ones_and_a_new_dropout_key_compiles_nothing():
    """``--compile``: each block's forward through torch.compile (on CPU the aot_eager backend:
    dynamo's capture and AOTAutograd's graph, without a C++ build), dropout on: the same losses
    and gradients, and steps 2 and 3 (new keys, new samples) reuse step 1's graphs."""
    from torch._dynamo.utils import counters

    eager = GPT(DROPOUT)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend="aot_eager")
    for step in range(3):
        key = DropoutKey(step, tuple(range(4 * step, 4 * step + 4)))
        losses = [model(*_batch(seed=step), dropout_key=key) for model in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs > 0
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0, msg=name)


def test_a_bare_recompute_flag_still_means_full():
    assert tiny_config(recompute=True).recompute == "full"
    assert tiny_config(recompute=False).recompute == "none"
    with pytest.raises(ValueError, match="recompute must be one of"):
        tiny_config(recompute="some")


def test_fused_operations_keep_the_activation_dtype_under_autocast():
    """bf16 autocast, dropout on: fused or not, the MLP's [b, s, 4h] GeLU output is bf16 (the fp32
    bias is added in the activation's dtype) with the same values, and a block's output fp32 (the
    residual stream's), the same to bf16's precision (the fused attention core rounds apart)."""
    config = tiny_config(dropout=0.2)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    outputs = []
    for fused in (False, True):
        block = GPT(dataclasses.replace(config, fused=fused)).blocks["0"].train()
        hook = block.mlp.proj.register_forward_pre_hook(lambda m, args: outputs.append(args[0]))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block.mlp(x)
            outputs.append(block(x, None, DropoutKey(3, (4, 5, 6, 7))))
        hook.remove()
    gelu, _, out, fused_gelu, _, fused_out = outputs
    assert (gelu.dtype, out.dtype) == (fused_gelu.dtype, fused_out.dtype) == (
        torch.bfloat16, torch.float32)
    torch.testing.assert_close(fused_gelu, gelu)                    # bf16's own tolerance
    torch.testing.assert_close(fused_out, out, atol=5e-2, rtol=1.6e-2)
