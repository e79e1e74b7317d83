"""Run a pipeline schedule on paper: when each action starts and ends, and how much is bubble.

`simulate` plays a schedule with fixed costs: each action starts once its rank is free and its
inputs have arrived. Time is exact (`fractions.Fraction`), so the simulated bubble equals the
paper's formula exactly. The result is a `Timeline`, the object that also holds a measured run
(``engine.py``), so bubble, memory in flight and message counts are computed one way for both.

The papers count the bubble differently: `bubble_fraction` (2104.04473 §2.2.1) counts a rank idle
until the whole step ends, since the optimizer step synchronises the ranks; `bubble_size`
(2401.10241 §2.3) only between a rank's *own* first and last action, the idle left once steps
overlap (§4), which ZB-H2 brings to zero. For 1F1B and ZB-H1 they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from megatron_edu.pipeline.schedules import (
    Action,
    Meeting,
    Schedule,
    check_schedule,
    dependencies,
    walk,
)
from megatron_edu.pipeline.stages import StageMap

__all__ = ["Timeline", "simulate", "measured_costs", "simulate_measured"]

Cost = float | Sequence[float]  # one number for every rank, or one per rank (unbalanced stages)


@dataclass(frozen=True)
class Timeline:
    """What each pipeline rank did and when: ranks[r] is a list of (action, start, end), run on
    ``stages`` (the schedule's own)."""

    ranks: list[list[tuple[Action, Real, Real]]]
    stages: StageMap

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
        """Idle over compute time, summed over ranks: Σ t_pb / Σ t_id (2104.04473 §2.2.1); with
        balanced stages (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved (§2.2.2)."""
        return sum(self.idle) / sum(self.busy)

    @property
    def idle_within(self) -> list[Real]:
        """Per rank, the time it idles between its own first start and its own last end."""
        return [row[-1][2] - row[0][1] - busy if row else 0
                for row, busy in zip(self.ranks, self.busy, strict=True)]

    @property
    def bubble_size(self) -> Real:
        """The most any rank idles between its own first and last action: 2401.10241's bubble
        size (§2.3, Table 2) — the idle left once consecutive steps overlap (§4, §5.3)."""
        return max(self.idle_within)

    @property
    def peak_activations(self) -> list[int]:
        """Per rank, the most (microbatch, chunk) activations held at once (``in_flight``)."""
        schedule = Schedule([[action for action, _, _ in row] for row in self.ranks], self.stages)
        return [max(map(sum, schedule.in_flight(rank)), default=0) for rank in range(len(schedule))]

    @property
    def num_p2p_messages(self) -> int:
        """Activations and gradients sent between ranks: 2·m·(v·p − 1) when p > 1 (§2.2.2);
        ZB-V's turn at rank p − 1 stays on its rank: 2·m·(2p − 2)."""
        return sum(1 for rank, row in enumerate(self.ranks) for action, _, _ in row
                   for dep_rank, _ in dependencies(rank, action, self.stages) if dep_rank != rank)


def _per_rank(cost: Cost, num_ranks: int, name: str) -> list[Fraction]:
    costs = list(cost) if isinstance(cost, Sequence) else [cost] * num_ranks
    if len(costs) != num_ranks:
        raise ValueError(f"{name} has {len(costs)} entries for {num_ranks} pipeline ranks")
    if any(c < 0 for c in costs):
        raise ValueError(f"{name} must not be negative, got {costs}")
    return [Fraction(c) for c in costs]


def simulate(schedule: Schedule, forward_time: Cost = 1.0, backward_time: Cost = 2.0,
             send_latency: float = 0.0, weight_time: Cost = 0.0) -> Timeline:
    """Play `schedule` with fixed costs and return its Timeline (times as exact Fractions).

    forward_time, backward_time, weight_time: a whole stage's t_F, t_B, t_W per microbatch
    (2401.10241), one number or one per rank; a chunk costs 1/v of it. Without W actions, B is the
    whole backward, t_B + t_W. send_latency: from an action's end to a dependent action's start
    on another rank (the send occupies neither rank's compute).
    """
    p, stages = len(schedule), schedule.stages
    check_schedule(schedule)
    forward, backward, weight = (_per_rank(t, p, name) for t, name in [
        (forward_time, "forward_time"), (backward_time, "backward_time"),
        (weight_time, "weight_time")])
    whole = [b + w for b, w in zip(backward, weight, strict=True)]
    cost = {"F": forward, "W": weight, "B": backward if schedule.splits_backward else whole}
    latency = Fraction(send_latency)
    end: dict[tuple[int, Action], Fraction] = {}
    free_at = [Fraction(0)] * p
    ranks: list[list[tuple[Action, Real, Real]]] = [[] for _ in range(p)]
    for rank, action in (event for event in walk(schedule) if not isinstance(event, Meeting)):
        inputs_at = [end[dep] + (latency if dep[0] != rank else 0)
                     for dep in dependencies(rank, action, stages)]
        start = max([free_at[rank], *inputs_at])
        free_at[rank] = end[rank, action] = start + cost[action.kind][rank] / stages.v
        ranks[rank].append((action, start, free_at[rank]))
    return Timeline(ranks, stages)


def measured_costs(timeline: Timeline, kinds: str = "FB") -> tuple[list[float], ...]:
    """Per rank, a whole stage's mean F and B time (and W with ``kinds="FBW"``; 0 where a rank ran
    none): `simulate`'s costs. An action runs 1/v of a stage, so its mean is scaled by v."""
    def mean(row, kind: str):
        durations = [end - start for action, start, end in row if action.kind == kind]
        return timeline.stages.v * sum(durations) / len(durations) if durations else 0

    return tuple([mean(row, kind) for row in timeline.ranks] for kind in kinds)


def simulate_measured(measured: Timeline, send_latency: float = 0.0) -> Timeline:
    """A measured run's schedule simulated with its per-rank mean costs: the same work, every
    action as long as its rank's average (equal costs, free sends: (p − 1)/m exactly)."""
    schedule = Schedule([[action for action, _, _ in row] for row in measured.ranks],
                        measured.stages)
    forward, backward, weight = measured_costs(measured, "FBW")
    return simulate(schedule, forward, backward, send_latency, weight_time=weight)
