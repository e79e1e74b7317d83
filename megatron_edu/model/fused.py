"""Operator fusion (2104.04473 §4.2): elementwise chains compiled into one kernel each.

Matmuls are compute-bound; the elementwise operations between them are memory-bound, each
reading and writing the whole activation. Megatron-LM fuses bias + GeLU, bias + dropout +
residual add, and scale + mask + softmax (here ``attention.FusedCore``). ``PLAIN`` runs the
chains op by op, as the papers count them; ``FUSED`` compiles each with ``torch.compile`` on
first use (``GPTConfig(fused=True)``); tests check they agree. Biases are added in the
activation's dtype (autocast).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from megatron_edu.model.config import GPTConfig
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey

__all__ = ["PLAIN", "FUSED", "kernels", "add_bias", "bias_swiglu"]


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y + bias in y's dtype (autocast's); a layer without biases (Llama): y."""
    return y if bias is None else y + bias.to(y.dtype)


def _bias_gelu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(add_bias(y, bias), approximate="tanh")     # GPT-2's "gelu_new"


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU (Shazeer 2020; Llama's MLP): silu(gate) · up, y [.., 2f/t] holding each unit's
    gate and up side by side (rows 2i and 2i + 1 of the fc weight): any column split keeps the
    pairs together, where a [gate; up] weight split down the middle would not."""
    gate, up = add_bias(y, bias).unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def _masked_bias_add(y: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None,
                     scale: float, residual: torch.Tensor) -> torch.Tensor:
    y = add_bias(y, bias)
    return residual + (y if keep is None else y * keep * scale)


@cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def _bias_dropout_add(y: torch.Tensor, bias: torch.Tensor, dropout: Dropout,
                      key: DropoutKey | None, residual: torch.Tensor) -> torch.Tensor:
    """residual + dropout(y + bias), op by op."""
    return residual + dropout(add_bias(y, bias), key)


def _fused_bias_dropout_add(y: torch.Tensor, bias: torch.Tensor, dropout: Dropout,
                            key: DropoutKey | None, residual: torch.Tensor) -> torch.Tensor:
    """The same as one kernel, given the dropout's mask (its bits: the same masks)."""
    keep = dropout.keep(key, y) if dropout.training and dropout.p > 0 else None
    return _compiled(_masked_bias_add)(y, bias, keep, 1.0 / (1.0 - dropout.p), residual)


@dataclass(frozen=True)
class Kernels:
    """The elementwise chains of a block: bias + GeLU, and bias + dropout + residual add."""

    bias_gelu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    bias_dropout_add: Callable[..., torch.Tensor]


PLAIN = Kernels(_bias_gelu, _bias_dropout_add)
FUSED = Kernels(lambda y, bias: _compiled(_bias_gelu)(y, bias), _fused_bias_dropout_add)


def kernels(config: GPTConfig) -> Kernels:
    """The kernels ``config`` asks for: compiled with ``fused``, else op by op."""
    return FUSED if config.fused else PLAIN
