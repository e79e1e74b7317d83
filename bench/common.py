"""What every benchmark shares: side-by-side timing, medians and spread, the results file, devices.

A shared, noisy machine changes speed from one second to the next. So each benchmark runs its
two contenders in turn, A B B A A B B A …, within one process and one run: a slow moment falls on
both alike. It then reports the *median* of the per-round ratios and their spread (the middle
half, 25th to 75th percentile, and the extremes), never a single timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("results.jsonl")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- devices ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Where a single-process benchmark runs and in which precision."""

    type: str  # "cpu" or "cuda"
    dtype: str  # "fp32" or "bf16" (bf16: autocast over fp32 master weights, as in training)

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type)

    def synchronize(self) -> None:
        """Wait for queued GPU kernels, so a timer measures them (a no-op on the CPU)."""
        if self.type == "cuda":
            torch.cuda.synchronize()

    def autocast(self) -> AbstractContextManager:
        if self.dtype == "fp32":
            return nullcontext()
        return torch.autocast(self.type, dtype=DTYPES[self.dtype])

    def describe(self) -> str:
        if self.type == "cuda":
            return f"{torch.cuda.get_device_name()} {self.dtype}"
        threads = torch.get_num_threads()
        return (f"CPU ({platform.processor() or platform.machine()}), {self.dtype}, "
                f"{threads} thread{'s' if threads > 1 else ''}")


def device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine a thread that loses "
                             "its core stalls the others at every sync point)")


def require_device(kind: str, dtype: str, threads: int | None = None) -> Device:
    """The requested device, or a SystemExit that says plainly why it cannot be had."""
    if threads:
        torch.set_num_threads(threads)
    if kind == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise SystemExit(f"--device cuda needs an NVIDIA GPU, and torch.cuda.is_available() is "
                         f"False here (torch {torch.__version__}, {build}). Run this on a GPU "
                         f"machine, or drop --device cuda for the CPU benchmark.")
    if kind == "cpu" and dtype != "fp32":
        raise SystemExit("the CPU benchmarks run in fp32 (the machine's matmul baseline is "
                         "fp32); use --dtype bf16 with --device cuda")
    return Device(kind, dtype)


# ---- timing -----------------------------------------------------------------------------------


@dataclass
class Timings:
    """Seconds per call of each contender: wall clock, and this process's CPU time.

    The CPU time (all threads of this process) is what the work cost, however busy the machine
    was; other processes sharing the cores inflate the wall clock but hardly this. A cross-check,
    not the headline: it misses time spent waiting (communication) and counts busy-waiting.
    """

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def alternate(contenders: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
              sync: Callable[[], None] = lambda: None) -> Timings:
    """Time each contender once per round, in turn, for ``rounds`` rounds after ``warmup``.

    The order flips every round (A B, B A, A B, …) so that neither always runs first.
    """
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    timings = Timings({name: [] for name in names}, {name: [] for name in names})
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            contenders[name]()
            sync()
            timings.wall[name].append(time.perf_counter() - wall)
            timings.cpu[name].append(time.process_time() - cpu)
    return timings


@dataclass(frozen=True)
class Spread:
    """The median of some samples, their middle half (25th to 75th percentile) and extremes."""

    median: float
    q25: float
    q75: float
    low: float
    high: float
    samples: int

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        if len(samples) < 2:
            raise ValueError(f"need at least 2 samples for a spread, got {len(samples)}")
        q25, _, q75 = statistics.quantiles(samples, n=4)
        return cls(statistics.median(samples), q25, q75, min(samples), max(samples),
                   len(samples))

    def format(self, fmt: str = ".3f") -> str:
        return (f"{self.median:{fmt}} (middle half {self.q25:{fmt}}–{self.q75:{fmt}}, "
                f"range {self.low:{fmt}}–{self.high:{fmt}}, {self.samples} rounds)")


def ratios(times: dict[str, list[float]], numerator: str, denominator: str) -> list[float]:
    """Per-round ratios numerator / denominator (each round's pair ran back to back)."""
    return [a / b for a, b in zip(times[numerator], times[denominator], strict=True)]


def all_close(xs: list[torch.Tensor], ys: list[torch.Tensor], rtol: float = 1e-4,
              atol: float = 1e-6) -> bool:
    """Whether two lists of tensors agree pairwise (the two contenders computed the same)."""
    return len(xs) == len(ys) and all(torch.allclose(x, y, rtol=rtol, atol=atol)
                                      for x, y in zip(xs, ys, strict=True))


# ---- reporting --------------------------------------------------------------------------------


def report(bench: str, metric: str, spread: Spread, target: str, met: bool | None,
           config: dict, extra: dict | None = None, results: Path = RESULTS) -> dict:
    """Print the result line and append a JSON record of it to ``results``; return the record.

    ``met`` None: a figure reported for information, with no target to meet.
    """
    verdict = {True: "meets the target", False: "MISSES the target", None: "for information:"}
    print(f"{bench}: {metric} = {spread.format()}  — {verdict[met]} {target}")
    record = {
        "bench": bench,
        "metric": metric,
        "median": spread.median,
        "q25": spread.q25,
        "q75": spread.q75,
        "min": spread.low,
        "max": spread.high,
        "rounds": spread.samples,
        "target": target,
        "met": met,
        "config": config,
        **(extra or {}),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with results.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record
