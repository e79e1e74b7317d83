"""Tensor (intra-layer) model parallelism of 1909.08053 §3.

layers.py              ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, and
                       how a region is entered and left: TensorParallel (f, g), its overlap
sequence_parallel.py   SequenceParallel: the activations split along the sequence outside
                       the regions (2205.05198); STYLES, the style a model's flags choose
cross_entropy.py       the loss over vocabulary-parallel logits, never gathering them
random.py              dropout masks seeded by (step, sample, layer): each rank draws its part
                       of the serial model's mask, at any layout; recomputation
init.py                parameters drawn from seeds of their own, each rank only its shard
                       (layout-independent)
"""

from megatron_edu.tensor_parallel.cross_entropy import (
    mask_padded_vocab,
    vocab_parallel_cross_entropy,
)
from megatron_edu.tensor_parallel.init import gather_full, init_parameters, shard
from megatron_edu.tensor_parallel.layers import (
    AsyncTensorParallel,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    serial_group,
)
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey, checkpoint
from megatron_edu.tensor_parallel.sequence_parallel import STYLES, SequenceParallel

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "serial_group",
    "TensorParallel", "AsyncTensorParallel", "SequenceParallel", "STYLES",
    "vocab_parallel_cross_entropy", "mask_padded_vocab",
    "Dropout", "DropoutKey", "checkpoint",
    "init_parameters", "shard", "gather_full",
]
