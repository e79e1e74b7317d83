"""Column- and row-parallel linear layers and the vocabulary-parallel embedding (1909.08053 §3).

A linear layer Y = X·A splits two ways over t tensor-parallel ranks:

* **by columns** (``ColumnParallelLinear``): A = [A_1, …, A_t], rank i computes Y_i = X·A_i.
  Every rank needs all of X: ``f`` (identity forward, all-reduce backward). A nonlinearity can
  follow on each slice alone, GeLU(X·A_i): why the MLP's first matrix is split so (§3, eq. 3).
* **by rows** (``RowParallelLinear``): A = [A_1; …; A_t], rank i holds A_i and the matching
  slice X_i of the input (a column layer's output); ``g`` sums Y = Σ_i X_i·A_i (all-reduce
  forward, identity backward). The bias is added once, after the sum.

Column then row, an MLP or attention block costs one all-reduce forward and one backward (Figure
3). Weights are stored [out, in], as nn.Linear stores them: a column split is ``tp_dim=0``, a
row split ``tp_dim=1``. The embedding is split by vocabulary: each rank looks up the ids in its
rows, zeros for the others, and ``g`` sums the partial lookups. With a group of one every layer
is the plain PyTorch layer; parameters are filled by ``init.init_parameters``.

How a region is entered and left is a ``TensorParallel`` object, chosen once for the model
(torchtitan's parallel styles): ``TensorParallel`` is Figure 3 as written; ``AsyncTensorParallel``
overlaps the column layer's dX all-reduce with dW; ``sequence_parallel.SequenceParallel`` splits
the activations along the sequence outside the regions. The layers ask their style, never branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.tensor_parallel.init import check_initialised, normal, placeholder, zeros

__all__ = ["serial_group", "TensorParallel", "AsyncTensorParallel", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "in_compute_dtype"]


def serial_group(name: str = "tp") -> CommGroup:
    """A group of this process alone: the layers below are then the plain serial layers."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommGroup(name, (rank,))


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {t}")
    return n // t


class TensorParallel:
    """How a tensor-parallel region over ``group`` is entered and left (1909.08053 §3, Figure 3):
    outside, every tp rank holds the whole activation [b, s, h]."""

    sequence_split = 1               # the parts of the sequence a rank holds outside a region

    def __init__(self, group: CommGroup) -> None:
        self.group = group

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        """X·A_i (+ b_i) of the whole X: ``f`` (identity forward, all-reduce of dX backward)."""
        return F.linear(comm.f(x, self.group), weight, bias)     # [.., out/t] on rank i

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """x as every rank of the region uses it whole: ``f`` (the experts' input, model/moe.py)."""
        return comm.f(x, self.group)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence of x [b, s, ...] without autograd (the routing decisions): here x."""
        return x

    def token_group(self, cp_group: CommGroup, tp_cp_group: CommGroup) -> CommGroup:
        """The ranks that split each sequence outside the regions: here the cp ranks."""
        return cp_group

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Σ_i of the ranks' partial results, on every rank: ``g`` (all-reduce forward)."""
        return comm.g(partial, self.group)


