"""ZeRO stage 1 (Rajbhandari et al. 2020, "P_os"; Megatron-LM's distributed optimizer): the
optimizer state sharded over the dp ranks.

Each dp rank owns 1/dp of every bucket (``Bucket.shard``): backward reduce-scatters the
gradients, the optimizer (and its Adam moments) exists for that shard only, and the updated
shards are all-gathered into every replica's weights. The traffic equals one all-reduce; the
optimizer state per rank falls to 1/dp. A rank steps its ``Piece``s, the parts of parameters in
its shards, with any element-wise optimizer (``DistributedOptimizer``). Under context
parallelism PTD-P passes the dp × cp ranks that hold the same weights (``grid.dp_cp_group``), so
the state falls to 1/(dp·cp), as in megatron-core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.data_parallel.buckets import Bucket
from megatron_edu.data_parallel.ddp import DataParallel, Launched
from megatron_edu.grid import ParallelGrid
from megatron_edu.optim import clip_held_grads_

__all__ = ["ZeRO1", "DistributedOptimizer"]


@dataclass(eq=False)
class Piece:
    """The part of ``param`` in this rank's shard of a bucket: ``tensor`` views the flat parameter
    buffer (an update lands in the weights) and its ``.grad`` the gradient shard; the optimizer
    steps it. ``offset``: its start in ``param`` flattened (for whole states in checkpoints)."""

    tensor: torch.Tensor
    param: nn.Parameter
    offset: int


class ZeRO1(DataParallel):
    """``DataParallel`` whose gradients are reduce-scattered, each rank keeping its shard's sum
    (Megatron-LM's ``overlap_grad_reduce``), and whose optimizer (``DistributedOptimizer``) steps
    this rank's shard only, then all-gathers the updated weights."""

    shards_optimizer = True          # each rank holds its pieces' state only (checkpoints)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("ZeRO keeps fp32 parameters, the master weights (use autocast for "
                             "bf16/fp16 compute)")
        self.pieces = [piece for bucket in self.buckets for piece in _pieces(bucket)]

    def _allocate(self, bucket: Bucket) -> None:
        super()._allocate(bucket)                    # the whole gradients, as stage 0
        bucket.grad_shard = bucket.grad_data[bucket.start:bucket.end]
        bucket.flatten_params()

    def _reduce(self, bucket: Bucket) -> Launched:
        """Start the reduce-scatter, in place: the sum of this rank's shard lands in its own slice
        of the bucket's buffer (Megatron-LM's distributed optimizer), here ``grad_shard``."""
        work, mine = comm.reduce_scatter(bucket.grad_data, bucket.group, 0, "dp grads",
                                         async_op=True,
                                         out=bucket.grad_data[bucket.start:bucket.end],
                                         tag=bucket.index)
        return work, lambda: self._keep(bucket, mine)

    def _keep(self, bucket: Bucket, mine: torch.Tensor) -> None:
        """Keep the reduced shard ``mine``: it is ``grad_shard`` already."""

    def local_grads(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The gradients this rank holds of ``params``: their pieces in its shards."""
        wanted = {id(p) for p in params}
        return [piece.tensor.grad for piece in self.pieces if id(piece.param) in wanted]

    def held_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def clip_grad_norm_(self, max_norm: float, grid: ParallelGrid,
                        tied_copies: Iterable[nn.Parameter] = ()) -> torch.Tensor:
        """Clip by the global norm from this rank's pieces, the squares summed over dp (× cp)."""
        return clip_held_grads_([(piece.param, piece.tensor.grad) for piece in self.pieces],
                                max_norm, grid, tied_copies, sum_over=(self.group,),
                                expert_sum_over=(self.ep_group, self.edp_group))

    def optimizer(self, param_groups: list[dict], optimizer_cls: type[torch.optim.Optimizer],
                  **defaults) -> DistributedOptimizer:
        return DistributedOptimizer(param_groups, self, optimizer_cls, **defaults)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step this rank's pieces, then give every rank every updated shard."""
        optimizer.step()
        for bucket in self.buckets:          # in place: the shards are param_data's own slices
            comm.all_gather(bucket.param_shard, bucket.group, 0, "dp params",
                            out=bucket.param_data)


class DistributedOptimizer:
    """Any element-wise optimizer, run by each dp rank on its pieces (``ZeRO1.optimizer``).
    ``params``: parameters or groups, as for ``torch.optim``, covering exactly ``zero``'s; each
    piece goes in its parameter's group. Element-wise rules (SGD, Adam, AdamW) give exactly the
    unsharded result; rules that need a whole tensor (LAMB's trust ratio, Adafactor) would not.
    Parameters are fp32, the master weights (mixed precision by autocast): no separate copy."""

    def __init__(self, params: Iterable, zero: ZeRO1,
                 optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **defaults) -> None:
        self.ddp, self.group, self.pieces = zero, zero.group, zero.pieces
        groups = _param_groups(params, zero)
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        for g in groups:
            g["params"] = []
        for piece in self.pieces:
            groups[group_of[id(piece.param)]]["params"].append(piece.tensor)
        self.optimizer = optimizer_cls(groups, **defaults)
        self.state_keys = _state_keys(optimizer_cls, defaults)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups: set ``group["lr"]`` here to schedule the learning rate."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self) -> None:
        self.ddp.zero_grad()

    def step(self) -> None:
        """Step this rank's pieces; the stage then shares the result (``ZeRO1.step``)."""
        self.ddp.step(self.optimizer)

    @torch.no_grad()
    def param_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's whole optimizer state, as an unsharded optimizer holds it ({} before
        any step). A collective every dp rank runs, even one holding no piece (a bucket smaller
        than dp): each writes its pieces into zeros, the sums assemble them, and the scalar state
        (Adam's step) comes from the ranks that have one."""
        tensors, scalars = self.state_keys
        have = float(bool(self.optimizer.state))
        sample = next(iter(self.optimizer.state.values()), {})
        shared = torch.tensor([have] + [float(sample.get(k, 0.0)) * have for k in scalars],
                              dtype=torch.float64, device=self.ddp.params[0].device)
        shared = comm.all_reduce(shared, self.group, "dp optimizer state")
        if shared[0] == 0:
            return {}
        full = {p: {k: torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for k in tensors}
                for p in self.ddp.params}
        for piece in self.pieces:
            for k in tensors:
                state = self.optimizer.state[piece.tensor][k]
                full[piece.param][k][piece.offset:piece.offset + state.numel()] = state
        return {p: {**{k: comm.all_reduce(v, self.ddp.group_of(p), "dp optimizer state")
                       .view_as(p)
                       for k, v in full[p].items()},
                    **{k: torch.tensor(float(shared[1 + i] / shared[0]))
                       for i, k in enumerate(scalars)}}
                for p in self.ddp.params}

    @torch.no_grad()
    def load_param_states(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """The inverse of ``param_states``: keep this rank's pieces of each whole state."""
        for piece in self.pieces:
            numel = piece.tensor.numel()
            self.optimizer.state[piece.tensor] = {
                k: (v.clone() if v.dim() == 0 else
                    v.reshape(-1)[piece.offset:piece.offset + numel].clone())
                for k, v in states[piece.param].items()}


def _state_keys(optimizer_cls, defaults) -> tuple[list[str], list[str]]:
    """(tensor keys, scalar keys) of the optimizer's per-parameter state, found by one step on a
    one-element probe: every rank knows them, even one that holds no piece."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.zeros(1)
    optimizer = optimizer_cls([probe], **defaults)
    optimizer.step()
    state = optimizer.state[probe]
    return (sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0),
            sorted(k for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0))


def _param_groups(params: Iterable, ddp: DataParallel) -> list[dict]:
    """Normalise ``params`` to groups (dicts) and check they cover exactly ddp's parameters."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{**g, "params": list(g["params"])} for g in groups]
    given = {id(p) for g in groups for p in g["params"]}
    held = {id(p) for p in ddp.params}
    if given != held:
        raise ValueError(f"the optimizer's parameters must be exactly DataParallel's: "
                         f"{len(given - held)} given but not held, {len(held - given)} held but "
                         f"not given")
    return groups


def _pieces(bucket: Bucket) -> list[Piece]:
    """The ``Piece``s of the bucket's parameters that lie in this rank's shard."""
    lo, hi = bucket.start, bucket.end                     # this rank's shard of the buffer
    pieces = []
    for p, start, stop in zip(bucket.params, bucket.offsets, bucket.offsets[1:], strict=False):
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            piece = Piece(bucket.param_shard[a - lo:b - lo], p, a - start)
            piece.tensor.grad = bucket.grad_shard[a - lo:b - lo]
            pieces.append(piece)
    return pieces
