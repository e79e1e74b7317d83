"""(d) The measured pipeline bubble of a 4-stage 1F1B run against (p − 1)/m and the simulator;
and of ZB-H1 (2401.10241) on the same stages, against 1F1B and Table 2's bubble size.

2104.04473 §2.2.1: with p stages and m microbatches, every rank of a 1F1B (or GPipe) pipeline
idles for (p − 1) forward-and-backward slots per iteration: bubble fraction t_pb / t_id =
(p − 1)/m. The formula assumes equal stages and free communication. A real run has neither, so
the measured bubble (``Timeline.bubble_fraction`` of the engine's own timeline) is compared with

* the formula, and
* the simulator (``pipeline.simulate.simulate``) fed with this run's measured per-rank forward and
  backward times and its measured mean send latency — the formula's assumptions removed.

The target is the measured bubble within 5 % of the simulated one. Two kinds of stage:

* ``sleep``: each stage sleeps t_f forward and 2·t_f backward — t_f for the input's gradient (B)
  and t_f for the weight's (W), two autograd nodes that ``pipeline/backward.py`` separates under
  a zero-bubble schedule (1F1B runs both as its B). It uses no core, so 4 ranks on a 2-core
  machine do not slow each other down: what remains is the schedule, the engine and the
  send/recv — exactly what the formula is about.
* ``gpt``: two GPT blocks per stage (4 ranks × 1 thread). On fewer than 4 cores the ranks compete
  for cores, so an action takes longer when more ranks are busy — a cost neither the formula nor
  the simulator knows. Reported for information.

ZB-H1 (``--schedules 1f1b zb-h1``, the default) runs on the same stages: its W's fill 1F1B's
bubble, which shrinks from (p − 1)(t_F + t_B + t_W) to (p − 1)(t_F + t_B − t_W) per rank
(2401.10241 §2.3, Table 2; the bubble *size*, the most a rank idles between its own first and
last action), a third with t_F = t_B = t_W. Reported: its measured bubble against its simulated
twin (the same 5 % target) and against 1F1B's.

    python -m bench.bubble
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import nn

from bench.common import Spread, report
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.perf.bubble import bubble_formula, bubble_size_formula
from megatron_edu.pipeline.engine import Batch, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import Action, dependencies, make_schedule
from megatron_edu.pipeline.simulate import Timeline, simulate_measured

P, M, MICROBATCH = 4, 8, 2
SLEEP_FORWARD = 0.030  # seconds; the backward sleeps twice as long (2104.04473 §2.2: t_b ≈ 2·t_f),
#                       half for the input's gradient (B), half for the weight's (W)
GPT_MODEL = dict(vocab_size=256, seq_len=64, num_layers=8, hidden=128, num_heads=4, dropout=0.0)
TARGET_PERCENT = 5.0


class _Sleep(torch.autograd.Function):
    """Identity that takes ``forward_s`` of wall time forward and ``backward_s`` backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A pipeline stage with the engine's interface (ids in on the first, a loss out on the last)
    whose compute is a fixed sleep: t_f forward, 2·t_f backward — t_f on the path to the input
    (B) and t_f on the weight's own branch (W): y = sleep(x · sleep(scale) + shift)."""

    def __init__(self, hidden: int, first: bool, last: bool, forward_s: float) -> None:
        super().__init__()
        self.first, self.last, self.forward_s, self.hidden = first, last, forward_s, hidden
        self.scale = nn.Parameter(torch.ones(hidden))
        self.shift = nn.Parameter(torch.zeros(hidden))  # a second weight: the path to it and
        # to scale is the trunk even on the first stage, whose input wants no gradient

    def boundary_shape(self, ids: torch.Size) -> torch.Size:
        """What it sends on for a microbatch of ids [b, s]: [b, s, h] (the engine asks)."""
        return torch.Size((ids[0], ids[1], self.hidden))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                dropout_key=None, loss_reduction: str = "mean") -> torch.Tensor:
        if self.first:
            x = x.float().unsqueeze(-1)  # ids [b, s] -> [b, s, 1], broadcast to [b, s, h]
        scale = _Sleep.apply(self.scale, 0.0, self.forward_s)  # W: t_f
        y = _Sleep.apply(x * scale + self.shift, self.forward_s, self.forward_s)  # F, B: t_f
        if not self.last:
            return y
        return y.sum() if loss_reduction == "sum" else y.mean()


def stages(kind: str, grid: ParallelGrid) -> list[nn.Module]:
    """This rank's one chunk of the chosen kind."""
    if kind == "sleep":
        r = grid.pp_rank
        return [SleepStage(64, r == 0, r == grid.pp - 1, SLEEP_FORWARD)]
    return build_chunks(GPTConfig(**GPT_MODEL), grid)


def timelines_on_ranks(kind: str, rounds: int, schedule_name: str = "1f1b"
                       ) -> list[list[tuple[Action, float, float]]]:
    """Runs on each rank: ``rounds`` iterations (after one warm-up); this rank's timelines."""
    grid = ParallelGrid(pp=P)
    chunks = stages(kind, grid)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(GPT_MODEL["vocab_size"], (M * MICROBATCH, GPT_MODEL["seq_len"] + 1),
                           generator=gen)
    schedule = make_schedule(schedule_name, P, M)
    timelines = []
    for _ in range(rounds + 1):
        result = run_schedule(schedule, chunks, grid, Batch(tokens[:, :-1], tokens[:, 1:]))
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        dist.barrier()
        timelines.append(result.timeline)
    return timelines[1:]


