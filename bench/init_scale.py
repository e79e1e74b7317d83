"""(f) Building GPT-2 XL at tp = 5: each rank's memory and time against its own shard.

"Nothing whole on one rank at scale" (docs/principles.md): initialisation produces each rank's
shard with memory bounded by the shard. Five CPU ranks, one thread each (gloo), build GPT-2 XL
(Radford et al. 2019: 48 layers, hidden 1600, 25 heads, so tp = 5; 1.56 B parameters with the
padded vocabulary) at tp = 5, pp = 1, and each measures

* the peak resident memory the build added (VmHWM, reset to VmRSS just before, minus VmRSS),
  over the bytes of the rank's own parameters: target ≤ 1.5;
* the build time over a floor measured right after it in the same process: drawing the shard's
  numbers once, in place (``normal_`` on its own parameters): target ≤ 3.

Each round builds a fresh model on every rank at once (a barrier before each timed phase, so all
five ranks share the two cores alike in both phases). Samples: every rank in every round.

    python -m bench.init_scale             # a few minutes on 2 cores: not part of `python -m bench`
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist

from bench.common import Spread, report
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig

PRESET, TP = "gpt2-xl", 5
PEAK_TARGET, TIME_TARGET = 1.5, 3.0
T = TypeVar("T")


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"


def _reset_peak() -> int:
    """Set the peak resident memory (VmHWM) to the current one (VmRSS); return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """One call's result, wall-clock seconds and CPU seconds (after a barrier: all ranks start
    together)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


@torch.no_grad()
def _draw_in_place(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.normal_()


def measure_on_rank(preset: str, tp: int, rounds: int) -> list[dict[str, float]]:
    """Runs on each rank: per round, the build's peak memory and time and the floor's time."""
    grid, config = ParallelGrid(tp=tp), GPTConfig.preset(preset, dropout=0.0)
    samples = []
    for _ in range(rounds):
        gc.collect()
        dist.barrier()
        before = _reset_peak()
        model, build_s, build_cpu_s = _timed(lambda: GPT(config, grid))
        peak = _status_bytes("VmHWM") - before
        _, floor_s, floor_cpu_s = _timed(partial(_draw_in_place, model))
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        samples.append(dict(shard=shard, peak=peak, build_s=build_s, build_cpu_s=build_cpu_s,
                            floor_s=floor_s, floor_cpu_s=floor_cpu_s))
        del model
    return samples


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--tp", type=int, default=TP)
    args = parser.parse_args(argv)
    print(f"(f) building {args.preset} at tp={args.tp}, pp=1: {args.tp} CPU ranks × 1 thread, "
          f"{args.rounds} rounds")
    per_rank = run(measure_on_rank, args.tp, args.preset, args.tp, args.rounds, backend="gloo",
                   threads_per_rank=1, timeout=3600)
    samples = [s for rank in per_rank for s in rank]
    peak = Spread.of([s["peak"] / s["shard"] for s in samples])
    wall = Spread.of([s["build_s"] / s["floor_s"] for s in samples])
    cpu = Spread.of([s["build_cpu_s"] / s["floor_cpu_s"] for s in samples])
    seconds = {key: Spread.of([s[key] for s in samples]).median
               for key in ("build_s", "floor_s", "build_cpu_s", "floor_cpu_s")}
    print(f"  shard {samples[0]['shard'] / 2**30:.2f} GiB per rank; build {seconds['build_s']:.1f} "
          f"s (CPU {seconds['build_cpu_s']:.1f} s), floor {seconds['floor_s']:.1f} s (CPU "
          f"{seconds['floor_cpu_s']:.1f} s); CPU-time ratio {cpu.format()}")
    config = dict(preset=args.preset, tp=args.tp, pp=1, ranks=args.tp, threads_per_rank=1,
                  shard_bytes=samples[0]["shard"])
    return [
        report("f_init_scale_memory", "peak_rss_over_shard", peak, f"<= {PEAK_TARGET:g}x shard",
               peak.median <= PEAK_TARGET, config=config),
        report("f_init_scale_time", "build_time_over_normal_floor", wall,
               f"<= {TIME_TARGET:g}x normal_ floor", wall.median <= TIME_TARGET, config=config,
               extra={"cpu_time_ratio": cpu.median, **seconds}),
    ]


if __name__ == "__main__":
    main()
