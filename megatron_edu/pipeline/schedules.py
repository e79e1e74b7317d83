"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2 — GPipe (Figure 3), 1F1B / PipeDream-Flush
(Figure 4, top) and the interleaved 1F1B schedule (Figure 4, bottom). The orders are those of
Megatron-LM's `forward_backward_pipelining_without_interleaving` and
`forward_backward_pipelining_with_interleaving`.

A schedule is a list with one entry per pipeline rank, each a list of `Action`s in execution order.
Nothing here computes or communicates: the same lists are checked (`check_schedule`), simulated
(`simulate.py`), drawn (`viz/pipeline.py`) and executed over send/recv (`engine.py`).

Model chunks (§2.2.2): with v chunks per rank, chunk c of rank r is virtual stage c·p + r of the
v·p virtual stages, so a microbatch's forward pass visits ranks 0, 1, …, p−1 (chunk 0), then
ranks 0, 1, …, p−1 again (chunk 1), and so on; its backward pass walks the same path in reverse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

Schedule = list[list["Action"]]


@dataclass(frozen=True)
class Action:
    """One step of one rank: the forward ("F") or backward ("B") pass of a microbatch on a chunk."""

    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0  # model chunk on this rank (interleaved schedule, §2.2.2)

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")

    def __str__(self) -> str:
        """'F3' for microbatch 3 on chunk 0, 'B3.1' for its backward pass on chunk 1."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


# --- the three schedules ------------------------------------------------------------------------


def _check_sizes(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    for name, value in [("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_chunks", num_chunks)]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _warmup_then_1f1b(forwards: list[Action], backwards: list[Action],
                      num_warmup: int) -> list[Action]:
    """`num_warmup` forwards, then alternate one forward and one backward, then the rest backward.

    Every schedule here is this shape; they differ only in the warm-up length and in the order
    of the forward and backward streams.
    """
    num_steady = len(forwards) - num_warmup
    order = forwards[:num_warmup]
    for i in range(num_steady):
        order += [forwards[num_warmup + i], backwards[i]]
    return order + backwards[num_steady:]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every rank (2104.04473 §2.2.1, Figure 3).

    Every rank holds the activations of all m microbatches before its first backward pass.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = [Action("F", i) for i in range(num_microbatches)]
    backwards = [Action("B", i) for i in range(num_microbatches)]
    return [_warmup_then_1f1b(forwards, backwards, num_microbatches) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush (2104.04473 §2.2.1, Figure 4 top): warm up, then one forward one backward.

    Rank r warms up with min(p − r − 1, m) forwards, as Megatron-LM does; m < p is allowed (the
    warm-up then takes every microbatch on the early ranks, which run GPipe's order). Rank r then
    holds at most p − r microbatches' activations instead of GPipe's m.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = [Action("F", i) for i in range(num_microbatches)]
    backwards = [Action("B", i) for i in range(num_microbatches)]
    return [
        _warmup_then_1f1b(forwards, backwards, min(num_stages - rank - 1, num_microbatches))
        for rank in range(num_stages)
    ]


def _interleaved_stream(kind: str, p: int, m: int, v: int) -> list[Action]:
    """The k-th forward (backward) of a rank, for k in 0..m·v−1, in Megatron's interleaved order.

    Microbatches go in groups of p: p microbatches through chunk 0, the same p through chunk 1, …,
    then the next p microbatches. Backward passes visit the chunks in reverse (v−1 first).
    """
    stream = []
    for k in range(m * v):
        chunk = (k // p) % v
        microbatch = (k // (p * v)) * p + k % p
        stream.append(Action(kind, microbatch, chunk if kind == "F" else v - 1 - chunk))
    return stream


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B with v model chunks per rank (2104.04473 §2.2.2, Figure 4 bottom).

    Rank r warms up with (p − r − 1)·2 + (v − 1)·p forwards (at most m·v), as in Megatron-LM's
    forward_backward_pipelining_with_interleaving, then alternates. Needs m to be a multiple of p,
    since microbatches go through the chunks in groups of p. With v = 1 this is 1F1B itself.

    One difference from Megatron-LM: when m = p it runs every forward first, a constraint of its
    paired send/recv calls. As data that is not needed: this order has the same bubble,
    (p − 1)/(v·m), and holds fewer activations, so the warm-up formula is used for every m.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p != 0:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches to be a multiple of num_stages; "
            f"got num_microbatches={m}, num_stages={p}")
    forwards = _interleaved_stream("F", p, m, v)
    backwards = _interleaved_stream("B", p, m, v)
    return [
        _warmup_then_1f1b(forwards, backwards, min((p - rank - 1) * 2 + (v - 1) * p, m * v))
        for rank in range(p)
    ]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved"): p stages, m microbatches."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_one_f_one_b(p, m, v)
    if v != 1:
        raise ValueError(f"the {name} schedule has one model chunk per rank; got v={v}")
    return SCHEDULES[name](p, m)


def forward_only(schedule: Schedule) -> Schedule:
    """The forward passes of ``schedule`` alone, in the same order: evaluation needs no backward.

    It cannot deadlock: a forward waits only for forwards of earlier virtual stages, each of
    which runs in its rank's order without waiting on any backward.
    """
    return [[a for a in row if a.kind == "F"] for row in schedule]


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: 'rank 0: F0 F1 B0 …'."""
    return "\n".join(f"rank {rank}: " + " ".join(map(str, row))
                     for rank, row in enumerate(schedule))


