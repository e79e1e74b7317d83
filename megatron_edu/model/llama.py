"""Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) on the GPT's skeleton: the same
stages, tensor-parallel layers and pipeline, with the parts ``LlamaConfig`` picks when each layer
is built (nothing asks at run time which model it is):

* RMSNorm instead of LayerNorm (``transformer.layer_norm``): whole on every tp rank, its
  gradient summed over tp under sequence parallelism, as any replicated weight;
* rotary positions instead of a position table (``attention.Rotary``): q and k turned by their
  true positions, this rank's zig-zag chunks under context parallelism;
* a SwiGLU MLP (``fused.bias_swiglu``): the gate and up columns of each unit side by side, so
  a column split gives every rank matching gates and ups;
* grouped-query attention (``attention.Attention``): num_kv_heads key/value heads, split over tp
  by whole groups;
* no biases, no dropout, and an output layer of its own (``OUTPUT_LAYER``): no embedding group
  between the first and the last pipeline stage.
"""

from __future__ import annotations

from megatron_edu.model.config import LlamaConfig
from megatron_edu.model.gpt import GPT

__all__ = ["Llama"]


class Llama(GPT):
    """A Llama, whole or one pipeline stage, tensor-parallel over ``grid`` (as ``GPT``)."""

    config_class = LlamaConfig
