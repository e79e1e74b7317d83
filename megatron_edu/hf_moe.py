"""How Hugging Face's mixtures of experts map onto this package's ``Llama`` with an ``MoE`` in
place of each MLP (``model/moe.py``): Mixtral (``MixtralForCausalLM``; Jiang et al. 2024) and
Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), config.json onto a
``LlamaConfig`` and the tensors onto whole tensors under this package's names, both ways. Around
the experts both are Llama's decoder (``hf_llama.decoder_fields``, ``decoder_pairs``); a
``Family`` says what its MoE layer is called and set to, and ``megatron_edu.hf`` reads and writes
the directories with its four methods (``load_hf``, ``save_hf``).

What differs, and what is done about it:

* The experts: files hold one tensor per expert and projection, [f, h] or [h, f]: Mixtral's
  layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down), Qwen2-MoE's
  layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj. Here one stack a layer:
  experts.fc [E, 2f, h], each expert's gate and up interleaved by row as Llama's fc
  (``hf_llama._fc_from_hf``), and experts.proj [E, h, f] → stacked, and apart again.
  (transformers 5 fuses them in memory, gate_up_proj [E, 2f, h] gate then up, but
  ``save_pretrained`` writes these per-expert names, the Hub's.)
* The router: gate.weight [E, h] is router.weight (computed in fp32 here). Both families take the
  softmax over the E experts and its k largest; Mixtral renormalises them to sum to one (the
  softmax over the k logits: ``moe_norm_topk``), Qwen2-MoE as its norm_topk_prob says (False in
  Qwen1.5-MoE).
* Qwen2-MoE's shared expert, an MLP of shared_expert_intermediate_size units times
  sigmoid(shared_expert_gate · x), is ``moe_shared_experts`` = that size / moe_intermediate_size
  experts' width (refused unless whole) with ``moe_shared_gate``: its gate_proj and up_proj
  interleave into shared.fc as Llama's do.
* Qwen2's attention has biases on q, k and v alone: ``qkv_bias`` (read from its qkv_bias, true
  when absent, as in every Qwen2-MoE), grouped as the weights are (``hf_llama``).
* The balance loss: router_aux_loss_coef becomes ``moe_aux_loss`` over the microbatch (the
  tokens transformers pools), carried as it is, as Megatron's bridges (mbridge) carry it to
  megatron-core, whose loss this package's is. The two losses are not the same function: with
  f_i expert i's share of the k choices and P_i its mean probability, transformers' is
  k·E·Σ f_i·P_i, once over all layers' tokens (and joins the loss only with
  output_router_logits), this package's E·Σ f_i·P_i a layer, summed over the layers. Routing,
  and so the logits, do not depend on it.

Refused by name, reading: what Llama refuses, and a sliding window shorter than the sequence
(Mixtral's sliding_window, Qwen2-MoE's use_sliding_window), router jitter (Mixtral), dense layers
among the experts' (Qwen2-MoE's decoder_sparse_step, mlp_only_layers). Saving: what neither
family routes by (a sigmoid router, a capacity, DeepSeek-V3's expert bias), and what the family
lacks or always has (Mixtral: shared experts, biases, top-k weights not renormalised;
Qwen2-MoE: no shared expert, or one without its gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_edu.hf_llama import (
    Join,
    Pair,
    Split,
    Tensors,
    _fc_from_hf,
    _fc_to_hf,
    _one,
    _one_to_hf,
    decoder_fields,
    decoder_hf_config,
    decoder_pairs,
    tensors_from_hf,
    tensors_to_hf,
)
from megatron_edu.model.config import LlamaConfig

__all__ = ["Family", "MIXTRAL", "QWEN2_MOE"]

# how both families route: softmax scores, every choice kept (dropless), no expert bias, no
# expert groups; read
# into every config, and required of one saved
_ROUTING = {"moe_router": "softmax", "moe_capacity": 0.0, "moe_bias_rate": 0.0, "moe_groups": 1}


@dataclass(frozen=True)
class Family:
    """One Hugging Face mixture-of-experts family on Llama's decoder."""

    architecture: str                          # "MixtralForCausalLM"
    model_type: str                            # config.json's
    keys: tuple[tuple[str, str, Any], ...]     # (our field, config.json key, transformers' default)
    fixed: dict[str, Any]                      # our fields every model of the family has
    only: dict[str, Any]                       # config.json settings implemented at one value
    layer: str                                 # the MoE layer's name in a block
    expert: tuple[str, str, str]               # expert {e}'s gate, up and down in the layer
    shared: tuple[str, str, str, str] | None   # the shared expert's gate, up, down, and its
                                               # gate (None: the family has no shared expert)
    windowed: bool                             # sliding_window: None or at least seq_len

    @property
    def name(self) -> str:
        """As messages name the family: "Mixtral", "Qwen2Moe"."""
        return self.architecture.removesuffix("ForCausalLM")

    def config_from_hf(self, hf: dict[str, Any], **overrides: Any) -> LlamaConfig:
        """A LlamaConfig from the family's config.json, refusing what the model does not do;
        ``overrides`` replace config fields (a shorter ``seq_len`` makes a sliding window
        longer than the sequence: no window)."""
        refused = {key: hf.get(key) not in (None, value) for key, value in self.only.items()}
        fields = decoder_fields(hf, self.name, **refused)
        fields.update({ours: hf.get(key, default) for ours, key, default in self.keys})
        fields.update(_ROUTING, moe_group="microbatch", **self.fixed)
        if self.shared is not None:
            fields["moe_shared_experts"] = _shared_experts(hf)
        config = LlamaConfig(**{**fields, **overrides})
        window = hf.get("sliding_window") if self.windowed else None
        if window is not None and window < config.seq_len:
            raise ValueError(f"this {self.name} checkpoint attends within a sliding window of "
                             f"sliding_window = {window} positions, shorter than seq_len = "
                             f"{config.seq_len}; the model attends to every earlier position: "
                             f"load it with seq_len={window} or less")
        return config

    def hf_config(self, config: LlamaConfig) -> dict[str, Any]:
        """config.json of ``config`` for the family; a ValueError for a config it cannot
        express (no experts, another router, shared experts or biases it lacks, …)."""
        required = {**_ROUTING, **self.fixed}
        unlike = {field: getattr(config, field) != value for field, value in required.items()}
        unlike["moe_experts"] = config.moe_experts == 0
        unlike["moe_shared_experts"] = (config.moe_shared_experts > 0) != (self.shared is not None)
        hf = decoder_hf_config(config, self.architecture, self.model_type, **unlike)
        hf.update({key: getattr(config, ours) for ours, key, _ in self.keys}, **self.only)
        if self.shared is not None:
            hf["shared_expert_intermediate_size"] = (config.moe_shared_experts
                                                     * config.moe_ffn_hidden)
        if self.windowed:
            hf["sliding_window"] = None
        return hf

    def pairs(self, config: LlamaConfig) -> list[Pair]:
        """(our name, Hugging Face names, join, split) for every tensor of the model."""
        gate, up, down = (f"{self.layer}.{name}" for name in self.expert)
        experts = range(config.moe_experts)
        mlp = [("mlp.router.weight", (f"{self.layer}.gate.weight",), _one, _one_to_hf),
               ("mlp.experts.fc", tuple(n.format(e=e) for e in experts for n in (gate, up)),
                _each_expert(_fc_from_hf), _each_expert_split(_fc_to_hf)),
               ("mlp.experts.proj", tuple(down.format(e=e) for e in experts),
                _each_expert(_one), _each_expert_split(_one_to_hf))]
        if self.shared is not None and config.moe_shared_experts:
            gate, up, down, shared_gate = (f"{self.layer}.{name}" for name in self.shared)
            mlp += [("mlp.shared.fc.weight", (gate, up), _fc_from_hf, _fc_to_hf),
                    ("mlp.shared.proj.weight", (down,), _one, _one_to_hf)]
            if config.moe_shared_gate:
                mlp.append(("mlp.shared_gate", (shared_gate,), _one, _one_to_hf))
        return decoder_pairs(config, mlp)

    def from_hf(self, hf: Tensors, config: LlamaConfig) -> Tensors:
        """The family's tensors (as its files name them) → whole tensors under our names, fp32,
        for ``load_full_state_dict`` (which keeps this rank's experts)."""
        return tensors_from_hf(hf, self.pairs(config), config)

    def to_hf(self, state: Tensors, config: LlamaConfig) -> Tensors:
        """Whole tensors under our names (``full_state_dict``: every expert, of weights or of
        gradients) → the family's names and layout."""
        return tensors_to_hf(state, self.pairs(config), config)


