"""Parameters independent of the layout, each rank drawing only its own shard; gathered back whole.

A parameter's numbers do not depend on tp (docs/principles.md, principle 1), so tp = 1, 2, 4
start from the same weights and a parallel run can be checked against the serial one step by
step; and no rank draws or holds a whole parameter. Both at once: the full tensor is cut into
blocks of ``BLOCK`` rows (or columns) along its split dimension — a layout of the full shape
only, never of tp — and block k is drawn from a generator seeded by (model seed, parameter name,
k). A rank draws the blocks that meet its slice and keeps its part. CPU generators: the same
numbers on any device. (Megatron-LM draws a whole "master weight" on every rank and splits it;
picotron draws per shard, which cannot be compared with serial.)

Layers are built on the meta device (``placeholder``s), filled by ``init_parameters``; used
before, they raise (``check_initialised``). Each parameter carries ``tp_dim``, the dimension it
is split along over tp (None: whole on every tp rank, e.g. layer norms, row-parallel biases,
positions), ``tp_replicas``, the tp ranks holding each part (1; r when t > g kv heads: the whole
cut into t/r parts, rank i holding part i // r, ``attention.GroupedQKV``), and ``init``, an
``Init``.

GPT-2's initialisation (Radford et al. 2019 §2.3; 1909.08053 §3 follows it): weights normal(0,
0.02), residual output projections scaled by 1/sqrt(2·layers), biases zero, layer-norm weights one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup

__all__ = ["normal", "zeros", "ones", "mark", "placeholder", "check_initialised", "full_shape",
           "shard", "gather_full", "init_parameters", "BLOCK", "blocks"]

# Rows (or columns) per block along tp_dim. Model widths are multiples of 64 (heads of 64 or 128,
# the vocabulary padded to 128·tp), so shard edges fall on block edges: a rank draws exactly its
# shard (else at most 63 wasted rows per edge). A block is 64·h numbers: seeding its generator
# is noise beside drawing it, and the temporary stays small (400 KB at h = 1600).
BLOCK = 64


@dataclass(frozen=True)
class Init:
    """How a parameter's full tensor is filled: N(0, std²), or the constant ``value`` when ``std``
    is None; with ``rows``, only the first ``rows`` rows are drawn and the rest are zero."""

    std: float | None = None
    value: float = 0.0
    rows: int | None = None


def normal(std: float, rows: int | None = None) -> Init:
    """N(0, std²) for the whole tensor, or for its first ``rows`` rows and zeros below them."""
    return Init(std=std, rows=rows)


zeros = Init(value=0.0)
ones = Init(value=1.0)


def mark(param: nn.Parameter, tp_dim: int | None, init: Init, replicas: int = 1,
         experts: range | None = None) -> nn.Parameter:
    """Attach the split dimension, the initialiser and the ranks holding each part (``replicas``
    consecutive tp ranks) to a parameter, and for a stack of experts [E/ep, …] their global ids
    (``expert_ids``; ``model/moe.py``); return it."""
    param.tp_dim, param.init, param.tp_replicas, param.expert_ids = tp_dim, init, replicas, experts
    return param


def placeholder(shape: tuple[int, ...], tp_dim: int | None, init: Init, replicas: int = 1,
                experts: range | None = None) -> nn.Parameter:
    """A marked parameter of ``shape`` on the meta device, until ``init_parameters`` fills it."""
    return mark(nn.Parameter(torch.empty(shape, device="meta")), tp_dim, init, replicas, experts)


def check_initialised(module: nn.Module) -> None:
    """Raise if ``module``'s parameters are still placeholders. One is enough to look at:
    ``init_parameters`` fills a module's all together, and this runs in every forward."""
    if (param := next(module.parameters(), None)) is not None and param.is_meta:
        raise RuntimeError(f"{type(module).__name__} is not initialised: its parameters are meta-"
                           f"device placeholders. Call init_parameters(module, seed, group) first")


