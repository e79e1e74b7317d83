"""How an exercise is checked: the learner's function against the reference, answered in words.

A checker is a function registered with ``@exercise(id, title)``; it receives the learner's
function, runs it (on several ranks where it matters, through ``on_ranks``) and either returns
a sentence saying what was verified, or raises ``Hint`` saying what is wrong — a wrong shape, a
slice on the wrong rank, a gradient missing its all-reduce, collective counts other than the
paper's, a deadlock. ``check`` turns every outcome into a ``CheckResult``; it never raises for a
wrong answer, and a learner's exception becomes a sentence too, not a bare traceback.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from megatron_edu.launch import DeadlockError, RankError, run

__all__ = ["Hint", "exercise", "check", "on_ranks", "EXERCISES", "REFERENCES", "MARKS", "TAUGHT",
           "close", "DEADLOCK_AFTER"]

EXERCISES: dict[str, str] = {}                     # id -> title, in registration order
REFERENCES: dict[str, tuple[Any, ...]] = {}        # id -> the package code its answer rewrites
MARKS: dict[str, tuple[str, ...]] = {}             # id -> regexes of what gives it away
TAUGHT: dict[str, tuple[str, ...]] = {}            # id -> answer lines earlier notebooks teach
_CHECKERS: dict[str, Callable[[Callable], str]] = {}
NOT_DONE = "not done yet"
# seconds every rank still running may sit blocked, using no CPU, before on_ranks(...,
# may_deadlock=True) calls it a deadlock: gloo's waits use no CPU, a learner's slow code does
DEADLOCK_AFTER = 1.0
_IN_ORDER = ("Every send needs a matching recv on the other rank, and every rank must reach "
             "every collective, in the same order")


class Hint(Exception):
    """Raised by a checker: the answer is wrong, and the message says how (in words)."""


@dataclass(frozen=True)
class CheckResult:
    """``passed`` and a ``message`` in words; shown as one line in a notebook."""

    exercise: str
    passed: bool
    message: str

    def __repr__(self) -> str:
        mark = "✓" if self.passed else "✗"
        return f"{mark} {self.exercise} {EXERCISES[self.exercise]}: {self.message}"

    __str__ = __repr__


def exercise(exercise_id: str, title: str, reference: tuple[Any, ...] = (),
             marks: tuple[str, ...] = (), taught: tuple[str, ...] = ()) -> Callable:
    """Register the decorated checker as exercise ``exercise_id`` ("03.2"). ``reference``: the
    package's functions or classes that the answer rewrites; ``marks``: regular expressions of
    what else gives the answer away (the constants it prints, the formula its checker compares
    with), matched against text with its spaces removed. No student notebook may show either
    before the exercise (``megatron_edu/course/reveals.py``). ``taught``: lines of the answer
    that an earlier notebook teaches as they stand (how notebook 05 builds a rank's chunks, a
    loop over a model's parameters): pieces the exercise asks the learner to put together, not
    fingerprints of the answer."""

    def register(checker: Callable[[Callable], str]) -> Callable[[Callable], str]:
        if exercise_id in EXERCISES:
            raise ValueError(f"exercise {exercise_id} is registered twice")
        EXERCISES[exercise_id] = title
        REFERENCES[exercise_id] = tuple(reference)
        MARKS[exercise_id] = tuple(marks)
        TAUGHT[exercise_id] = tuple(taught)
        _CHECKERS[exercise_id] = checker
        return checker

    return register


def check(exercise_id: str, fn: Callable) -> CheckResult:
    """Check the learner's ``fn`` for exercise ``exercise_id``; never raises for a wrong answer."""
    if exercise_id not in EXERCISES:
        raise KeyError(f"no exercise {exercise_id!r}; there are {', '.join(EXERCISES)}")
    stub = _stub_message(fn)
    if stub is not None:  # the student notebook's placeholder: answered without starting ranks
        return CheckResult(exercise_id, False, _not_done(stub))
    try:
        return CheckResult(exercise_id, True, _CHECKERS[exercise_id](fn))
    except Hint as hint:
        return CheckResult(exercise_id, False, str(hint))
    except NotImplementedError as err:
        return CheckResult(exercise_id, False, _not_done(str(err)))
    except Exception as err:  # the learner's code raised in this process
        return CheckResult(exercise_id, False, f"your function raised {type(err).__name__}: "
                                               f"{err}")


def _stub_message(answer: Any) -> str | None:
    """The message of ``raise NotImplementedError("…")`` if that (after a docstring) is all the
    ``answer`` does: a function, a class whose every own method is such a stub, or a tuple of
    them; None for anything else, or where a source cannot be read."""
    if isinstance(answer, tuple | list | type):
        parts = answer if not isinstance(answer, type) else [
            getattr(m, "__func__", m) for m in vars(answer).values()   # staticmethods unwrapped
            if inspect.isfunction(getattr(m, "__func__", m))]
        messages = [_stub_message(part) for part in parts]
        return messages[0] if messages and None not in messages else None
    try:   # a function's source: a class's is not kept for a notebook cell (before Python 3.13)
        tree = ast.parse(textwrap.dedent(inspect.getsource(answer)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return None
    raised = body[0].exc
    call = raised if isinstance(raised, ast.Call) else None
    name = (call.func if call else raised)
    if not (isinstance(name, ast.Name) and name.id == "NotImplementedError"):
        return None
    args = call.args if call else []
    return args[0].value if args and isinstance(args[0], ast.Constant) else ""


def _not_done(detail: str) -> str:
    return f"{NOT_DONE} — replace the `raise NotImplementedError` with your code" + (
        f" ({detail})" if detail else "")


def on_ranks(world_size: int, rank_fn: Callable[..., Any], *args: Any,
             timeout: float = 30.0, may_deadlock: bool = False,
             deadlock_advice: str = "") -> list[Any]:
    """``rank_fn(*args)`` on ``world_size`` gloo ranks; its per-rank results. A rank that raises
    or does not finish becomes a ``Hint`` in words: the exception's last line and the rank, or
    a likely deadlock (a send without its receive, a collective some rank never reaches), then
    ``deadlock_advice``: how this exercise's answer deadlocks. ``may_deadlock``, for checkers
    where a wrong answer can deadlock: ranks all blocked for DEADLOCK_AFTER seconds are a
    deadlock then, ``timeout`` only the backstop."""
    advice = f". {deadlock_advice}" if deadlock_advice else ""
    # A checker's rank function travels by value, as the learner's does: a rank then never
    # imports megatron_edu.course.exercises (every checker module and what it imports) to run it.
    cloudpickle.register_pickle_by_value(sys.modules[rank_fn.__module__])
    try:  # the collectives' own timeout later than the launcher's: a stuck rank is one report
        return run(rank_fn, world_size, *args, backend="gloo", timeout=timeout,
                   collective_timeout=2 * timeout,
                   deadlock_after=DEADLOCK_AFTER if may_deadlock else None)
    except DeadlockError as err:
        raise Hint(f"ranks {err.ranks} did not finish: they sat blocked, using no CPU, for "
                   f"{err.idle:g} s — a deadlock. {_IN_ORDER}{advice}") from None
    except TimeoutError as err:
        ranks = re.search(r"ranks (\[[\d, ]*\])", str(err))
        raise Hint(f"ranks {ranks.group(1) if ranks else '?'} did not finish within "
                   f"{timeout:g} s: a deadlock? {_IN_ORDER}{advice}") from None
    except RankError as err:
        raise Hint(_rank_failure(str(err))) from None


def _rank_failure(report: str) -> str:
    """The launcher's report in one sentence: which rank raised what (or died). Of several
    failed ranks, the first whose error is its own, not a peer's "connection closed"."""
    blocks = re.findall(r"rank (\d+) raised:\n(.*?)(?=\n\nrank \d+ (?:raised|exited)|\Z)",
                        report, re.S)
    if not blocks:
        return report.splitlines()[0]
    failures = [(rank, _last_error_line(text)) for rank, text in blocks]
    rank, last = next(((r, line) for r, line in failures if "Connection closed" not in line),
                      failures[0])
    if last.startswith("NotImplementedError"):
        return _not_done(last.partition(":")[2].strip())
    return f"rank {rank} raised {last}"


def _last_error_line(text: str) -> str:
    """The exception line of a traceback (the rank's captured output may follow it)."""
    traceback = text.split("\n--- last output")[0]
    return traceback.strip().splitlines()[-1]


def close(got: Any, expected: Any, what: str, atol: float = 1e-5) -> None:
    """Raise a Hint unless ``got`` (a tensor) has ``expected``'s shape and values within atol."""
    import torch

    if not isinstance(got, torch.Tensor):
        raise Hint(f"{what} should be a tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        raise Hint(f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    diff = (got.detach().float() - expected.detach().float()).abs().max().item()
    if not diff <= atol:
        raise Hint(f"{what} differs from the reference by up to {diff:.3g} (tolerance {atol:g})")
