"""ZeRO stage 1 (Rajbhandari et al. 2020; Megatron-LM's distributed optimizer): the optimizer
state sharded over the dp ranks — and the optimizer of stages 2 and 3.

With ``DataParallel(..., zero=1)`` each dp rank owns 1/dp of every bucket: backward
reduce-scatters the gradients (a rank receives only its shard's sum), the optimizer — and so its
Adam moments — exists for that shard only, and the updated shards are all-gathered back into
every replica's weights. The traffic equals one all-reduce (= reduce-scatter + all-gather); the
optimizer state per rank falls to 1/dp. Under ZeRO-2 the gradient shards are all a rank holds of
the gradients, and under ZeRO-3 the parameter shards all it holds of the weights: the optimizer
steps the same shards (``Bucket.param_shard``, ``grad_shard``); ZeRO-3 gathers nothing after
the step — the next forward does (``zero3.py``).

"The dp ranks" are the ranks of ``ddp.group``: under context parallelism PTD-P gives it the
dp × cp ranks that hold the same weights (``grid.dp_cp_group``), so the state falls to 1/(dp·cp),
as megatron-core shards its distributed optimizer over data-parallel-with-context ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.data_parallel.ddp import DataParallel
from megatron_edu.grid import ParallelGrid
from megatron_edu.optim import counted_in_norm, global_grad_norm, optimizer_state_bytes, scale_grads

__all__ = ["Piece", "DistributedOptimizer"]


@dataclass(eq=False)
class Piece:
    """The part of parameter ``param`` that lies in this rank's shard of a bucket.

    ``tensor`` is a view of the bucket's flat parameter buffer (an update lands in the model's
    weights) whose ``.grad`` views the same range of the gradient buffer; the optimizer steps it.
    ``offset``: where it starts in ``param`` flattened (to assemble whole states for checkpoints).
    """

    tensor: torch.Tensor
    param: nn.Parameter
    offset: int


class DistributedOptimizer:
    """ZeRO stage 1: any element-wise optimizer, run by each dp rank on its 1/dp shard of every
    bucket, then the shards are all-gathered.

    ``params``: parameters or param groups (as for ``torch.optim``; e.g. ``build_param_groups``),
    covering exactly the parameters of ``ddp``, whose ``zero`` stage must be 1, 2 or 3.
    ``optimizer_cls(**defaults)`` is built over the ``Piece`` tensors of this rank, each in its
    parameter's group. Element-wise update rules (SGD, Adam, AdamW) give exactly the unsharded
    result; rules that need a whole tensor (LAMB's trust ratio, Adafactor) would not. Parameters
    are fp32 here — they are the master weights (mixed precision by autocast) — so ZeRO's
    separate fp32 master copy is not needed.
    """

    def __init__(self, params: Iterable, ddp: DataParallel,
                 optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **defaults) -> None:
        if ddp.zero == 0:
            raise ValueError("DistributedOptimizer needs DataParallel(..., zero=1, 2 or 3): its "
                             "gradients must be reduce-scattered, not all-reduced")
        if any(p.dtype != torch.float32 for p in ddp.params):
            raise ValueError("DistributedOptimizer keeps fp32 parameters (use autocast for "
                             "bf16/fp16 compute)")
        self.ddp, self.group = ddp, ddp.group
        groups = _param_groups(params, ddp)
        self.pieces = _shard_pieces(ddp, groups)
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

    def clip_grad_norm_(self, max_norm: float, grid: ParallelGrid,
                        tied_copies: Iterable[nn.Parameter] = ()) -> float:
        """Clip by the global norm; each rank holds 1/dp of the gradients, so sum over dp (× cp)
        too (``global_grad_norm(dp_sharded=True)``).
        ``tied_copies``: parameters whose original another stage holds (counted there)."""
        copies = {id(p) for p in tied_copies}
        counted = [piece.tensor.grad for piece in self.pieces
                   if counted_in_norm(piece.param, grid.tp_rank) and id(piece.param) not in copies]
        norm = global_grad_norm(counted, grid, dp_sharded=True)
        scale_grads([piece.tensor.grad for piece in self.pieces], norm, max_norm)
        return norm

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: ≈ 1/dp of the unsharded optimizer's."""
        return optimizer_state_bytes(self.optimizer)

    @torch.no_grad()
    def param_states(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's whole optimizer state, as an unsharded optimizer would hold it.

        A collective over dp that every rank runs alike — also one that holds no piece (a bucket
        smaller than dp): each writes its pieces into zeros, the sums assemble them, and the
        scalar state (Adam's step) is taken from the ranks that have one. {} before any step.
        """
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
        return {p: {**{k: comm.all_reduce(v, self.group, "dp optimizer state").view_as(p)
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

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's shard of each bucket; then every rank gets every updated shard
        (ZeRO-1, 2) — or, under ZeRO-3, keeps its shard until the next forward gathers it."""
        if self.ddp.sharding is not None:        # ZeRO-3
            self.ddp.sharding.free_all()         # no gathered copy outlives the update
            self.optimizer.step()
            return
        self.optimizer.step()
        for bucket in self.ddp.buckets:
            bucket.param_data.copy_(comm.all_gather(bucket.param_shard, self.group, dim=0,
                                                    label="dp params"))


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


def _shard_pieces(ddp: DataParallel, groups: list[dict]) -> list[Piece]:
    """Replace each group's parameters by the pieces of them that lie in this rank's shards."""
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    for g in groups:
        g["params"] = []
    pieces = []
    for bucket in ddp.buckets:
        lo, hi = bucket.start, bucket.end                 # this rank's shard of the buffer
        for p, start, stop in zip(bucket.params, bucket.offsets, bucket.offsets[1:],
                                  strict=False):
            a, b = max(lo, start), min(hi, stop)
            if a >= b:
                continue
            piece = Piece(bucket.param_shard[a - lo:b - lo], p, a - start)
            piece.tensor.grad = bucket.grad_shard[a - lo:b - lo]
            groups[group_of[id(p)]]["params"].append(piece.tensor)
            pieces.append(piece)
    return pieces
