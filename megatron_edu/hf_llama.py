"""How a Hugging Face Llama (``LlamaForCausalLM``) maps onto this package's ``Llama``: its
config.json onto a ``LlamaConfig`` and its tensors onto whole tensors under this package's names,
both ways. No files here: ``megatron_edu.hf`` reads and writes the directories (``load_hf``,
``load_hf_llama``, ``save_hf_llama``) with these four functions. Mixtral and Qwen2-MoE are this
decoder with experts in place of the MLP: ``hf_moe.py`` maps them with ``decoder_fields``,
``decoder_hf_config`` and ``decoder_pairs``.

What differs between the two layouts, and what is done about it:

* The attention projections: Hugging Face keeps q_proj [a·d, h], k_proj and v_proj [g·d, h]
  (a heads, g kv heads, d = head_dim, each [out, in] like nn.Linear). Here, with g < a, q_proj
  as it is and one kv [2g·d, h], per kv head j its k_j then v_j (``attention.GroupedQKV``: kv
  may be cut fewer ways than q); with g = a one qkv [3h, h], per head its q, k, v (GPT-2's
  layout) → concatenated per group, and split back. Their biases, where only q, k and v have
  them (Qwen2's ``qkv_bias``), the same way.
* The MLP's gate_proj and up_proj, [f, h] each, are one fc [2f, h] with the two interleaved by
  row (row 2i: gate_proj row i; row 2i + 1: up_proj row i; ``fused.bias_swiglu``), so that a
  column split keeps each unit's gate and up on the same rank → interleaved, and apart again.
* Rotary positions: both rotate the planes (i, i + d/2) ("rotate half"), so q_proj and k_proj
  load as they are; no permutation (Meta's original checkpoints pair (2i, 2i + 1) instead, and
  Hugging Face's conversion script permutes them once, on the way in).
* The names: model.embed_tokens / layers.{i}.input_layernorm, self_attn.o_proj,
  post_attention_layernorm, mlp.down_proj / model.norm / lm_head are embedding.word /
  blocks.{i}.ln1, attn.proj, ln2, mlp.proj / ln_f / output. Tied (tie_word_embeddings, SmolLM):
  there is no output layer, the word table is the head, and lm_head.weight, if a file holds it,
  is ignored (``save_pretrained`` leaves it out).
* The vocabulary is padded to a multiple of 128·tp with zero rows here, masked out of the
  logits; ``full_state_dict`` trims it back, so these tensors are always vocab_size rows.

A Llama the model does not implement is refused by name: rope scaling (Llama 3.1's "llama3",
YaRN, …), biases (attention_bias, mlp_bias), a head_dim other than hidden/heads, an activation
other than SiLU, attention dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_edu.model.config import LlamaConfig

__all__ = ["config_from_hf", "hf_config", "from_hf", "to_hf", "decoder_fields",
           "decoder_hf_config", "decoder_pairs", "tensors_from_hf", "tensors_to_hf"]

_SILU = ("silu", "swish")  # two names of the same function

Tensors = dict[str, torch.Tensor]
Join = Callable[..., torch.Tensor]                              # theirs…, config → ours
Split = Callable[[torch.Tensor, LlamaConfig], list[torch.Tensor]]  # ours, config → theirs
Pair = tuple[str, tuple[str, ...], Join, Split]                 # our name, theirs, join, split


def decoder_fields(hf: dict[str, Any], family: str, **refused: bool) -> dict[str, Any]:
    """The LlamaConfig fields of a Llama-like config.json (Llama, Mixtral, Qwen2-MoE), ffn_hidden
    from intermediate_size; a ValueError naming every setting the model does not implement: the
    ones all refuse (rope scaling, a head_dim other than hidden/heads, an activation other than
    SiLU, attention dropout) and ``refused``, the ``family``'s own (config.json key → is it set).

    Rotary settings are read in both spellings: ``rope_parameters`` (transformers 5) and
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    scaled = [rope for rope in (params, scaling)         # any rope_type but "default"
              if rope.get("rope_type", rope.get("type", "default")) != "default"]
    unsupported = {
        "rope_scaling": bool(scaled),
        "head_dim": (hf.get("head_dim") or hidden // heads) * heads != hidden,
        "hidden_act": hf.get("hidden_act", "silu") not in _SILU,
        "attention_dropout": hf.get("attention_dropout", 0.0) != 0.0,
        **refused,
    }
    bad = {key: scaled[0] if key == "rope_scaling" else hf.get(key)
           for key, is_bad in unsupported.items() if is_bad}
    if bad:
        raise ValueError(f"this {family} checkpoint uses settings the model does not implement: "
                         f"{bad}")
    return dict(vocab_size=hf["vocab_size"], seq_len=hf["max_position_embeddings"],
                num_layers=hf["num_hidden_layers"], hidden=hidden, num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                ffn_hidden=hf["intermediate_size"], layernorm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                init_std=hf.get("initializer_range", 0.02))


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """A LlamaConfig from a Hugging Face Llama config.json, refusing what the model does not do
    (``decoder_fields``, and biases: attention_bias, mlp_bias)."""
    fields = decoder_fields(hf, "Llama", attention_bias=bool(hf.get("attention_bias", False)),
                            mlp_bias=bool(hf.get("mlp_bias", False)))
    return LlamaConfig(**{**fields, **overrides})


def decoder_hf_config(config: LlamaConfig, architecture: str, model_type: str,
                      **unlike: bool) -> dict[str, Any]:
    """The config.json keys every Llama-like ``architecture`` shares, rotary settings in both
    spellings (transformers 5 reads ``rope_parameters``, 4 ``rope_theta``); a ValueError for a
    config it cannot express: not a LlamaConfig, a block unlike Llama's, or ``unlike``, the
    family's own (our field → does it differ)."""
    family = architecture.removesuffix("ForCausalLM")
    if type(config) is not LlamaConfig:
        raise ValueError(f"only a LlamaConfig saves as a Hugging Face {family}, got "
                         f"{type(config).__name__}")
    unlike = {"bias": config.bias, "norm": config.norm != "rmsnorm",
              "mlp": config.mlp != "swiglu", "positions": config.positions != "rope",
              "causal": not config.causal, "ln_placement": config.ln_placement != "rearranged",
              **unlike}
    bad = {key: getattr(config, key) for key, is_bad in unlike.items() if is_bad}
    if bad:
        raise ValueError(f"a Hugging Face {family} cannot express these settings: {bad}")
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.seq_len,
        "hidden_size": config.hidden, "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.layernorm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_dropout": 0.0, "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
    }


