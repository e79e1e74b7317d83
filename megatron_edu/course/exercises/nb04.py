"""Exercises of notebook 04: pipeline schedules as data (2104.04473 §2.2).

04.1 ★   the peak activations a 1F1B rank holds, as a formula in p, m and the rank.
04.2 ★★  one rank's 1F1B order: warm-up, steady one-forward-one-backward, cool-down.
04.3 ★★★ one rank's interleaved 1F1B order: microbatches in groups of p through v chunks.
04.4 ★★  the bubble fraction of a schedule played on paper: Σ idle / Σ compute (§2.2.1).

Schedules are pure data, so the checkers need no ranks: they compare the learner's answers with
``schedules.one_f_one_b`` / ``interleaved_one_f_one_b`` over many (p, m, v), and say where the
first difference comes from — the warm-up length, the order of one of the two streams, a missing
action, a deadlock of the ranks run together. 04.4 compares with ``simulate``'s timelines of
GPipe, 1F1B, interleaved 1F1B and one microbatch at a time (whose bubble, p − 1, no formula of
§2.2 gives), and names the other definitions (over the whole step's time, idle until a rank's
own end or within its own span) and the formulas (p/m, (p − 1)/(p·m), v forgotten) that a wrong
answer equals.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    _interleaved_stream,
    _warmup_then_1f1b,
    check_schedule,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
)
from megatron_edu.pipeline.simulate import Timeline, simulate
from megatron_edu.pipeline.stages import StageMap

__all__ = ["BubbleCase", "BUBBLE_CASES"]  # the checkers register themselves (``@exercise``)


def _peaks(schedule: Schedule) -> list[int]:
    """Per rank, the most activations held at once (the simulator's count: F adds, B frees)."""
    return Timeline([[(a, 0, 0) for a in row] for row in schedule], schedule.stages
                    ).peak_activations


# --- 04.1 ★ the peak of 1F1B ------------------------------------------------------------------

def _typical_first(cases: list[tuple], typical: list[tuple]) -> list[tuple]:
    """``cases`` with the paper's typical sizes first: the first mistake found is shown there."""
    return [c for c in cases if c in typical] + [c for c in cases if c not in typical]


PEAK_CASES = _typical_first([(p, m, r) for p in range(1, 9) for m in range(1, 13)
                             for r in range(p)], [(4, 8, r) for r in range(4)])

PEAK_MISTAKES: dict[str, tuple[Callable[[int, int, int], int], str]] = {
    "warm-up only": (lambda p, m, r: min(p - r - 1, m),
                     "you counted the warm-up forwards only: after its p − r − 1 warm-up "
                     "forwards a rank runs one more forward, the steady state's first, before "
                     "its first backward frees anything"),
    "no min": (lambda p, m, r: p - r,
               "p − r is right while m ≥ p; with fewer microbatches than stages a rank cannot "
               "hold more than the m there are"),
    "gpipe": (lambda p, m, r: m,
              "that is GPipe's peak, all m microbatches; 1F1B starts its backward passes early, "
              "so its peak does not grow with m"),
    "reversed": (lambda p, m, r: min(r + 1, m),
                 "reversed: the first stage (rank 0) holds the most — its first backward comes "
                 "last, after the microbatch has crossed every stage and come back"),
}


@exercise("04.1", "the activations a 1F1B rank holds at its peak",
          marks=(r"p[−-]r(?:ank)?(?![−-]1)(?!ank)",         # p − r held, not the p − r − 1 warm-up
                 r"peakactivationsperrank:\[4,3,2,1\]"))   # 1F1B's peaks at p = 4, m = 8
def _peak(fn) -> str:
    answers = {}
    for p, m, r in PEAK_CASES:
        got = fn(p, m, r)
        if isinstance(got, bool) or not isinstance(got, int):
            raise Hint(f"peak_activations({p}, {m}, {r}) returned {got!r} "
                       f"({type(got).__name__}); return a whole number of microbatches (int)")
        answers[p, m, r] = got
    expected = {(p, m, r): _peaks(one_f_one_b(p, m))[r] for p, m, r in PEAK_CASES}
    wrong = [case for case in PEAK_CASES if answers[case] != expected[case]]
    if not wrong:
        return (f"your formula equals the simulator's count on every rank of {len(PEAK_CASES)} "
                "(p, m, rank) cases, p ≤ 8, m ≤ 12 — independent of m once m ≥ p")
    p, m, r = wrong[0]
    first = (f"p={p}, m={m}, rank {r}: you said {answers[p, m, r]}, the schedule holds "
             f"{expected[p, m, r]}")
    for formula, advice in PEAK_MISTAKES.values():
        if all(answers[case] == formula(*case) for case in PEAK_CASES):
            raise Hint(f"{first} — {advice}")
    raise Hint(f"{first} (count along one_f_one_b(p, m)[rank]: each F adds a microbatch's "
               "activations, each B frees one; the peak is the most held at once)")


# --- 04.2 ★★ one rank's 1F1B order -----------------------------------------------------------

ORDER_CASES = _typical_first([(p, m) for p in range(1, 7) for m in range(1, 11)], [(4, 8)])


def _row(fn, *args) -> list[Action]:
    row = fn(*args)
    if not isinstance(row, list | tuple) or not all(isinstance(a, Action) for a in row):
        raise Hint(f"your function returned {type(row).__name__} for {args}; return a list of "
                   "Action(kind, microbatch[, chunk]) in the order the rank runs them")
    return list(row)


def _forwards_before_first_backward(row: list[Action]) -> int:
    return next((i for i, a in enumerate(row) if a.kind == "B"), len(row))


def _incomplete(got: list[Action], expected: list[Action], where: str) -> None:
    missing = sorted(map(str, Counter(expected) - Counter(got)))
    extra = sorted(map(str, Counter(got) - Counter(expected)))
    m = 1 + max(a.microbatch for a in expected)
    if any(a.microbatch >= m for a in got):
        raise Hint(f"{where}: you run {' '.join(extra)}, but there are only m = {m} "
                   f"microbatches (0 to {m - 1}) — when m is small the warm-up is capped: it "
                   "cannot run more forwards than there are")
    if missing or extra:
        raise Hint(f"{where}: " + "; ".join(
            [f"missing {' '.join(missing)}"] * bool(missing)
            + [f"unexpected or duplicated {' '.join(extra)}"] * bool(extra))
            + " — every rank runs F and B of every microbatch (on each chunk) exactly once")


def _first_difference(got: list[Action], expected: list[Action]) -> str:
    i = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    return (f"first difference at position {i}: you run {got[i]}, the schedule runs "
            f"{expected[i]} (you: {' '.join(map(str, got))}; expected: "
            f"{' '.join(map(str, expected))})")


def _together(rows: list[list[Action]], num_chunks: int) -> str:
    """What the ranks' lists do when run together, in words (empty when they run fine): the
    learner's lists on the interleaved placement, chunk c of rank r at stage c·p + r."""
    try:
        check_schedule(Schedule(rows, StageMap(len(rows), num_chunks, "interleaved")))
    except ValueError as error:
        return f". Run together, your ranks' lists fail check_schedule: {error}"
    return ""


@exercise("04.2", "one rank's 1F1B order: warm-up, one forward one backward, cool-down",
          reference=(one_f_one_b, _warmup_then_1f1b),
          marks=(r"forwards\[\w+\+i\],backwards\[i\]",))  # the steady state, as code
def _one_f_one_b_rank(fn) -> str:
    for p, m in ORDER_CASES:
        reference = one_f_one_b(p, m)
        rows = [_row(fn, p, m, r) for r in range(p)]
        for r, (got, expected) in enumerate(zip(rows, reference, strict=True)):
            if got == expected:
                continue
            where = f"p={p}, m={m}, rank {r}"
            _incomplete(got, expected, where)
            warm_got = _forwards_before_first_backward(got)
            warm = _forwards_before_first_backward(expected)
            if warm_got != warm:
                raise Hint(f"{where} starts its first backward after {warm_got} forwards, "
                           f"expected {warm}: the warm-up is min(p − r − 1, m) = "
                           f"{min(p - r - 1, m)} forwards, then the steady state's first forward "
                           "(if any is left), then the first backward" + _together(rows, 1))
            raise Hint(f"{where}: {_first_difference(got, expected)} — after the warm-up, "
                       "alternate one forward and one backward (oldest microbatch first), then "
                       "run the remaining backwards" + _together(rows, 1))
    return (f"equal to one_f_one_b on every rank for all {len(ORDER_CASES)} (p, m) with p ≤ 6, "
            "m ≤ 10, m < p included")


# --- 04.3 ★★★ one rank's interleaved order ----------------------------------------------------

INTERLEAVED_CASES = _typical_first([(p, k * p, v) for p in (2, 3, 4) for k in (1, 2, 3)
                                    for v in (2, 3)], [(4, 8, 2)])


def _stream(row: list[Action], kind: str) -> list[Action]:
    return [a for a in row if a.kind == kind]


def _stream_hint(got: list[Action], expected: list[Action], kind: str, p: int, v: int) -> str:
    words = {"F": "forward", "B": "backward"}[kind]
    unreversed = [Action("B", a.microbatch, v - 1 - a.chunk) for a in expected]
    if kind == "B" and got == unreversed:
        return (f"your backward passes visit the chunks in the forwards' order; they go in "
                f"reverse: each group of p microbatches runs its backward on chunk {v - 1} "
                f"first (B0.{v - 1} before B0), since the last virtual stage starts the "
                "backward pass")
    i = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    return (f"your {words} passes come in another order: the {words} #{i} is {got[i]}, expected "
            f"{expected[i]} ({' '.join(map(str, expected[:2 * p * v]))} …) — microbatches go "
            f"through the chunks in groups of p = {p}: p microbatches through chunk "
            f"{0 if kind == 'F' else v - 1}, the same p through the next chunk, and so on, then "
            "the next p microbatches")


@exercise("04.3", "one rank's interleaved 1F1B order: groups of p through v chunks",
          reference=(interleaved_one_f_one_b, _interleaved_stream),
          marks=(r"\(k//p\)%v", r"k//\(p\*v\)"))  # chunk and microbatch of a stream's k-th
def _interleaved_rank(fn) -> str:
    for p, m, v in INTERLEAVED_CASES:
        reference = interleaved_one_f_one_b(p, m, v)
        rows = [_row(fn, p, m, v, r) for r in range(p)]
        for r, (got, expected) in enumerate(zip(rows, reference, strict=True)):
            if got == expected:
                continue
            where = f"p={p}, m={m}, v={v}, rank {r}"
            _incomplete(got, expected, where)
            for kind in "FB":
                if _stream(got, kind) != _stream(expected, kind):
                    raise Hint(f"{where}: "
                               + _stream_hint(_stream(got, kind), _stream(expected, kind), kind,
                                              p, v))
            warm_got = _forwards_before_first_backward(got)
            warm = _forwards_before_first_backward(expected)
            if warm_got != warm:
                raise Hint(f"{where} runs {warm_got} forwards before its first backward, "
                           f"expected {warm}: the warm-up is min((p − r − 1)·2 + (v − 1)·p, m·v) "
                           f"= {min((p - r - 1) * 2 + (v - 1) * p, m * v)} forwards, then the "
                           "steady state's first forward (if any is left)" + _together(rows, v))
            raise Hint(f"{where}: {_first_difference(got, expected)}" + _together(rows, v))
    return (f"equal to interleaved_one_f_one_b on every rank for {len(INTERLEAVED_CASES)} "
            "(p, m, v) with p ≤ 4, m up to 3p, v ≤ 3: the two streams in groups of p, the "
            "longer warm-up, then one forward one backward")


# --- 04.4 ★★ the bubble, played on paper -------------------------------------------------------

NAIVE = "one microbatch at a time"   # F0 B0 F1 B1 … on every rank: naive model parallelism


@dataclass(frozen=True)
class BubbleCase:
    """A schedule to play: ``name`` (``make_schedule``'s, or NAIVE), its sizes and its costs."""

    name: str
    p: int
    m: int
    v: int = 1
    forward_time: int = 1
    backward_time: int = 2

    def schedule(self) -> Schedule:
        if self.name == NAIVE:
            row = [Action(kind, i) for i in range(self.m) for kind in "FB"]
            return Schedule([row] * self.p, StageMap.plain(self.p))
        return make_schedule(self.name, self.p, self.m, self.v)

    def __str__(self) -> str:
        v = f", v={self.v}" if self.name == "interleaved" else ""
        return (f"{self.name}, p={self.p}, m={self.m}{v}, t_f={self.forward_time}, "
                f"t_b={self.backward_time}")


BUBBLE_CASES = _typical_first(
    [BubbleCase(name, p, m) for name in ("gpipe", "1f1b")
     for p, m in ((4, 8), (1, 3), (2, 1), (2, 4), (3, 5), (4, 2), (8, 16))]
    + [BubbleCase("interleaved", p, m, v) for p, m, v in ((4, 8, 2), (2, 4, 3), (3, 6, 2),
                                                         (4, 16, 4))]
    + [BubbleCase("1f1b", 4, 8, 1, 1, 1), BubbleCase("1f1b", 4, 8, 1, 2, 3),
       BubbleCase("interleaved", 4, 8, 2, 2, 3)]
    + [BubbleCase(NAIVE, p, m) for p, m in ((4, 2), (2, 3), (3, 3))],
    [BubbleCase("1f1b", 4, 8), BubbleCase("interleaved", 4, 8, 2)])

BUBBLE_MISTAKES: list[tuple[Callable[[BubbleCase, Timeline], Real], str]] = [
    (lambda case, run: sum(run.idle) / (case.p * run.total_time),
     "you divided the idle time by the whole step's (p ranks × the step, idle included); "
     "2104.04473 §2.2.1 divides it by the ideal time t_id = m·(t_f + t_b), the compute alone: "
     "t_pb / t_id = (p − 1)/m, not (p − 1)/(m + p − 1)"),
    (lambda case, run: sum(run.idle_within) / sum(run.busy),
     "you counted a rank idle only between its own first and last action (2401.10241's bubble "
     "size); 2104.04473 counts every rank idle from the start until the last rank finishes — "
     "the optimizer step waits for the whole pipeline — so the last rank's wait for its first "
     "input counts too"),
    (lambda case, run: sum(row[-1][2] - busy for row, busy in zip(run.ranks, run.busy,
                                                                    strict=True)) / sum(run.busy),
     "you counted each rank idle until its own last action ends; 2104.04473 counts it idle until "
     "the step ends, when the last rank finishes (rank 0's last backward): the optimizer step "
     "waits for every rank"),
    (lambda case, run: sum(run.busy) / (case.p * run.total_time),
     "that is the share of the step spent computing, Σ compute / (p × the step); the bubble "
     "fraction is the idle time over the compute time, Σ idle / Σ compute"),
    (lambda case, run: 0,
     "your timeline has no bubble: an action waits not only for its rank to be free but for the "
     "actions it depends on to end (dependencies(rank, action, schedule.stages)) — rank 1's F0 "
     "for rank 0's F0, rank 0's B0 for rank 1's B0"),
    (lambda case, run: run.bubble_fraction / case.p,
     "(p − 1)/(p·m), p times too small: one rank's idle time over all p ranks' compute — sum the "
     "idle over the ranks too"),
    (lambda case, run: run.bubble_fraction * case.p,
     "p times too large: the idle time summed over the p ranks, over one rank's compute — "
     "divide by the compute of all of them"),
    (lambda case, run: Fraction(case.p, case.v * case.m),
     "p/m: the pipeline fills in p − 1 steps, not p — the first stage starts at once, and each "
     "of the p − 1 others one step after the one before it"),
    (lambda case, run: Fraction(case.p - 1, case.m),
     "(p − 1)/m on the interleaved schedule too: with v chunks per rank a chunk's pass costs "
     "t_f/v and t_b/v, so a step and the ramps are v times shorter: (p − 1)/(v·m)"),
]


def _same_number(got: Real, want: Real) -> bool:
    return abs(float(got) - float(want)) <= 1e-9 * max(1.0, abs(float(want)))


def _show(x: Real) -> str:
    return str(x) if isinstance(x, int | Fraction) else f"{float(x):.6g}"


def _bubble_answer(fn, case: BubbleCase) -> Real:
    got = fn(case.schedule(), case.forward_time, case.backward_time)
    if isinstance(got, bool) or not isinstance(got, Real):
        raise Hint(f"for {case} your function returned {got!r} ({type(got).__name__}); return "
                   "one number: the ranks' idle time over their compute time")
    return got


def _naive_hint(case: BubbleCase, got: Real) -> str:
    if _same_number(got, Fraction(case.p - 1, case.m)):
        return ("that is the formula of GPipe and 1F1B, (p − 1)/m; this schedule runs one "
                "microbatch at a time (F0 B0 F1 B1 … on every rank: naive model parallelism), "
                "so each rank idles p − 1 steps of every p. Play the schedule rather than "
                "recognise it")
    return ("play it: rank 0's F1 starts only once its B0 has ended, after the microbatch has "
            "gone down the pipeline and back")


@exercise("04.4", "the bubble fraction of a schedule, played on paper",
          reference=(simulate, Timeline.bubble_fraction.fget),
          marks=(r"p[−-]1(steps?)?ofeveryp",))  # one microbatch at a time: p − 1 idle of p
def _bubble(fn) -> str:
    runs = {case: simulate(case.schedule(), case.forward_time, case.backward_time)
            for case in BUBBLE_CASES}
    answers = {case: _bubble_answer(fn, case) for case in BUBBLE_CASES}
    wrong = [case for case in BUBBLE_CASES
             if not _same_number(answers[case], runs[case].bubble_fraction)]
    if not wrong:
        return (f"equal to the simulator's Σ idle / Σ compute for all {len(BUBBLE_CASES)} "
                "schedules: GPipe and 1F1B (p − 1)/m, interleaved (p − 1)/(v·m), whatever "
                "t_b/t_f, and p − 1 for one microbatch at a time, which no formula of §2.2 "
                "covers — t_pb / t_id, the idle time over the ideal time (2104.04473 §2.2.1)")
    case, run = wrong[0], runs[wrong[0]]
    first = (f"{case}: you said {_show(answers[case])}, the timeline gives "
             f"{_show(run.bubble_fraction)}")
    if all(c.name == NAIVE for c in wrong):
        raise Hint(f"right for GPipe, 1F1B and interleaved, but {first} — "
                   + _naive_hint(case, answers[case]))
    standard = [c for c in BUBBLE_CASES if c.name != NAIVE]
    for candidate, advice in BUBBLE_MISTAKES:
        if all(_same_number(answers[c], candidate(c, runs[c])) for c in standard):
            raise Hint(f"{first} — {advice}")
    raise Hint(f"{first}: each rank idles {', '.join(map(_show, run.idle))} and computes "
               f"{', '.join(map(_show, run.busy))}, counted from 0 to the last rank's last end "
               f"({_show(run.total_time)}); the fraction is Σ idle / Σ compute")
