"""(c) megatron-edu's pipeline engine against ``torch.distributed.pipelining``, same stages.

Two pipeline ranks, one thread each. Both run the *same* model chunks — megatron-edu's GPT
stages from ``pipeline.engine.build_chunks`` — one training iteration of m microbatches (forward
and backward, no optimizer step), with two schedules of 2104.04473 §2.2:

* 1F1B (PipeDream-Flush, §2.2.1): our ``one_f_one_b`` against PyTorch's ``Schedule1F1B``;
* interleaved 1F1B with v chunks per rank (§2.2.2): our ``interleaved_one_f_one_b`` against
  ``ScheduleInterleaved1F1B``.

A GPT chunk is a module PyTorch's ``PipelineStage`` can hold as it is: the first takes token ids,
the middle ones hidden states, the last returns logits (without labels). Its loss function is the
same vocabulary-parallel cross entropy our last chunk computes inside. The benchmark checks that
the two give the same loss and gradients, then alternates them and reports, per schedule,
    t(megatron-edu) / t(torch.distributed.pipelining),    target ≤ 1.0.

    python -m bench.pp_pipelining
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from bench.common import Spread, Timings, all_close, alternate, ratios, report
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.pipeline.engine import Batch, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import interleaved_one_f_one_b, one_f_one_b
from megatron_edu.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_edu.tensor_parallel.layers import serial_group

PP, CHUNKS, MICROBATCHES, MICROBATCH = 2, 2, 8, 2
MODEL = dict(vocab_size=1024, seq_len=64, num_layers=8, hidden=128, num_heads=4, dropout=0.0)
TARGET = 1.0


def torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What our last chunk computes from its logits: the mean vocabulary-parallel cross entropy."""
    return vocab_parallel_cross_entropy(logits, labels, serial_group()).mean()


class Contenders:
    """One schedule, run by our engine and by PyTorch's, over the same chunks on this rank."""

    def __init__(self, config: GPTConfig, grid: ParallelGrid, v: int,
                 batch: tuple[torch.Tensor, ...]) -> None:
        p, m = grid.pp, MICROBATCHES
        self.ours = one_f_one_b(p, m) if v == 1 else interleaved_one_f_one_b(p, m, v)
        self.chunks = build_chunks(config, grid, self.ours.stages)
        self.grid, self.batch = grid, Batch(*batch)
        where = self.ours.stages
        stages = [PipelineStage(chunk, where.stage(grid.pp_rank, c), where.num_stages,
                                torch.device("cpu")) for c, chunk in enumerate(self.chunks)]
        if v == 1:
            self.theirs = Schedule1F1B(stages[0], m, loss_fn=torch_loss)
        else:
            self.theirs = ScheduleInterleaved1F1B(stages, m, loss_fn=torch_loss)

    def megatron_edu(self) -> None:
        run_schedule(self.ours, self.chunks, self.grid, self.batch)

    def pipelining(self) -> None:
        first, last = self.grid.pp_rank == 0, self.grid.pp_rank == self.grid.pp - 1
        args = (self.batch.input_ids,) if first else ()
        self.theirs.step(*args, target=self.batch.labels if last else None,
                         return_outputs=False)

    def then_zero_grad(self, step: Callable[[], None]) -> Callable[[], None]:
        """``step``, then this rank's gradients set back to zero for the next one."""

        def run_and_zero() -> None:
            step()
            self._zero_grad()

        return run_and_zero

    def gradients(self, step: Callable[[], None]) -> list[torch.Tensor]:
        """This rank's gradients after one ``step`` (then zeroed)."""
        step()
        grads = [p.grad.clone() for chunk in self.chunks for p in chunk.parameters()]
        self._zero_grad()
        return grads

    def _zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=False)


def compare_on_ranks(rounds: int) -> dict[str, Timings]:
    """Runs on each pipeline rank: for 1F1B and interleaved, check and time both engines."""
    grid = ParallelGrid(pp=PP)
    config = GPTConfig(**MODEL)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.vocab_size, (MICROBATCHES * MICROBATCH, config.seq_len + 1),
                           generator=gen)
    batch = tokens[:, :-1], tokens[:, 1:]
    timings = {}
    for name, v in (("1f1b", 1), ("interleaved", CHUNKS)):
        both = Contenders(config, grid, v, batch)
        if not all_close(both.gradients(both.megatron_edu), both.gradients(both.pipelining)):
            raise RuntimeError(f"{name}: our engine and torch.distributed.pipelining disagree "
                               f"on the gradients")
        steps = {"megatron-edu": both.then_zero_grad(both.megatron_edu),
                 "pipelining": both.then_zero_grad(both.pipelining)}
        timings[name] = alternate(steps, rounds, warmup=1, sync=dist.barrier)
    return timings


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"(c) pipeline engines, p={PP} processes × 1 thread, m={MICROBATCHES} microbatches of "
          f"{MICROBATCH}: GPT {MODEL['num_layers']} layers, hidden {MODEL['hidden']}, seq "
          f"{MODEL['seq_len']}; interleaved v={CHUNKS}")
    timings = run(compare_on_ranks, PP, args.rounds, backend="gloo", threads_per_rank=1)[0]
    records = []
    for name, times in timings.items():
        ratio = Spread.of(ratios(times.wall, "megatron-edu", "pipelining"))
        cpu = Spread.of(ratios(times.cpu, "megatron-edu", "pipelining"))
        step_ms = {who: 1e3 * Spread.of(t).median for who, t in times.wall.items()}
        print(f"  {name} median ms: " + ", ".join(f"{k} {ms:.1f}" for k, ms in step_ms.items())
              + f"; CPU-time ratio (rank 0) {cpu.median:.3f}")
        records.append(report(
            f"c_{name}_vs_pipelining", "time_ratio", ratio, f"<= {TARGET:g}x pipelining",
            ratio.median <= TARGET,
            config=dict(MODEL, pp=PP, chunks=CHUNKS if name == "interleaved" else 1,
                        microbatches=MICROBATCHES, microbatch=MICROBATCH, threads_per_rank=1),
            extra={"step_ms": step_ms, "cpu_time_ratio_rank0": cpu.median}))
    return records


if __name__ == "__main__":
    main()