def param_seed(seed: int, name: str, block: int | None = None) -> int:
    """A seed of the parameter's own (of one of its blocks, with ``block``): stable across
    processes and machines (not Python's hash())."""
    key = f"{seed}/{name}" if block is None else f"{seed}/{name}/{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative 63-bit integer


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The shape of the whole tensor of which ``param`` is one of tp_size / tp_replicas parts."""
    shape = list(param.shape)
    if param.tp_dim is not None:
        shape[param.tp_dim] *= tp_size // param.tp_replicas
    return tuple(shape)


def shard(full: torch.Tensor, tp_dim: int | None, group: CommGroup,
          replicas: int = 1) -> torch.Tensor:
    """This rank's part of a whole tensor, rank // replicas of size / replicas (the whole tensor
    when ``tp_dim`` is None)."""
    parts, part = group.size // replicas, group.rank // replicas
    return full if tp_dim is None else full.chunk(parts, dim=tp_dim)[part]


def gather_full(shard_: torch.Tensor, tp_dim: int | None, group: CommGroup,
                replicas: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's slice, each part once (a collective: all tp ranks
    must call it)."""
    if tp_dim is None:
        return shard_
    every = comm.all_gather(shard_.detach(), group, dim=tp_dim, label="gather params")
    return torch.cat(every.chunk(group.size, dim=tp_dim)[::replicas], dim=tp_dim)


def blocks(length: int, lo: int, hi: int) -> range:
    """The blocks of [0, length) (``BLOCK`` each, the last one shorter) that meet [lo, hi)."""
    hi = min(hi, length)
    return range(lo // BLOCK, (hi - 1) // BLOCK + 1) if lo < hi else range(0)


def _draw_slice(param: nn.Parameter, std: float, drawn: tuple[int, ...], seed: int, name: str,
                rank: int, gen: torch.Generator) -> None:
    """Draw the blocks of the ``drawn`` region that meet this rank's slice; keep what it holds."""
    d, n = param.tp_dim, param.shape[param.tp_dim]
    lo = rank * n                                      # the slice is [lo, lo + n) along d
    for k in blocks(drawn[d], lo, lo + n):
        start, stop = k * BLOCK, min((k + 1) * BLOCK, drawn[d])
        gen.manual_seed(param_seed(seed, name, block=k))
        if d == 0 and lo <= start and stop <= lo + n:  # whole rows of it, contiguous: in place
            param.narrow(0, start - lo, stop - start).normal_(0.0, std, generator=gen)
            continue
        values = torch.empty(*drawn[:d], stop - start, *drawn[d + 1:])  # block k, whole
        values.normal_(0.0, std, generator=gen)
        a, b = max(start, lo), min(stop, lo + n)       # the part of the block this rank holds
        kept = values.narrow(d, a - start, b - a)
        param.narrow(d, a - lo, b - a)[: kept.shape[0]].copy_(kept)  # rows ≥ drawn[0] stay 0


def _draw(param: nn.Parameter, seed: int, name: str, group: CommGroup,
          gen: torch.Generator) -> None:
    """Fill this rank's slice of one parameter with the serial model's numbers."""
    init: Init = param.init
    if param.expert_ids is not None:                   # each expert's matrix by its global id
        for i, expert in enumerate(param.expert_ids):
            one = mark(param[i], param.tp_dim - 1, init, param.tp_replicas)
            _draw(one, seed, f"{name}.{expert}", group, gen)
        return
    if init.std is None:
        param.fill_(init.value)
        return
    full = full_shape(param, group.size)
    drawn = full if init.rows is None else (init.rows, *full[1:])
    if init.rows is not None:
        param.zero_()                                  # the padding rows, from drawn[0] on
    if param.tp_dim is None:                           # replicated, and small: drawn whole
        gen.manual_seed(param_seed(seed, name))
        param[: drawn[0]].copy_(torch.empty(drawn).normal_(0.0, init.std, generator=gen))
        return
    _draw_slice(param, init.std, drawn, seed, name, group.rank // param.tp_replicas, gen)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, group: CommGroup,
                    device: torch.device | str = "cpu") -> None:
    """Make every parameter real on ``device`` (placeholders or not) and fill its slice on this
    rank, drawing only the blocks that meet it: the same numbers on any device."""
    marks = {name: (p.tp_dim, p.init, p.tp_replicas, p.expert_ids)
             for name, p in module.named_parameters()}
    module.to_empty(device=device)                    # new tensors: their marks are put back
    gen = torch.Generator()                           # CPU: the same numbers on any device
    for name, param in module.named_parameters():
        _draw(mark(param, *marks[name]), seed, name, group, gen)
