"""The process grid of PTD-P: which rank does which slice of the work (2104.04473 §3).

``world = tp · dp · pp`` ranks are laid out as a tensor ``ranks[pp, dp, tp]`` — tensor-parallel
rank fastest, then data-parallel, then pipeline — exactly like Megatron-LM:

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

Why this order (2104.04473 §3.2–3.3, takeaway #1): tensor parallelism all-reduces activations
twice per layer in the forward and twice in the backward, so its ranks must be adjacent — the
GPUs of one node, on NVLink. Data parallelism exchanges gradients once per step; pipeline
parallelism sends one activation per microbatch per stage boundary, the least traffic of all, so
it is the dimension that may cross the slow links between nodes.

``GridLayout`` is the pure arithmetic (no processes: a notebook can draw a 1024-GPU cluster).
``ParallelGrid`` is built inside a launched rank and adds the process groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_edu.comm import CommGroup

__all__ = ["GridLayout", "ParallelGrid", "validate_layout"]


def validate_layout(tp: int, pp: int, dp: int, world_size: int) -> None:
    """Raise a ValueError naming the numbers unless tp·pp·dp == world_size, all positive."""
    for name, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if tp * pp * dp != world_size:
        raise ValueError(f"tp·pp·dp = {tp}·{pp}·{dp} = {tp * pp * dp} ranks, but the world has "
                         f"{world_size}: they must be equal")


@dataclass
class GridLayout:
    """The rank arithmetic of a tp × pp × dp grid, without any process group."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        validate_layout(self.tp, self.pp, self.dp, self.tp * self.pp * self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks(self) -> torch.Tensor:
        """``ranks[pp_rank, dp_rank, tp_rank]`` = global rank (tp fastest)."""
        return torch.arange(self.world_size).view(self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        return rank % self.tp, rank // (self.tp * self.dp), (rank // self.tp) % self.dp

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank

    # Each group is the set of ranks that differ only in one coordinate.
    def tp_groups(self) -> list[list[int]]:
        return self.ranks.reshape(-1, self.tp).tolist()

    def dp_groups(self) -> list[list[int]]:
        return self.ranks.permute(0, 2, 1).reshape(-1, self.dp).tolist()

    def pp_groups(self) -> list[list[int]]:
        return self.ranks.permute(1, 2, 0).reshape(-1, self.pp).tolist()

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they hold the tied input/output embedding."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]


class ParallelGrid(GridLayout):
    """This rank's place in the grid and its tp, pp, dp and embedding process groups.

    Build it inside a launched rank (``megatron_edu.launch.run``): every rank must construct the
    same grid, since creating a process group is itself a collective.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelGrid needs torch.distributed initialised: build it inside "
                               "a function started by megatron_edu.launch.run")
        validate_layout(tp, pp, dp, dist.get_world_size())
        super().__init__(tp, pp, dp)
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank, self.dp_rank = self.coords(self.rank)
        self.tp_group = self._new_group("tp", self.tp_groups())
        self.pp_group = self._new_group("pp", self.pp_groups())
        self.dp_group = self._new_group("dp", self.dp_groups())
        self.embedding_group = self._new_group("embedding", self.embedding_groups())
        # Model-parallel ranks (tp × pp) share one model replica: global gradient norms reduce here.
        self.mp_group = self._new_group("mp", self._model_parallel_groups())
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
        """One two-rank process group per pipeline direction and kind of message, keyed
        (kind, src, dst): activations go to the next stage, gradients to the previous one,
        around the ring (the interleaved schedule wraps). With p = 2 the four channels join the
        same two ranks. Separate groups keep each channel's messages in order on their own, so
        the gloo mailbox can keep a receive posted on each (pipeline/p2p.py). Each is used once
        here, so that every pair connects now, in the same order everywhere."""
        channels = {}
        for pipeline in self.pp_groups() if self.pp > 1 else []:
            for a, b in zip(pipeline, pipeline[1:] + pipeline[:1], strict=True):
                for kind, src, dst in (("act", a, b), ("grad", b, a)):
                    pg = dist.new_group(sorted((src, dst)))
                    if self.rank in (src, dst):
                        dist.barrier(group=pg)
                        channels[kind, src, dst] = pg
        return channels

    def _model_parallel_groups(self) -> list[list[int]]:
        return [self.ranks[:, d, :].flatten().tolist() for d in range(self.dp)]

    # --- pipeline neighbours (global ranks; they wrap around for the interleaved schedule) ---
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.tp_rank, (self.pp_rank + 1) % self.pp, self.dp_rank)

    @property
    def prev_rank(self) -> int:
        return self.rank_of(self.tp_rank, (self.pp_rank - 1) % self.pp, self.dp_rank)

    @property
    def device(self) -> torch.device:
        """cuda:<current> under NCCL, else cpu: where this rank's tensors live."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return (f"ParallelGrid(tp={self.tp}, pp={self.pp}, dp={self.dp}; rank {self.rank} = "
                f"tp {self.tp_rank}, pp {self.pp_rank}, dp {self.dp_rank})")


def all_layouts(world_size: int) -> list[GridLayout]:
    """Every (tp, pp, dp) factorisation of ``world_size``."""
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [GridLayout(tp, pp, world_size // (tp * pp))
            for tp, pp in itertools.product(sizes, sizes) if world_size % (tp * pp) == 0]
