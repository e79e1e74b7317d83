"""Hugging Face Llama in and out: the same logits, loss and every gradient as
``LlamaForCausalLM``, serial and at tp = 2 and 4 (each of 2 kv heads on 2 ranks), for a
grouped-query model with its own output layer and a tied one (SmolLM-like); saved back,
``from_pretrained`` gives the same logits.

The outside reference: randomly initialised tiny LlamaForCausalLMs, saved with
``save_pretrained`` — nothing is downloaded. Only this process imports transformers; the ranks
read the files without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import Result, assert_same

from megatron_edu import comm, hf_llama
from megatron_edu.grid import ParallelGrid
from megatron_edu.hf import (
    config_from_hf,
    load_hf,
    load_hf_gpt2,
    load_hf_llama,
    read_hf_llama,
    save_hf,
    save_hf_gpt2,
    save_hf_llama,
)
from megatron_edu.launch import run
from megatron_edu.model import Llama, LlamaConfig

VOCAB, TOL = 100, 1e-5
# one batch of 16 positions: the inputs TOKENS[:, :-1], the next-token labels TOKENS[:, 1:]
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))

SHAPES = {
    # grouped-query attention, 2 query heads per kv head, an output layer of its own, and a
    # rope_theta that is not the default (a loader that dropped it would differ)
    "gqa": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=500.0),
    # SmolLM-like: the word table is the head; 3 query heads per kv head
    "tied": dict(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def _hf_model(transformers, shape: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=32,
                                      num_hidden_layers=2, **SHAPES[shape])
    return transformers.LlamaForCausalLM(config).eval()


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits[:, :-1]


@pytest.fixture(scope="module")
def saved(transformers, tmp_path_factory) -> dict[str, tuple[Path, Result]]:
    """Each shape: its directory and Hugging Face's own result (the loss: LlamaForCausalLM's,
    labels shifted inside)."""
    out = {}
    for shape in SHAPES:
        model = _hf_model(transformers, shape)
        path = tmp_path_factory.mktemp(f"hf_llama_{shape}")
        model.save_pretrained(path)
        result = model(TOKENS, labels=TOKENS)
        result.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}   # the tied head once
        out[shape] = path, Result(result.logits[:, :-1].detach(), result.loss.detach(), grads)
    return out


def _ours(model: Llama) -> Result:
    """The model's logits (gathered over tp), loss and gradients (whole, Hugging Face names)."""
    with torch.no_grad():
        logits = comm.all_gather(model(TOKENS[:, :-1]), model.tp_group)[..., :VOCAB]
    loss = model(TOKENS[:, :-1], TOKENS[:, 1:])
    loss.backward()
    grads = hf_llama.to_hf(model.full_state_dict(grads=True), model.config)
    return Result(logits, loss.detach(), grads)


def _at_tp(paths: dict[str, Path], out: Path) -> dict[str, Result]:
    """Each rank, each shape: the model's result at tp = the ranks; then save it back into
    out/shape."""
    grid = ParallelGrid(tp=dist.get_world_size())
    results = {}
    for shape, path in paths.items():
        model = load_hf_llama(path, grid)
        results[shape] = _ours(model)
        save_hf_llama(model, out / shape)
    dist.barrier()  # tp rank 0 has finished writing
    return results


# tp = 4 replicates each of the 2 kv heads on 2 ranks (the tied shape's 6 heads do not split 4)
LAYOUTS = [(2, "gqa"), (2, "tied"), (4, "gqa")]


@pytest.fixture(scope="module")
def parallel(saved, tmp_path_factory) -> dict[int, tuple[list[dict[str, Result]], Path]]:
    """By tp: every rank's results and the directory of the models it saved (one launch a tp)."""
    runs = {}
    for tp in sorted({tp for tp, _ in LAYOUTS}):
        out = tmp_path_factory.mktemp(f"exported_tp{tp}")
        paths = {shape: saved[shape][0] for t, shape in LAYOUTS if t == tp}
        runs[tp] = run(_at_tp, tp, paths, out), out
    return runs


@pytest.mark.parametrize("shape", SHAPES)
def test_serial_logits_loss_and_gradients_equal_hugging_face(saved, shape):
    path, theirs = saved[shape]
    assert_same(_ours(load_hf_llama(path)), theirs)


@pytest.mark.parametrize(("tp", "shape"), LAYOUTS)
def test_parallel_logits_loss_and_gradients_equal_hugging_face(saved, parallel, tp, shape):
    for rank in parallel[tp][0]:
        assert_same(rank[shape], saved[shape][1])


@pytest.mark.parametrize(("tp", "shape"), LAYOUTS)
def test_parallel_export_loads_in_hugging_face_with_the_same_logits(transformers, saved,
                                                                     parallel, tp, shape):
    exported = transformers.LlamaForCausalLM.from_pretrained(parallel[tp][1] / shape).eval()
    assert (_hf_logits(exported) - saved[shape][1].logits).abs().max() < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_serial_export_round_trips_through_hugging_face(transformers, saved, shape, tmp_path):
    path, theirs = saved[shape]
    save_hf_llama(load_hf_llama(path), tmp_path)
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert exported.config.tie_word_embeddings == (shape == "tied")
    assert (_hf_logits(exported) - theirs.logits).abs().max() < TOL
    assert read_hf_llama(tmp_path)[0] == read_hf_llama(path)[0]      # the same LlamaConfig


def test_a_layout_splitting_kv_heads_unevenly_is_refused_by_the_config():
    """6 heads in 2 kv groups at tp = 3: two heads a rank, but neither whole kv heads per rank
    nor whole replicas of one; refused before any rank builds anything."""
    config = LlamaConfig(hidden=96, num_heads=6, num_kv_heads=2, ffn_hidden=96)
    with pytest.raises(ValueError, match="num_kv_heads = 2 and tp = 3"):
        config.validate(tp=3)


def test_load_hf_and_save_hf_follow_the_model_type_and_the_gpt2_functions_refuse_a_llama(
        saved, tmp_path):
    path = saved["gqa"][0]
    model = load_hf(path)
    assert isinstance(model, Llama) and model.config.num_kv_heads == 2
    save_hf(model, tmp_path / "any")
    assert json.loads((tmp_path / "any" / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ValueError, match="holds a Hugging Face 'llama', not a 'gpt2'"):
        load_hf_gpt2(path)
    with pytest.raises(ValueError, match="only a GPT-2 .* a LlamaConfig"):
        save_hf_gpt2(model, tmp_path)


def _llama_json(saved) -> dict:
    return json.loads((saved["gqa"][0] / "config.json").read_text())


@pytest.mark.parametrize("key, value", [
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),       # transformers 4's spelling
    ("attention_bias", True),
    ("mlp_bias", True),
    ("head_dim", 32),
    ("hidden_act", "gelu"),
])
def test_an_unsupported_setting_is_refused_by_name(saved, key, value):
    named = "rope_scaling" if key.startswith("rope") else key
    with pytest.raises(ValueError, match=f"does not implement: .*'{named}'"):
        config_from_hf({**_llama_json(saved), key: value})


def test_a_transformers_4_config_reads_rope_theta_at_the_top(saved):
    hf = {**_llama_json(saved), "rope_theta": 123.0, "rope_scaling": None}
    del hf["rope_parameters"]
    assert config_from_hf(hf).rope_theta == 123.0
