"""Exercises of notebook 04: pipeline schedules as data (2104.04473 §2.2).

04.1 ★   the peak activations a 1F1B rank holds, as a formula in p, m and the rank.
04.2 ★★  one rank's 1F1B order: warm-up, steady one-forward-one-backward, cool-down.
04.3 ★★★ one rank's interleaved 1F1B order: microbatches in groups of p through v chunks.

Schedules are pure data, so the checkers need no ranks: they compare the learner's answers with
``schedules.one_f_one_b`` / ``interleaved_one_f_one_b`` over many (p, m, v), and say where the
first difference comes from — the warm-up length, the order of one of the two streams, a missing
action, a deadlock of the ranks run together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    _warmup_then_1f1b,
    check_schedule,
    interleaved_one_f_one_b,
    one_f_one_b,
)
from megatron_edu.pipeline.simulate import Timeline
from megatron_edu.pipeline.stages import StageMap


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


@exercise("04.1", "the activations a 1F1B rank holds at its peak")
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
          reference=(one_f_one_b, _warmup_then_1f1b))
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
          reference=(interleaved_one_f_one_b,))
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
