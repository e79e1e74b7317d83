"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2 — GPipe (Figure 3), 1F1B / PipeDream-Flush
(Figure 4, top) and the interleaved 1F1B schedule (Figure 4, bottom). The orders are those of
Megatron-LM's `forward_backward_pipelining_without_interleaving` and
`forward_backward_pipelining_with_interleaving`. Qi et al. 2023, arXiv 2401.10241 — the zero-bubble
schedules ZB-H1 and ZB-H2 (§2, Figure 3) and ZB-V (§6), whose backward pass is split in two.

A schedule is a list with one entry per pipeline rank, each a list of `Action`s in execution order.
Nothing here computes or communicates: the same lists are checked (`check_schedule`), simulated
(`simulate.py`), drawn (`viz/pipeline.py`) and executed over send/recv (`engine.py`).

Model chunks (§2.2.2): with v chunks per rank, chunk c of rank r is virtual stage c·p + r of the
v·p virtual stages, so a microbatch's forward pass visits ranks 0, 1, …, p−1 (chunk 0), then
ranks 0, 1, …, p−1 again (chunk 1), and so on; its backward pass walks the same path in reverse.
ZB-V places its two chunks in a V instead (`virtual_stage`): down the ranks, then back up.

The backward pass split in two (2401.10241 §1, Figure 1): for a layer y = f(x, W), B computes the
input's gradient — which the previous stage waits for — and W the weights' gradient, which nobody
needs before the optimizer step. A schedule with W actions runs B as the input gradient only; a
schedule without them (GPipe, 1F1B, interleaved) runs the whole backward as its B.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

Schedule = list[list["Action"]]


@dataclass(frozen=True)
class Action:
    """One step of one rank: the forward ("F") or backward ("B") pass of a microbatch on a chunk,
    or, in a zero-bubble schedule, its weight-gradient pass ("W"; B is then the input gradient)."""

    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0  # model chunk on this rank (interleaved schedule, §2.2.2; ZB-V)

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W"):
            raise ValueError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")

    def __str__(self) -> str:
        """'F3' for microbatch 3 on chunk 0, 'B3.1' for its backward pass on chunk 1."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


# --- where the model chunks live ----------------------------------------------------------------

PLACEMENTS = ("interleaved", "v")


def virtual_stage(rank: int, chunk: int, num_stages: int, placement: str = "interleaved") -> int:
    """The virtual stage that model chunk `chunk` of pipeline rank `rank` holds.

    "interleaved" (2104.04473 §2.2.2): c·p + r — every chunk's stages run down the ranks again.
    "v" (2401.10241 §6, ZB-V): even chunks run down the ranks, odd ones back up — chunk 0 of rank
    r is stage r, chunk 1 is stage 2p − 1 − r — so rank 0 holds the first and the last stage, and
    the turn at rank p − 1 sends nothing.
    """
    p = num_stages
    if placement == "interleaved":
        return chunk * p + rank
    if placement == "v":
        return chunk * p + (rank if chunk % 2 == 0 else p - 1 - rank)
    raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")


def stage_location(stage: int, num_stages: int, placement: str = "interleaved") -> tuple[int, int]:
    """(rank, chunk) that holds virtual stage `stage`: the inverse of `virtual_stage`."""
    chunk, offset = divmod(stage, num_stages)
    rank = num_stages - 1 - offset if placement == "v" and chunk % 2 else offset
    if virtual_stage(rank, chunk, num_stages, placement) != stage:  # also rejects a placement
        raise AssertionError(f"placement {placement!r} does not invert at stage {stage}")
    return rank, chunk


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


# --- zero bubble (2401.10241): the backward split into B and W ---------------------------------


def _weights_after_backwards(order: list[Action], delay: int) -> list[Action]:
    """`order` with each B followed by the W of the backward `delay` B's before it; the W's of
    the last `delay` backward passes close the list.

    W needs nothing but its own B, so it can go anywhere after it: here it fills the time that
    1F1B spends waiting. A microbatch's activations live from its F to its W, so a rank holds
    `delay` more microbatches than `order` alone would.
    """
    result, backwards = [], []
    for action in order:
        result.append(action)
        if action.kind == "B":
            backwards.append(action)
            if len(backwards) > delay:
                result.append(_weight_pass(backwards[-1 - delay]))
    return result + [_weight_pass(b) for b in backwards[max(len(backwards) - delay, 0):]]


def _weight_pass(backward: Action) -> Action:
    return Action("W", backward.microbatch, backward.chunk)


def _zero_bubble(num_stages: int, num_microbatches: int, k: int) -> Schedule:
    """1F1B's two streams, rank r warming up with k·(p − r − 1) forwards and delaying its W's
    by k·r backwards: every rank holds k·(p − 1) + 1 microbatches between F and W."""
    p, m = num_stages, num_microbatches
    _check_sizes(p, m)
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    return [_weights_after_backwards(
        _warmup_then_1f1b(forwards, backwards, min(k * (p - rank - 1), m)), k * rank)
        for rank in range(p)]


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (2401.10241 §2.1, Figure 3 top): 1F1B whose B is the input gradient only.

    Each rank warms up as in 1F1B, and rank r runs the W of a microbatch r backward passes after
    its B — the later ranks, which warmed up less, keep their W's for the tail, where 1F1B idles.
    Every rank holds p microbatches, 1F1B's peak on rank 0, and B reaches rank 0 without waiting
    for any W: the bubble shrinks to (p − 1)(t_F + t_B − t_W), a third of 1F1B's when the three
    costs are equal (§2.3, Table 2; when t_W ≤ t_F).
    """
    return _zero_bubble(num_stages, num_microbatches, 1)


