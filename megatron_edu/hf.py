"""Hugging Face models in and out, at any tensor-parallel size: GPT-2 (``GPT2LMHeadModel``),
Llama (``LlamaForCausalLM``, whose mapping is ``hf_llama.py``), and the mixtures of experts
Mixtral (``MixtralForCausalLM``) and Qwen2-MoE (``Qwen2MoeForCausalLM``; ``hf_moe.py``), at any
expert-parallel size too.

``load_hf(path, grid)`` reads a directory written by ``save_pretrained`` (config.json +
model.safetensors, sharded safetensors, or pytorch_model.bin) straight from the files — loading
needs neither ``transformers`` nor a network — and returns the model config.json's model_type
names, a ``GPT`` ("gpt2") or a ``Llama`` ("llama", "mixtral", "qwen2_moe"), whose logits equal
Hugging Face's. ``save_hf(model, path)`` writes the format that expresses the model back, for
``from_pretrained``. ``load_hf_gpt2``, ``load_hf_llama`` (and their ``read_`` and ``save_``) do
the same for one family, refusing the other's directories by name.

What differs between GPT-2's layout and this package's, and what is done about it (Llama's:
``hf_llama.py``):

* Conv1D: Hugging Face's GPT-2 stores linear weights [in, out] (y = x·W + b); nn.Linear and this
  package store [out, in] → transposed.
* The fused qkv: c_attn is [h, 3h] with the output columns as q | k | v blocks (heads contiguous
  inside each). Here qkv is [3h, h] grouped per head (q, k, v of head 0, then head 1, …) so that
  a column split gives each tensor-parallel rank whole heads (model/transformer.py) → permuted.
* The tied head: lm_head.weight is wte.weight; here the output layer reads embedding.word.weight.
* gelu_new is GeLU's tanh approximation, F.gelu(approximate="tanh"); eps is layer_norm_epsilon.
* The vocabulary (50,257) is padded to a multiple of 128·tp with zero rows, masked out of the
  logits; saving trims it back.

Every function works on whole tensors (``GPT.full_state_dict`` / ``load_full_state_dict``), so
any tp and ep work: loading slices each tensor for this rank and keeps its experts; saving
gathers the shards and the experts (a collective: every tp and ep rank calls it, the rank first
in both writes; under data parallelism beyond ep call it on one replica).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_edu import hf_llama, hf_moe
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import build_model
from megatron_edu.model.config import GPTConfig, LlamaConfig
from megatron_edu.model.gpt import GPT
from megatron_edu.model.llama import Llama

__all__ = ["load_hf", "read_hf", "save_hf", "config_from_hf", "load_hf_gpt2", "read_hf_gpt2",
           "save_hf_gpt2", "load_hf_llama", "read_hf_llama", "save_hf_llama"]

Tensors = dict[str, torch.Tensor]

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # two names of the same function


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The configuration a Hugging Face config.json describes: a GPTConfig for model_type
    "gpt2" (also when it names none), a LlamaConfig for "llama", "mixtral" and "qwen2_moe"; a
    ValueError naming any setting the model does not implement. ``overrides`` replace config
    fields."""
    return _format(hf.get("model_type", "gpt2")).config_from_hf(hf, **overrides)


def read_hf(path: str | Path, **overrides: Any) -> tuple[GPTConfig, Tensors]:
    """A saved Hugging Face model's config and whole tensors under this package's names, of any
    family this package reads: load them into any stage of any layout with
    ``load_full_state_dict`` (evaluation does)."""
    return _read(Path(path), None, overrides)


def load_hf(path: str | Path, grid: ParallelGrid | None = None, **overrides: Any) -> GPT:
    """The model a saved Hugging Face directory holds, a GPT or a Llama (with experts for Mixtral
    and Qwen2-MoE) as its model_type says, with its weights (this rank's slices under tp, its
    experts under ep). ``overrides`` replace config fields, e.g. ``dropout=0.0``."""
    return _built(*read_hf(path, **overrides), grid)


