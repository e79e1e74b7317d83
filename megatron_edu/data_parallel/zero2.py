"""ZeRO stage 2 (Rajbhandari et al. 2020, "P_os+g"): the gradients sharded too.

Between steps a rank holds only its shard of the gradients: a bucket's whole buffer lives from
its first gradient of a backward to its reduce-scatter, whose sum is added into the shard. So the
reduce-scatter runs in *every* backward (m per step, as DeepSpeed's ZeRO-2 and FSDP do): the
price of never holding every gradient. At most two whole buckets live at once (one filling, one
in flight). The optimizer is ZeRO-1's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megatron_edu.data_parallel.buckets import Bucket
from megatron_edu.data_parallel.zero1 import ZeRO1

__all__ = ["ZeRO2"]


class ZeRO2(ZeRO1):
    """``ZeRO1`` whose whole gradients live only during a backward (the arguments are
    ``DataParallel``'s). ``.grad`` is None between backward passes: the shards hold the sums."""

    def _allocate(self, bucket: Bucket) -> None:
        bucket.grad_shard = bucket.zeros(bucket.numel // bucket.dp)   # own, between steps
        bucket.flatten_params()

    @contextmanager
    def sync(self, enabled: bool = True) -> Iterator[None]:
        """Every backward communicates; one that is not the last is finished on leaving (the
        last by ``finish_grad_sync``)."""
        with super().sync(True):
            yield
        if not enabled:
            self.finish_grad_sync()

    def zero_grad(self) -> None:
        """Zero the shards; ``.grad`` is None until a backward."""
        for bucket in self.buckets:
            bucket.grad_shard.zero_()
            for p in bucket.params:
                p.grad = None

    def _accumulate(self, param: nn.Parameter, bucket: Bucket) -> None:
        """Move the gradient autograd made into the backward's whole buffer; ``.grad`` is None
        again, so autograd makes a fresh one next time (never a whole set alive at once)."""
        if param.grad is not None:
            bucket.view(self._open(bucket), param).add_(param.grad)
            param.grad = None

    def _prepare(self, bucket: Bucket) -> None:
        """One reduce-scatter in flight at a time (two whole buckets at most); zeros if no
        gradient arrived."""
        self._wait_launched()
        self._open(bucket)

    @torch.no_grad()
    def _keep(self, bucket: Bucket, mine: torch.Tensor) -> None:
        """Once reduce-scattered (``ZeRO1._reduce``): add the sum into the shard, free the whole
        buffer."""
        bucket.grad_shard.add_(mine)
        bucket.grad_data = None

    @staticmethod
    def _open(bucket: Bucket) -> torch.Tensor:
        """The whole gradient buffer of this backward, zeros until gradients land."""
        if bucket.grad_data is None:
            bucket.grad_data = bucket.zeros()
        return bucket.grad_data
