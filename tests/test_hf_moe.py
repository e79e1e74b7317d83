"""Hugging Face mixtures of experts in and out: a Mixtral (grouped-query attention) and a
Qwen2-MoE (q, k, v biases, a gated shared expert two experts wide, top-k weights not
renormalised) give ``MixtralForCausalLM``'s and ``Qwen2MoeForCausalLM``'s logits, loss and every
gradient, serial, at ep = 2 and 4 (4 or 2 of the 8 experts a rank) and at tp 2 × ep 2; what each
layout exports loads in transformers with the same logits; ``evaluate --hf`` on each folder
gives transformers' summed loss; what the model does not do is refused by name.

The outside reference: randomly initialised tiny models, saved with ``save_pretrained`` —
nothing is downloaded. Only this process imports transformers; the ranks read the files
without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import Launches, Result, assert_same

from megatron_edu import comm, evaluate
from megatron_edu.data import zeroshot
from megatron_edu.data.tokenizer import Tokenizer
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.hf import config_from_hf, load_hf, read_hf, save_hf, save_hf_llama
from megatron_edu.model import Llama, LlamaConfig

VOCAB, TOL = 100, 1e-5
# one batch of 16 positions: the inputs TOKENS[:, :-1], the next-token labels TOKENS[:, 1:]
TOKENS = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))

SIZES = dict(vocab_size=VOCAB, max_position_embeddings=32, num_hidden_layers=2, hidden_size=64,
             num_attention_heads=4, num_experts_per_tok=2)
# shape: (transformers' model class, its config class, the config's own settings)
SHAPES = {
    # Mixtral-like: 2 kv heads, 8 experts of 32 units, a rope_theta that is not the default
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_key_value_heads=2, num_local_experts=8, intermediate_size=32,
                     rope_theta=500.0)),
    # Qwen1.5-MoE-like: as many kv heads as heads, q/k/v biases, a shared expert of 64 units
    # (2 experts' width) behind its sigmoid gate, the top-k weights not renormalised
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(num_key_value_heads=4, num_experts=8, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, intermediate_size=48)),
    # serial only: the biases of grouped-query attention's q and kv, renormalised weights
    "qwen2_moe_gqa": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                      dict(num_key_value_heads=2, num_experts=8, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, intermediate_size=48,
                           norm_topk_prob=True)),
}
PARALLEL_SHAPES = ("mixtral", "qwen2_moe")
# ep splits the 8 experts over the data-parallel ranks; tp 2 × ep 2 splits each expert too
LAYOUTS = {"ep2": Layout(dp=2, ep=2), "ep4": Layout(dp=4, ep=4),
           "tp2_ep2": Layout(tp=2, dp=2, ep=2)}


def _hf_class(transformers, shape: str):
    return getattr(transformers, SHAPES[shape][0])


def _hf_model(transformers, shape: str):
    """The shape's model, randomly initialised; its q, k, v biases (zero at initialisation)
    random too, so that a bias loaded into the wrong place shows."""
    _, config_class, own = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SIZES, **own)
    model = _hf_class(transformers, shape)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)
    return model.eval()


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits[:, :-1]


def _hf_grads(model, path: Path) -> dict[str, torch.Tensor]:
    """transformers' gradients under our names: written as a model's weights (save_pretrained
    writes one tensor per expert, as the weights' files) and read back as weights are."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad)
    model.save_pretrained(path)
    return read_hf(path)[1]


@pytest.fixture(scope="module")
def saved(transformers, tmp_path_factory) -> dict[str, tuple[Path, Result]]:
    """Each shape: its directory and transformers' own result (the loss with labels shifted
    inside)."""
    out = {}
    for shape in SHAPES:
        model = _hf_model(transformers, shape)
        path = tmp_path_factory.mktemp(f"hf_{shape}")
        model.save_pretrained(path)
        result = model(TOKENS, labels=TOKENS)
        result.loss.backward()
        grads = _hf_grads(model, tmp_path_factory.mktemp(f"hf_{shape}_grads"))
        out[shape] = path, Result(result.logits[:, :-1].detach(), result.loss.detach(), grads)
    return out


def _ours(model: Llama) -> Result:
    """The model's logits (gathered over tp), loss and gradients (whole). Every ep rank runs the
    same batch, so each expert's gradient sums ep copies of its tokens' (the data-parallel
    average divides by them in training): divided by ep here."""
    with torch.no_grad():
        logits = comm.all_gather(model(TOKENS[:, :-1]), model.tp_group)[..., :VOCAB]
    loss = model(TOKENS[:, :-1], TOKENS[:, 1:])
    loss.backward()
    ep = model.expert_groups.ep.size
    grads = {name: grad / ep if ".experts." in name else grad
             for name, grad in model.full_state_dict(grads=True).items()}
    return Result(logits, loss.detach(), grads)


def _at(layout: Layout, paths: dict[str, Path], out: Path) -> dict[str, Result]:
    """Each rank, each shape: the model's result at ``layout``; then save it into out/shape
    (every rank gathers, one writes)."""
    grid = ParallelGrid(layout)
    results = {}
    for shape, path in paths.items():
        model = load_hf(path, grid)
        results[shape] = _ours(model)
        save_hf(model, out / shape)
    dist.barrier()  # the writer has finished
    return results


@pytest.fixture(scope="module")
def parallel(saved, tmp_path_factory) -> tuple[Launches, Path]:
    """Every layout's ranks' results (one launch a world size) and where each exported."""
    paths = {shape: saved[shape][0] for shape in PARALLEL_SHAPES}
    out = tmp_path_factory.mktemp("exported")
    return Launches({name: (layout.world_size, _at, (layout, paths, out / name))
                     for name, layout in LAYOUTS.items()}), out


@pytest.mark.parametrize("shape", SHAPES)
def test_serial_logits_loss_and_gradients_equal_transformers(saved, shape):
    path, theirs = saved[shape]
    assert_same(_ours(load_hf(path)), theirs)


@pytest.mark.parametrize("shape", PARALLEL_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_logits_loss_and_gradients_equal_transformers(saved, parallel, layout,
                                                                       shape):
    for rank in parallel[0][layout]:
        assert_same(rank[shape], saved[shape][1])


@pytest.mark.parametrize("shape", PARALLEL_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_export_loads_in_transformers_with_the_same_logits(
        transformers, saved, parallel, layout, shape):
    assert len(parallel[0][layout]) == LAYOUTS[layout].world_size   # the launch that wrote it
    exported = _hf_class(transformers, shape).from_pretrained(parallel[1] / layout / shape)
    assert (_hf_logits(exported.eval()) - saved[shape][1].logits).abs().max() < TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_serial_export_round_trips_through_transformers(transformers, saved, shape, tmp_path):
    path, theirs = saved[shape]
    save_hf(load_hf(path), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [SHAPES[shape][0]]
    exported = _hf_class(transformers, shape).from_pretrained(tmp_path).eval()
    assert (_hf_logits(exported) - theirs.logits).abs().max() < TOL
    assert read_hf(tmp_path)[0] == read_hf(path)[0]                  # the same LlamaConfig


WIKI = " = Experts = \n The router sends each token to two of eight experts , and the " \
       "shared expert sees every token . \n"


@pytest.mark.parametrize("shape, layout", [("mixtral", ["--nproc", "2"]),
                                           ("qwen2_moe", ["--nproc", "2", "--tp", "2"])])
def test_evaluate_hf_gives_transformers_summed_loss(transformers, saved, shape, layout,
                                                    tmp_path, capsys):
    """WikiText-103's perplexity on the folder (with a word-level tokenizer.json): the text in
    one window, every token after the first scored; the summed loss is transformers'."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = Path(shutil.copytree(saved[shape][0], tmp_path / "hf"))
    text = zeroshot.wikitext_detokenize(WIKI)
    words = ["<unk>", "</s>", *sorted(set(text.split()))]
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    word_level.save(str(folder / "tokenizer.json"))
    (tmp_path / "wiki.test.tokens").write_text(WIKI)
    assert evaluate.main(["--task", "wikitext103", "--data", str(tmp_path), "--hf",
                          str(folder), *layout]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = torch.tensor([Tokenizer.load(folder).encode(text)])
    assert result["tokens"] == ids.shape[1] <= 32                   # one window of the model's
    model = _hf_class(transformers, shape).from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
    assert result["loss_sum"] == pytest.approx(theirs, abs=1e-4)


def _config_json(saved, shape: str) -> dict:
    return json.loads((saved[shape][0] / "config.json").read_text())


@pytest.mark.parametrize("shape, key, value, named", [
    ("mixtral", "sliding_window", 16, "sliding_window = 16 .* seq_len = 32"),
    ("mixtral", "router_jitter_noise", 0.1, "does not implement: .*'router_jitter_noise'"),
    ("mixtral", "rope_parameters", {"rope_type": "yarn", "factor": 4.0},
     "does not implement: .*'rope_scaling'"),
    ("qwen2_moe", "decoder_sparse_step", 2, "does not implement: .*'decoder_sparse_step'"),
    ("qwen2_moe", "mlp_only_layers", [1], "does not implement: .*'mlp_only_layers'"),
    ("qwen2_moe", "use_sliding_window", True, "does not implement: .*'use_sliding_window'"),
    ("qwen2_moe", "shared_expert_intermediate_size", 48,
     "shared_expert_intermediate_size = 48 is not a multiple of moe_intermediate_size = 32"),
])
def test_an_unsupported_setting_is_refused_by_name(saved, shape, key, value, named):
    with pytest.raises(ValueError, match=named):
        config_from_hf({**_config_json(saved, shape), key: value})


def test_a_sliding_window_no_shorter_than_the_sequence_is_no_window(saved):
    hf = {**_config_json(saved, "mixtral"), "sliding_window": 16}
    assert config_from_hf(hf, seq_len=16).seq_len == 16
    assert config_from_hf({**hf, "sliding_window": 32}).seq_len == 32


def test_the_balance_coefficient_and_the_routing_are_read_from_the_config(saved):
    mixtral = config_from_hf({**_config_json(saved, "mixtral"), "router_aux_loss_coef": 0.02})
    qwen = config_from_hf(_config_json(saved, "qwen2_moe"))
    assert (mixtral.moe_aux_loss, mixtral.moe_group, mixtral.moe_norm_topk) == (
        0.02, "microbatch", True)
    assert (qwen.moe_shared_experts, qwen.moe_shared_gate, qwen.moe_norm_topk,
            qwen.qkv_bias, qwen.bias) == (2, True, False, True, False)


MOE = dict(vocab_size=VOCAB, seq_len=16, num_layers=1, hidden=64, num_heads=4, num_kv_heads=2,
           ffn_hidden=32, moe_experts=4, moe_ffn_hidden=16)


@pytest.mark.parametrize("field, value", [("moe_norm_topk", False), ("moe_capacity", 1.25),
                                          ("moe_bias_rate", 1e-3), ("moe_router", "sigmoid")])
def test_a_model_no_family_expresses_is_refused_with_each_familys_reason(tmp_path, field,
                                                                          value):
    model = Llama(LlamaConfig(**MOE, **{field: value}))
    with pytest.raises(ValueError, match=f"no Hugging Face format expresses .*Llama cannot "
                                         f"express .*'moe_experts'.*Mixtral .*'{field}'"):
        save_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_experts_are_not_saved_as_a_dense_llama(tmp_path):
    model = Llama(LlamaConfig(**MOE))
    with pytest.raises(ValueError, match="Llama cannot express these settings: .*'moe_experts'"):
        save_hf_llama(model, tmp_path)
    save_hf(model, tmp_path)                                         # a Mixtral
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mixtral"
