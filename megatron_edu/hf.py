"""Hugging Face GPT-2 weights in and out, at any tensor-parallel size.

``load_hf_gpt2(path, grid)`` reads a directory written by ``GPT2LMHeadModel.save_pretrained``
(config.json + model.safetensors, sharded safetensors, or pytorch_model.bin) straight from the
files — loading needs neither ``transformers`` nor a network — and returns a ``GPT`` whose logits
equal Hugging Face's. ``save_hf_gpt2(model, path)`` writes the same format back, for
``GPT2LMHeadModel.from_pretrained``.

What differs between the two layouts, and what is done about it:

* Conv1D: Hugging Face's GPT-2 stores linear weights [in, out] (y = x·W + b); nn.Linear and this
  package store [out, in] → transposed.
* The fused qkv: c_attn is [h, 3h] with the output columns as q | k | v blocks (heads contiguous
  inside each). Here qkv is [3h, h] grouped per head (q, k, v of head 0, then head 1, …) so that
  a column split gives each tensor-parallel rank whole heads (model/transformer.py) → permuted.
* The tied head: lm_head.weight is wte.weight; here the output layer reads embedding.word.weight.
* gelu_new is GeLU's tanh approximation, F.gelu(approximate="tanh"); eps is layer_norm_epsilon.
* The vocabulary (50,257) is padded to a multiple of 128·tp with zero rows, masked out of the
  logits; saving trims it back.

Both functions work on whole tensors (``GPT.full_state_dict`` / ``load_full_state_dict``), so
any tp works: loading slices each tensor for this rank; saving gathers the shards (a collective:
every tp rank calls it, tp rank 0 writes; under data parallelism call it on one replica).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_edu.grid import ParallelGrid
from megatron_edu.model.config import GPTConfig
from megatron_edu.model.gpt import GPT

__all__ = ["load_hf_gpt2", "save_hf_gpt2", "config_from_hf", "read_hf_gpt2"]

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # two names of the same function


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """A GPTConfig from a Hugging Face GPT-2 config.json, refusing what this GPT does not do."""
    unsupported = {
        "activation_function": hf.get("activation_function", "gelu_new") not in _GELU_TANH,
        "scale_attn_weights": not hf.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": hf.get("scale_attn_by_inverse_layer_idx", False),
        "tie_word_embeddings": not hf.get("tie_word_embeddings", True),
    }
    bad = {key: hf.get(key) for key, is_bad in unsupported.items() if is_bad}
    if bad:
        raise ValueError(f"this GPT-2 checkpoint uses settings the model does not implement: {bad}")
    fields = dict(vocab_size=hf["vocab_size"], seq_len=hf["n_positions"], num_layers=hf["n_layer"],
                  hidden=hf["n_embd"], num_heads=hf["n_head"], ffn_hidden=hf.get("n_inner") or 0,
                  dropout=hf.get("resid_pdrop", 0.1),
                  layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
                  init_std=hf.get("initializer_range", 0.02))
    return GPTConfig(**{**fields, **overrides})


def load_hf_gpt2(path: str | Path, grid: ParallelGrid | None = None, **overrides: Any) -> GPT:
    """A GPT holding the weights of a saved Hugging Face GPT-2 (this rank's slices under tp).

    ``overrides`` replace config fields, e.g. ``dropout=0.0`` or ``recompute=True``.
    """
    config, state = read_hf_gpt2(path, **overrides)
    model = GPT(config, grid)
    model.load_full_state_dict(state)
    return model


def read_hf_gpt2(path: str | Path, **overrides: Any) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A saved Hugging Face GPT-2's config and whole tensors under this package's names: load
    them into any stage of any layout with ``GPT.load_full_state_dict`` (evaluation does)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    config = config_from_hf(json.loads((path / "config.json").read_text()), **overrides)
    return config, _from_hf(_read_weights(path), config)


def save_hf_gpt2(model: GPT, path: str | Path) -> None:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors).

    The model must be whole (one pipeline stage holding every layer); under tp every tp rank
    must call this (the shards are gathered) and tp rank 0 writes.
    """
    config = model.config
    if type(config) is not GPTConfig or not config.causal or config.ln_placement != "rearranged":
        raise ValueError("only a GPT-2 (causal, pre-LN) saves as a Hugging Face GPT-2")
    if not (model.first and model.last and list(model.layers) == list(range(config.num_layers))):
        raise ValueError("save_hf_gpt2 needs the whole model; gather pipeline stages first")
    state = _to_hf(model.full_state_dict(), config)
    if model.tp_group.rank != 0:
        return
    save_file = _safetensors().save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_hf_config(config), indent=2) + "\n")


# --- reading and writing files ----------------------------------------------------------------

def _safetensors():
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError("reading or writing model.safetensors needs the safetensors package: "
                          "pip install safetensors (it comes with transformers)") from error
    return safetensors.torch


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, with the "transformer." prefix removed."""
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = [path / name for name in sorted(set(index["weight_map"].values()))]
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k.removeprefix("transformer."): v for k, v in state.items()}
    else:
        raise FileNotFoundError(f"no model.safetensors(.index.json) or pytorch_model.bin in {path}")
    state = {}
    for file in files:
        state.update(_safetensors().load_file(str(file)))
    return {k.removeprefix("transformer."): v for k, v in state.items()}


def _hf_config(config: GPTConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.seq_len,
        "n_embd": config.hidden, "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": config.ffn_hidden, "activation_function": "gelu_new",
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layernorm_eps, "initializer_range": config.init_std,
        "tie_word_embeddings": True,
    }


# --- the name and layout mapping ----------------------------------------------------------------

def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[3h, …] as q | k | v blocks → [3h, …] grouped per head (q, k, v of head 0, head 1, …)."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


_BLOCK_PAIRS = (("ln1", "ln_1", False), ("ln2", "ln_2", False),
                ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))


def _pairs(config: GPTConfig) -> list[tuple[str, str, bool]]:
    """(our name, Hugging Face name, is it a Conv1D weight stored [in, out]) for every tensor."""
    pairs = [("embedding.word.weight", "wte.weight", False),
             ("embedding.position.weight", "wpe.weight", False),
             ("ln_f.weight", "ln_f.weight", False), ("ln_f.bias", "ln_f.bias", False)]
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"h.{i}."
        for mine, hf, conv in _BLOCK_PAIRS:
            pairs.append((f"{ours}{mine}.weight", f"{theirs}{hf}.weight", conv))
            pairs.append((f"{ours}{mine}.bias", f"{theirs}{hf}.bias", False))
    return pairs


def _from_hf(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    state = {}
    for ours, theirs, conv in _pairs(config):
        if theirs not in hf:
            raise ValueError(f"the checkpoint has no tensor {theirs!r} (for {ours})")
        t = hf[theirs].float()
        t = t.t() if conv else t
        state[ours] = _qkv_from_hf(t, config.num_heads) if ".qkv." in ours else t
    return state


def _to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    hf = {}
    for ours, theirs, conv in _pairs(config):
        t = _qkv_to_hf(state[ours], config.num_heads) if ".qkv." in ours else state[ours]
        hf[f"transformer.{theirs}"] = t.t() if conv else t
    return hf
