"""Parameters independent of the layout: drawn whole, then sliced; gathered back whole.

DESIGN principle 1 ("one serial truth"): every parameter is drawn as the *full* matrix the serial
model would hold, from a generator seeded by (model seed, the parameter's full name), and each
tensor-parallel rank keeps its slice. So tp = 1, 2, 4 start from the same weights, and a parallel
run can be checked against the serial one step by step. (Megatron-LM does the same with a "master
weight" drawn whole and split; picotron draws per shard, which cannot be compared with serial.)

Every parameter carries two attributes set where it is created:

* ``param.tp_dim`` — the dimension it is split along across the tensor-parallel group, or None
  when every tp rank holds the whole of it (layer norms, row-parallel biases, positions). Gathering
  shards, resharding checkpoints and a global gradient norm without double counting all read it.
* ``param.init`` — how to draw the full tensor: ``normal(std)``, ``normal(std, rows=n)`` (only
  the first n rows are drawn, the rest are zero: vocabulary padding), ``zeros`` or ``ones``.

GPT-2's initialisation (Radford et al. 2019 §2.3; 1909.08053 §3 follows it): weights normal(0,
0.02), residual output projections scaled by 1/sqrt(2·layers), biases zero, layer-norm weights one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup

__all__ = [
    "Init", "normal", "zeros", "ones", "mark", "param_seed", "full_shape", "shard",
    "gather_full", "init_parameters",
]

Init = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]  # (full shape, gen) -> tensor


def normal(std: float, rows: int | None = None) -> Init:
    """N(0, std²) for the whole tensor, or for its first ``rows`` rows and zeros below them."""

    def draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        n = shape[0] if rows is None else rows
        out = torch.zeros(shape)
        out[:n] = torch.randn((n, *shape[1:]), generator=gen) * std
        return out

    return draw


def zeros(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.zeros(shape)


def ones(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.ones(shape)


def mark(param: nn.Parameter, tp_dim: int | None, init: Init) -> nn.Parameter:
    """Attach the split dimension and the initialiser to a parameter; return it."""
    param.tp_dim = tp_dim
    param.init = init
    return param


def param_seed(seed: int, name: str) -> int:
    """A seed of the parameter's own: stable across processes and machines (not Python's hash())."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative 63-bit integer


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The shape of the whole tensor of which ``param`` is one of ``tp_size`` slices."""
    shape = list(param.shape)
    if param.tp_dim is not None:
        shape[param.tp_dim] *= tp_size
    return tuple(shape)


def shard(full: torch.Tensor, tp_dim: int | None, group: CommGroup) -> torch.Tensor:
    """This rank's slice of a whole tensor (the whole tensor when ``tp_dim`` is None)."""
    if tp_dim is None or group.size == 1:
        return full
    return full.chunk(group.size, dim=tp_dim)[group.rank]


def gather_full(shard_: torch.Tensor, tp_dim: int | None, group: CommGroup) -> torch.Tensor:
    """The whole tensor from every rank's slice (a collective: all tp ranks must call it)."""
    if tp_dim is None:
        return shard_
    return comm.all_gather(shard_.detach(), group, dim=tp_dim, label="gather params")


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, group: CommGroup) -> None:
    """Draw every parameter whole from its own seed (model seed + full name) and keep this slice.

    Drawn on the CPU with a CPU generator, so the numbers do not depend on the device either.
    """
    for name, param in module.named_parameters():
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        full = param.init(full_shape(param, group.size), gen)
        param.copy_(shard(full, param.tp_dim, group))
