"""Optimizer helpers: the global gradient norm under tp × pp × dp, weight-decay groups, lr schedule.

References: Pascanu et al. 2013 (clipping by the global norm); Loshchilov & Hutter 2019 (AdamW;
cosine schedule from SGDR 2017); 2104.04473 for Megatron-LM's norm over a split model.

**The global norm** is the *whole model's* gradient norm, as one serial process would compute it:
each rank sums the squares of its part, the sums are added over ``grid.mp_group`` (the tp × pp
ranks of a replica), and a parameter held twice counts once (Megatron-LM's
``param_is_not_tensor_parallel_duplicate``, ``param_is_not_shared``): one replicated across tp
(``tp_dim`` None) on tp rank 0 only, a kv head held by r tp ranks on the first of them, the
last stage's copy of the tied embedding (``tied_copies``) never. Replicas hold the same
gradients after the dp all-reduce; under ZeRO each rank holds a 1/(dp·cp) shard, so the sums are
also added over ``grid.dp_cp_group`` (``sum_over``). A NaN or inf on any rank makes the norm inf
on all, so every rank skips the step together (a replica that stepped alone would drift).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid

__all__ = ["clip_grad_norm_", "clip_held_grads_", "build_param_groups", "warmup_cosine",
           "optimizer_state_bytes", "FixedLossScale", "DynamicLossScale"]

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6)


def counted_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Does this tp rank count ``param`` in the global norm? (split: yes, or the first of the
    ``tp_replicas`` ranks holding each part; replicated: rank 0)"""
    if getattr(param, "tp_dim", None) is None:
        return tp_rank == 0
    return tp_rank % getattr(param, "tp_replicas", 1) == 0


@torch.no_grad()
def global_grad_norm(grads: Iterable[torch.Tensor], grid: ParallelGrid | None = None,
                     sum_over: Sequence[comm.CommGroup] = (),
                     experts: tuple[Iterable[torch.Tensor], Sequence[comm.CommGroup]] = ((), ())
                     ) -> torch.Tensor:
    """The whole model's gradient norm from the gradients this rank counts, summed over
    ``grid.mp_group`` and ``sum_over``; ``experts``: the expert gradients it counts, summed over
    their own groups instead (the ep ranks holding the other experts; each expert counted once);
    the replicas agree on a non-finite norm (inf). A collective. A 0-d tensor on the device, as
    torch's: reading it is the caller's one host sync."""
    device = grid.device if grid is not None else torch.device("cpu")
    squares = _squares(grads, device)
    if grid is None:
        return (squares + _squares(experts[0], device)).sqrt()
    for group in sum_over:
        squares = comm.all_reduce(squares, group, "grad norm")
    expert_squares = _squares(experts[0], device)
    for group in experts[1]:
        expert_squares = comm.all_reduce(expert_squares, group, "grad norm")
    squares = comm.all_reduce(squares + expert_squares, grid.mp_group, "grad norm")
    bad = comm.all_reduce((~squares.isfinite()).float(), grid.dp_cp_group, "grad norm")
    return torch.where(bad > 0, math.inf, squares.sqrt())


def _squares(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ of the squares of ``grads``: one foreach, not 4 kernels a tensor."""
    grads = list(grads)
    return (torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum()
            if grads else torch.zeros((), device=device))


@torch.no_grad()
def scale_grads(grads: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale by ``max_norm / (norm + 1e-6)`` if below 1, as torch; a non-finite norm: untouched.
    The factor stays on the device (torch's ``clip_grad_norm_`` too): no host sync."""
    grads = list(grads)
    factor = (max_norm / (norm + EPS)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, torch.where(norm.isfinite(), factor, 1.0))


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float,
                    grid: ParallelGrid | None = None,
                    tied_copies: Iterable[torch.Tensor] = ()) -> float:
    """Scale the gradients so that the global norm is at most ``max_norm``; return that norm.
    A collective (``grid`` None: one serial process); ``tied_copies`` are not counted."""
    params = {id(p): p for p in params if p.grad is not None}.values()
    experts = () if grid is None else (grid.ep_group,)
    return clip_held_grads_([(p, p.grad) for p in params], max_norm, grid, tied_copies,
                            expert_sum_over=experts).item()


def clip_held_grads_(held: Iterable[tuple[torch.Tensor, torch.Tensor]], max_norm: float,
                     grid: ParallelGrid | None = None, tied_copies: Iterable[torch.Tensor] = (),
                     sum_over: Sequence[comm.CommGroup] = (),
                     expert_sum_over: Sequence[comm.CommGroup] = ()) -> torch.Tensor:
    """``clip_grad_norm_`` of what this rank holds, (parameter, gradient) pairs: whole gradients,
    or under ZeRO its shard's pieces, whose squares are summed over ``sum_over`` too (an
    expert's over ``expert_sum_over``). The norm is returned on the device: a training step
    reads it with its loss, in one host sync."""
    held, copies = list(held), {id(p) for p in tied_copies}
    tp_rank = grid.tp_rank if grid is not None else 0
    counted = [(p, g) for p, g in held if counted_in_norm(p, tp_rank) and id(p) not in copies]
    experts = [g for p, g in counted if getattr(p, "expert_ids", None) is not None]
    dense = [g for p, g in counted if getattr(p, "expert_ids", None) is None]
    norm = global_grad_norm(dense, grid, sum_over, (experts, expert_sum_over))
    scale_grads([g for _, g in held], norm, max_norm)
    return norm


def build_param_groups(modules: nn.Module | Iterable[nn.Module],
                       weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (weights, embeddings) decay; biases and layer norms do not, as a
    gain pulled to zero shrinks the activations (Megatron-LM, nanoGPT). Shared parameters once."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values()
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """The lr of step ``step`` (0-based): linear warm-up to ``lr`` (step 0 already takes
    lr/warmup: a zero step would waste a batch), a half cosine to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)          # 0 → 1
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (Adam: exp_avg, exp_avg_sq, step)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


@dataclass
class FixedLossScale:
    """No loss scaling (fp32, bf16): backward from the loss itself, every step."""

    scale: float = 1.0

    def update(self, overflow: bool) -> None:
        """Nothing to adapt."""


@dataclass
class DynamicLossScale:
    """fp16's dynamic loss scaling (Micikevicius et al. 2018; 1909.08053 trains so): fp16 holds
    nothing below ~6e-8, so the loss is multiplied by ``scale`` before backward and the gradients
    divided by it before the update. An overflow (inf) skips the step on every rank (the global
    norm is agreed) and halves the scale; ``growth_interval`` clean steps double it."""

    scale: float = 2.0**16
    growth_interval: int = 1000
    factor: float = 2.0
    clean_steps: int = 0

    def update(self, overflow: bool) -> None:
        """After a step: halve on an overflow, double after growth_interval clean steps."""
        if overflow:
            self.scale, self.clean_steps = self.scale / self.factor, 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale, self.clean_steps = self.scale * self.factor, 0