def save_hf(model: GPT, path: str | Path) -> None:
    """Write ``model`` as a Hugging Face directory (config.json + model.safetensors) of the first
    family that expresses it: GPT-2, Llama, Mixtral (experts), Qwen2-MoE (experts and a shared
    one). The model must be whole (one pipeline stage holding every layer); under tp and ep
    every tp and ep rank must call this (the shards and experts are gathered), one writes."""
    formats = [f for f in _FORMATS.values() if type(model.config) is f.config_class]
    if not formats:
        raise ValueError(f"no Hugging Face format for a {type(model.config).__name__}: "
                         f"GPT-2 (GPTConfig) and the Llama family (LlamaConfig) save")
    refusals = []
    for fmt in formats:
        try:
            fmt.hf_config(model.config)
        except ValueError as refused:
            refusals.append(str(refused))
            continue
        return _write(model, Path(path), fmt)
    raise ValueError("no Hugging Face format expresses this model: " + "; ".join(refusals))


def load_hf_gpt2(path: str | Path, grid: ParallelGrid | None = None, **overrides: Any) -> GPT:
    """A GPT holding the weights of a saved Hugging Face GPT-2 (this rank's slices under tp).

    ``overrides`` replace config fields, e.g. ``dropout=0.0`` or ``recompute=True``.
    """
    return _built(*read_hf_gpt2(path, **overrides), grid)


def read_hf_gpt2(path: str | Path, **overrides: Any) -> tuple[GPTConfig, Tensors]:
    """A saved Hugging Face GPT-2's config and whole tensors under this package's names: load
    them into any stage of any layout with ``GPT.load_full_state_dict`` (evaluation does)."""
    return _read(Path(path), "gpt2", overrides)


def save_hf_gpt2(model: GPT, path: str | Path) -> None:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors).

    The model must be whole (one pipeline stage holding every layer); under tp every tp rank
    must call this (the shards are gathered) and tp rank 0 writes.
    """
    _write(model, Path(path), _FORMATS["gpt2"])


def load_hf_llama(path: str | Path, grid: ParallelGrid | None = None,
                  **overrides: Any) -> Llama:
    """A Llama holding the weights of a saved Hugging Face Llama (``LlamaForCausalLM``; this
    rank's slices under tp). ``overrides`` replace config fields."""
    return _built(*read_hf_llama(path, **overrides), grid)


def read_hf_llama(path: str | Path, **overrides: Any) -> tuple[LlamaConfig, Tensors]:
    """A saved Hugging Face Llama's config and whole tensors under this package's names."""
    return _read(Path(path), "llama", overrides)


def save_hf_llama(model: Llama, path: str | Path) -> None:
    """Write ``model`` as a Hugging Face Llama directory (config.json + model.safetensors) that
    ``LlamaForCausalLM.from_pretrained`` loads; whole, every tp rank calling (as ``save_hf``)."""
    _write(model, Path(path), _FORMATS["llama"])


@dataclass(frozen=True)
class _Format:
    """One Hugging Face model family: the config class it becomes here and the four maps
    between the two (config.json ↔ config, their tensors ↔ ours, whole)."""

    config_class: type[GPTConfig]
    config_from_hf: Callable[..., GPTConfig]            # config.json, **overrides → config
    hf_config: Callable[[Any], dict[str, Any]]          # config → config.json (or ValueError)
    from_hf: Callable[[Tensors, Any], Tensors]          # their tensors, config → ours
    to_hf: Callable[[Tensors, Any], Tensors]            # ours, config → theirs


def _format(model_type: str) -> _Format:
    if model_type not in _FORMATS:
        raise ValueError(f"a Hugging Face {model_type!r} model: this package reads "
                         f"{sorted(_FORMATS)}")
    return _FORMATS[model_type]


def _built(config: GPTConfig, state: Tensors, grid: ParallelGrid | None) -> GPT:
    model = build_model(config, grid)
    model.load_full_state_dict(state)
    return model


def _read(path: Path, family: str | None, overrides: dict[str, Any]) -> tuple[GPTConfig, Tensors]:
    """config.json and the tensors of ``path`` mapped by its model_type's format; ``family``:
    the model_type expected (None: any)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    hf = json.loads((path / "config.json").read_text())
    model_type = hf.get("model_type", "gpt2")
    if family is not None and model_type != family:
        raise ValueError(f"{path} holds a Hugging Face {model_type!r}, not a {family!r}: "
                         f"load_hf and read_hf read either")
    fmt = _format(model_type)
    config = fmt.config_from_hf(hf, **overrides)
    return config, fmt.from_hf(_read_weights(path), config)


def _write(model: GPT, path: Path, fmt: _Format) -> None:
    """Gather ``model``'s tensors, map them by ``fmt``; tp rank 0 writes the directory."""
    config = model.config
    hf_config = fmt.hf_config(config)              # refuses what the format cannot express
    if not (model.first and model.last and list(model.layers) == list(range(config.num_layers))):
        raise ValueError("saving as Hugging Face needs the whole model; gather pipeline stages "
                         "first")
    state = fmt.to_hf(model.full_state_dict(), config)
    if model.tp_group.rank != 0 or model.expert_groups.ep.rank != 0:   # ep ranks: one writes
        return
    path.mkdir(parents=True, exist_ok=True)
    # contiguous copies: safetensors refuses views that share memory (q, k, v of one qkv)
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
               for k, v in state.items()}
    _safetensors().save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


