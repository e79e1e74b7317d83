"""GPT-2 (Radford et al. 2019) on the blocks of ``model/transformer.py``, whole or one pipeline
stage: learned positions, pre-LN blocks, causal self-attention, a 4h MLP with tanh GeLU
("gelu_new", so Hugging Face weights load exactly), a final layer norm, and an output layer tied
to the input embedding. ``forward(ids, cache=KVCache())`` keeps every block's keys and values,
so the next call feeds only the new token (``megatron_edu/generate.py``, over any tp × pp).
"""

from __future__ import annotations

import torch

from megatron_edu.model.attention import KVCache
from megatron_edu.model.config import GPTConfig
from megatron_edu.model.transformer import IGNORE_INDEX, TransformerStage, reduce_loss
from megatron_edu.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_edu.tensor_parallel.random import DropoutKey

__all__ = ["GPT"]


class GPT(TransformerStage):
    """GPT-2, whole (the defaults) or one pipeline stage of it, tensor-parallel over ``grid``:
    ``GPT(config, grid, layers=range(4, 8), first=False)`` holds blocks 4–7, the final layer
    norm and the output layer (``TransformerStage`` describes the arguments)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                cache: KVCache | None = None, dropout_key: DropoutKey | None = None,
                loss_reduction: str = "mean") -> torch.Tensor:
        """ids [b, s] (first stage) or hidden [b, s, h] → hidden [b, s, h] (not last), this rank's
        logits [b, s, V_padded/t] (last, no labels; padded ids −inf) or the loss over the tokens
        whose label is not −100, equal on every tp rank: their mean, or their sum with
        ``loss_reduction="sum"``. ``cache``: the keys and values of the positions before x's;
        x's are appended. ``dropout_key``: the step and global samples that seed the dropout
        masks (a pipeline passes it); without one, a model in training numbers its calls."""
        if cache is not None and self.style.sequence_split * self.cp_group.size > 1:
            raise ValueError("generation with a KV cache runs without sequence or context "
                             "parallelism: build the model with sequence_parallel=False and "
                             "cp = 1 (the same weights)")
        dropout_key = self._dropout_key(x, dropout_key)
        offset = 0 if cache is None else cache.length
        h, _ = self.enter(x, offset, dropout_key)                # [b, s, h]
        h = self._blocks(h, dropout_key, cache)
        if cache is not None:
            cache.length += h.shape[1]
        return self.leave(h, labels, loss_reduction)

    def _build_first(self, config: GPTConfig):
        return self._ids_in

    def _build_last(self, config: GPTConfig):
        return self._head

    def _ids_in(self, ids: torch.Tensor, offset: int, dropout_key: DropoutKey | None):
        return self._embed(ids, offset, dropout_key), None

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None,
              loss_reduction: str) -> torch.Tensor:
        logits = self._logits(self.ln_f(h))                      # [b, s, V_padded/t]
        if labels is None:
            return logits
        losses = vocab_parallel_cross_entropy(logits, labels, self.tp_group,
                                              ignore_index=IGNORE_INDEX)   # [b, s]
        return reduce_loss(losses.sum(), labels, loss_reduction)