def gaps(timeline: Timeline) -> dict[str, list[float]]:
    """The idle time before each action of each rank (its first excepted), sorted by cause.

    "send": the rank waited for another rank — the time from that rank's action ending to this
    one starting is the message's latency. A clock offset between two ranks adds to the forward
    messages and subtracts from the backward ones, so a mean over both cancels most of it.
    "engine": every input had been sent before the rank became free, yet it did not start at
    once — receiving an already-sent message and the engine's own bookkeeping. The simulator
    counts neither as idle; the real run does.
    """
    end = {(rank, action): e for rank, row in enumerate(timeline.ranks) for action, _, e in row}
    found: dict[str, list[float]] = {"send": [], "engine": []}
    for rank, row in enumerate(timeline.ranks):
        for (_, _, free_at), (action, start, _) in pairwise(row):
            sent = max((end[d] for d in dependencies(rank, action, timeline.stages)
                        if d[0] != rank),
                       default=float("-inf"))
            if sent > free_at:
                found["send"].append(start - sent)
            else:
                found["engine"].append(start - free_at)
    return found


def mean_send_latency(timeline: Timeline) -> float:
    return statistics.mean(gaps(timeline)["send"] or [0.0])


def simulated_twin(timeline: Timeline) -> Timeline:
    """The simulator fed with this run's per-rank mean forward, backward (and weight-gradient)
    times and its mean send latency."""
    return simulate_measured(timeline, mean_send_latency(timeline))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", choices=("sleep", "gpt"), default=["sleep", "gpt"])
    parser.add_argument("--schedules", nargs="+", choices=("1f1b", "zb-h1"),
                        default=["1f1b", "zb-h1"])
    args = parser.parse_args(argv)
    formula = float(bubble_formula("1f1b", P, M))
    print(f"(d) bubble of 1F1B, p={P} ranks × 1 thread, m={M}: (p-1)/m = {formula:.3f}")
    records, sizes = [], {}
    for kind in args.kinds:
        for name in args.schedules:
            record, sizes[kind, name] = _measure(kind, name, args.rounds, formula)
            records.append(record)
        if {"1f1b", "zb-h1"} <= set(args.schedules):
            (f1, s1), (fz, sz) = sizes[kind, "1f1b"], sizes[kind, "zb-h1"]
            print(f"  {kind}: ZB-H1 against 1F1B on the same stages: bubble fraction {fz:.3f} vs "
                  f"{f1:.3f}; bubble size {1e3 * sz:.0f} vs {1e3 * s1:.0f} ms "
                  f"({sz / s1:.2f}×; Table 2 with equal t_F, t_B, t_W: 1/3)")
    return records


def _measure(kind: str, name: str, rounds: int, formula: float) -> tuple[dict, tuple]:
    """Run ``name`` on ``kind`` stages; print and record its measured bubble against its twin."""
    per_rank = run(timelines_on_ranks, P, kind, rounds, name, backend="gloo",
                   threads_per_rank=1)
    stages = make_schedule(name, P, M).stages
    measured = [Timeline(list(ranks), stages) for ranks in zip(*per_rank, strict=True)]
    simulated = [simulated_twin(t) for t in measured]
    bubbles = [float(t.bubble_fraction) for t in measured]
    off = Spread.of([100 * (b / float(s.bubble_fraction) - 1)
                     for b, s in zip(bubbles, simulated, strict=True)])
    latency = statistics.median(mean_send_latency(t) for t in measured)
    engine = statistics.median(statistics.mean(gaps(t)["engine"] or [0.0]) for t in measured)
    size = statistics.median(float(t.bubble_size) for t in measured)
    print(f"  {kind}, {name}: measured bubble {statistics.median(bubbles):.3f}, simulated with "
          f"the measured costs and {1e3 * latency:.2f} ms send latency "
          f"{statistics.median(float(s.bubble_fraction) for s in simulated):.3f}, "
          f"(p-1)/m {formula:.3f}; idle before an action whose inputs were already sent: "
          f"{1e3 * engine:.2f} ms; bubble size {1e3 * size:.0f} ms (simulated "
          f"{1e3 * statistics.median(float(s.bubble_size) for s in simulated):.0f} ms)")
    extra = {"measured_bubble": statistics.median(bubbles), "formula": formula,
             "measured_vs_formula_percent": 100 * (statistics.median(bubbles) / formula - 1),
             "send_latency_ms": 1e3 * latency, "engine_gap_ms": 1e3 * engine,
             "bubble_size_ms": 1e3 * size}
    if kind == "sleep":  # t_F = t_B = t_W: Table 2's bubble size
        t = SLEEP_FORWARD
        extra["table_2_bubble_size_ms"] = 1e3 * float(bubble_size_formula(name, P, t, t, t))
    target = kind == "sleep"  # the gpt stages compete for cores: information only
    record = report(
        f"d_bubble_{kind}" if name == "1f1b" else f"d_bubble_{name}_{kind}",
        "measured_vs_simulated_percent", off,
        f"within {TARGET_PERCENT:g} %" if target else "(4 ranks share 2 cores)",
        abs(off.median) <= TARGET_PERCENT if target else None,
        config=dict(p=P, m=M, microbatch=MICROBATCH, stage=kind, schedule=name,
                    **({"forward_s": SLEEP_FORWARD} if kind == "sleep" else GPT_MODEL)),
        extra=extra)
    return record, (statistics.median(bubbles), size)


if __name__ == "__main__":
    main()
