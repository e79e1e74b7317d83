"""The mesh of a PTD-P run: how many ranks split each dimension, and which rank does which
slice of the work (2104.04473 §3).

``Layout`` holds the degrees only (torchtitan's ``ParallelDims``), validated before any process
starts; pure arithmetic, so a notebook can draw a 1024-GPU cluster with it. ``ParallelGrid``,
built inside a launched rank, adds the process groups.

Ranks are laid out as ``ranks[pp, dp, tp]``, tp fastest, then dp, then pp (as Megatron-LM):

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

Why (2104.04473 §3.2–3.3, takeaway #1): tensor parallelism all-reduces activations twice per
layer each way, so its ranks must share a node's NVLink; pipeline parallelism sends one activation
per microbatch per stage boundary, the least traffic, so it may cross the slow links between
nodes. Context parallelism (``context_parallel.py``) sits next to tp, megatron-core's order (its
ring exchanges K, V every layer): ``ranks[pp, dp, cp, tp]``; its ranks hold parts of the same
sequences, so gradients are reduced over the dp × cp ranks (``dp_cp_groups``).

Expert parallelism (``expert_parallel.py``) folds into those dp × cp ranks (megatron-core's
"parallel folding"): ep consecutive ones of them (cp fastest, the nearest) split the experts, and
the dp·cp/ep ranks that hold the same experts reduce their gradients (``edp_groups``). The rest
of the model is unchanged: ep adds no ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_edu.comm import CommGroup

__all__ = ["Layout", "ParallelGrid", "all_layouts", "to_device"]


@dataclass(frozen=True)
class Layout:
    """How many ranks split each dimension, tp × cp × pp × dp, and the experts, ep (which divides
    dp·cp): positive integers, or ValueError."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert parallelism splits the experts over ranks that hold the "
                             f"same dense weights: ep = {self.ep} must divide dp·cp = "
                             f"{self.dp}·{self.cp} = {self.dp * self.cp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def check_world(self, world_size: int) -> None:
        """Raise a ValueError unless this layout fills exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            sizes = ("tp·cp·pp·dp", (self.tp, self.cp, self.pp, self.dp)) if self.cp > 1 else (
                "tp·pp·dp", (self.tp, self.pp, self.dp))
            raise ValueError(f"{sizes[0]} = {'·'.join(map(str, sizes[1]))} = {self.world_size} "
                             f"ranks, but the world has {world_size}: they must be equal")

    @property
    def ranks(self) -> torch.Tensor:
        """``ranks[pp_rank, dp_rank, tp_rank]`` = global rank (tp fastest); with cp > 1
        ``ranks[pp_rank, dp_rank, cp_rank, tp_rank]`` (cp next to tp)."""
        return self._ranks.squeeze(2)                     # (squeeze drops a cp of 1 only)

    @property
    def _ranks(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.pp, self.dp, self.cp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank (its cp rank: ``cp_rank``)."""
        tc = self.tp * self.cp
        return rank % self.tp, rank // (tc * self.dp), (rank // tc) % self.dp

    def cp_rank(self, rank: int) -> int:
        """The context-parallel rank of a global rank."""
        return (rank // self.tp) % self.cp

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    # Each group is the set of ranks that differ only in one coordinate.
    def tp_groups(self) -> list[list[int]]:
        return self._ranks.reshape(-1, self.tp).tolist()

    def tp_blocks(self, r: int) -> list[list[int]]:  # r consecutive ranks of a tp group
        return self._ranks.reshape(-1, r).tolist()

    def cp_groups(self) -> list[list[int]]:
        return self._ranks.permute(0, 1, 3, 2).reshape(-1, self.cp).tolist()

    def dp_groups(self) -> list[list[int]]:
        return self._ranks.permute(0, 2, 3, 1).reshape(-1, self.dp).tolist()

    def dp_cp_groups(self) -> list[list[int]]:
        """The dp × cp ranks that hold the same weights: where gradients are reduced."""
        return self._ranks.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp).tolist()

    def ep_groups(self) -> list[list[int]]:
        """ep consecutive ranks of each dp × cp group: they split the experts."""
        return self._ranks.permute(0, 3, 1, 2).reshape(-1, self.ep).tolist()

    def edp_groups(self) -> list[list[int]]:
        """The dp·cp/ep ranks of each dp × cp group holding the same experts (expert-data-parallel:
        where expert gradients are reduced)."""
        folded = self._ranks.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp // self.ep, self.ep)
        return folded.transpose(1, 2).reshape(-1, self.dp * self.cp // self.ep).tolist()

    def tp_cp_groups(self) -> list[list[int]]:
        """The tp × cp ranks that split the same sequences (under sequence parallelism)."""
        return self._ranks.reshape(-1, self.cp * self.tp).tolist()

    def pp_groups(self) -> list[list[int]]:
        return self._ranks.permute(1, 2, 3, 0).reshape(-1, self.pp).tolist()

    def embedding_groups(self, ends: tuple[int, int] = (0, -1)) -> list[list[int]]:
        """Each pipeline's ranks ``ends``, the tied embedding's first and last stage (ZB-V: one)."""
        return [sorted({group[r] for r in ends}) for group in self.pp_groups()]

    def model_parallel_groups(self) -> list[list[int]]:
        """The tp × pp ranks of each model replica (and cp part of it)."""
        return [self._ranks[:, d, c, :].flatten().tolist()
                for d in range(self.dp) for c in range(self.cp)]


class ParallelGrid:
    """This rank's place in a ``Layout`` and its tp, cp, pp, dp, dp × cp, embedding and
    model-parallel groups. ``embedding_ranks``: the pipeline ranks sharing the tied embedding
    (megatron-core's ``get_embedding_ranks``). Every rank of a launched run (``launch.run``) must
    build the same grid: creating a process group is a collective."""

    def __init__(self, tp: int | Layout = 1, pp: int = 1, dp: int = 1, *,
                 embedding_ranks: tuple[int, int] = (0, -1)) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelGrid needs torch.distributed initialised: build it inside "
                               "a function started by megatron_edu.launch.run")
        if isinstance(tp, Layout) and (pp, dp) != (1, 1):
            raise ValueError("give a Layout or the sizes tp, pp, dp, not both")
        self.layout = tp if isinstance(tp, Layout) else Layout(tp, pp, dp)
        self.layout.check_world(dist.get_world_size())
        self.tp, self.pp, self.dp = self.layout.tp, self.layout.pp, self.layout.dp
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank, self.dp_rank = self.layout.coords(self.rank)
        self.cp, self.cp_rank = self.layout.cp, self.layout.cp_rank(self.rank)
        self.tp_group = self._new_group("tp", self.layout.tp_groups())
        # blocks of r consecutive tp ranks, every r dividing tp: a kv head's holders when tp
        # exceeds the kv heads (model/attention.py, GroupedQKV)
        blocks = {r: self._new_group(f"tp/{r}", self.layout.tp_blocks(r))
                  for r in range(2, self.tp) if self.tp % r == 0}
        self.tp_group = dataclasses.replace(self.tp_group, blocks=blocks)
        self.cp_group = self._new_group("cp", self.layout.cp_groups())
        self.pp_group = self._new_group("pp", self.layout.pp_groups())
        self.dp_group = self._new_group("dp", self.layout.dp_groups())
        self.dp_cp_group = (self._new_group("dp_cp", self.layout.dp_cp_groups()) if self.cp > 1
                            else self.dp_group)
        self.tp_cp_group = self._new_group("tp_cp", self.layout.tp_cp_groups())
        self.ep = self.layout.ep                     # experts: ep splits, edp reduces
        self.ep_group = self._new_group("ep", self.layout.ep_groups())
        self.edp_group = self._new_group("edp", self.layout.edp_groups())
        self.embedding_ranks = tuple(r % self.pp for r in embedding_ranks)
        self.embedding_group = self._new_group(
            "embedding", self.layout.embedding_groups(self.embedding_ranks))
        # Model-parallel ranks (tp × pp) share one model replica: global gradient norms reduce here.
        self.mp_group = self._new_group("mp", self.layout.model_parallel_groups())
        # gloo's pipeline messages travel on channels of their own; NCCL's in batches over the
        # pipeline group (pipeline/p2p.py), which needs no extra communicators.
        self.p2p_channels = self._new_p2p_channels() if dist.get_backend() != "nccl" else {}

    def _new_group(self, name: str, groups: list[list[int]]) -> CommGroup:
        """Create every group of this kind (a collective call on all ranks); keep ours. A rank
        in none of them (a middle stage has no embedding) gets a group of itself: a no-op."""
        mine = CommGroup(name, (self.rank,), None)
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = CommGroup(name, tuple(ranks), pg)
        return mine

    def _new_p2p_channels(self) -> dict[tuple[str, int, int], dist.ProcessGroup]:
        """gloo's mailbox (pipeline/p2p.py): a two-rank group per ring direction and kind of
        message, (kind, src, dst) — each keeps its messages in order, so a receive can stay
        posted on it. Each is used once here: every pair connects now, in the same order."""
        channels = {}
        for pipeline in self.layout.pp_groups():
            ring = zip(pipeline, pipeline[1:] + pipeline[:1], strict=True)
            for a, b in [(a, b) for a, b in ring if a != b]:     # (none in a pipeline of one)
                for kind, src, dst in (("act", a, b), ("grad", b, a)):
                    pg = dist.new_group(sorted((src, dst)))
                    if self.rank in (src, dst):
                        dist.barrier(group=pg)
                        channels[kind, src, dst] = pg
        return channels

    @property
    def device(self) -> torch.device:
        """cuda:<current> under NCCL, else cpu: where this rank's tensors live."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return (f"ParallelGrid(tp={self.tp}, pp={self.pp}, dp={self.dp}; rank {self.rank} = "
                f"tp {self.tp_rank}, pp {self.pp_rank}, dp {self.dp_rank})")


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x``, a host tensor, on ``device`` without a host sync: a GPU gets it from pinned memory,
    non-blocking (a pageable copy waits for the stream). Safe to let go of the pinned copy at
    once: PyTorch's pinned-memory allocator reuses a block only after the copies queued from it
    have run (the pattern of ``DataLoader(pin_memory=True)`` with ``.to(non_blocking=True)``)."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def all_layouts(world_size: int) -> list[Layout]:
    """Every (tp, pp, dp) factorisation of ``world_size``."""
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [Layout(tp, pp, world_size // (tp * pp))
            for tp, pp in itertools.product(sizes, sizes) if world_size % (tp * pp) == 0]
