"""Data parallelism: averaged gradients in overlapped buckets, and ZeRO's three stages of sharding.

References: Narayanan et al. 2021 (arXiv 2104.04473) §2.1 and §3.3; Rajbhandari et al. 2020,
*ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, stages 1–3 ("P_os",
which Megatron-LM calls the *distributed optimizer*; "P_os+g"; "P_os+g+p"); Li et al. 2020,
*PyTorch Distributed* (buckets); Zhao et al. 2023, *PyTorch FSDP* (ZeRO-3's units, prefetch).

Every one of the dp replicas holds the same weights and runs its own slice of the global batch.
If each replica's loss is the mean over its slice, the mean of the replicas' gradients is the
gradient of the mean loss over the whole batch (§2.1) — so after averaging, every replica takes
the same optimizer step and the replicas never drift apart. (If each replica's loss is already
its share of the global mean — PTD-P weighs by target tokens — the gradients are summed instead.)

Read in this order — one class per stage, each adding to the one before only what it shards:

* ``buckets.py`` — ``Bucket``: consecutive parameters whose gradients share one flat buffer
  (Megatron-LM's contiguous grad buffer: each ``param.grad`` *is* a view into it), and how
  parameters are cut into buckets in the order backward produces their gradients.
* ``ddp.py`` — ``DataParallel``, stage 0: hooks launch each bucket's all-reduce the moment its
  last gradient arrives, overlapped with the rest of backward, strictly in order, once per
  optimizer step however many microbatches accumulate (``with ddp.sync(is_last_microbatch)``).
* ``zero1.py`` — ``ZeRO1``: gradients reduce-scattered, each rank steps only its 1/dp shard of
  every bucket (so holds 1/dp of Adam's moments, ``DistributedOptimizer``), the updated shards
  all-gathered back: the same traffic as one all-reduce.
* ``zero2.py`` — ``ZeRO2``: the whole gradients freed after each bucket's reduce-scatter, which
  therefore runs in every backward.
* ``zero3.py`` — ``ZeRO3``: the parameters too sharded at rest, gathered per unit (a transformer
  block) just before its forward and its backward, freed after (FSDP).

``STAGES[k]`` is the class of ZeRO stage k (0: plain data parallelism); PTD-P picks it once.
When each bucket communicated, and each ZeRO-3 unit gathered and ran, is recorded beside the
algorithm, not inside it (``megatron_edu/timing.py``: what notebooks 06 and 13 draw).

Per optimizer step (a pipeline engine, or any training loop)::

    ddp = STAGES[zero](model, group)
    optimizer = ddp.optimizer(build_param_groups(model, 0.1), torch.optim.AdamW, lr=3e-4)
    for i, microbatch in enumerate(microbatches):
        with ddp.sync(i == len(microbatches) - 1):   # communicate during the last backward only
            (loss(microbatch) / len(microbatches)).backward()
    ddp.finish_grad_sync()      # launch what is left, wait: every .grad is now the dp average
    # (tied embedding copies: all-reduce ddp.local_grads(them) over grid.embedding_group here)
    ddp.clip_grad_norm_(...); optimizer.step(); ddp.zero_grad()
"""

from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.data_parallel.ddp import DataParallel
from megatron_edu.data_parallel.zero1 import DistributedOptimizer, Piece, ZeRO1
from megatron_edu.data_parallel.zero2 import ZeRO2
from megatron_edu.data_parallel.zero3 import ParameterSharding, ZeRO3

__all__ = ["Bucket", "make_buckets", "DataParallel", "ZeRO1", "ZeRO2", "ZeRO3", "STAGES",
           "DistributedOptimizer", "Piece", "ParameterSharding"]

STAGES: dict[int, type[DataParallel]] = {0: DataParallel, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
