"""(h) context parallelism: one causal attention layer's forward + backward as a ring at cp = 2,
against the serial attention of the same total work, and the zig-zag split against consecutive
parts.

PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
refuses to run on a CPU with torch 2.13 (no sharding strategy for the CPU flash-attention
operator), so on this machine the reference is the serial attention — the model's unfused core
on the whole sequence, on one rank while the other waits. Two ranks on two cores can at best
halve it (ratio 0.5). Per rank, the CPU time of each split shows the causal imbalance that the
zig-zag removes: with consecutive parts rank 1 computes 6 chunk pairs to rank 0's 2
(``causal_work``), with the zig-zag both compute 4.

    python -m bench.ring_attention            # 2 processes × 1 thread
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench.common import Spread, all_close, alternate, ratios, report
from megatron_edu import comm
from megatron_edu.context_parallel import causal_work, ring_attention, split
from megatron_edu.launch import run

CP = 2
SHAPE = dict(batch=2, heads=8, seq=1024, head_dim=64)
TARGET = 0.6  # × the serial layer: within 20 % of a perfect split over two cores


def serial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√d, causal)·v with the [s, s] scores materialised (``attention.EagerCore``)."""
    s = q.shape[2]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def _step(attend, inputs: list[torch.Tensor], grad: torch.Tensor):
    def step() -> list[torch.Tensor]:
        for x in inputs:
            x.grad = None
        attend(*inputs).backward(grad)
        return [x.grad for x in inputs]
    return step


def compare_on_ranks(rounds: int) -> dict:
    """Runs on each rank: check each split's gradients against the serial layer, then time."""
    group = comm.world()
    gen = torch.Generator().manual_seed(0)
    b, a, s, d = SHAPE.values()
    whole = [torch.randn(b, a, s, d, generator=gen) for _ in range(4)]   # q, k, v, dO
    serial_inputs = [x.clone().requires_grad_() for x in whole[:3]]
    steps = {"serial": _step(serial_attention, serial_inputs, whole[3])}
    if group.rank != 0:                              # the serial layer runs on rank 0 alone
        steps["serial"] = lambda: None
    expected = _step(serial_attention, serial_inputs, whole[3])()
    for zigzag, name in ((True, "zig-zag"), (False, "consecutive")):
        part = [split(x, group.rank, CP, zigzag, dim=2) for x in whole]
        inputs = [x.clone().requires_grad_() for x in part[:3]]
        steps[name] = _step(lambda q, k, v, z=zigzag: ring_attention(q, k, v, group, z),
                            inputs, part[3])
        mine = [split(g, group.rank, CP, zigzag, dim=2) for g in expected]
        if not all_close(steps[name](), mine, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"the ring ({name}) and the serial attention disagree")
    with comm.record() as log:
        steps["zig-zag"]()
    times = alternate(steps, rounds, warmup=1, sync=dist.barrier)
    return {"wall": times.wall, "cpu": times.cpu, "bytes": log.total_bytes(op="send")}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    b, a, s, d = SHAPE.values()
    print(f"(h) ring attention, cp={CP} processes × 1 thread: batch {b}, heads {a}, seq {s}, "
          f"head dim {d}; forward + backward")
    ranks = run(compare_on_ranks, CP, args.rounds, backend="gloo", threads_per_rank=1)
    wall = ranks[0]["wall"]
    ms = {name: 1e3 * Spread.of(t).median for name, t in wall.items()}
    print("  median ms (rank 0): " + ", ".join(f"{n} {t:.1f}" for n, t in ms.items()))
    block = b * a * (s // CP) * d * 4
    print(f"  bytes sent per rank: {ranks[0]['bytes']:,} (formula 6·(cp − 1)·block = "
          f"{6 * (CP - 1) * block:,})")
    imbalance = {name: Spread.of([t1 / t0 for t0, t1 in zip(ranks[0]["cpu"][name],
                                                            ranks[1]["cpu"][name], strict=True)])
                 for name in ("zig-zag", "consecutive")}
    for name, zigzag in (("zig-zag", True), ("consecutive", False)):
        work = causal_work(1, CP, zigzag) / causal_work(0, CP, zigzag)
        print(f"  {name}: CPU time rank 1 / rank 0 {imbalance[name].format('.2f')}; "
              f"chunk pairs {work:.1f}")
    config = dict(SHAPE, cp=CP, threads_per_rank=1, dtype="fp32")
    extra = {"step_ms": ms, "bytes_per_rank": ranks[0]["bytes"],
             "cpu_rank1_over_rank0": {n: x.median for n, x in imbalance.items()}}
    ring = Spread.of(ratios(wall, "zig-zag", "serial"))
    return [report("h_ring_vs_serial", "time_ratio", ring, f"<= {TARGET:g}x serial",
                   ring.median <= TARGET, config, extra),
            report("h_consecutive_vs_zigzag", "time_ratio",
                   Spread.of(ratios(wall, "consecutive", "zig-zag")),
                   "information (the causal imbalance)", None, config, extra)]

if __name__ == "__main__":
    main()
