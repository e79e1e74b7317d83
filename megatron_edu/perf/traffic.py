"""The bytes a run puts on the wire, from the logs ``comm.record()`` keeps, by purpose
(2104.04473 §3.2–3.4: how much each of tensor, pipeline and data parallelism communicates), and
the experts' all-to-alls a step sends under expert parallelism (GShard, Lepikhin et al. 2020,
arXiv 2006.16668 §2.3; ``expert_parallel``).

Each ``CommEvent`` carries its wire bytes (ring algorithms: ``CommEvent.wire_bytes``); here they
are summed over all ranks and split by what they are for.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_edu.comm import CommLog
from megatron_edu.model.config import GPTConfig
from megatron_edu.ptdp import Parallelism

__all__ = ["PURPOSES", "wire_bytes_by_group", "all_to_alls", "all_to_all_bytes",
           "expert_parallel_bytes"]

PURPOSES = ("tp", "pp", "dp", "embedding", "scalars")  # and "ep" where the logs hold its groups
# the labels of the few-byte collectives: the loss printed, the loss weighted by target tokens,
# the gradient norm for clipping; a mixture's routing statistics (selections per expert)
SCALAR_LABELS = ("dp loss", "pp loss", "dp tokens", "grad norm", "moe counts", "moe stats")
# the group whose gradients a purpose reduces: the experts', over their expert-data-parallel group
GROUP_PURPOSES = {"edp": "dp"}


def _purpose(op: str, group: str, label: str) -> str:
    if label in SCALAR_LABELS:
        return "scalars"
    if op == "send":
        return "pp"
    return GROUP_PURPOSES.get(group, group)


def wire_bytes_by_group(logs: Sequence[CommLog], steps: int = 1) -> dict[str, int]:
    """Bytes all ranks together put on the wire per step, by purpose: "tp" (the tp group: f/g
    all-reduces, the vocab-parallel loss, §4.1's all-gather), "pp" (point-to-point sends;
    receives are the same bytes, not counted again), "dp" (gradients — the experts' too, over
    their expert-data-parallel group —, and ZeRO-1's parameter all-gather), "embedding"
    (tied-embedding gradients), "scalars" (losses, the gradient norm, routing statistics), and
    under expert parallelism "ep" (the dispatch and combine all-to-alls and their counts, each
    at its whole buffer: ``CommEvent.wire_bytes`` keeps no record of the rank's own part).
    ``logs``: one per rank, over ``steps`` steps."""
    totals = dict.fromkeys(PURPOSES, 0.0)
    for log in logs:
        for event in log.events:
            if event.op != "recv":
                purpose = _purpose(event.op, event.group, event.label)
                totals[purpose] = totals.get(purpose, 0.0) + event.wire_bytes
    return {purpose: round(total / steps) for purpose, total in totals.items()}


def all_to_alls(config: GPTConfig) -> int:
    """The all-to-alls of one MoE layer and microbatch: dispatch and combine forward, their
    gradients back the other way, and the forward's two again under full recomputation."""
    return 6 if config.recompute == "full" else 4


def all_to_all_bytes(config: GPTConfig, microbatch: int, cp: int = 1, ep: int = 1,
                     bytes_per_value: int = 2) -> float:
    """Bytes one rank sends to the other ep ranks in one all-to-all of a MoE layer, one
    microbatch, routing uniform: the k rows of each of its b·s/cp tokens, h values each (every
    tp rank dispatches all its tokens: the experts are split over tp as the MLP), the
    (ep − 1)/ep of them whose experts live on other ranks."""
    rows = config.moe_topk * microbatch * config.seq_len // cp
    return rows * config.hidden * bytes_per_value * (ep - 1) / ep


def expert_parallel_bytes(config: GPTConfig, parallelism: Parallelism,
                          bytes_per_value: int = 2) -> int:
    """Bytes all ranks send in the experts' all-to-alls of one step: every rank's
    ``all_to_all_bytes`` in each of ``all_to_alls`` a layer, its l/pp layers, m microbatches:

        n·l·B·s·k·h·t·(ep − 1)/ep values      (n = 4, or 6 under full recomputation)

    the same at any cp and pp (each holds a part of the tokens or of the layers); 0 for a dense
    model or at ep = 1."""
    if not config.moe_experts:
        return 0
    ranks = parallelism.world_size
    per_rank = (config.num_layers // parallelism.pp * parallelism.num_microbatches
                * all_to_alls(config) * all_to_all_bytes(config, parallelism.microbatch,
                                                         parallelism.cp, parallelism.ep,
                                                         bytes_per_value))
    return round(ranks * per_rank)
