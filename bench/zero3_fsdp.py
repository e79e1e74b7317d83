"""(i) ZeRO-3: one training step of the same GPT at dp = 2, megatron-edu's against PyTorch's FSDP2.

Two processes, one thread each, gloo. Every rank builds the package's serial ``GPT(config)``
from one seed (its parameters are drawn by name: the same weights on every rank and in every
copy) and the same batch of its own (seeded by the rank). Three contenders, each one training
step — forward, backward, AdamW (same hyperparameters, weight decay on matrices only, no
clipping):

* **megatron-edu** (the headline): ``ZeRO3(model, dp, units=blocks, average=True)`` and its
  optimizer (a ``DistributedOptimizer`` over ``torch.optim.AdamW``), the loss the model's own
  mean over
  this rank's tokens. This is like with like: FSDP2 too is a wrapper around an ordinary model and
  an ordinary optimizer, averages the gradients over the ranks, and does nothing else in a step.
  Each transformer block is a unit (gathered before its forward and again before its backward,
  freed after each), the rest — embeddings, final layer norm — the root, kept gathered from its
  forward to its backward; the next unit's gather is launched before the current one runs.
* **FSDP2**: ``fully_shard`` on each block, then on the whole model (its root), and
  ``torch.optim.AdamW`` over its DTensor parameters: the same units, the same root, the same
  prefetch (FSDP2's forward and backward prefetch of one unit), its reduce-scatters averaging.
* **megatron-edu PTDP** (information): ``PTDP(config, ParallelGrid(Layout(dp=2)), zero=3)``'s
  ``train_step`` — the same ZeRO-3 under the whole trainer: the pipeline engine at pp = 1, the
  token count and the loss all-reduced over dp, the global gradient norm computed (``clip=0``
  skips only the scaling).

First the three take 3 steps each from the same weights on the same batches and must report the
same losses (fp32, relative 1e-5); then their steps alternate, and the benchmark reports
t(megatron-edu) / t(FSDP2), target ≤ 1.0, and t(PTDP) / t(FSDP2) for information. Bytes: both
sides' collectives of one step counted — megatron-edu's by ``comm.record()`` ("dp params gather",
"dp grads"), FSDP2's by wrapping the two ``torch.distributed`` calls it makes
(``all_gather_single``, ``reduce_scatter_single``) — as full buffers (an all-gather its output, a
reduce-scatter its input, ``comm``'s convention) and as each rank's ring wire bytes, (d − 1)/d of
that, beside the formula 3(d − 1)/d · Ψ (two gathers and one reduce-scatter of all Ψ parameter
bytes; the root's second gather is saved, so the step sends (d − 1)/d · Ψ_root less).

    python -m bench.zero3_fsdp
    python -m bench.zero3_fsdp --rounds 6      # a quick look
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.common import Spread, alternate, ratios, report
from megatron_edu import comm
from megatron_edu.data_parallel import ZeRO3
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.optim import build_param_groups
from megatron_edu.ptdp import PTDP, PTDPOptions

__all__ = ["main"]

DP = 2
MODEL = dict(vocab_size=4096, seq_len=128, num_layers=4, hidden=256, num_heads=8, dropout=0.0)
BATCH = 4                                   # sequences per rank
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CHECK_STEPS = 3
RTOL = 1e-5
TARGET = 1.0


def batch_of_rank(config: GPTConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(config.vocab_size, (BATCH, config.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def decay_groups(model: nn.Module) -> list[dict]:
    """AdamW's two groups, the package's rule (matrices decay; biases, norms do not)."""
    return build_param_groups(model, ADAMW["weight_decay"])


def megatron_step(config: GPTConfig, grid: ParallelGrid, ids: torch.Tensor,
                  labels: torch.Tensor) -> Callable[[], torch.Tensor]:
    """megatron-edu's ZeRO-3 on the serial GPT: its step returns this rank's loss."""
    model = GPT(config)
    ddp = ZeRO3(model, grid.dp_group, average=True, units=list(model.blocks.values()))
    adamw = {k: v for k, v in ADAMW.items() if k != "weight_decay"}
    optimizer = ddp.optimizer(decay_groups(model), torch.optim.AdamW, **adamw)

    def step() -> torch.Tensor:
        loss = model(ids, labels)
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        ddp.zero_grad()
        return loss.detach()

    return step


def fsdp_step(config: GPTConfig, ids: torch.Tensor,
              labels: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FSDP2 on the same GPT: each block a unit, the model its root; this rank's loss."""
    model = GPT(config)
    mesh = init_device_mesh("cpu", (DP,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adamw = {k: v for k, v in ADAMW.items() if k != "weight_decay"}
    optimizer = torch.optim.AdamW(decay_groups(model), **adamw)

    def step() -> torch.Tensor:
        loss = model(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ptdp_step(config: GPTConfig, grid: ParallelGrid, ids: torch.Tensor,
              labels: torch.Tensor) -> Callable[[], float]:
    """PTDP's whole training step at dp = 2, ZeRO-3: the global loss."""
    options = PTDPOptions(lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                          weight_decay=ADAMW["weight_decay"], clip=0.0)
    trainer = PTDP(config, grid, options, zero=3)
    return lambda: trainer.train_step(ids, labels, ADAMW["lr"]).loss


@contextmanager
def count_fsdp_collectives(log: dict[str, list[int]]):
    """Wrap the ``torch.distributed`` calls FSDP2 makes (torch 2.13: ``all_gather_single``,
    ``reduce_scatter_single``; the older names, an all-reduce or a broadcast are counted too if
    any is made): each call's full-buffer bytes, by name."""
    counted = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
               "reduce_scatter_single": "input", "reduce_scatter_tensor": "input",
               "all_reduce": "tensor", "broadcast": "tensor"}
    originals = {name: getattr(dist, name) for name in counted}

    def wrapped(name: str) -> Callable:
        original, signature = originals[name], inspect.signature(originals[name])

        def call(*args, **kwargs):
            tensor = signature.bind(*args, **kwargs).arguments[counted[name]]
            log.setdefault(name, []).append(tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)
        return call

    try:
        for name in counted:
            setattr(dist, name, wrapped(name))
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def compare_on_ranks(rounds: int) -> dict:
    """Runs on each rank: the same losses first, then the bytes of one step, then the timing."""
    grid = ParallelGrid(Layout(dp=DP))
    config = GPTConfig(**MODEL)
    ids, labels = batch_of_rank(config, grid.dp_rank)
    steps = {"megatron-edu": megatron_step(config, grid, ids, labels),
             "fsdp2": fsdp_step(config, ids, labels),
             "megatron-edu PTDP": ptdp_step(config, grid, ids, labels)}
    losses = {name: [] for name in steps}
    for _ in range(CHECK_STEPS):
        for name, step in steps.items():
            loss = torch.as_tensor(step(), dtype=torch.float32)
            if name != "megatron-edu PTDP":             # this rank's mean → the global one
                loss = comm.all_reduce(loss, grid.dp_group, "check") / DP
            losses[name].append(float(loss))
    for name, values in losses.items():
        if not torch.allclose(torch.tensor(values), torch.tensor(losses["fsdp2"]), rtol=RTOL,
                              atol=0.0):
            raise RuntimeError(f"{name} and FSDP2 take different steps: losses {values} "
                               f"against {losses['fsdp2']}")
    with comm.record() as ours:
        steps["megatron-edu"]()
    with count_fsdp_collectives({}) as theirs:
        steps["fsdp2"]()
    times = alternate(steps, rounds, warmup=1, sync=dist.barrier)
    return {"wall": times.wall, "cpu": times.cpu, "losses": losses,
            "ours": ours.summary(), "fsdp": {k: (len(v), sum(v)) for k, v in theirs.items()}}


def parameter_bytes(config: GPTConfig) -> tuple[int, int]:
    """Ψ, all parameter bytes, and Ψ_root, those outside the blocks (fp32)."""
    model = GPT(config)
    total = sum(p.numel() for p in model.parameters()) * 4
    blocks = sum(p.numel() for b in model.blocks.values() for p in b.parameters()) * 4
    return total, total - blocks


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    config = GPTConfig(**MODEL)
    print(f"(i) ZeRO-3 at dp={DP}, {DP} processes × 1 thread: GPT {config.num_layers} layers, "
          f"hidden {config.hidden}, heads {config.num_heads}, vocab {config.vocab_size}, seq "
          f"{config.seq_len}, batch {BATCH} per rank; one training step (AdamW)")
    ranks = run(compare_on_ranks, DP, args.rounds, backend="gloo", threads_per_rank=1)
    rank0 = ranks[0]
    print("  global losses of the first steps: " + "; ".join(
        f"{name} " + ", ".join(f"{x:.6f}" for x in v) for name, v in rank0["losses"].items()))
    ms = {name: 1e3 * Spread.of(t).median for name, t in rank0["wall"].items()}
    print("  median ms (rank 0): " + ", ".join(f"{n} {t:.1f}" for n, t in ms.items()))

    psi, psi_root = parameter_bytes(config)
    wire = (DP - 1) / DP
    ours = {label: (n, b) for (op, _, label), (n, b) in rank0["ours"].items()
            if label in ("dp params gather", "dp grads")}
    ours_bytes = sum(b for _, b in ours.values())
    fsdp_bytes = sum(b for _, b in rank0["fsdp"].values())
    print(f"  Ψ = {psi:,} parameter bytes (root, outside the blocks: {psi_root:,})")
    for side, table in (("megatron-edu", ours), ("FSDP2", rank0["fsdp"])):
        print(f"  {side}: " + ", ".join(f"{k} {n} calls {b:,} B" for k, (n, b) in table.items())
              + f"; wire per rank {wire * sum(b for _, b in table.values()):,.0f} B")
    print(f"  formula 3(d − 1)/d · Ψ = {3 * wire * psi:,.0f} B; without the root's second "
          f"gather {wire * (3 * psi - psi_root):,.0f} B")

    config_record = dict(MODEL, dp=DP, zero=3, batch_per_rank=BATCH, threads_per_rank=1,
                         dtype="fp32", adamw=ADAMW)
    wire_bytes = {"megatron-edu": wire * ours_bytes, "fsdp2": wire * fsdp_bytes,
                  "formula": 3 * wire * psi, "formula_root_kept": wire * (3 * psi - psi_root)}
    extra = {"step_ms": ms, "wire_bytes_per_rank": wire_bytes,
             "collectives": {"megatron-edu": {k: list(v) for k, v in ours.items()},
                             "fsdp2": {k: list(v) for k, v in rank0["fsdp"].items()}},
             "losses": rank0["losses"]}
    records = []
    for name, ours_name, target in (("i_zero3_vs_fsdp2", "megatron-edu", TARGET),
                                    ("i_ptdp_zero3_vs_fsdp2", "megatron-edu PTDP", None)):
        ratio = Spread.of(ratios(rank0["wall"], ours_name, "fsdp2"))
        cpu = Spread.of(ratios(rank0["cpu"], ours_name, "fsdp2"))
        print(f"  {ours_name} / FSDP2: CPU-time ratio {cpu.median:.3f}")
        records.append(report(
            name, "time_ratio", ratio,
            f"<= {target:g}x FSDP2" if target else "information (PTDP)",
            ratio.median <= target if target else None, config_record,
            {**extra, "cpu_time_ratio": cpu.median}))
    return records


if __name__ == "__main__":
    main()
