"""The GPT: tensor-parallel runs equal the serial model; stages compose into it; the checks that
run before launching say what is wrong."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TOL, assert_two_stages_chain_into_serial, batch, max_diff, tiny_config

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig, Llama, LlamaConfig
from megatron_edu.pipeline.stages import StageMap

# --- configuration: pure checks, before any launch ------------------------------------------


@pytest.mark.parametrize("field, value, tp, overrides", [("num_heads", 6, 4, {"hidden": 48}),
                                                         ("ffn_hidden", 130, 4, {})])
def test_validate_names_the_number_not_divisible_by_tp(field, value, tp, overrides):
    config = tiny_config(**{field: value, **overrides})
    with pytest.raises(ValueError, match=f"{field} = {value} is not divisible .* tp = {tp}"):
        config.validate(tp)


def test_validate_names_the_layers_not_divisible_by_pipeline_stages():
    with pytest.raises(ValueError, match=r"num_layers = 2 is not divisible by pp·chunks = 2·2 = 4"):
        tiny_config().validate(tp=1, pp=2, chunks=2)


def test_a_model_larger_than_the_grid_allows_is_refused_before_building():
    with pytest.raises(ValueError, match="num_heads = 25 is not divisible"):
        GPTConfig.preset("gpt2-xl").validate(tp=2)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="gpt2-small"):
        GPTConfig.preset("gpt5")


def test_preset_overrides_rescale_the_ffn():
    assert GPTConfig.preset("tiny", hidden=64).ffn_hidden == 256


@pytest.mark.parametrize("vocab, tp, padded", [(50257, 1, 50304), (50257, 2, 50432),
                                               (51200, 8, 51200), (100, 4, 512)])
def test_padded_vocab_is_a_multiple_of_128_tp(vocab, tp, padded):
    assert GPTConfig(vocab_size=vocab).padded_vocab(tp) == padded


def test_gpt2_small_has_124m_parameters_as_in_the_literature():
    assert round(GPTConfig.preset("gpt2-small", vocab_size=50257).num_parameters() / 1e6) == 124


def test_megatron_8b_fits_its_tp_of_8():
    GPTConfig.preset("megatron-8.3b").validate(tp=8)


def test_num_parameters_is_the_papers_formula_plus_the_final_layer_norm():
    c = tiny_config()
    l, h, v, s = c.num_layers, c.hidden, c.padded_vocab(1), c.seq_len
    paper = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))  # 2104.04473 §5.1
    assert GPT(c).num_parameters() == round(paper) + 2 * h


@pytest.mark.parametrize("stages, rank, chunk, expected", [
    (StageMap(2, 1, "interleaved"), 1, 0, range(4, 8)),
    (StageMap(2, 2, "interleaved"), 0, 1, range(4, 6)),   # chunk 1 of rank 0: stage 2
    (StageMap(2, 2, "interleaved"), 1, 0, range(2, 4)),
    (StageMap(2, 2, "v"), 1, 1, range(4, 6)),             # ZB-V's turn: stage 2 on rank 1
    (StageMap(2, 2, "v"), 0, 1, range(6, 8)),             # rank 0 holds the last stage too
])
def test_a_stage_map_gives_each_chunk_its_layers(stages, rank, chunk, expected):
    assert stages.layers(stages.stage(rank, chunk), 8) == expected


@pytest.mark.parametrize("kind", ["interleaved", "v"])
def test_the_stages_cover_every_layer_once(kind):
    stages = StageMap(4, 3, kind)
    held = [i for r in range(4) for c in range(3) for i in stages.layers(stages.stage(r, c), 24)]
    assert sorted(held) == list(range(24))


def test_a_stage_map_rejects_an_uneven_split():
    with pytest.raises(ValueError, match="num_layers = 10 is not divisible by the 4 virtual"):
        StageMap(4, 1, "interleaved").layers(0, 10)


# --- serial model ------------------------------------------------------------------------------

def test_loss_is_f_cross_entropy_of_the_logits_ignoring_minus_100():
    model = GPT(tiny_config())
    ids, labels = batch(model.config)
    labels[0, :3] = -100
    logits = model(ids)[..., : model.config.vocab_size]
    expected = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)
    assert abs(model(ids, labels).item() - expected.item()) < TOL


def test_padded_vocabulary_logits_are_minus_infinity():
    logits = GPT(tiny_config())(batch(tiny_config())[0])
    assert bool(torch.isneginf(logits[..., 100:]).all())


def test_a_sequence_longer_than_seq_len_is_refused():
    with pytest.raises(ValueError, match="17 tokens is longer than seq_len = 16"):
        GPT(tiny_config())(torch.zeros(1, 17, dtype=torch.long))


def test_pipeline_stages_chain_into_the_serial_model():
    """Names, weights, loss and (tied) gradients of two stages equal the serial model's."""
    config = tiny_config()
    ids, labels = batch(config)
    assert_two_stages_chain_into_serial(config, ids, labels)


def test_every_parameter_says_along_which_dimension_it_is_split():
    dims = {name: p.tp_dim for name, p in GPT(tiny_config()).named_parameters()}
    assert (dims["embedding.word.weight"], dims["blocks.0.attn.qkv.weight"],
            dims["blocks.0.attn.proj.weight"], dims["blocks.0.attn.proj.bias"],
            dims["ln_f.weight"]) == (0, 0, 1, None, None)


def test_a_stage_loads_its_part_of_the_whole_models_state():
    config = tiny_config()
    stage = GPT(tiny_config(seed=99), layers=range(1, 2), first=False)
    stage.load_full_state_dict(GPT(config).full_state_dict())
    assert max_diff(stage.full_state_dict(),
                    GPT(config, layers=range(1, 2), first=False).full_state_dict()) == 0.0


