"""Operator fusion (2104.04473 §4.2): elementwise chains compiled into one kernel each.

A transformer layer's matmuls are compute-bound; the elementwise operations between them are
memory-bound — each reads and writes the whole activation. Megatron-LM fuses the chains into
single kernels: bias + GeLU after the MLP's first matmul, bias + dropout + residual add after each
block's output projection, and scale + mask + softmax in attention (here the attention core is
``F.scaled_dot_product_attention``, one kernel with its dropout). The chains are plain PyTorch,
compiled by ``torch.compile`` on first use (``GPTConfig(fused=True)``); unfused, the model runs
them op by op — tests check the two agree. A bias is added in the activation's dtype (autocast).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

__all__ = ["bias_gelu", "bias_dropout_add"]


def _bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(y + bias.to(y.dtype), approximate="tanh")


def _bias_dropout_add(y: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None,
                      scale: float, residual: torch.Tensor) -> torch.Tensor:
    y = y + bias.to(y.dtype)
    return residual + (y if keep is None else y * keep * scale)


@cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GeLU(y + bias) (GPT-2's tanh GeLU), as one compiled kernel."""
    return _compiled(_bias_gelu)(y, bias)


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None,
                     scale: float, residual: torch.Tensor) -> torch.Tensor:
    """residual + dropout(y + bias) with the given mask (None: no dropout), as one kernel."""
    return _compiled(_bias_dropout_add)(y, bias, keep, scale, residual)
