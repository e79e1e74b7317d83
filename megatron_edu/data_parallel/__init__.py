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

Read in this order:

* ``buckets.py`` — ``Bucket``: consecutive parameters whose gradients share one flat buffer
  (Megatron-LM's contiguous grad buffer: each ``param.grad`` *is* a view into it), and how
  parameters are cut into buckets in the order backward produces their gradients.
* ``ddp.py`` — ``DataParallel``: hooks launch each bucket's all-reduce the moment its last
  gradient arrives, overlapped with the rest of backward, strictly in order, once per optimizer
  step however many microbatches accumulate (``with ddp.sync(is_last_microbatch)``).
* ``zero1.py`` — ``DistributedOptimizer``: ZeRO-1. Gradients are reduce-scattered, each rank
  steps only its 1/dp shard of every bucket (so holds 1/dp of Adam's moments), and the updated
  shards are all-gathered back: the same traffic as one all-reduce. ZeRO-2 (``zero=2``) frees
  the whole gradients after each bucket's reduce-scatter (``ddp.py``); the same optimizer.
* ``zero3.py`` — ``ParameterSharding``: ZeRO-3 / FSDP. The parameters too are sharded at rest,
  gathered per unit (a transformer block) just before its forward and its backward, freed after.
* ``megatron_edu/timing.py``'s ``BucketTimer`` — when each bucket was ready, launched and done:
  what notebook 06 draws. Kept beside the algorithm, not inside it.

Per optimizer step (a pipeline engine, or any training loop)::

    for i, microbatch in enumerate(microbatches):
        with ddp.sync(i == len(microbatches) - 1):   # communicate during the last backward only
            (loss(microbatch) / len(microbatches)).backward()
    ddp.finish_grad_sync()      # launch what is left, wait: every .grad is now the dp average
    # (tied embedding copies: all-reduce their .grad over grid.embedding_group here)
    clip_grad_norm_(...); optimizer.step(); ddp.zero_grad()
"""

from megatron_edu.data_parallel.buckets import Bucket, make_buckets
from megatron_edu.data_parallel.ddp import DataParallel
from megatron_edu.data_parallel.zero1 import DistributedOptimizer, Piece
from megatron_edu.data_parallel.zero3 import ParameterSharding
from megatron_edu.timing import BucketTimer, BucketTiming

__all__ = ["Bucket", "make_buckets", "DataParallel", "BucketTimer", "BucketTiming",
           "DistributedOptimizer", "Piece", "ParameterSharding"]
