"""Column- and row-parallel linear layers and the vocabulary-parallel embedding (1909.08053 §3).

A linear layer Y = X·A can be split two ways across t tensor-parallel ranks:

* **by columns** (``ColumnParallelLinear``): A = [A_1, …, A_t]; rank i computes Y_i = X·A_i, a
  slice of the output. Every rank needs all of X, so the input goes through ``f`` (identity
  forward, all-reduce of the gradient backward). A nonlinearity can follow on each slice alone —
  GeLU(X·A_i) — which is why the MLP's first matrix is split this way (§3, eq. 3).
* **by rows** (``RowParallelLinear``): A = [A_1; …; A_t] stacked; rank i holds A_i and the
  matching slice X_i of the input (the output of a column-parallel layer), so Y = Σ_i X_i·A_i:
  ``g`` sums the partial products (all-reduce forward, identity backward). The bias is added
  once, after the sum.

Together, column then row, a whole MLP or attention block costs one all-reduce forward (``g``)
and one backward (``f``): Figure 3. Weights are stored as nn.Linear stores them, [out, in]: a
column split is ``tp_dim=0`` of the stored weight, a row split ``tp_dim=1``.

The embedding is split by vocabulary (§3, "input embedding"): each rank owns a contiguous range
of rows, looks up the ids that fall in it, writes zeros for the others, and ``g`` sums the partial
lookups so that every rank ends with the full [b, s, h] embedding.

**Sequence parallelism** (Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2), ``sequence_parallel
=True``: outside these layers the activations are split along the sequence over the t ranks
([b, s/t, h]) instead of replicated. Then ``f`` becomes an all-gather of the sequence (the column
layer's input) and ``g`` a reduce-scatter of it (the row layer's output): the same bytes as the
all-reduce, which *is* a reduce-scatter plus an all-gather. The column layer keeps only its
split input for the backward pass and all-gathers it again there (what makes the saving real:
the gathered input is never kept), so a layer's backward makes one more all-gather per column
layer than the forward. Under autocast, X and its gradient travel in the compute dtype.

With a group of one member every layer here is the plain PyTorch layer and communicates nothing.
Parameters are built on the meta device and filled by ``init.init_parameters`` (each rank drawing
its shard only, the same numbers at any tp); a layer used before that raises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.tensor_parallel.init import check_initialised, normal, placeholder, zeros

__all__ = ["serial_group", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "sequence_gather_linear", "sum_replicated_grads_"]


def serial_group(name: str = "tp") -> CommGroup:
    """A group of this process alone: the layers below are then the plain serial layers."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommGroup(name, (rank,))


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {t}")
    return n // t