class AsyncTensorParallel(TensorParallel):
    """Figure 3 with the column layer's backward written out (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``): dX's all-reduce runs during dW."""

    def column_linear(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return _AsyncColumnLinear.apply(x, weight, bias, self.group)


class ColumnParallelLinear(nn.Module):
    """Y = X·A + b with A split by output columns: this rank computes Y_i = X·A_i + b_i. ``style``
    enters the region: ``f`` then ``F.linear`` (whose dX and dW zero bubble splits), ``f``
    overlapped with dW (``AsyncTensorParallel``), or sequence parallelism's all-gather."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, init_std: float = 0.02,
                 style: type[TensorParallel] = TensorParallel) -> None:
        super().__init__()
        self.group, self.style = group, style(group)
        out_local = _divide(out_features, group.size, "out_features")
        self.weight = placeholder((out_local, in_features), 0, normal(init_std))
        self.bias = placeholder((out_local,), 0, zeros) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False``: leave the bias to the caller (a fused bias+GeLU)."""
        check_initialised(self)
        return self.style.column_linear(x, self.weight, self.bias if add_bias else None)


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·A_i + b with A split by input rows; the input X_i is this rank's slice. The
    bias is replicated, added once after the sum; ``style`` says how the sum is made (``g``; a
    reduce-scatter along the sequence under sequence parallelism, [b, s/t, out])."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, init_std: float = 0.02,
                 style: type[TensorParallel] = TensorParallel) -> None:
        super().__init__()
        self.group, self.style = group, style(group)
        in_local = _divide(in_features, group.size, "in_features")
        self.weight = placeholder((out_features, in_local), 1, normal(init_std))
        self.bias = placeholder((out_features,), None, zeros) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False``: leave the bias to the caller (a fused bias+dropout+add)."""
        check_initialised(self)
        y = self.style.reduce(F.linear(x, self.weight))  # [.., out] summed over the tp ranks
        return y if self.bias is None or not add_bias else y + self.bias.to(y.dtype)


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's compute dtype where autocast is on (bf16: the residual stream, and what
    crosses tp and pp, in Megatron-LM's 2 bytes an element), else unchanged."""
    return x.to(comm.compute_dtype(x.device.type, x.dtype))


def autocast_of(x: torch.Tensor) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for x's device, and its compute dtype: saved by a forward whose
    backward is written out, to run under the same autocast."""
    dev = x.device.type
    return torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


class _AsyncColumnLinear(torch.autograd.Function):
    """F.linear(f(x), weight, bias) with the backward written out: dX's all-reduce is awaited
    only after dW = dYᵀ·X — the same operations on the same tensors, bit for bit. Safe on NCCL:
    all ranks start the collective in autograd's order, which no timing changes; no GEMM between
    touches its tensor; it is awaited before its result is read. Under autocast, X and dX travel
    in the compute dtype and the backward runs under the forward's autocast."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.autocast = on, dtype = autocast_of(x)
        x = x.to(dtype) if on else x       # in the compute dtype (dX too; autograd casts back)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                  # grad: [b, s, out/t]
        x, weight = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        with torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            dx = grad.matmul(weight)                          # [b, s, in], partial over tp
            reduce = comm.all_reduce_(dx, ctx.group, "f backward", async_op=True)  # in place
            dw = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))        # meanwhile
        db = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        reduce.wait()
        return dx, dw.to(weight.dtype), db, None


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split in contiguous ranges over tp:
    ``padded_vocab`` rows (default ``vocab_size``), those from ``vocab_size`` on zero padding,
    never looked up. ``style`` sums the partial lookups."""

    def __init__(self, vocab_size: int, hidden: int, group: CommGroup, *,
                 padded_vocab: int | None = None, init_std: float = 0.02,
                 style: type[TensorParallel] = TensorParallel) -> None:
        super().__init__()
        self.group, self.style = group, style(group)
        padded_vocab = vocab_size if padded_vocab is None else padded_vocab
        rows = _divide(padded_vocab, group.size, "padded vocabulary")
        self.vocab_start, self.vocab_end = group.rank * rows, (group.rank + 1) * rows  # its ids
        self.weight = placeholder((rows, hidden), 0, normal(init_std, rows=vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] → their embeddings [b, s, h] ([b, s/t, h] under sequence parallelism)."""
        return self.style.reduce(in_compute_dtype(self.partial(ids)))  # found on one rank

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the lookup, before g: its rows, zeros for the ids it lacks."""
        check_initialised(self)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)   # [b, s] not ours
        local = (ids - self.vocab_start).masked_fill(outside, 0)      # look up row 0 instead...
        out = F.embedding(local, self.weight)                           # [b, s, h]
        return out.masked_fill(outside.unsqueeze(-1), 0.0)             # ...and zero it
