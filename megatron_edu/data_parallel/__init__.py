"""Data parallelism (2104.04473 §2.1, §3.3) and ZeRO's three stages of sharding (Rajbhandari et al.
2020: "P_os" — Megatron-LM's distributed optimizer —, "P_os+g", "P_os+g+p"; FSDP, Zhao et al. 2023).

Every replica holds the same weights and runs its own slice of the global batch. If each
replica's loss is the mean over its slice, the mean of the replicas' gradients is the gradient
of the whole batch's mean (§2.1): after averaging, every replica takes the same step. (PTD-P's
replicas each compute their *share* of the global token mean, so it sums instead.)

One class a stage, each adding to the one before only what it shards — read in this order:
``buckets.py`` (``Bucket``: gradients in flat buffers, the order backward fills them), ``ddp.py``
(``DataParallel``: all-reduces launched in order as buckets fill, overlapped with backward, once
a step), ``zero1.py`` (reduce-scatter, each rank steps its shard, all-gather), ``zero2.py`` (the
whole gradients freed after each reduce-scatter), ``zero3.py`` (the weights gathered per unit
around its forward and backward). ``STAGES[k]`` is stage k's class, picked once::

    ddp = STAGES[zero](model, group)
    optimizer = ddp.optimizer(build_param_groups(model, 0.1), torch.optim.AdamW, lr=3e-4)
    for i, microbatch in enumerate(microbatches):
        with ddp.sync(i == len(microbatches) - 1):   # communicate in the last backward only
            (loss(microbatch) / len(microbatches)).backward()
    ddp.finish_grad_sync()      # every .grad (under ZeRO: this rank's shard) is the dp average
    ddp.clip_grad_norm_(...); optimizer.step(); ddp.zero_grad()
"""

from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.data_parallel.ddp import DataParallel
from megatron_edu.data_parallel.zero1 import DistributedOptimizer, ZeRO1
from megatron_edu.data_parallel.zero2 import ZeRO2
from megatron_edu.data_parallel.zero3 import ParameterSharding, ZeRO3

__all__ = ["Bucket", "make_buckets", "DataParallel", "ZeRO1", "ZeRO2", "ZeRO3", "STAGES",
           "DistributedOptimizer", "ParameterSharding"]

STAGES: dict[int, type[DataParallel]] = {0: DataParallel, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
