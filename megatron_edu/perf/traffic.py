"""The bytes a run puts on the wire, from the logs ``comm.record()`` keeps, by purpose
(2104.04473 §3.2–3.4: how much each of tensor, pipeline and data parallelism communicates).

Each ``CommEvent`` carries its wire bytes (ring algorithms: ``CommEvent.wire_bytes``); here they
are summed over all ranks and split by what they are for.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_edu.comm import CommLog

__all__ = ["PURPOSES", "wire_bytes_by_group"]

PURPOSES = ("tp", "pp", "dp", "embedding", "scalars")
# the labels of the few-byte collectives: the loss printed, the loss weighted by target tokens,
# the gradient norm for clipping
SCALAR_LABELS = ("dp loss", "pp loss", "dp tokens", "grad norm")


def _purpose(op: str, group: str, label: str) -> str:
    if label in SCALAR_LABELS:
        return "scalars"
    if op == "send":
        return "pp"
    return group


def wire_bytes_by_group(logs: Sequence[CommLog], steps: int = 1) -> dict[str, int]:
    """Bytes all ranks together put on the wire per step, by purpose: "tp" (the tp group: f/g
    all-reduces, the vocab-parallel loss, §4.1's all-gather), "pp" (point-to-point sends;
    receives are the same bytes, not counted again), "dp" (gradients, and ZeRO-1's parameter
    all-gather), "embedding" (tied-embedding gradients), "scalars" (losses and the gradient
    norm). ``logs``: one per rank, over ``steps`` steps."""
    totals = dict.fromkeys(PURPOSES, 0.0)
    for log in logs:
        for event in log.events:
            if event.op != "recv":
                totals[_purpose(event.op, event.group, event.label)] += event.wire_bytes
    return {purpose: round(total / steps) for purpose, total in totals.items()}