def zero_bubble_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (2401.10241 §2.2, Figure 3 bottom): ZB-H1 stretched to hold 2p − 1 microbatches.

    Rank r warms up with 2(p − r − 1) forwards, which fill the wait for the first B, and delays
    its W's by 2r backward passes, which fill the tail: the ranks' timelines become
    parallelograms, busy from their first action to their last (t_F = t_B = t_W; otherwise
    (p − 1)(t_F + t_B − 2·t_W) idle, §2.3 Table 2). The idle time left is each rank's late start
    and early finish, which the next step's actions fill once the optimizer step does not
    synchronise the ranks (§4).
    """
    return _zero_bubble(num_stages, num_microbatches, 2)


def zero_bubble_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (2401.10241 §6): two chunks per rank placed in a V, 1F1B's memory and no bubble.

    Chunk 0 of rank r is stage r, chunk 1 is stage 2p − 1 − r (`virtual_stage`, placement "v"):
    a microbatch goes down the ranks and back up, so the first and the last stage share rank 0.
    Rank r runs, on chunk 0 (F⁰, B⁰, W⁰) and chunk 1 (F¹, B¹, W¹), the phases of the paper's
    (and PyTorch's ScheduleZBVZeroBubble's) order: 2(p − r) − 1 F⁰; r × (F¹ F⁰); p − r ×
    (F¹ B¹ W¹); the steady (F⁰ B⁰ W⁰ F¹ B¹ W¹) until every forward ran; r × (B⁰ B¹);
    p − r × (B⁰ W⁰); the W's left. With fewer than 2p − 1 microbatches the order is that of
    2p − 1 without the missing ones. Every rank holds at most 2p chunk-microbatches, each half a
    stage's layers: p whole microbatches, as 1F1B's rank 0.
    """
    p, m = num_stages, num_microbatches
    _check_sizes(p, m)
    return [[a for a in _zbv_rank(p, max(m, 2 * p - 1), rank) if a.microbatch < m]
            for rank in range(p)]


