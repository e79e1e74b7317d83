"""Checked command-line arguments: ``type=`` functions for ``argparse`` and a parser whose every
refusal is one line on stderr, exit status 2 (``evaluate`` and ``generate`` use them).

Each ``type=`` function turns the text into a number and refuses what is out of range, not a
number, or not finite; the parser names the argument, so the user reads

    error: --micro-batch must be a positive integer, got 0

before any rank is launched (DESIGN principle 7), not a traceback from inside one.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import NoReturn

__all__ = ["Parser", "positive_int", "non_negative_int", "at_least", "random_seed",
           "positive_float", "probability"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``error: …`` (no usage block), exit 2.
    A ``type=`` function's refusal reads ``--name must be …, got …``."""

    def error(self, message: str) -> NoReturn:
        """Print ``error: message`` on stderr and exit with status 2."""
        # argparse says "argument --x: must be …"; a type function's text continues the name
        message = re.sub(r"^argument (-[^:]*): (must .*)$", r"\1 \2", message, flags=re.S)
        message = re.sub(r"^argument (-[^:]*): ", r"\1: ", message)
        self.exit(2, f"error: {' '.join(message.split())}\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def at_least(low: int):
    """A ``type=`` function: an integer ≥ ``low``."""
    def check(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer ≥ {low}, got {text}")
        return value
    check.__name__ = f"integer_at_least_{low}"
    return check


def random_seed(text: str) -> int:
    """A random seed: an integer in 0 … 2**64 − 1 (what ``torch.Generator.manual_seed`` takes)."""
    value = _integer(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in 0 … 2**64 − 1, got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value