def _shared_experts(hf: dict[str, Any]) -> int:
    """Qwen2-MoE's shared expert as a number of experts' width (``MoE``: n·moe_ffn_hidden)."""
    shared, expert = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if shared % expert:
        raise ValueError(f"shared_expert_intermediate_size = {shared} is not a multiple of "
                         f"moe_intermediate_size = {expert}: the shared expert here is a whole "
                         f"number of experts' width")
    return shared // expert


def _each_expert(join: Join) -> Join:
    """``join`` of one expert's tensors, for each expert in turn (theirs listed expert by
    expert), stacked: [E, …]."""
    def stacked(*theirs: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
        per = len(theirs) // config.moe_experts
        return torch.stack([join(*theirs[i:i + per], config=config)
                            for i in range(0, len(theirs), per)])
    return stacked


def _each_expert_split(split: Split) -> Split:
    """``split`` of each expert of a stack [E, …]: theirs listed expert by expert."""
    def unstacked(stack: torch.Tensor, config: LlamaConfig) -> list[torch.Tensor]:
        return [t for expert in stack for t in split(expert, config)]
    return unstacked


_BALANCE = ("moe_aux_loss", "router_aux_loss_coef", 0.001)
MIXTRAL = Family(
    architecture="MixtralForCausalLM", model_type="mixtral",
    keys=(("moe_experts", "num_local_experts", 8), ("moe_topk", "num_experts_per_tok", 2),
          ("moe_ffn_hidden", "intermediate_size", 14336), _BALANCE),
    fixed={"moe_norm_topk": True, "qkv_bias": False},
    only={"router_jitter_noise": 0.0},
    layer="block_sparse_moe", expert=("experts.{e}.w1.weight", "experts.{e}.w3.weight",
                                      "experts.{e}.w2.weight"),
    shared=None, windowed=True)
QWEN2_MOE = Family(
    architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe",
    keys=(("moe_experts", "num_experts", 60), ("moe_topk", "num_experts_per_tok", 4),
          ("moe_ffn_hidden", "moe_intermediate_size", 1408),
          ("moe_norm_topk", "norm_topk_prob", False), ("qkv_bias", "qkv_bias", True), _BALANCE),
    fixed={"moe_shared_gate": True},
    only={"decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False},
    layer="mlp", expert=("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                         "experts.{e}.down_proj.weight"),
    shared=("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
            "shared_expert.down_proj.weight", "shared_expert_gate.weight"),
    windowed=False)
