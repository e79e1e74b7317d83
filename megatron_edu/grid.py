"""The layout of a PTD-P run, and the process grid it gives: which rank does which slice of the
work (2104.04473 §3).

``Layout`` is the one description of how a run is split — tp × pp × dp ranks, the pipeline
schedule and its chunks per rank, the microbatches, ZeRO-1 — validated once, when it is made,
before any process starts (torchtitan's ``ParallelDims`` plays this part). Everything else takes
it: the grid, PTD-P, the training script, the memory model and the advisor. It is pure arithmetic
(no processes), so a notebook can draw a 1024-GPU cluster with it.

``world = tp · dp · pp`` ranks are laid out as a tensor ``ranks[pp, dp, tp]`` — tensor-parallel
rank fastest, then data-parallel, then pipeline — exactly like Megatron-LM:

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

With context parallelism (``cp`` > 1, ``context_parallel.py``) the world is tp · cp · dp · pp and
cp sits next to tp, megatron-core's order (its ring exchanges K, V every layer, so its ranks
are kept close): ``ranks[pp, dp, cp, tp]``. Its ranks hold parts of the same sequences, so
their gradients are partial sums: they are reduced over the dp × cp ranks (``dp_cp_groups``).

Why this order (2104.04473 §3.2–3.3, takeaway #1): tensor parallelism all-reduces activations
twice per layer in the forward and twice in the backward, so its ranks must be adjacent — the
GPUs of one node, on NVLink. Data parallelism exchanges gradients once per step; pipeline
parallelism sends one activation per microbatch per stage boundary, the least traffic of all, so
it is the dimension that may cross the slow links between nodes.

``ParallelGrid`` is built inside a launched rank from a layout and adds the process groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_edu.comm import CommGroup
from megatron_edu.pipeline.schedules import Schedule, check_layout, make_schedule, stage_map
from megatron_edu.pipeline.stages import StageMap

if TYPE_CHECKING:  # the model is built on a grid: the model package imports this module
    from megatron_edu.model.config import GPTConfig

__all__ = ["Layout", "ParallelGrid", "all_layouts"]


@dataclass(frozen=True)
class Layout:
    """How one run is split: tp × pp × dp ranks; the pipeline ``schedule`` (a name of
    ``pipeline.schedules.SCHEDULES``) with ``chunks`` model chunks per rank (None: the
    schedule's own — 2 for ZB-V, else 1); ``num_microbatches`` m of ``microbatch`` b sequences
    per replica and step; ``zero``: the ZeRO stage — 1 shards the optimizer state over the dp × cp
    ranks that hold the same weights, 2 the gradients too, 3 the parameters too
    (``data_parallel``); ``cp``: context-parallel ranks per replica. A ValueError naming the
    numbers if any of it cannot work."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    chunks: int | None = None
    microbatch: int = 1
    num_microbatches: int = 1
    zero: int = 0
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "microbatch", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero is a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        v = check_layout(self.schedule, self.pp, self.num_microbatches, self.chunks)
        if v > 1 and self.pp == 1:
            raise ValueError(f"{v} model chunks per rank need a pipeline (pp ≥ 2): with one "
                             "stage there is nothing to interleave")
        object.__setattr__(self, "chunks", v)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        """B = dp · m · b sequences per optimizer step."""
        return self.dp * self.num_microbatches * self.microbatch

    @property
    def stages(self) -> StageMap:
        """Where the schedule puts the pp · v virtual stages."""
        return stage_map(self.schedule, self.pp, self.chunks)

    def make_schedule(self) -> Schedule:
        """The schedule every pipeline runs: p stages, m microbatches, v chunks per rank."""
        return make_schedule(self.schedule, self.pp, self.num_microbatches, self.chunks)

    def check(self, config: GPTConfig) -> None:
        """Raise a ValueError naming the numbers if ``config``'s model cannot be split this way:
        tp must divide the heads and the MLP, the pp · v stages the layers."""
        config.validate(self.tp, self.pp, self.chunks, self.cp)
        if self.zero >= 2 and (self.pp > 1 or self.make_schedule().splits_backward):
            raise ValueError(f"ZeRO-{self.zero} reduce-scatters the gradients in every backward "
                             f"pass (and ZeRO-3 gathers the weights for each): with pp = "
                             f"{self.pp} and the {self.schedule} schedule that is every "
                             "microbatch's; Megatron pairs pipelines with ZeRO-1 (2104.04473 §3), "
                             "as DeepSpeed does: use zero = 1, or pp = 1 with 1f1b")
        if config.async_tp and self.make_schedule().splits_backward:  # B and W: one node here
            raise ValueError(f"async_tp computes dX and dW in one node: {self.schedule}'s B/W "
                             "split would run it, and its collectives, twice")

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
        return self._ranks if self.cp > 1 else self._ranks.squeeze(2)

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

    def cp_groups(self) -> list[list[int]]:
        return self._ranks.permute(0, 1, 3, 2).reshape(-1, self.cp).tolist()

    def dp_groups(self) -> list[list[int]]:
        return self._ranks.permute(0, 2, 3, 1).reshape(-1, self.dp).tolist()

    def dp_cp_groups(self) -> list[list[int]]:
        """The dp × cp ranks that hold the same weights: where gradients are reduced."""
        return self._ranks.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp).tolist()

    def pp_groups(self) -> list[list[int]]:
        return self._ranks.permute(1, 2, 3, 0).reshape(-1, self.pp).tolist()

    def embedding_groups(self) -> list[list[int]]:
        """The ranks of the first and the last stage of each pipeline, which hold the tied
        input/output embedding: the two ends of the pipeline, or one rank under ZB-V's V."""
        ends = (self.stages.first_rank, self.stages.last_rank)
        return [sorted({group[r] for r in ends}) for group in self.pp_groups()]

    def model_parallel_groups(self) -> list[list[int]]:
        """The tp × pp ranks of each model replica (and cp part of it)."""
        return [self._ranks[:, d, c, :].flatten().tolist()
                for d in range(self.dp) for c in range(self.cp)]


class ParallelGrid:
    """This rank's place in a ``Layout`` and its tp, cp, pp, dp, dp × cp, embedding and
    model-parallel process groups: ``ParallelGrid(layout)``, or ``ParallelGrid(tp, pp, dp)``
    for ``Layout(tp, pp, dp)`` (1F1B: the first and the last stage are the pipeline's ends).

    Build it inside a launched rank (``megatron_edu.launch.run``): every rank must construct the
    same grid, since creating a process group is itself a collective.
    """

    def __init__(self, tp: int | Layout = 1, pp: int = 1, dp: int = 1) -> None:
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
        self.cp_group = self._new_group("cp", self.layout.cp_groups())
        self.pp_group = self._new_group("pp", self.layout.pp_groups())
        self.dp_group = self._new_group("dp", self.layout.dp_groups())
        self.dp_cp_group = (self._new_group("dp_cp", self.layout.dp_cp_groups()) if self.cp > 1
                            else self.dp_group)
        self.embedding_group = self._new_group("embedding", self.layout.embedding_groups())
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
        for pipeline in self.layout.pp_groups() if self.pp > 1 else []:
            for a, b in zip(pipeline, pipeline[1:] + pipeline[:1], strict=True):
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


def all_layouts(world_size: int) -> list[Layout]:
    """Every (tp, pp, dp) factorisation of ``world_size`` (1F1B, one microbatch)."""
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [Layout(tp, pp, world_size // (tp * pp))
            for tp, pp in itertools.product(sizes, sizes) if world_size % (tp * pp) == 0]
