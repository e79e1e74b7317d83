"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

GPipe, 1F1B and interleaved 1F1B (2104.04473 §2.2, Figures 3 and 4), in the orders of Megatron-LM's
``forward_backward_pipelining_{without,with}_interleaving``; the zero-bubble ZB-H1, ZB-H2
(2401.10241 §2, Figure 3) and ZB-V (§6) split the backward pass (§1, Figure 1): B computes the
input's gradient, which the previous stage waits for, W the weights', which nobody needs before
the optimizer step. Without W actions, B is the whole backward.

Nothing here computes or communicates: the lists are checked (``check_schedule``), simulated
(``simulate.py``) and executed (``engine.py``). ``messages_of`` is the one definition of the data
flow; the dependencies, the checker, the simulator and ``p2p.exchange_plan`` all follow from it
through one ``walk``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from megatron_edu.pipeline.stages import Message, StageMap

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
           "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v", "SCHEDULES", "stage_map",
           "check_layout", "make_schedule", "PipelineConfig", "forward_only", "format_schedule",
           "messages_of", "dependencies", "Meeting", "walk", "check_schedule"]


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


class Schedule(list):
    """One list of `Action`s per pipeline rank, in order, and ``stages``, its chunks' `StageMap`."""

    def __init__(self, rows: Iterable[Iterable[Action]], stages: StageMap) -> None:
        super().__init__(list(row) for row in rows)
        if len(self) != stages.p:
            raise ValueError(f"a schedule for {stages} needs {stages.p} ranks, got {len(self)}")
        if bad := [a for row in self for a in row if not 0 <= a.chunk < stages.v]:
            raise ValueError(f"{bad[0]} names chunk {bad[0].chunk}, but each rank holds "
                             f"{stages.v} chunk(s) ({stages})")
        self.stages = stages

    @property
    def num_microbatches(self) -> int:
        return 1 + max((a.microbatch for row in self for a in row), default=-1)

    @property
    def splits_backward(self) -> bool:
        """Whether it has W actions: then each B is the input gradient only (2401.10241)."""
        return any(action.kind == "W" for row in self for action in row)

    def in_flight(self, rank: int) -> Iterator[tuple[int, ...]]:
        """Per chunk, the microbatches whose activations ``rank`` holds after each of its
        actions: F stores them; B frees them, or W when the backward is split (2401.10241 §2.3)."""
        held, freed_by = [0] * self.stages.v, "W" if self.splits_backward else "B"
        for action in self[rank]:
            held[action.chunk] += {"F": 1, freed_by: -1}.get(action.kind, 0)
            yield tuple(held)


