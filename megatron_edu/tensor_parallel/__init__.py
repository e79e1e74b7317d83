"""Tensor (intra-layer) model parallelism of 1909.08053 §3.

layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
cross_entropy.py  the loss over vocabulary-parallel logits, never gathering them
random.py         dropout masks seeded by (step, sample, layer): the same outside the split
                  regions, per tp rank inside, independent of the layout; recomputation
init.py           parameters drawn from seeds of their own, each rank only its shard
                  (layout-independent)
"""

from megatron_edu.tensor_parallel.cross_entropy import (
    mask_padded_vocab,
    vocab_parallel_cross_entropy,
)
from megatron_edu.tensor_parallel.init import gather_full, init_parameters, shard
from megatron_edu.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    serial_group,
)
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey, checkpoint

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "serial_group",
    "vocab_parallel_cross_entropy", "mask_padded_vocab",
    "Dropout", "DropoutKey", "checkpoint",
    "init_parameters", "shard", "gather_full",
]
