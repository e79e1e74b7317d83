"""What the command lines share: argument types that say what they allow, and a parser whose
every error is one line (train, evaluate, generate, checkpoint).

    p = Parser(prog="python -m megatron_edu.train")
    p.add_argument("--micro-batch", type=positive_int, default=4)
    p.parse_args(["--micro-batch", "0"])
    # stderr: error: --micro-batch must be a positive integer, got 0      (exit status 2)

Each ``type=`` function turns the text into a number and refuses what is not a number, out of
range or not finite while the command line is read, so a bad number never reaches a rank
(docs/principles.md, principle 7). Relations between arguments (a batch that dp·micro-batch
divides, …) are each script's own pre-launch validation.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

__all__ = ["Parser", "positive_int", "nonnegative_int", "at_least", "random_seed",
           "positive_float", "nonnegative_float", "rate", "probability", "DTYPES", "autocast"]

DTYPES = ("auto", "fp32", "bf16", "fp16")  # --dtype of train and evaluate


class Parser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one line on stderr — ``error: --flag
    must be …, got …`` — without the usage text, exit status 2 (argparse's own) — and whose
    ``--help`` shows every default."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "formatter_class": _WithDefaults})

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line naming the argument; exit with status 2."""
        print(f"error: {_one_line(message)}", file=sys.stderr)
        sys.exit(2)


class _WithDefaults(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default after its help (argparse's
    own formatter skips an option without help text): "(default: 600)"; an off switch or a
    None default says nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings or action.default is None
                or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _one_line(message: str) -> str:
    """argparse's ``argument --x: …`` as ``--x must be …``; an invalid choice listed."""
    found = re.fullmatch(r"argument ([^:]+): (.*)", message, re.DOTALL)
    if not found:
        return " ".join(message.split())
    name, text = found.groups()
    choice = re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", text)
    if choice:
        return f"{name} must be one of {choice[2].replace(chr(39), '')}, got {choice[1]}"
    text = " ".join(text.split())
    return f"{name} {text}" if text.startswith("must be") else f"{name}: {text}"


def _parsed(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None


def _checked(kind: type, allowed: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """A ``type=`` function: ``text`` as ``kind``, refused unless ``ok`` (``allowed`` says why)."""
    def check(text: str) -> int | float:
        value = _parsed(text, kind)
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value
    return check


positive_int = _checked(int, "a positive integer", lambda n: n >= 1)
positive_int.__doc__ = "An integer ≥ 1 (sizes, steps, intervals)."
nonnegative_int = _checked(int, "a non-negative integer", lambda n: n >= 0)
nonnegative_int.__doc__ = "An integer ≥ 0 (warm-up steps, tokens to sample, a step)."
random_seed = _checked(int, "an integer in 0 … 2**64 − 1", lambda n: 0 <= n < 2**64)
random_seed.__doc__ = "A seed ``torch.Generator.manual_seed`` takes: 0 … 2**64 − 1."
positive_float = _checked(float, "a finite number > 0", lambda x: x > 0)
positive_float.__doc__ = "A finite number > 0 (a learning rate, a temperature, a timeout)."
nonnegative_float = _checked(float, "a finite number ≥ 0", lambda x: x >= 0)
nonnegative_float.__doc__ = "A finite number ≥ 0 (a minimum learning rate, weight decay, clip)."
rate = _checked(float, "a number in [0, 1)", lambda x: 0 <= x < 1)
rate.__doc__ = "A rate in [0, 1) (dropout)."
probability = _checked(float, "a number in (0, 1]", lambda x: 0 < x <= 1)
probability.__doc__ = "A probability mass in (0, 1] (top-p)."


def at_least(low: int) -> Callable[[str], int]:
    """A ``type=`` function: an integer ≥ ``low``."""
    return _checked(int, f"an integer ≥ {low}", lambda n: n >= low)


def autocast(dtype: str, device: torch.device) -> torch.autocast:
    """``--dtype`` as an autocast context: "auto" is bf16 on a GPU and fp32 on a CPU; "bf16" and
    "fp16" autocast the matmuls (the weights stay fp32); "fp32" none. Training and evaluation use
    the same, so a model is scored in the precision it trained in."""
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"
    return torch.autocast(device.type, dtype=torch.float16 if dtype == "fp16" else torch.bfloat16,
                          enabled=dtype in ("bf16", "fp16"))