class ColumnParallelLinear(nn.Module):
    """Y = X·A + b with A split by output columns: this rank computes Y_i = X·A_i + b_i.

    ``gather_output=True`` all-gathers the slices into the full Y (backward: keep own slice).
    ``sequence_parallel``: X arrives split along the sequence and is all-gathered first.
    ``async_tp`` (an attribute): backward overlaps dX's communication with dW (``_ColumnLinear``).
    Off by default: ``f`` then ``F.linear``, Figure 3 as written; zero bubble splits their dX, dW.
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, gather_output: bool = False, init_std: float = 0.02,
                 sequence_parallel: bool = False, async_tp: bool = False) -> None:
        super().__init__()
        self.group, self.gather_output, self.async_tp = group, gather_output, async_tp
        self.sequence_parallel = sequence_parallel and group.size > 1
        out_local = _divide(out_features, group.size, "out_features")
        self.weight = placeholder((out_local, in_features), 0, normal(init_std))
        self.bias = placeholder((out_local,), 0, zeros) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False``: leave the bias to the caller (a fused bias+GeLU)."""
        check_initialised(self)
        bias = self.bias if add_bias else None
        if self.sequence_parallel or (self.async_tp and self.group.size > 1):  # f inside
            y = _ColumnLinear.apply(x, self.weight, bias, self.group, self.sequence_parallel,
                                    self.async_tp)
        else:
            x = comm.f(x, self.group)                # [.., in] on every rank; grad all-reduced
            y = F.linear(x, self.weight, bias)       # [.., out/tp]
        return comm.gather(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·A_i + b with A split by input rows; the input X_i is this rank's slice.

    ``sequence_parallel``: the sum is reduce-scattered along the sequence ([b, s/t, out]).
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, init_std: float = 0.02,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel and group.size > 1
        in_local = _divide(in_features, group.size, "in_features")
        self.weight = placeholder((out_features, in_local), 1, normal(init_std))
        # Replicated: added once after the all-reduce, so it is not counted t times.
        self.bias = placeholder((out_features,), None, zeros) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False``: leave the bias to the caller (a fused bias+dropout+add)."""
        check_initialised(self)
        y = F.linear(x, self.weight)                 # [.., out] partial sum on each rank
        if self.sequence_parallel:
            y = comm.reduce_scatter_seq(y, self.group)  # [b, s/t, out] summed, this rank's part
        else:
            y = comm.g(y, self.group)                # [.., out] summed over the tp ranks
        return y if self.bias is None or not add_bias else y + self.bias.to(y.dtype)


def sequence_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: CommGroup) -> torch.Tensor:
    """F.linear(all_gather_seq(x), weight, bias), keeping only x [b, s/t, in] for backward."""
    return _ColumnLinear.apply(x, weight, bias, group, True, False)


class _ColumnLinear(torch.autograd.Function):
    """F.linear(f(x), weight, bias) with the backward written out, as Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication`` (sequence parallel: of x all-gathered, only
    the split x kept, gathered again in backward; backward under forward's autocast). ``overlap``
    waits for each collective only where its result is needed: the re-gather runs during dX = dY·A,
    dX's all-reduce (reduce-scatter) during dW = dYᵀ·X — the same operations on the same tensors,
    bit for bit. Safe on NCCL: all ranks start the collectives in autograd's order, which no timing
    changes; no GEMM between touches their tensors; each is awaited before its result is read."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, overlap):
        dev = x.device.type
        on, dtype = ctx.autocast = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
        x = x.to(dtype) if on else x       # sent in the compute dtype (dX too; autograd casts back)
        ctx.args = group, sequence_parallel, overlap, bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel:                                 # [b, s/t, in] → [b, s, in]
            x = comm.all_gather(x, group, dim=1, label="all_gather_seq forward")
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                  # grad: [b, s, out/t]
        x, weight = ctx.saved_tensors
        (group, sp, overlap, has_bias), (enabled, dtype) = ctx.args, ctx.autocast
        with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            if sp:                                            # x was kept split: gather it again
                gather, x = comm.all_gather(x, group, 1, "all_gather_seq regather", True)
                if not overlap:
                    gather.wait()
            dx = grad.matmul(weight)                          # [b, s, in], partial over tp
            if sp:                                            # summed, split along the sequence
                gather.wait()
                reduce, dx = comm.reduce_scatter(dx, group, 1, "all_gather_seq backward", True)
            else:                                             # f's all-reduce, in place: ours
                reduce = comm.all_reduce_(dx, group, "f backward", True)
            if not overlap:
                reduce.wait()
            dw = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))  # overlap: meanwhile
        db = grad.flatten(0, -2).sum(0).to(weight.dtype) if has_bias else None
        reduce.wait()
        return dx, dw.to(weight.dtype), db, None, None, None


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split in contiguous ranges over tp.

    ``padded_vocab`` rows in all (default ``vocab_size``; it must divide by the tp size); the rows
    from ``vocab_size`` on are padding, initialised to zero and never looked up.
    ``sequence_parallel``: the partial lookups are reduce-scattered along the sequence.
    """

    def __init__(self, vocab_size: int, hidden: int, group: CommGroup, *,
                 padded_vocab: int | None = None, init_std: float = 0.02,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel and group.size > 1
        padded_vocab = vocab_size if padded_vocab is None else padded_vocab
        rows = _divide(padded_vocab, group.size, "padded vocabulary")
        self.vocab_start, self.vocab_end = group.rank * rows, (group.rank + 1) * rows  # its ids
        self.weight = placeholder((rows, hidden), 0, normal(init_std, rows=vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] → their embeddings [b, s, h] ([b, s/t, h] under sequence parallelism)."""
        reduce = comm.reduce_scatter_seq if self.sequence_parallel else comm.g
        return reduce(self.partial(ids), self.group)  # each id found on one rank, summed

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the lookup, before g: its rows, zeros for the ids it lacks."""
        check_initialised(self)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)   # [b, s] not ours
        local = (ids - self.vocab_start).masked_fill(outside, 0)      # look up row 0 instead...
        out = F.embedding(local, self.weight)                           # [b, s, h]
        return out.masked_fill(outside.unsqueeze(-1), 0.0)             # ...and zero it


@torch.no_grad()
def sum_replicated_grads_(grads: list[torch.Tensor], group: CommGroup) -> None:
    """Sequence parallelism's last step (Megatron-LM's ``_allreduce_layernorm_grads``): each tp
    rank computed the gradients of the replicated parameters — layer norms, row-parallel biases,
    positions — from its own part of the sequence; their sum over tp is the whole gradient. One
    all-reduce of them all, flattened. Call it after backward with those parameters' gradients."""
    if group.size == 1 or not grads:
        return
    comm.all_reduce_(flat := torch.cat([g.flatten() for g in grads]), group, "sp replicated grads")
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))
