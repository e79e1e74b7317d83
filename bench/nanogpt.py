"""A plain PyTorch GPT-2, nanoGPT-style: the reference the benchmarks hold megatron-edu against.

The same math as ``megatron_edu.model.GPT`` at tp = pp = 1 (Radford et al. 2019; the layout of
Karpathy's nanoGPT ``model.py``): learned positions, pre-LN blocks, causal self-attention through
``F.scaled_dot_product_attention`` — or, with ``explicit_attention``, the same explicit core as
megatron-edu's unfused model (scores, causal mask, softmax, dropout, · V), so that each is compared
like with like —, a tanh-GeLU MLP of 4h, a final layer norm, an output layer
tied to the word embedding, ``F.cross_entropy``. Nothing parallel, nothing counted, no RNG
streams: plain ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding`` and ``nn.Dropout``.

Two choices let weights move across unchanged:

* parameter names are megatron-edu's (``blocks.3.attn.qkv.weight``), so
  ``plain.load_state_dict(ours.full_state_dict())`` copies a model in;
* the fused qkv weight keeps Megatron's rows grouped per head ([heads, 3, head_dim]), where
  nanoGPT stacks q | k | v. A column split of it into t blocks then gives each rank whole heads,
  so PyTorch's ``ColwiseParallel`` can shard this very module (``bench/tp_dtensor.py``); attention
  reads its number of heads from the projection's output, which is the local heads under DTensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu.model import GPTConfig


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, explicit: bool = False) -> None:
        super().__init__()
        self.head_dim, self.dropout, self.explicit = config.head_dim, config.dropout, explicit
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)     # [b, s, heads, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)         # each [b, heads, s, d]
        p = self.dropout if self.training else 0.0
        if self.explicit:
            scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))  # [b, a, s, s]
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = F.dropout(scores.masked_fill(future, float("-inf")).softmax(-1), p)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, h]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden)
        self.proj = nn.Linear(config.ffn_hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, explicit_attention: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.attn = Attention(config, explicit_attention)
        self.ln2 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden)
        self.position = nn.Embedding(config.seq_len, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.word(ids) + self.position(positions))  # [b, s, h]


class GPT(nn.Module):
    """``GPT(config)(ids, labels)`` is the mean cross entropy; without labels, the logits.
    ``explicit_attention``: the attention core op by op, as megatron-edu's unfused model has it."""

    def __init__(self, config: GPTConfig, explicit_attention: bool = False) -> None:
        super().__init__()
        self.embedding = Embedding(config)
        self.blocks = nn.ModuleList(Block(config, explicit_attention)
                                    for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embedding.word.weight)  # [b, s, V], tied
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
