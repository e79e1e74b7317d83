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

With a group of one member every layer here is the plain PyTorch layer and communicates nothing.
Parameters are allocated here and filled by ``init.init_parameters`` (each rank drawing its
shard only, the same numbers at any tp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.tensor_parallel.init import mark, normal, zeros

__all__ = ["serial_group", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


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
    """

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, gather_output: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        out_local = _divide(out_features, group.size, "out_features")
        self.weight = mark(nn.Parameter(torch.empty(out_local, in_features)), 0, normal(init_std))
        self.bias = mark(nn.Parameter(torch.empty(out_local)), 0, zeros) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.f(x, self.group)                    # [.., in] on every rank; grad all-reduced
        y = F.linear(x, self.weight, self.bias)      # [.., out/tp]
        return comm.gather(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·A_i + b with A split by input rows; the input X_i is this rank's slice."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, *,
                 bias: bool = True, init_std: float = 0.02) -> None:
        super().__init__()
        self.group = group
        in_local = _divide(in_features, group.size, "in_features")
        self.weight = mark(nn.Parameter(torch.empty(out_features, in_local)), 1, normal(init_std))
        # Replicated: added once after the all-reduce, so it is not counted t times.
        self.bias = mark(nn.Parameter(torch.empty(out_features)), None, zeros) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)                 # [.., out] partial sum on each rank
        y = comm.g(y, self.group)                    # [.., out] summed over the tp ranks
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split in contiguous ranges over tp.

    ``padded_vocab`` rows in all (default ``vocab_size``; it must divide by the tp size); the rows
    from ``vocab_size`` on are padding, initialised to zero and never looked up.
    """

    def __init__(self, vocab_size: int, hidden: int, group: CommGroup, *,
                 padded_vocab: int | None = None, init_std: float = 0.02) -> None:
        super().__init__()
        self.group = group
        padded_vocab = vocab_size if padded_vocab is None else padded_vocab
        rows = _divide(padded_vocab, group.size, "padded vocabulary")
        rank = group.rank if group.size > 1 else 0
        self.vocab_start, self.vocab_end = rank * rows, (rank + 1) * rows  # this rank's ids
        init = normal(init_std, rows=vocab_size)
        self.weight = mark(nn.Parameter(torch.empty(rows, hidden)), 0, init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return comm.g(self.partial(ids), self.group)  # [b, s, h]: each id found on one rank

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the lookup, before g: its rows, zeros for the ids it lacks."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)   # [b, s] not ours
        local = (ids - self.vocab_start).masked_fill(outside, 0)      # look up row 0 instead...
        out = F.embedding(local, self.weight)                           # [b, s, h]
        return out.masked_fill(outside.unsqueeze(-1), 0.0)             # ...and zero it
