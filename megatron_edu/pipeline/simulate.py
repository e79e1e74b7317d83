"""Run a pipeline schedule on paper: when each action starts and ends, and how much is bubble.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2.1 (pipeline bubble t_pb / t_id =
(p − 1)/m for GPipe and 1F1B) and §2.2.2 (interleaved: (p − 1)/(v·m), with v times the
point-to-point communication).

`simulate` plays a schedule with fixed costs: each rank runs its list in order and every action
starts as soon as its rank is free and its inputs have arrived. Time is kept as exact fractions
(`fractions.Fraction`), so the simulated bubble equals the paper's formula exactly, not to 1e-16.
The result is a `Timeline`, the same object that holds a *measured* run (the engine records
(action, start, end) per rank), so bubble fraction, memory in flight and message counts are
computed one way for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from .schedules import Action, Schedule, check_schedule, dependencies, execution_order

Cost = float | Sequence[float]  # one number for every rank, or one per rank (unbalanced stages)


@dataclass(frozen=True)
class Timeline:
    """What each pipeline rank did and when: ranks[r] is a list of (action, start, end)."""

    ranks: list[list[tuple[Action, Real, Real]]]

    @property
    def num_chunks(self) -> int:
        return 1 + max(action.chunk for row in self.ranks for action, _, _ in row)

    @property
    def total_time(self) -> Real:
        """From the first start to the last end, over all ranks."""
        starts = [start for row in self.ranks for _, start, _ in row]
        ends = [end for row in self.ranks for _, _, end in row]
        return max(ends) - min(starts)

    @property
    def busy(self) -> list[Real]:
        """Per rank, the time spent computing (the paper's ideal time t_id when stages balance)."""
        return [sum(end - start for _, start, end in row) for row in self.ranks]

    @property
    def idle(self) -> list[Real]:
        """Per rank, the time spent waiting: the pipeline bubble t_pb."""
        return [self.total_time - busy for busy in self.busy]

    @property
    def bubble_fraction(self) -> Real:
        """Idle time over compute time, summed over ranks: Σ t_pb / Σ t_id (2104.04473 §2.2.1).

        With balanced stages every rank has the same t_pb and t_id, so this is each rank's own
        t_pb / t_id: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved. With unbalanced
        stages it is the pipeline's idle device-time per unit of useful compute.
        """
        return sum(self.idle) / sum(self.busy)

    @property
    def peak_activations(self) -> list[int]:
        """Per rank, the most (microbatch, chunk) activations held at once: F stores, B frees."""
        peaks = []
        for row in self.ranks:
            held = peak = 0
            for action, _, _ in row:
                held += 1 if action.kind == "F" else -1
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    @property
    def num_p2p_messages(self) -> int:
        """Activations and gradients sent between ranks: 2·m·(v·p − 1) when p > 1 (§2.2.2)."""
        p, v = len(self.ranks), self.num_chunks
        return sum(1 for rank, row in enumerate(self.ranks) for action, _, _ in row
                   for dep_rank, _ in dependencies(rank, action, p, v) if dep_rank != rank)


def _per_rank(cost: Cost, num_ranks: int, name: str) -> list[Fraction]:
    costs = list(cost) if isinstance(cost, Sequence) else [cost] * num_ranks
    if len(costs) != num_ranks:
        raise ValueError(f"{name} has {len(costs)} entries for {num_ranks} pipeline ranks")
    if any(c < 0 for c in costs):
        raise ValueError(f"{name} must not be negative, got {costs}")
    return [Fraction(c) for c in costs]


def simulate(schedule: Schedule, forward_time: Cost = 1.0, backward_time: Cost = 2.0,
             send_latency: float = 0.0) -> Timeline:
    """Play `schedule` with fixed costs and return its Timeline (times as exact Fractions).

    forward_time, backward_time: cost of a whole stage's forward / backward pass for one
    microbatch, one number or one per rank; with v chunks per rank each chunk costs 1/v of it.
    send_latency: delay between an action ending on one rank and a dependent action starting on
    another (the p2p send, which does not occupy either rank's compute).
    """
    p = len(schedule)
    v = 1 + max((a.chunk for row in schedule for a in row), default=0)
    check_schedule(schedule, v)
    cost = {"F": _per_rank(forward_time, p, "forward_time"),
            "B": _per_rank(backward_time, p, "backward_time")}
    latency = Fraction(send_latency)
    end: dict[tuple[int, Action], Fraction] = {}
    free_at = [Fraction(0)] * p
    ranks: list[list[tuple[Action, Real, Real]]] = [[] for _ in range(p)]
    for rank, action in execution_order(schedule, v):
        inputs_at = [end[dep] + (latency if dep[0] != rank else 0)
                     for dep in dependencies(rank, action, p, v)]
        start = max([free_at[rank], *inputs_at])
        free_at[rank] = end[rank, action] = start + cost[action.kind][rank] / v
        ranks[rank].append((action, start, free_at[rank]))
    return Timeline(ranks)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """The paper's bubble fraction: (p − 1)/m (§2.2.1), or (p − 1)/(v·m) interleaved (§2.2.2)."""
    return Fraction(p - 1, (v if name == "interleaved" else 1) * m)