def test_the_last_stage_holds_the_word_embedding_under_the_same_name_and_values():
    config = tiny_config()
    last = GPT(config, layers=range(1, 2), first=False)
    assert torch.equal(last.embedding.word.weight, GPT(config).embedding.word.weight)


def test_recompute_gives_identical_gradients_with_dropout_on():
    config = tiny_config(dropout=0.1)
    ids, labels = batch(config)
    grads = []
    for recompute in (False, True):
        model = GPT(tiny_config(dropout=0.1, recompute=recompute))
        model(ids, labels).backward()
        grads.append(model.full_state_dict(grads=True))
    assert max_diff(*grads) == 0.0


# --- tensor parallel against serial, in one launch per tp -------------------------------------

def _block_events(model):
    """The collectives of one transformer block, forward and backward."""
    x = torch.randn(2, 8, model.config.hidden, requires_grad=True)
    with comm.record() as log:
        model.blocks["0"](x).sum().backward()
    return log.summary()


def _tensor_parallel_vs_serial():
    grid = ParallelGrid(tp=dist.get_world_size())
    config = tiny_config()
    ids, labels = batch(config)
    serial, parallel = GPT(config), GPT(config, grid)
    start = max_diff(parallel.full_state_dict(), serial.full_state_dict())
    with comm.record() as log:
        loss = parallel(ids, labels)
        loss.backward()
    serial_loss = serial(ids, labels)
    serial_loss.backward()
    logits = comm.all_gather(parallel(ids).detach(), grid.tp_group)[..., :100]
    out = {"start": start, "loss": abs(loss.item() - serial_loss.item()),
           "logits": (logits - serial(ids)[..., :100]).abs().max().item(),
           "grads": max_diff(parallel.full_state_dict(grads=True),
                             serial.full_state_dict(grads=True)),
           "events": log.summary(), "block_events": _block_events(parallel),
           "params": [(m.num_parameters(), m.config.num_parameters(grid.tp))
                      for m in (parallel, Llama(GQA, grid))]}
    return {**out, **_with_dropout(grid)}


GQA = LlamaConfig(vocab_size=100, seq_len=16, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2)


def _with_dropout(grid):
    """Dropout on: replicated activations agree across tp ranks; recompute changes nothing."""
    config = tiny_config(dropout=0.3)
    ids, labels = batch(config)
    hidden = GPT(config, grid, last=False)(ids)
    gathered = comm.all_gather(hidden[None], grid.tp_group, dim=0)
    grads = []
    for recompute in (False, True):
        model = GPT(tiny_config(dropout=0.3, recompute=recompute), grid)
        model(ids, labels).backward()
        grads.append(model.full_state_dict(grads=True))
    return {"hidden_spread": (gathered - gathered[0]).abs().max().item(),
            "recompute": max_diff(*grads)}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def tp_run(request):
    return request.param, run(_tensor_parallel_vs_serial, request.param)


def test_initial_weights_are_the_same_at_every_tp(tp_run):
    assert all(r["start"] == 0.0 for r in tp_run[1])


def test_loss_equals_serial_on_every_rank(tp_run):
    assert all(r["loss"] < TOL for r in tp_run[1])


def test_gathered_logits_equal_serial(tp_run):
    assert all(r["logits"] < TOL for r in tp_run[1])


def test_every_parameter_gradient_equals_serial(tp_run):
    assert all(r["grads"] < TOL for r in tp_run[1])


def test_parameters_per_rank_match_the_config_formula(tp_run):
    """The GPT, and a Llama of 2 kv heads (at tp 4 each on 2 ranks)."""
    assert all(model == formula for r in tp_run[1] for model, formula in r["params"])


def test_a_block_all_reduces_twice_forward_and_twice_backward(tp_run):
    tp, results = tp_run
    nbytes = 4 * 2 * 8 * 32  # one [b, s, h] fp32 activation
    expected = {} if tp == 1 else {("all_reduce", "tp", "g forward"): (2, 2 * nbytes),
                                   ("all_reduce", "tp", "f backward"): (2, 2 * nbytes)}
    assert all(r["block_events"] == expected for r in results)


def test_the_whole_model_adds_the_embedding_output_layer_and_loss_reductions(tp_run):
    tp, results = tp_run
    layers, tokens = 2, 2 * 8
    expected = {} if tp == 1 else {
        ("all_reduce", "tp", "g forward"): (2 * layers + 1, (2 * layers + 1) * 4 * tokens * 32),
        ("all_gather", "tp", "ce max"): (1, 4 * tokens * tp),
        ("all_reduce", "tp", "ce target logit"): (1, 4 * tokens),
        ("all_reduce", "tp", "ce sum-exp"): (1, 4 * tokens),
        ("all_reduce", "tp", "f backward"): (2 * layers + 1, (2 * layers + 1) * 4 * tokens * 32)}
    assert all(r["events"] == expected for r in results)


def test_dropout_keeps_replicated_activations_identical_across_tp_ranks(tp_run):
    assert all(r["hidden_spread"] == 0.0 for r in tp_run[1])


def test_recompute_gives_identical_gradients_under_tp_with_dropout(tp_run):
    assert all(r["recompute"] == 0.0 for r in tp_run[1])


def test_initial_loss_is_near_log_vocab():
    """A sanity anchor outside the serial comparison: GPT-2 init predicts near-uniformly."""
    config = tiny_config()
    loss = GPT(config)(*batch(config)).item()
    assert abs(loss - math.log(config.vocab_size)) < 0.1