def hf_config(config: LlamaConfig) -> dict[str, Any]:
    """The config.json of ``config`` for ``LlamaForCausalLM`` (``decoder_hf_config``); a
    ValueError for a config that a Hugging Face Llama cannot express (experts, q/k/v biases
    without the others among them)."""
    return {**decoder_hf_config(config, "LlamaForCausalLM", "llama",
                                moe_experts=config.moe_experts > 0, qkv_bias=config.qkv_bias),
            "attention_bias": False, "mlp_bias": False}


# --- the name and layout mapping ----------------------------------------------------------------

def _per_group(*parts: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """q [a·d, …], k and v [g·d, …] (or k and v alone; weights [·, h] or biases) → per kv head
    j, its rows of each in turn: its n query heads, k_j, v_j."""
    g, rest = config.num_kv_heads, parts[0].shape[1:]
    return torch.cat([t.reshape(g, -1, *rest) for t in parts], dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv: torch.Tensor, config: LlamaConfig) -> list[torch.Tensor]:
    return _ungroup(qkv, config, config.num_heads // config.num_kv_heads, 1, 1)   # q, k, v


def _kv_to_hf(kv: torch.Tensor, config: LlamaConfig) -> list[torch.Tensor]:
    return _ungroup(kv, config, 1, 1)                                             # k, v


def _ungroup(x: torch.Tensor, config: LlamaConfig, *heads: int) -> list[torch.Tensor]:
    """``_per_group`` undone, ``heads`` the heads of each part in a group."""
    g, d, rest = config.num_kv_heads, config.head_dim, x.shape[1:]
    groups = x.reshape(g, sum(heads) * d, *rest).split([n * d for n in heads], dim=1)
    return [t.reshape(-1, *rest) for t in groups]


def _fc_from_hf(gate: torch.Tensor, up: torch.Tensor, *,
                config: LlamaConfig) -> torch.Tensor:
    """gate, up [f, h] → [2f, h] with row 2i = gate row i, row 2i + 1 = up row i."""
    return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[-1])


def _fc_to_hf(fc: torch.Tensor, config: LlamaConfig) -> list[torch.Tensor]:
    return list(fc.reshape(-1, 2, fc.shape[-1]).unbind(1))       # gate, up


def _one(t: torch.Tensor, *, config: LlamaConfig) -> torch.Tensor:
    return t


def _one_to_hf(t: torch.Tensor, config: LlamaConfig) -> list[torch.Tensor]:
    return [t]


def _attention(config: LlamaConfig, part: str) -> list[Pair]:
    """The q, k, v projections' ``part`` ("weight", or "bias" with ``qkv_bias``): q and kv apart
    under grouped-query attention (``GroupedQKV``), else one tensor per head q | k | v
    (``attention.qkv_projection`` chooses the same way)."""
    q, k, v = (f"self_attn.{x}_proj.{part}" for x in "qkv")
    if config.num_kv_heads < config.num_heads:
        return [(f"attn.qkv.q_{part}", (q,), _one, _one_to_hf),
                (f"attn.qkv.kv_{part}", (k, v), _per_group, _kv_to_hf)]
    return [(f"attn.qkv.{part}", (q, k, v), _per_group, _qkv_to_hf)]


# the rest of a block: (our name, Hugging Face's names, join them into ours, split ours)
_BLOCK = (("ln1.weight", ("input_layernorm.weight",), _one, _one_to_hf),
          ("attn.proj.weight", ("self_attn.o_proj.weight",), _one, _one_to_hf),
          ("ln2.weight", ("post_attention_layernorm.weight",), _one, _one_to_hf))
# Llama's MLP (Mixtral's and Qwen2-MoE's experts: ``hf_moe.py``)
_MLP = (("mlp.fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), _fc_from_hf, _fc_to_hf),
        ("mlp.proj.weight", ("mlp.down_proj.weight",), _one, _one_to_hf))


def decoder_pairs(config: LlamaConfig, mlp: Sequence[Pair]) -> list[Pair]:
    """(our name, Hugging Face names, join, split) for every tensor of a Llama-like model whose
    blocks' MLP is ``mlp`` (names under blocks.{i}. and model.layers.{i}.)."""
    pairs = [("embedding.word.weight", ("model.embed_tokens.weight",), _one, _one_to_hf),
             ("ln_f.weight", ("model.norm.weight",), _one, _one_to_hf)]
    if not config.tie_embeddings:
        pairs.append(("output.weight", ("lm_head.weight",), _one, _one_to_hf))
    parts = ("weight", "bias") if config.qkv_bias else ("weight",)
    block = [*_BLOCK, *(pair for part in parts for pair in _attention(config, part)), *mlp]
    for i in range(config.num_layers):
        pairs += [(f"blocks.{i}.{ours}", tuple(f"model.layers.{i}.{t}" for t in theirs), join,
                   split) for ours, theirs, join, split in block]
    return pairs


def tensors_from_hf(hf: Tensors, pairs: list[Pair], config: LlamaConfig) -> Tensors:
    """Hugging Face's tensors (as its files name them) → whole tensors under our names, fp32,
    for ``load_full_state_dict``, by ``pairs``."""
    state = {}
    for ours, theirs, join, _ in pairs:
        missing = [name for name in theirs if name not in hf]
        if missing:
            raise ValueError(f"the checkpoint has no tensor {missing[0]!r} (for {ours})")
        state[ours] = join(*(hf[name].float() for name in theirs), config=config)
    return state


def tensors_to_hf(state: Tensors, pairs: list[Pair], config: LlamaConfig) -> Tensors:
    """Whole tensors under our names (``full_state_dict``, of weights or of gradients) → Hugging
    Face's names and layout, by ``pairs``."""
    hf = {}
    for ours, theirs, _, split in pairs:
        hf.update(zip(theirs, split(state[ours], config), strict=True))
    return hf


def from_hf(hf: Tensors, config: LlamaConfig) -> Tensors:
    """A LlamaForCausalLM's tensors (as its files name them) → whole tensors under our names,
    fp32, for ``Llama.load_full_state_dict``."""
    return tensors_from_hf(hf, decoder_pairs(config, _MLP), config)


def to_hf(state: Tensors, config: LlamaConfig) -> Tensors:
    """Whole tensors under our names (``full_state_dict``, of weights or of gradients) → a
    LlamaForCausalLM's names and layout (no lm_head.weight when tied)."""
    return tensors_to_hf(state, decoder_pairs(config, _MLP), config)
