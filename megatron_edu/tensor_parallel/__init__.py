"""Tensor (intra-layer) model parallelism of 1909.08053 §3.

layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
cross_entropy.py  the loss over vocabulary-parallel logits, never gathering them
random.py         dropout streams (same mask outside the split regions, per-rank inside) and
                  activation recomputation that replays them
init.py           parameters drawn whole from a seed of their own, then sliced (layout-independent)
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
from megatron_edu.tensor_parallel.random import (
    REPLICATED,
    TENSOR_PARALLEL,
    Dropout,
    RNGTracker,
    checkpoint,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "serial_group",
    "vocab_parallel_cross_entropy", "mask_padded_vocab",
    "RNGTracker", "Dropout", "REPLICATED", "TENSOR_PARALLEL", "checkpoint",
    "init_parameters", "shard", "gather_full",
]