# --- the schedules ----------------------------------------------------------------------------
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
    """All forwards, then all backwards, on every rank (2104.04473 §2.2.1, Figure 3): each
    holds all m microbatches' activations."""
    check_layout("gpipe", num_stages, num_microbatches)
    forwards = [Action("F", i) for i in range(num_microbatches)]
    backwards = [Action("B", i) for i in range(num_microbatches)]
    return Schedule([_warmup_then_1f1b(forwards, backwards, num_microbatches)
                     for _ in range(num_stages)], StageMap.plain(num_stages))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush (2104.04473 §2.2.1, Figure 4 top): warm up, then one forward one backward.

    Rank r warms up with min(p − r − 1, m) forwards, as Megatron-LM does; m < p is allowed (the
    warm-up then takes every microbatch on the early ranks, which run GPipe's order). Rank r then
    holds at most p − r microbatches' activations instead of GPipe's m.
    """
    check_layout("1f1b", num_stages, num_microbatches)
    forwards = [Action("F", i) for i in range(num_microbatches)]
    backwards = [Action("B", i) for i in range(num_microbatches)]
    return Schedule([
        _warmup_then_1f1b(forwards, backwards, min(num_stages - rank - 1, num_microbatches))
        for rank in range(num_stages)], StageMap.plain(num_stages))


def _interleaved_stream(kind: str, p: int, m: int, v: int) -> list[Action]:
    """A rank's m·v forwards (backwards) in Megatron's interleaved order: p microbatches through
    chunk 0, the same p through chunk 1, …, then the next p; backwards take the chunks from v−1."""
    stream = []
    for k in range(m * v):
        chunk = (k // p) % v
        microbatch = (k // (p * v)) * p + k % p
        stream.append(Action(kind, microbatch, chunk if kind == "F" else v - 1 - chunk))
    return stream


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int, *,
                            warmup_per_hop: int = 2) -> Schedule:
    """Interleaved 1F1B with v model chunks per rank (2104.04473 §2.2.2, Figure 4 bottom).

    Rank r warms up with (p − r − 1)·2 + (v − 1)·p forwards (at most m·v), as Megatron-LM does,
    then alternates; m must be a multiple of p. With v = 1 this is 1F1B. The 2 per hop is
    Megatron-LM's: it exchanges both directions in one call after each step, so a result reaches
    the neighbour a step late. Sends that leave at once need ``warmup_per_hop=1``: the same bubble
    with less held, but every send's latency on the critical path (notebook 04). Megatron-LM runs
    every forward first when m = p (its paired calls need it); as data, the same formula holds for
    every m: the same bubble, (p − 1)/(v·m), with fewer activations held.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    check_layout("interleaved", p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    forwards = _interleaved_stream("F", p, m, v)
    backwards = _interleaved_stream("B", p, m, v)
    return Schedule([
        _warmup_then_1f1b(forwards, backwards,
                          min((p - rank - 1) * warmup_per_hop + (v - 1) * p, m * v))
        for rank in range(p)], StageMap(p, v, "interleaved"))


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
    check_layout(f"zb-h{k}", p, m)
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    return Schedule([_weights_after_backwards(
        _warmup_then_1f1b(forwards, backwards, min(k * (p - rank - 1), m)), k * rank)
        for rank in range(p)], StageMap.plain(p))


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (2401.10241 §2.1, Figure 3 top): 1F1B whose B is the input gradient only.

    Rank r runs each W r backward passes after its B, filling the tail where 1F1B idles. Every
    rank holds p microbatches (1F1B's rank 0) and B reaches rank 0 without waiting for a W: the
    bubble is (p − 1)(t_F + t_B − t_W), a third of 1F1B's at equal costs (§2.3 Table 2; t_W ≤ t_F).
    """
    return _zero_bubble(num_stages, num_microbatches, 1)


def zero_bubble_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (2401.10241 §2.2, Figure 3 bottom): ZB-H1 stretched to hold 2p − 1 microbatches.

    Rank r warms up with 2(p − r − 1) forwards and delays its W's by 2r backward passes: each rank
    is busy from its first action to its last (t_F = t_B = t_W; else (p − 1)(t_F + t_B − 2·t_W)
    idle, §2.3 Table 2). The next step fills its late start and early finish once the optimizer
    step no longer synchronises the ranks (§4).
    """
    return _zero_bubble(num_stages, num_microbatches, 2)


def zero_bubble_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (2401.10241 §6): two chunks per rank placed in a V, 1F1B's memory and no bubble.

    Chunk 1 of rank r is stage 2p − 1 − r (``StageMap`` kind "v"): rank 0 holds the first and the
    last stage. The order is the paper's (and PyTorch's ScheduleZBVZeroBubble), phase by phase in
    ``_zbv_rank``; for m < 2p − 1, that of 2p − 1 without the missing microbatches. A rank holds at
    most 2p chunk-microbatches of half a stage: p microbatches, as 1F1B's rank 0.
    """
    p, m = num_stages, num_microbatches
    check_layout("zb-v", p, m)
    return Schedule([[a for a in _zbv_rank(p, max(m, 2 * p - 1), rank) if a.microbatch < m]
                     for rank in range(p)], StageMap(p, 2, "v"))


def _zbv_rank(p: int, n: int, rank: int) -> list[Action]:
    """ZB-V's order on `rank` for n ≥ 2p − 1 microbatches, phase by phase (2401.10241 §6)."""
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


# --- by name -------------------------------------------------------------------------------------
SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b,
    "zb-h1": zero_bubble_h1, "zb-h2": zero_bubble_h2, "zb-v": zero_bubble_v}
_CHUNKS = {"zb-v": 2}  # model chunks per rank where fixed and not 1 (interleaved: any v)


def check_layout(name: str, p: int, m: int, v: int | None = None) -> int:
    """Raise a ValueError unless schedule ``name`` runs p stages, m microbatches, v chunks per
    rank; return v (None: the schedule's own, 2 for ZB-V, else 1). Every size rule is here."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if v is None:
        if name == "interleaved":
            raise ValueError("the interleaved schedule needs its number of chunks per rank, v")
        v = _CHUNKS.get(name, 1)
    for size, value in [("num_stages", p), ("num_microbatches", m), ("num_chunks", v)]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{size} must be at least 1, got {value!r}")
    if name != "interleaved" and v != _CHUNKS.get(name, 1):
        chunks = {1: "one model chunk", 2: "two model chunks"}[_CHUNKS.get(name, 1)]
        raise ValueError(f"the {name} schedule has {chunks} per rank; got v={v}")
    if name == "interleaved" and v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs num_microbatches to be a multiple of "
                         f"num_stages; got num_microbatches={m}, num_stages={p}")
    return v


def stage_map(name: str, p: int, v: int | None = None) -> StageMap:
    """Where schedule ``name`` puts v chunks on p ranks: ZB-V's V, the others c·p + r."""
    v = check_layout(name, p, p, v)
    return StageMap(p, v, "v" if name == "zb-v" else "interleaved")


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Schedule `name` (a key of ``SCHEDULES``): p stages, m microbatches, v chunks per rank."""
    v = check_layout(name, p, m, v)
    return interleaved_one_f_one_b(p, m, v) if name == "interleaved" else SCHEDULES[name](p, m)


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline of any p runs: ``schedule`` (a key of ``SCHEDULES``) with ``chunks`` per
    rank (None: the schedule's own), ``num_microbatches`` of ``microbatch`` sequences per replica
    and step. Checked when made; against p by ``check``."""

    schedule: str = "1f1b"
    chunks: int | None = None
    microbatch: int = 1
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.microbatch, int) or self.microbatch < 1:
            raise ValueError(f"microbatch must be a positive integer, got {self.microbatch!r}")
        # p = 1 passes every rule that depends on p; ``check`` applies the real one
        object.__setattr__(self, "chunks",
                           check_layout(self.schedule, 1, self.num_microbatches, self.chunks))

    def check(self, p: int) -> None:
        """Raise a ValueError naming the numbers unless this pipeline runs on p stages."""
        check_layout(self.schedule, p, self.num_microbatches, self.chunks)
        if self.chunks > 1 and p == 1:
            raise ValueError(f"{self.chunks} model chunks per rank need a pipeline (pp ≥ 2): "
                             "with one stage there is nothing to interleave")

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule splits the backward pass into B and W (2401.10241)."""
        return make_schedule(self.schedule, 2, 2, self.chunks).splits_backward   # (any p, m)

    def stages(self, p: int) -> StageMap:
        """Where the schedule puts the p · v virtual stages."""
        return stage_map(self.schedule, p, self.chunks)

    def make_schedule(self, p: int) -> Schedule:
        """The schedule every pipeline of p stages runs: m microbatches, v chunks per rank."""
        return make_schedule(self.schedule, p, self.num_microbatches, self.chunks)


def forward_only(schedule: Schedule) -> Schedule:
    """The forward passes of ``schedule`` alone, in order (evaluation). It cannot deadlock: a
    forward waits only for forwards of earlier stages, none of which waits on a backward."""
    return Schedule(([a for a in row if a.kind == "F"] for row in schedule), schedule.stages)


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: 'rank 0: F0 F1 B0 …'."""
    return "\n".join(f"rank {rank}: " + " ".join(map(str, row))
                     for rank, row in enumerate(schedule))


