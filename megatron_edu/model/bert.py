"""BERT on the GPT's blocks (Devlin et al. 2019; 1909.08053 §5.3, Figure 7).

1909.08053 finds the original BERT (Figure 7a, post-LN) trains well at 336M parameters but not
at 752M; rearranged, pre-LN as in GPT-2 (Figure 7b), both train stably, as do BERTs of 1.3B and
3.9B (Table 4). Both are the switch ``config.ln_placement`` of the shared ``Block``.

What BERT adds to the GPT:

* **inputs**: ``[CLS] a [SEP] b [SEP]``, [PAD] after; bidirectional attention that keeps padded
  keys out of every softmax; a token-type embedding (0 up to and including the first [SEP], 1
  after). Both follow from the ids, so a pipeline stage needs only the engine's ids and labels.
* **the masked-LM head** (Devlin §3.1): dense + GeLU + layer norm, then the output layer tied to
  the word embedding plus a vocabulary-parallel bias; logits stay split, [b, s, V/t] (§3).
* **the sentence-order head** (ALBERT's SOP, Lan et al. 2019, which §5.3 uses in place of
  next-sentence prediction): a pooler (dense + tanh) on [CLS], then a 2-way classifier: in order
  (0) or swapped (1)? Small, and replicated on every tp rank, as in Megatron-LM.

**Labels**, one [b, s] tensor as the pipeline engine passes them: ``labels[:, 1:]`` are the
masked-LM targets (−100 where nothing was masked), ``labels[:, 0]`` ([CLS], never a masked-LM
target) the order label. The loss is the mean over all of them: the engine's weighting by the
count of labels ≠ −100. (Megatron-LM adds two means, mlm_mean + sop_mean; here an order label
weighs as one of the sequence's ~0.15·s masked tokens.)

**Padding under a pipeline.** Only the first stage sees the ids to find the padding in, so with
pp > 1 batches hold no [PAD] (the training data is packed, ``data/bert.py``), and a padded batch
on a first stage that is not also the last raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu.comm import CommGroup
from megatron_edu.model.config import BertConfig
from megatron_edu.model.transformer import (
    IGNORE_INDEX,
    WORD_EMBEDDING,
    TransformerStage,
    layer_norm,
    reduce_loss,
)
from megatron_edu.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_edu.tensor_parallel.init import mark, normal, placeholder, zeros
from megatron_edu.tensor_parallel.random import DropoutKey

__all__ = ["BERT", "token_types", "padding_mask"]

MLM_BIAS = "mlm.bias"


class BertOutput(NamedTuple):
    """The two heads' logits (a BERT's last stage, called without labels)."""

    mlm_logits: torch.Tensor    # [b, s, V_padded/t]: this tp rank's vocabulary shard
    order_logits: torch.Tensor  # [b, 2]: in order, swapped


def token_types(ids: torch.Tensor, sep_id: int) -> torch.Tensor:
    """0 up to and including the first [SEP], 1 after it: [b, s] int64."""
    sep = (ids == sep_id).long()
    return (sep.cumsum(1) - sep).clamp(max=1)     # [SEP]s strictly before each position


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """The keys attention may see, [b, s] bool (False at [PAD]); None when nothing is padded."""
    keep = ids != pad_id
    return None if bool(keep.all()) else keep


def _replicated_linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    """A plain linear, whole on every tp rank (the heads are small: Megatron keeps them so)."""
    linear = nn.Linear(n_in, n_out, device="meta")
    mark(linear.weight, None, normal(std))
    mark(linear.bias, None, zeros)
    return linear


class MaskedLMHead(nn.Module):
    """dense + GeLU + layer norm (Devlin's "transform"); the output layer is the word embedding,
    applied by ``BERT``; ``bias`` is the output layer's, split by vocabulary like its rows."""

    def __init__(self, config: BertConfig, group: CommGroup) -> None:
        super().__init__()
        self.dense = _replicated_linear(config.hidden, config.hidden, config.init_std)
        self.ln = layer_norm(config)
        self.bias = placeholder((config.padded_vocab(group.size) // group.size,), 0, zeros)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The last hidden states [b, s, h] transformed, for the output layer."""
        return self.ln(F.gelu(self.dense(h), approximate="tanh"))      # [b, s, h]


class SentenceOrderHead(nn.Module):
    """The pooler (dense + tanh on [CLS]) and the 2-way in-order / swapped classifier."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.pooler = _replicated_linear(config.hidden, config.hidden, config.init_std)
        self.classifier = _replicated_linear(config.hidden, 2, config.init_std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The last hidden states [b, s, h] → in-order / swapped logits [b, 2]."""
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))      # [b, 2]


class BERT(TransformerStage):
    """BERT, whole or one pipeline stage, tensor-parallel over ``grid``: the GPT's stage with
    BERT's inputs and heads; stage arguments (``layers``, ``first``, ``last``) as for the GPT."""

    config_class = BertConfig
    vocab_rows = (WORD_EMBEDDING, MLM_BIAS)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None,
                loss_reduction: str = "mean") -> torch.Tensor | BertOutput:
        """ids [b, s] (first stage) or hidden [b, s, h] → hidden (not last), the heads' logits
        (last, no labels) or the loss over every label ≠ −100, masked-LM and order alike: their
        mean, or their sum with ``loss_reduction="sum"``. ``attention_mask`` [b, s] bool (False:
        padding) defaults to the ids that are not ``pad_id``."""
        dropout_key = self._dropout_key(x, dropout_key)
        h, mask = self.enter(x, dropout_key, attention_mask)
        h = self._blocks(h, dropout_key, mask=mask)
        return self.leave(h, labels, loss_reduction)

    def _build_first(self, config: BertConfig):
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden, device="meta")
        mark(self.token_type.weight, None, normal(config.init_std))
        return self._ids_in

    def _build_last(self, config: BertConfig):
        self.mlm = MaskedLMHead(config, self.tp_group)
        self.order = SentenceOrderHead(config)
        return self._heads

    def _ids_in(self, ids: torch.Tensor, dropout_key: DropoutKey | None,
                attention_mask: torch.Tensor | None):
        """The embeddings of ``ids`` with their token types, and the keys' padding mask."""
        mask = padding_mask(ids, self.config.pad_id) if attention_mask is None else \
            attention_mask.bool()
        if mask is not None and not self.last:
            raise ValueError("a padded batch cannot cross pipeline stages: the stages after "
                             "the first get no ids to find the padding in. Pack the batch "
                             "to full length (no [PAD]; the training data is) or use pp=1")
        types = self.token_type(token_types(ids, self.config.sep_id))
        return self._embed(ids, 0, dropout_key, extra=types), mask   # [b, s, h]

    def _heads(self, h: torch.Tensor, labels: torch.Tensor | None,
               loss_reduction: str) -> torch.Tensor | BertOutput:
        h = self.ln_f(h)
        out = BertOutput(self._logits(self.mlm(h)) + self.mlm.bias, self.order(h))
        if labels is None:
            return out
        return reduce_loss(self._losses(out, labels), labels, loss_reduction)

    def _losses(self, out: BertOutput, labels: torch.Tensor) -> torch.Tensor:
        """The summed masked-LM losses (labels[:, 1:]) and order losses (labels[:, 0])."""
        mlm_labels = labels.clone()
        mlm_labels[:, 0] = IGNORE_INDEX                  # [CLS]: the order label's place
        mlm = vocab_parallel_cross_entropy(out.mlm_logits, mlm_labels, self.tp_group,
                                           ignore_index=IGNORE_INDEX)     # [b, s]
        order = F.cross_entropy(out.order_logits.float(), labels[:, 0],
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return mlm.sum() + order
