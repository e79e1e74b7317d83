"""(d) The measured pipeline bubble of a 4-stage 1F1B run against (p − 1)/m and the simulator.

2104.04473 §2.2.1: with p stages and m microbatches, every rank of a 1F1B (or GPipe) pipeline
idles for (p − 1) forward-and-backward slots per iteration: bubble fraction t_pb / t_id =
(p − 1)/m. The formula assumes equal stages and free communication. A real run has neither, so
the measured bubble (``Timeline.bubble_fraction`` of the engine's own timeline) is compared with

* the formula, and
* the simulator (``pipeline.simulate.simulate``) fed with this run's measured per-rank forward and
  backward times and its measured mean send latency — the formula's assumptions removed.

The target is the measured bubble within 5 % of the simulated one. Two kinds of stage:

* ``sleep``: each stage sleeps t_f forward and 2·t_f backward. It uses no core, so 4 ranks on a
  2-core machine do not slow each other down: what remains is the schedule, the engine and
  the send/recv — exactly what the formula is about.
* ``gpt``: two GPT blocks per stage (4 ranks × 1 thread). On fewer than 4 cores the ranks compete
  for cores, so an action takes longer when more ranks are busy — a cost neither the formula nor
  the simulator knows. Reported for information.

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
from megatron_edu.pipeline.engine import build_chunks, run_schedule
from megatron_edu.pipeline.schedules import Action, dependencies, one_f_one_b
from megatron_edu.pipeline.simulate import Timeline, bubble_formula, simulate

P, M, MICROBATCH = 4, 8, 2
SLEEP_FORWARD = 0.030  # seconds; the backward sleeps twice as long (2104.04473 §2.2: t_b ≈ 2·t_f)
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
    whose compute is a fixed sleep: t_f forward, 2·t_f backward."""

    def __init__(self, hidden: int, first: bool, last: bool, forward_s: float) -> None:
        super().__init__()
        self.first, self.last, self.forward_s = first, last, forward_s
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                dropout_key=None, loss_reduction: str = "mean") -> torch.Tensor:
        if self.first:
            x = x.float().unsqueeze(-1)  # ids [b, s] -> [b, s, 1], broadcast to [b, s, h]
        y = _Sleep.apply(x * self.scale, self.forward_s, 2 * self.forward_s)
        if not self.last:
            return y
        return y.sum() if loss_reduction == "sum" else y.mean()


def stages(kind: str, grid: ParallelGrid) -> tuple[list[nn.Module], int]:
    """This rank's one chunk of the chosen kind, and the hidden size its messages carry."""
    if kind == "sleep":
        hidden, r = 64, grid.pp_rank
        return [SleepStage(hidden, r == 0, r == grid.pp - 1, SLEEP_FORWARD)], hidden
    config = GPTConfig(**GPT_MODEL)
    return build_chunks(config, grid), config.hidden


def timelines_on_ranks(kind: str, rounds: int) -> list[list[tuple[Action, float, float]]]:
    """Runs on each rank: ``rounds`` iterations (after one warm-up); this rank's timelines."""
    grid = ParallelGrid(pp=P)
    chunks, hidden = stages(kind, grid)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(GPT_MODEL["vocab_size"], (M * MICROBATCH, GPT_MODEL["seq_len"] + 1),
                           generator=gen)
    schedule = one_f_one_b(P, M)
    timelines = []
    for _ in range(rounds + 1):
        result = run_schedule(schedule, chunks, grid, tokens[:, :-1], tokens[:, 1:], M, hidden)
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
    p = len(timeline.ranks)
    end = {(rank, action): e for rank, row in enumerate(timeline.ranks) for action, _, e in row}
    found: dict[str, list[float]] = {"send": [], "engine": []}
    for rank, row in enumerate(timeline.ranks):
        for (_, _, free_at), (action, start, _) in pairwise(row):
            sent = max((end[d] for d in dependencies(rank, action, p) if d[0] != rank),
                       default=float("-inf"))
            if sent > free_at:
                found["send"].append(start - sent)
            else:
                found["engine"].append(start - free_at)
    return found


def mean_send_latency(timeline: Timeline) -> float:
    return statistics.mean(gaps(timeline)["send"] or [0.0])


def simulated_twin(timeline: Timeline) -> Timeline:
    """The simulator fed with this run's per-rank mean forward/backward times and send latency."""
    means = {kind: [statistics.mean(e - s for a, s, e in row if a.kind == kind)
                    for row in timeline.ranks] for kind in "FB"}
    return simulate(one_f_one_b(P, M), means["F"], means["B"], mean_send_latency(timeline))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", choices=("sleep", "gpt"), default=["sleep", "gpt"])
    args = parser.parse_args(argv)
    formula = float(bubble_formula("1f1b", P, M))
    print(f"(d) bubble of 1F1B, p={P} ranks × 1 thread, m={M}: (p-1)/m = {formula:.3f}")
    records = []
    for kind in args.kinds:
        per_rank = run(timelines_on_ranks, P, kind, args.rounds, backend="gloo",
                       threads_per_rank=1)
        measured = [Timeline(list(ranks)) for ranks in zip(*per_rank, strict=True)]
        simulated = [simulated_twin(t) for t in measured]
        bubbles = [float(t.bubble_fraction) for t in measured]
        off = Spread.of([100 * (b / float(s.bubble_fraction) - 1)
                         for b, s in zip(bubbles, simulated, strict=True)])
        latency = statistics.median(mean_send_latency(t) for t in measured)
        engine = statistics.median(statistics.mean(gaps(t)["engine"] or [0.0]) for t in measured)
        print(f"  {kind}: measured bubble {statistics.median(bubbles):.3f}, simulated with the "
              f"measured costs and {1e3 * latency:.2f} ms send latency "
              f"{statistics.median(float(s.bubble_fraction) for s in simulated):.3f}, "
              f"formula {formula:.3f}; idle before an action whose inputs were already sent: "
              f"{1e3 * engine:.2f} ms")
        target = kind == "sleep"  # the gpt stages compete for cores: information only
        records.append(report(
            f"d_bubble_{kind}", "measured_vs_simulated_percent", off,
            f"within {TARGET_PERCENT:g} %" if target else "(4 ranks share 2 cores)",
            abs(off.median) <= TARGET_PERCENT if target else None,
            config=dict(p=P, m=M, microbatch=MICROBATCH, stage=kind,
                        **({"forward_s": SLEEP_FORWARD} if kind == "sleep" else GPT_MODEL)),
            extra={"measured_bubble": statistics.median(bubbles), "formula": formula,
                   "measured_vs_formula_percent": 100 * (statistics.median(bubbles) / formula - 1),
                   "send_latency_ms": 1e3 * latency, "engine_gap_ms": 1e3 * engine}))
    return records


if __name__ == "__main__":
    main()