# --- the data flow, and one walk of it ------------------------------------------------------------
MessagesOf = Callable[[Action, int, StageMap], tuple[Message | None, Message | None]]


def messages_of(action: Action, rank: int, stages: StageMap
                ) -> tuple[Message | None, Message | None]:
    """(what ``action`` on pipeline rank ``rank`` receives, what it sends); None for neither.
    F of stage s receives act s and sends act s+1; B receives grad s and sends grad s−1; none at
    the ends (the last stage starts from its loss). W keeps to itself."""
    stage, last, mb = stages.stage(rank, action.chunk), stages.num_stages - 1, action.microbatch
    if action.kind == "F":
        return (Message("act", mb, stage) if stage > 0 else None,
                Message("act", mb, stage + 1) if stage < last else None)
    if action.kind == "B":
        return (Message("grad", mb, stage) if stage < last else None,
                Message("grad", mb, stage - 1) if stage > 0 else None)
    return None, None


def _producer(message: Message, stages: StageMap) -> tuple[int, Action]:
    """The (rank, action) that sends ``message``: F of the stage before, or B of the one after."""
    rank, chunk = stages.location(message.stage + (-1 if message.kind == "act" else 1))
    return rank, Action("F" if message.kind == "act" else "B", message.microbatch, chunk)