# --- dependencies and checking ------------------------------------------------------------------


def dependencies(rank: int, action: Action, num_stages: int, num_chunks: int = 1):
    """The (rank, action) pairs that must finish before `action` can start on `rank`.

    With virtual stage s = chunk·p + rank: F(mb, s) needs F(mb, s−1); B(mb, s) needs F(mb, s)
    (its own activations) and B(mb, s+1) (the gradient of its output).
    """
    p = num_stages
    stage = action.chunk * p + rank

    def at_stage(kind: str, s: int) -> tuple[int, Action]:
        return s % p, Action(kind, action.microbatch, s // p)

    if action.kind == "F":
        return [at_stage("F", stage - 1)] if stage > 0 else []
    needs = [(rank, Action("F", action.microbatch, action.chunk))]
    if stage < num_chunks * p - 1:
        needs.append(at_stage("B", stage + 1))
    return needs


def execution_order(schedule: Schedule, num_chunks: int = 1) -> Iterator[tuple[int, Action]]:
    """Yield (rank, action) as the ranks would run their lists, each blocking on its dependencies.

    Every action comes after all the actions it needs. Raises ValueError on deadlock: no rank's
    next action has its inputs, yet some rank still has work.
    """
    p = len(schedule)
    done: set[tuple[int, Action]] = set()
    position = [0] * p
    while any(position[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while position[rank] < len(schedule[rank]):
                action = schedule[rank][position[rank]]
                if not done.issuperset(dependencies(rank, action, p, num_chunks)):
                    break
                yield rank, action
                done.add((rank, action))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: no rank can progress; " + _blocked(schedule, position,
                                                                            done, num_chunks))


def _blocked(schedule: Schedule, position: list[int], done: set, num_chunks: int) -> str:
    p = len(schedule)
    waits = []
    for rank in range(p):
        if position[rank] < len(schedule[rank]):
            action = schedule[rank][position[rank]]
            missing = [(r, a) for r, a in dependencies(rank, action, p, num_chunks)
                       if (r, a) not in done]
            waits.append(f"rank {rank} waits at {action} for "
                         + ", ".join(f"{a} on rank {r}" for r, a in missing))
    return "; ".join(waits)


def check_schedule(schedule: Schedule, num_chunks: int = 1) -> None:
    """Raise ValueError unless `schedule` is complete, dependency-ordered and deadlock-free.

    Complete: every rank runs F and B of every microbatch (0..m−1, m inferred from the largest
    microbatch seen) on each of its `num_chunks` chunks exactly once. Dependency-ordered: no rank
    lists an action before one it needs from itself. Deadlock-free: the ranks, each blocking on
    its inputs, all reach the end of their lists.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    if not schedule:
        raise ValueError("a schedule needs at least one rank, got an empty list")
    num_microbatches = 1 + max((a.microbatch for row in schedule for a in row), default=-1)
    expected = Counter(Action(kind, mb, chunk) for kind in "FB" for mb in range(num_microbatches)
                       for chunk in range(num_chunks))
    for rank, row in enumerate(schedule):
        _check_complete(rank, Counter(row), expected)
        _check_own_order(rank, row, len(schedule), num_chunks)
    for _ in execution_order(schedule, num_chunks):
        pass


def _check_complete(rank: int, counts: Counter, expected: Counter) -> None:
    problems = []
    if missing := sorted(expected - counts, key=_sort_key):
        problems.append("missing " + ", ".join(map(str, missing)))
    if extra := sorted((counts - expected).elements(), key=_sort_key):
        problems.append("unexpected or duplicated " + ", ".join(map(str, extra)))
    if problems:
        raise ValueError(f"incomplete schedule: rank {rank} is " + "; ".join(problems))


def _sort_key(action: Action) -> tuple[int, str, int]:
    return action.chunk, action.kind, action.microbatch


def _check_own_order(rank: int, row: list[Action], num_stages: int, num_chunks: int) -> None:
    index = {action: i for i, action in enumerate(row)}
    for i, action in enumerate(row):
        for dep_rank, dep in dependencies(rank, action, num_stages, num_chunks):
            if dep_rank == rank and index[dep] > i:
                raise ValueError(
                    f"dependency violation: rank {rank} runs {action} (position {i}) before "
                    f"{dep} (position {index[dep]}), which it needs")
