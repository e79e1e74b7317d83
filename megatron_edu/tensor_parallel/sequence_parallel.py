"""Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2): outside the tp
regions the activations are split along the sequence, [b, s/t, h], instead of replicated, so
layer norms, dropouts and residual adds do 1/t of the work and hold 1/t of the memory.

A column layer enters a region by all-gathering the sequence (the paper's ``g``, where plain tp
has the identity ``f``); a row layer leaves by reduce-scattering it (``ḡ``, where plain tp
all-reduces): the same bytes, since an all-reduce *is* a reduce-scatter then an all-gather. The
column layer keeps only its split input and gathers it again in backward: the gathered input is
never kept, which makes the saving real. The collectives overlap the GEMMs that do not need them.

Replicated parameters (layer norms, row-parallel biases, positions) see only this rank's part of
the sequence: their gradients are summed over tp after backward (``sum_replicated_grads_``,
Megatron-LM's ``_allreduce_layernorm_grads``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.tensor_parallel.layers import AsyncTensorParallel, TensorParallel, autocast_of

__all__ = ["SequenceParallel", "STYLES", "sum_replicated_grads_"]


class SequenceParallel(TensorParallel):
    """The tp regions entered by an all-gather of the sequence and left by a reduce-scatter of
    it: outside, each tp rank holds its part r of t of every sequence, [b, s/t, h]."""

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.sequence_split = group.size

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """X·A_i (+ b_i) of the whole sequence from this rank's part x [b, s/t, in]."""
        return _SequenceParallelLinear.apply(x, weight, bias, self.group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from this rank's part: all-gather, reduce-scatter backward."""
        return comm.all_gather_seq(x, self.group)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(x, self.group, dim=1, label="gather routing")

    def token_group(self, cp_group: CommGroup, tp_cp_group: CommGroup) -> CommGroup:
        return tp_cp_group

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Σ_i of the partial results, this rank's part of the sequence: [b, s/t, h]."""
        return comm.reduce_scatter_seq(partial, self.group)


class _SequenceParallelLinear(torch.autograd.Function):
    """F.linear(all_gather_seq(x), weight, bias), keeping only the split x [b, s/t, in] for
    backward (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``). Backward: the
    re-gather of x runs during dX = dY·A, dX's reduce-scatter during dW = dYᵀ·X. Safe on NCCL, as
    ``layers._AsyncColumnLinear`` is: the collectives start in autograd's order, no GEMM between
    touches their tensors, each is awaited before its result is read. Autocast as there."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.autocast = on, dtype = autocast_of(x)
        x = x.to(dtype) if on else x
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        whole = comm.all_gather(x, group, dim=1, label="all_gather_seq forward")  # [b, s, in]
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                  # grad: [b, s, out/t]
        x, weight = ctx.saved_tensors
        (enabled, dtype), group = ctx.autocast, ctx.group
        with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            gather, x = comm.all_gather(x, group, 1, "all_gather_seq regather", async_op=True)
            dx = grad.matmul(weight)                          # [b, s, in], partial over tp
            gather.wait()
            reduce, dx = comm.reduce_scatter(dx, group, 1, "all_gather_seq backward",
                                             async_op=True)   # summed, split along the sequence
            dw = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))        # meanwhile
        db = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        reduce.wait()
        return dx, dw.to(weight.dtype), db, None


@torch.no_grad()
def sum_replicated_grads_(grads: list[torch.Tensor], group: CommGroup) -> None:
    """Sum over tp, in one flat all-reduce after backward, the gradients of the replicated
    parameters, which each tp rank computed from its own part of the sequence."""
    if not grads:
        return
    comm.all_reduce_(flat := torch.cat([g.flatten() for g in grads]), group, "sp replicated grads")
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


# The style of a model's (sequence_parallel, async_tp) flags: chosen once, when it is built.
# Sequence parallelism's column layers always overlap their collectives (async_tp changes nothing).
STYLES: dict[tuple[bool, bool], type[TensorParallel]] = {
    (False, False): TensorParallel, (False, True): AsyncTensorParallel,
    (True, False): SequenceParallel, (True, True): SequenceParallel}