def dependencies(rank: int, action: Action, stages: StageMap) -> list[tuple[int, Action]]:
    """The (rank, action) pairs `action` on `rank` waits for: its input's sender (a B, never a
    W: what lets zero bubble delay W, 2401.10241 §2), and on its own rank B's F and W's B."""
    own = {"B": [(rank, Action("F", action.microbatch, action.chunk))],
           "W": [(rank, Action("B", action.microbatch, action.chunk))]}.get(action.kind, [])
    receive, _ = messages_of(action, rank, stages)
    return own + ([_producer(receive, stages)] if receive is not None else [])


@dataclass(frozen=True)
class Meeting:
    """Neighbours ``ranks`` (lower first) swap ``messages`` in one exchange, standing before
    actions ``at`` of their lists (the lower rank's messages first, each in sending order)."""

    ranks: tuple[int, int]
    at: tuple[int, int]
    messages: tuple[Message, ...]


def walk(schedule: Schedule, messages: MessagesOf = messages_of
         ) -> Iterator[tuple[int, Action] | Meeting]:
    """Play the ranks' lists as a real run does; yield each (rank, action) as it runs and each
    `Meeting` where messages change hands (``p2p.exchange_plan``'s matched batches).

    A rank runs its next action once its input has arrived and stops after one that produced a
    message until that is handed over; when no rank can move, each pair of neighbours with
    messages pending meets where both stand and swaps them all (a ``local`` message, ZB-V's turn,
    arrives at once). ValueError on deadlock: nobody can move or hand over, yet work is left.
    """
    p, stages = len(schedule), schedule.stages
    position = [0] * p
    inbox: list[set[Message]] = [set() for _ in range(p)]
    outbox: list[list[Message]] = [[] for _ in range(p)]
    while True:
        for rank, row in enumerate(schedule):
            while position[rank] < len(row) and not outbox[rank]:
                needs, sends = messages(row[position[rank]], rank, stages)
                if needs is not None and needs not in inbox[rank]:
                    break
                inbox[rank].discard(needs)
                yield rank, row[position[rank]]
                position[rank] += 1
                if sends is not None:
                    (inbox[rank].add if stages.is_local(sends) else outbox[rank].append)(sends)
        pairs = sorted({tuple(sorted((r, stages.receiver(m)))) for r in range(p)
                        for m in outbox[r]})
        if not pairs:
            if any(position[r] < len(row) for r, row in enumerate(schedule)):
                raise ValueError("deadlock: no rank can progress; "
                                 + _waits(schedule, position, messages))
            return
        for a, b in pairs:
            handed = tuple(m for r, peer in ((a, b), (b, a)) for m in outbox[r]
                           if stages.receiver(m) == peer)
            yield Meeting((a, b), (position[a], position[b]), handed)
            for r in (a, b):
                outbox[r] = [m for m in outbox[r] if m not in handed]
            for m in handed:
                inbox[stages.receiver(m)].add(m)


def _waits(schedule: Schedule, position: list[int], messages: MessagesOf) -> str:
    """'rank 0 waits at B0 for B0 on rank 1; …': each stuck rank and the action it waits for."""
    waits = []
    for rank, row in enumerate(schedule):
        if position[rank] < len(row):
            action = row[position[rank]]
            r, sender = _producer(messages(action, rank, schedule.stages)[0], schedule.stages)
            waits.append(f"rank {rank} waits at {action} for {sender} on rank {r}")
    return "; ".join(waits)


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError unless `schedule` is complete (each rank runs F, B and, if split, W of
    every microbatch on each chunk exactly once), ordered on each rank (no B before its F, no W
    before its B) and deadlock-free (``walk``)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"check_schedule takes a Schedule (its lists and the StageMap they run "
                        f"on), got {type(schedule).__name__}: wrap the lists as "
                        "Schedule(rows, StageMap(p, v, 'interleaved'))")
    kinds = "FBW" if schedule.splits_backward else "FB"
    expected = Counter(Action(kind, mb, chunk) for kind in kinds
                       for mb in range(schedule.num_microbatches)
                       for chunk in range(schedule.stages.v))
    for rank, row in enumerate(schedule):
        _check_complete(rank, Counter(row), expected)
        _check_own_order(rank, row, schedule.stages)
    for _ in walk(schedule):
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


def _check_own_order(rank: int, row: list[Action], stages: StageMap) -> None:
    index = {action: i for i, action in enumerate(row)}
    for i, action in enumerate(row):
        for dep_rank, dep in dependencies(rank, action, stages):
            if dep_rank == rank and index[dep] > i:
                raise ValueError(
                    f"dependency violation: rank {rank} runs {action} (position {i}) before "
                    f"{dep} (position {index[dep]}), which it needs")