# --- reading and writing files ----------------------------------------------------------------

def _safetensors():
    try:
        import safetensors.torch
    except ImportError as error:
        raise ImportError("reading or writing model.safetensors needs the safetensors package: "
                          "pip install safetensors (it comes with transformers)") from error
    return safetensors.torch


def _read_weights(path: Path) -> Tensors:
    """All tensors of the checkpoint, under the names its files give them."""
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = [path / name for name in sorted(set(index["weight_map"].values()))]
    elif (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model.safetensors(.index.json) or pytorch_model.bin in {path}")
    state = {}
    for file in files:
        state.update(_safetensors().load_file(str(file)))
    return state


# --- GPT-2: the config and the name and layout mapping ------------------------------------------

def _gpt2_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
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


def _gpt2_hf_config(config: GPTConfig) -> dict[str, Any]:
    """config.json for ``GPT2LMHeadModel``; a ValueError unless ``config`` is a GPT-2's."""
    unlike = {"causal": not config.causal, "ln_placement": config.ln_placement != "rearranged",
              "norm": config.norm != "layernorm", "mlp": config.mlp != "gelu",
              "positions": config.positions != "learned", "bias": not config.bias,
              "num_kv_heads": config.num_kv_heads != config.num_heads,
              "tie_embeddings": not config.tie_embeddings}
    bad = {key: getattr(config, key) for key, is_bad in unlike.items() if is_bad}
    if type(config) is not GPTConfig or bad:
        raise ValueError(f"only a GPT-2 (causal, pre-LN, GPTConfig's defaults for the block's "
                         f"parts) saves as a Hugging Face GPT-2: a {type(config).__name__}"
                         + (f" with {bad}" if bad else ""))
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.seq_len,
        "n_embd": config.hidden, "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": config.ffn_hidden, "activation_function": "gelu_new",
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layernorm_eps, "initializer_range": config.init_std,
        "tie_word_embeddings": True,
    }


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


def _gpt2_from_hf(hf: Tensors, config: GPTConfig) -> Tensors:
    """GPT2LMHeadModel's tensors (or GPT2Model's, without the "transformer." prefix) → ours."""
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    state = {}
    for ours, theirs, conv in _pairs(config):
        if theirs not in hf:
            raise ValueError(f"the checkpoint has no tensor {theirs!r} (for {ours})")
        t = hf[theirs].float()
        t = t.t() if conv else t
        state[ours] = _qkv_from_hf(t, config.num_heads) if ".qkv." in ours else t
    return state


def _gpt2_to_hf(state: Tensors, config: GPTConfig) -> Tensors:
    hf = {}
    for ours, theirs, conv in _pairs(config):
        t = _qkv_to_hf(state[ours], config.num_heads) if ".qkv." in ours else state[ours]
        hf[f"transformer.{theirs}"] = t.t() if conv else t
    return hf


# the families read and written, by config.json's model_type
_FORMATS = {
    "gpt2": _Format(GPTConfig, _gpt2_config_from_hf, _gpt2_hf_config, _gpt2_from_hf, _gpt2_to_hf),
    "llama": _Format(LlamaConfig, hf_llama.config_from_hf, hf_llama.hf_config, hf_llama.from_hf,
                     hf_llama.to_hf),
    **{family.model_type: _Format(LlamaConfig, family.config_from_hf, family.hf_config,
                                  family.from_hf, family.to_hf)
       for family in (hf_moe.MIXTRAL, hf_moe.QWEN2_MOE)},
}
