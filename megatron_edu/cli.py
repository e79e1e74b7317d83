"""What the command lines share: argument types that say what they allow, and a parser whose
every error is one line.

    p = Parser(prog="python -m megatron_edu.train")
    p.add_argument("--micro-batch", type=positive_int, default=4)
    p.parse_args(["--micro-batch", "0"])
    # stderr: error: --micro-batch must be a positive integer, got 0      (exit status 2)

Each type checks its range and finiteness while the command line is read, so a bad number never
reaches a rank (DESIGN principle 7). Relations between arguments (a batch that dp·micro-batch
divides, ...) are the training script's ``validate``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import NoReturn

__all__ = ["Parser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float",
           "probability"]


class Parser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one line on stderr — ``error: --flag
    must be …, got …`` — without the usage text, exit status 2 (argparse's own)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line naming the argument; exit with status 2."""
        print(f"error: {_one_line(message)}", file=sys.stderr)
        sys.exit(2)


def _one_line(message: str) -> str:
    """argparse's ``argument --x: …`` as ``--x must be …``; an invalid choice listed."""
    found = re.fullmatch(r"argument ([^:]+): (.*)", message, re.DOTALL)
    if not found:
        return message
    name, text = found.groups()
    choice = re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", text)
    if choice:
        return f"{name} must be one of {choice[2].replace(chr(39), '')}, got {choice[1]}"
    return f"{name} {text}" if text.startswith("must be") else f"{name}: {text}"


def _number(text: str, kind: type, allowed: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (sizes, steps, intervals)."""
    return _number(text, int, "a positive integer", lambda n: n >= 1)


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0 (warm-up steps, tokens to sample, a seed)."""
    return _number(text, int, "a non-negative integer", lambda n: n >= 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate, a timeout): not 0, inf or nan."""
    return _number(text, float, "a finite number > 0", lambda x: math.isfinite(x) and x > 0)


def nonnegative_float(text: str) -> float:
    """A finite number ≥ 0 (a minimum learning rate, weight decay, a clipping norm)."""
    return _number(text, float, "a finite number ≥ 0", lambda x: math.isfinite(x) and x >= 0)


def probability(text: str) -> float:
    """A number in [0, 1) (dropout)."""
    return _number(text, float, "a number in [0, 1)", lambda x: 0 <= x < 1)