def _zbv_rank(p: int, n: int, rank: int) -> list[Action]:
    """ZB-V's order on `rank` for n ≥ 2p − 1 microbatches (see `zero_bubble_v`)."""
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    order: list[Action] = []

    def run(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            order.append(Action(kind, count[kind, chunk], chunk))
            count[kind, chunk] += 1

    run(*[("F", 0)] * (2 * (p - rank) - 1))
    for _ in range(rank):
        run(("F", 1), ("F", 0))
    for _ in range(p - rank):
        run(("F", 1), ("B", 1), ("W", 1))
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        run(*[("F", 0)] * (count["F", 0] < n), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(rank):
        run(("B", 0), ("B", 1))
    for _ in range(p - rank):
        run(("B", 0), ("W", 0))
    run(*[("W", 1)] * (n - count["W", 1]), *[("W", 0)] * (n - count["W", 0]))
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b,
             "zb-h1": zero_bubble_h1, "zb-h2": zero_bubble_h2, "zb-v": zero_bubble_v}
CHUNKS = {"zb-v": 2}          # model chunks per rank where fixed and not 1
PLACEMENT = {"zb-v": "v"}     # where it is not "interleaved"


def placement_of(name: str) -> str:
    """Where the schedule called `name` puts the model chunks: "v" for ZB-V, else "interleaved"."""
    return PLACEMENT.get(name, "interleaved")


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"):
    p stages, m microbatches; v model chunks per rank (interleaved: any; ZB-V: 2; others: 1)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_one_f_one_b(p, m, v)
    if v != CHUNKS.get(name, 1):
        chunks = {1: "one model chunk", 2: "two model chunks"}[CHUNKS.get(name, 1)]
        raise ValueError(f"the {name} schedule has {chunks} per rank; got v={v}")
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


def dependencies(rank: int, action: Action, num_stages: int, num_chunks: int = 1,
                 placement: str = "interleaved"):
    """The (rank, action) pairs that must finish before `action` can start on `rank`.

    With virtual stage s (`virtual_stage`): F(mb, s) needs F(mb, s−1); B(mb, s) needs F(mb, s)
    (its own activations) and B(mb, s+1) (the gradient of its output) — only B, never W, which is
    what lets a zero-bubble schedule delay W (2401.10241 §2); W(mb, s) needs B(mb, s), on its rank.
    """
    p = num_stages
    stage = virtual_stage(rank, action.chunk, p, placement)

    def at_stage(kind: str, s: int) -> tuple[int, Action]:
        r, c = stage_location(s, p, placement)
        return r, Action(kind, action.microbatch, c)

    if action.kind == "F":
        return [at_stage("F", stage - 1)] if stage > 0 else []
    if action.kind == "W":
        return [(rank, Action("B", action.microbatch, action.chunk))]
    needs = [(rank, Action("F", action.microbatch, action.chunk))]
    if stage < num_chunks * p - 1:
        needs.append(at_stage("B", stage + 1))
    return needs


def execution_order(schedule: Schedule, num_chunks: int = 1,
                    placement: str = "interleaved") -> Iterator[tuple[int, Action]]:
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
                if not done.issuperset(dependencies(rank, action, p, num_chunks, placement)):
                    break
                yield rank, action
                done.add((rank, action))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("deadlock: no rank can progress; " + _blocked(
                schedule, position, done, num_chunks, placement))


def _blocked(schedule: Schedule, position: list[int], done: set, num_chunks: int,
             placement: str) -> str:
    p = len(schedule)
    waits = []
    for rank in range(p):
        if position[rank] < len(schedule[rank]):
            action = schedule[rank][position[rank]]
            missing = [(r, a) for r, a in dependencies(rank, action, p, num_chunks, placement)
                       if (r, a) not in done]
            waits.append(f"rank {rank} waits at {action} for "
                         + ", ".join(f"{a} on rank {r}" for r, a in missing))
    return "; ".join(waits)


def splits_backward(schedule: Schedule) -> bool:
    """Whether `schedule` has W actions: then each B is the input gradient only (2401.10241)."""
    return any(action.kind == "W" for row in schedule for action in row)


def check_schedule(schedule: Schedule, num_chunks: int = 1,
                   placement: str = "interleaved") -> None:
    """Raise ValueError unless `schedule` is complete, dependency-ordered and deadlock-free.

    Complete: every rank runs F and B — and W, if the schedule splits the backward — of every
    microbatch (0..m−1, m inferred from the largest microbatch seen) on each of its `num_chunks`
    chunks exactly once. Dependency-ordered: no rank lists an action before one it needs from
    itself (a B before its F, a W before its B). Deadlock-free: the ranks, each blocking on its
    inputs, all reach the end of their lists. `placement`: where the chunks live
    (`virtual_stage`; "v" for ZB-V).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    if not schedule:
        raise ValueError("a schedule needs at least one rank, got an empty list")
    num_microbatches = 1 + max((a.microbatch for row in schedule for a in row), default=-1)
    kinds = "FBW" if splits_backward(schedule) else "FB"
    expected = Counter(Action(kind, mb, chunk) for kind in kinds for mb in range(num_microbatches)
                       for chunk in range(num_chunks))
    for rank, row in enumerate(schedule):
        _check_complete(rank, Counter(row), expected)
        _check_own_order(rank, row, len(schedule), num_chunks, placement)
    for _ in execution_order(schedule, num_chunks, placement):
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


def _check_own_order(rank: int, row: list[Action], num_stages: int, num_chunks: int,
                     placement: str) -> None:
    index = {action: i for i, action in enumerate(row)}
    for i, action in enumerate(row):
        for dep_rank, dep in dependencies(rank, action, num_stages, num_chunks, placement):
            if dep_rank == rank and index[dep] > i:
                raise ValueError(
                    f"dependency violation: rank {rank} runs {action} (position {i}) before "
                    f"{dep} (position {index[dep]}), which it needs")
