"""(b) A tensor-parallel transformer block at tp = 2 against PyTorch's own tensor parallelism.

Two processes, one thread each. Each holds megatron-edu's ``Block`` (1909.08053 §3: qkv and fc
column-parallel, both projections row-parallel, f and g around them) and the plain block of
``bench/nanogpt.py`` carrying the same full weights, sharded by PyTorch's DTensor:
``parallelize_module`` with ``ColwiseParallel`` on qkv and fc and ``RowwiseParallel`` on the
projections — the same split, so both do 2 all-reduces forward and 2 backward. megatron-edu runs
twice: as it is by default, and with ``async_tp`` on its column layers (the backward all-reduce
of the input gradient overlapped with the weight-gradient GEMM, Megatron-LM's asynchronous
tensor-parallel all-reduce). The benchmark checks that all three compute the same input
gradient, then alternates their forward + backward and reports  t(megatron-edu) / t(DTensor),
target ≤ 0.9, with and without ``async_tp``, and t(async) / t(plain), at three sizes: the block
PyTorch's DTensor was first timed on, as the development machine's baseline (hidden 512,
sequence 256, batch 8: about 320 ms forward + backward on 2 processes × 1 thread of a 2-core
CPU), where all spend nearly all their time in the same matmuls; the same at hidden 1024; and a
small one (hidden 128), where what each framework adds around the matmuls shows.

    python -m bench.tp_dtensor
    python -m bench.tp_dtensor --rounds 4 --hidden 512 1024   # a quick look
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from bench import nanogpt
from bench.common import Spread, Timings, all_close, alternate, ratios, report
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.model.transformer import Block
from megatron_edu.tensor_parallel import AsyncTensorParallel, ColumnParallelLinear, TensorParallel
from megatron_edu.tensor_parallel.init import gather_full, init_parameters

__all__ = ["main"]

TP = 2
MODEL = dict(vocab_size=128, num_layers=1, num_heads=8, dropout=0.0)  # no dropout: same outputs
# (hidden, seq, batch, rounds per --rounds): the DTensor baseline's block, where the matmuls take
# nearly all the time, the same at twice the width (half the rounds: ~1.5 s a step), then a small
# block, where what each framework adds around them shows.
SIZES = [(512, 256, 8, 1), (1024, 256, 8, 0.5), (128, 128, 4, 2)]
TARGET = 0.9
# PyTorch's plan for a Megatron-style block (its tensor-parallel tutorial does the same).
DTENSOR_PLAN = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def twin_blocks(config: GPTConfig, grid: ParallelGrid) -> tuple[nn.Module, nn.Module]:
    """megatron-edu's tp block and the plain block sharded by DTensor, with the same weights."""
    ours = Block(config, grid.tp_group)
    init_parameters(ours, config.seed, grid.tp_group)
    plain = nanogpt.Block(config)
    plain.load_state_dict({name: gather_full(p, p.tp_dim, grid.tp_group)
                           for name, p in ours.named_parameters()})
    mesh = init_device_mesh("cpu", (grid.tp,))
    return ours, parallelize_module(plain, mesh, DTENSOR_PLAN)


def forward_backward(block: nn.Module, x: torch.Tensor, dy: torch.Tensor,
                     async_tp: bool | None = None) -> Callable[[], torch.Tensor]:
    """A callable running the block forward and backward from ``dy``; it returns x's gradient.
    ``async_tp`` (megatron-edu's block): its column layers' style, set before each step (the
    same block, overlapped or not)."""
    style = AsyncTensorParallel if async_tp else TensorParallel

    def step() -> torch.Tensor:
        if async_tp is not None:
            for layer in block.modules():
                if isinstance(layer, ColumnParallelLinear):
                    layer.style = style(layer.group)
        x.grad = None
        block.zero_grad(set_to_none=True)
        block(x).backward(dy)
        return x.grad

    return step


def compare_on_ranks(model: dict, batch: int, rounds: int) -> Timings:
    """Runs on each rank: check the two blocks agree, then time them in turn."""
    grid = ParallelGrid(tp=TP)
    config = GPTConfig(**model)
    ours, dtensor = twin_blocks(config, grid)
    gen = torch.Generator().manual_seed(0)  # the same input on both ranks
    x = torch.randn(batch, config.seq_len, config.hidden, generator=gen, requires_grad=True)
    dy = torch.randn(batch, config.seq_len, config.hidden, generator=gen)
    steps = {"megatron-edu": forward_backward(ours, x, dy, async_tp=False),
             "megatron-edu async": forward_backward(ours, x, dy, async_tp=True),
             "dtensor": forward_backward(dtensor, x, dy)}
    grads = {name: [step()] for name, step in steps.items()}
    if not all(all_close(grads[name], grads["dtensor"]) for name in grads):
        raise RuntimeError("megatron-edu's block and DTensor's disagree on the input gradient")
    return alternate(steps, rounds, warmup=2, sync=dist.barrier)


def main(argv: list[str] | None = None) -> list[dict]:
    """Time ours against DTensor at each size; the rows printed and returned."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24,
                        help="(twice as many at the small size, half at hidden 1024)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[h for h, *_ in SIZES],
                        choices=[h for h, *_ in SIZES], help="the sizes to run (default all)")
    args = parser.parse_args(argv)
    records = []
    for hidden, seq, batch, rounds in SIZES:
        if hidden not in args.hidden:
            continue
        model = dict(MODEL, hidden=hidden, seq_len=seq)
        print(f"(b) tp={TP} block, {TP} processes × 1 thread: hidden {hidden}, heads "
              f"{model['num_heads']}, seq {seq}, batch {batch}; forward + backward")
        times = run(compare_on_ranks, TP, model, batch, max(2, round(rounds * args.rounds)),
                    backend="gloo", threads_per_rank=1)[0]
        step_ms = {name: 1e3 * Spread.of(t).median for name, t in times.wall.items()}
        print("  median ms: " + ", ".join(f"{name} {ms:.1f}" for name, ms in step_ms.items()))
        config = dict(model, tp=TP, batch=batch, threads_per_rank=1)
        for name, ours, theirs, target in (
                (f"b_tp_vs_dtensor_h{hidden}", "megatron-edu", "dtensor", TARGET),
                (f"b_tp_async_vs_dtensor_h{hidden}", "megatron-edu async", "dtensor", TARGET),
                (f"b_tp_async_vs_sync_h{hidden}", "megatron-edu async", "megatron-edu", None)):
            ratio = Spread.of(ratios(times.wall, ours, theirs))
            cpu = Spread.of(ratios(times.cpu, ours, theirs))
            print(f"  {ours} / {theirs}: CPU-time ratio {cpu.median:.3f}")
            records.append(report(
                name, "time_ratio", ratio,
                f"<= {target:g}x DTensor" if target else "information (async_tp on / off)",
                ratio.median <= target if target else None, config=config,
                extra={"step_ms": step_ms, "cpu_time_ratio": cpu.median}))
    return records


if __name__ == "__main__":
    main()
