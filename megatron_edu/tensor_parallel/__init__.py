"""Tensor (intra-layer) model parallelism of 1909.08053 §3.

layers.py             column- and row-parallel linears, the vocab-parallel embedding; TensorParallel
sequence_parallel.py  SequenceParallel (2205.05198); STYLES, the style a model's flags choose
cross_entropy.py      the loss over vocabulary-parallel logits, never gathering them
random.py             dropout masks keyed by (step, sample, layer): the serial ones at any layout
init.py               layout-independent parameters, each rank drawing only its shard
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
