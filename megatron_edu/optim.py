"""Optimizer helpers: the global gradient norm under tp × pp × dp, weight-decay groups, lr schedule.

References: Pascanu et al. 2013 (gradient clipping by the global norm); Loshchilov & Hutter 2019
(AdamW, decoupled weight decay; cosine schedule from SGDR 2017); Narayanan et al. 2021 (arXiv
2104.04473) for how Megatron-LM computes the norm when the model is split over ranks.

**The global norm** is the norm of the *whole model's* gradient, as one serial process would
compute it. Under tensor and pipeline parallelism each rank holds a part of the model, so each
rank sums the squares of its part and the sums are added over the model-parallel group
(``grid.mp_group``: the tp × pp ranks of one replica). Two kinds of parameter are held twice
and must be counted once (Megatron-LM's ``param_is_not_tensor_parallel_duplicate`` and
``param_is_not_shared``):

* replicated across tp (``param.tp_dim is None``: layer norms, row-parallel biases, positions):
  every tp rank holds the same gradient — counted on tp rank 0 only;
* a copy of a parameter held by another pipeline stage (the last stage's copy of the tied word
  embedding; the caller names them in ``tied_copies``) — never counted; its original is.

After the dp all-reduce every dp replica holds the same gradients, so no sum over dp is needed.
Under ZeRO each rank holds only its shard of them, 1/(dp·cp) (the dp × cp ranks that hold the
same weights share the optimizer, as in megatron-core): then the sums are also added over
``grid.dp_cp_group`` (``sum_over``; the dp group when cp = 1). Either way the returned norm is
equal on every rank — also when it is not finite: a NaN or inf on any rank makes it inf on all
of them, so that every rank skips the step together (a replica that stepped alone would drift
from the others).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid

__all__ = ["clip_grad_norm_", "global_grad_norm", "counted_in_norm", "scale_grads",
           "build_param_groups", "warmup_cosine", "optimizer_state_bytes", "FixedLossScale",
           "DynamicLossScale"]

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6)


def counted_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Does this tp rank count ``param`` in the global norm? (split: yes; replicated: rank 0)"""
    return getattr(param, "tp_dim", None) is not None or tp_rank == 0


@torch.no_grad()
def global_grad_norm(grads: Iterable[torch.Tensor], grid: ParallelGrid | None = None,
                     sum_over: Sequence[comm.CommGroup] = ()) -> float:
    """The norm of the whole model's gradient from the gradients this rank counts: their squares
    summed over ``grid.mp_group`` and the groups ``sum_over`` (a sharded optimizer's dp × cp
    ranks); then the replicas, ``grid.dp_cp_group``, agree on a non-finite norm whichever saw
    it. Collectives: every rank must call it (see the module docstring)."""
    device, grads = grid.device if grid is not None else torch.device("cpu"), list(grads)
    squares = (torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum()
               if grads else torch.zeros((), device=device))  # one foreach, not 4 kernels a tensor
    if grid is None:
        return squares.sqrt().item()
    for group in (grid.mp_group, *sum_over):
        squares = comm.all_reduce(squares, group, "grad norm")
    bad = comm.all_reduce((~squares.isfinite()).float(), grid.dp_cp_group, "grad norm")
    return torch.where(bad > 0, math.inf, squares.sqrt()).item()   # one host sync


@torch.no_grad()
def scale_grads(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale by max_norm / norm if that is below 1 (as torch: ``max_norm / (norm + 1e-6)``);
    a non-finite norm leaves the gradients alone: that step is skipped, not clipped."""
    grads, scale = list(grads), max_norm / (norm + EPS)
    if math.isfinite(norm) and scale < 1.0 and grads:
        torch._foreach_mul_(grads, scale)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float,
                    grid: ParallelGrid | None = None,
                    tied_copies: Iterable[torch.Tensor] = ()) -> float:
    """Scale the gradients so that the global norm is at most ``max_norm``; return that norm.

    ``grid`` None: one serial process. A collective over ``grid.mp_group`` (and over
    ``grid.dp_cp_group`` when dp · cp > 1): every rank must call it. Parameters without a
    gradient are skipped; ``tied_copies`` are not counted (their originals are, on another stage).
    """
    params = list({id(p): p for p in params if p.grad is not None}.values())
    tp_rank = grid.tp_rank if grid is not None else 0
    copies = {id(p) for p in tied_copies}
    norm = global_grad_norm([p.grad for p in params
                             if counted_in_norm(p, tp_rank) and id(p) not in copies], grid)
    scale_grads([p.grad for p in params], norm, max_norm)
    return norm


def build_param_groups(modules: nn.Module | Iterable[nn.Module],
                       weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight matrices and embeddings decay; biases and layer norms do not.

    The rule of GPT-2 as trained by Megatron-LM and nanoGPT: a parameter with fewer than two
    dimensions (a bias, a layer norm's gain or shift) gets no weight decay; pulling a gain
    towards zero would shrink the activations rather than regularise. Embedding tables are
    matrices and decay (Megatron-LM; nanoGPT the same). A parameter shared by two modules
    (a tied embedding within one stage) appears once.
    """
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values()
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up over ``warmup``
    steps to ``lr``, then a half cosine down to ``min_lr`` at step ``total``, then ``min_lr``.

    Step 0 already takes lr/warmup (a zero first step would waste a batch).
    """
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
    """fp16's dynamic loss scaling (Micikevicius et al. 2018; 1909.08053 trains so).

    fp16 holds nothing below ~6e-8: small gradients of activations would flush to zero. So the
    loss is multiplied by ``scale`` before backward (every gradient with it), and the gradients
    divided by it again before the update. Too large a scale overflows to inf: then the step is
    skipped — on every rank, since the global norm that sees the inf is agreed by all — and the
    scale halved; after ``growth_interval`` clean steps in a row it doubles again.
    """

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
