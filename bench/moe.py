"""(j) Mixture of experts (``model.moe``): the MoE layer's training step against a dense SwiGLU MLP
of the same active FLOPs, and the experts' grouped GEMM against a loop of per-expert matmuls.

Layer: E experts of f units, top-k, against the dense MLP of k·f units — the same matmul FLOPs
per token (each token passes k experts of f units), plus the router's E·h. Both are built as a
block builds them (``transformer.feed_forward``), serial (ep = tp = 1; every choice kept, as the
layer routes by default), and take forward and backward of one batch. The two do not compute
the same function, so there is no equality check: what is compared is the price of sparsity at
equal FLOPs. A third contender, the experts alone on the already-dispatched rows (grouped GEMMs
and SwiGLU), measures the routing's share of the layer's step, 1 − t(experts) / t(MoE): router,
permutation, un-permutation, the weighted sum.

Grouped GEMM: ``moe.grouped_mm`` (one ``F.grouped_mm``) against a loop of E matmuls over the same
rows, the experts' fc shape, forward and backward, with balanced counts (the same rows for every
expert) and skewed ones (∝ 1/(e + 1)); outputs and gradients checked equal first. Reported:
    t(MoE) / t(dense),  routing share,  t(loop) / t(grouped),     no targets: measured.

    python -m bench.moe                               # CPU, fp32: hidden 1024, 8 × 512, top-2
    python -m bench.moe --device cuda --dtype bf16    # one GPU: hidden 4096, 8 × 2048, top-2
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bench.common import (
    Device,
    Spread,
    Timings,
    all_close,
    alternate,
    device_arguments,
    ratios,
    report,
    require_device,
)
from megatron_edu.expert_parallel import Dispatch
from megatron_edu.model import LlamaConfig
from megatron_edu.model.moe import ExpertGroups, grouped_mm
from megatron_edu.model.transformer import feed_forward
from megatron_edu.tensor_parallel.init import init_parameters
from megatron_edu.tensor_parallel.layers import serial_group


@dataclass(frozen=True)
class Shape:
    """The layer's sizes: hidden, E experts of ``expert_ffn`` units, top-k, batch × seq tokens."""

    hidden: int
    experts: int
    topk: int
    expert_ffn: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SHAPES = {"cpu": Shape(hidden=1024, experts=8, topk=2, expert_ffn=512, batch=2, seq=512),
          "cuda": Shape(hidden=4096, experts=8, topk=2, expert_ffn=2048, batch=4, seq=2048)}


def layer_config(shape: Shape) -> LlamaConfig:
    """One Llama block's sizes, no attention needed: ``ffn_hidden`` is the dense MLP's k·f."""
    return LlamaConfig(vocab_size=128, seq_len=shape.seq, num_layers=1, hidden=shape.hidden,
                       num_heads=1, ffn_hidden=shape.topk * shape.expert_ffn,
                       moe_experts=shape.experts, moe_topk=shape.topk,
                       moe_ffn_hidden=shape.expert_ffn)


def matmul_flops(shape: Shape) -> dict[str, int]:
    """Forward + backward matmul FLOPs of a step (6 per weight and token): the experts' (the dense
    MLP's alike: 3 matrices h × k·f a token) and the router's."""
    return {"experts": 6 * shape.tokens * 3 * shape.hidden * shape.topk * shape.expert_ffn,
            "router": 6 * shape.tokens * shape.hidden * shape.experts}


def backward_step(forward: Callable[[], torch.Tensor], grad: torch.Tensor,
                  leaves: list[torch.Tensor], device: Device) -> Callable[[], list[torch.Tensor]]:
    """Forward (under the device's autocast) and backward with output gradient ``grad``, as a
    callable that returns the output and the leaves' gradients (reset before each call)."""
    def step() -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        with device.autocast():
            y = forward()
        y.backward(grad)
        return [y.detach(), *(leaf.grad for leaf in leaves)]
    return step


def measure_layer(shape: Shape, device: Device, rounds: int) -> tuple[Timings, list[int]]:
    """The MoE layer, the dense MLP and the experts alone, alternated; and the rows each expert
    received (the router's choice on this batch)."""
    config = layer_config(shape)
    moe, dense = (feed_forward(c, serial_group(), ExpertGroups.serial())
                  for c in (config, dataclasses.replace(config, moe_experts=0)))
    for module in (moe, dense):
        init_parameters(module, config.seed, serial_group(), device.torch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=gen)
    grad = torch.randn(x.shape, generator=gen).to(device.torch)
    x = x.to(device.torch).requires_grad_()
    with torch.no_grad(), device.autocast():
        ids, _ = moe.router(x)
        route = Dispatch(ids.flatten(0, 1), moe.dispatcher.group, shape.experts)
        rows = moe.dispatcher.dispatch(moe.style.enter(x).flatten(0, 1), route)
    rows.requires_grad_()
    rows_grad = torch.randn(rows.shape, generator=gen).to(device.torch)
    per_expert = route.per_expert
    steps = {
        "moe": backward_step(partial(moe, x), grad, [x, *moe.parameters()], device),
        "dense": backward_step(partial(dense, x), grad, [x, *dense.parameters()], device),
        "experts": backward_step(partial(moe.experts, rows, per_expert), rows_grad,
                                 [rows, *moe.experts.parameters()], device),
    }
    times = alternate(steps, rounds, warmup=2, sync=device.synchronize)
    return times, per_expert.tolist()


def skewed_counts(total: int, experts: int) -> list[int]:
    """``total`` rows over ``experts`` in proportion to 1/(e + 1), the remainder to expert 0."""
    share = [1 / (e + 1) for e in range(experts)]
    counts = [int(total * s / sum(share)) for s in share]
    counts[0] += total - sum(counts)
    return counts


def measure_grouped(shape: Shape, device: Device, rounds: int) -> Timings:
    """``grouped_mm`` and the loop of matmuls, each with balanced and skewed counts, alternated
    (contenders "grouped balanced", "loop balanced", "grouped skewed", "loop skewed"), after
    checking that both give the same output and gradients."""
    n, out = shape.tokens * shape.topk, 2 * shape.expert_ffn           # the experts' fc
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(n, shape.hidden, generator=gen), torch.randn(n, out, generator=gen)
    w = torch.randn(shape.experts, out, shape.hidden, generator=gen) * shape.hidden ** -0.5
    x, w, dy = (t.to(device.torch) for t in (x, w, dy))
    x.requires_grad_()
    w.requires_grad_()

    def loop(rows: torch.Tensor) -> torch.Tensor:
        """The experts one by one; ``unbind``'s backward stacks their gradients once, where
        ``w[e]``'s would write each into a zeroed gradient of the whole stack."""
        parts = x.split(rows.tolist())
        return torch.cat([part @ weight.T for part, weight in zip(parts, w.unbind(0),
                                                                   strict=True)])

    balanced = [n // shape.experts + (e < n % shape.experts) for e in range(shape.experts)]
    counts = {"balanced": balanced, "skewed": skewed_counts(n, shape.experts)}
    steps = {}
    tolerance = 1e-4 if device.dtype == "fp32" else 2e-2
    for name, per_expert in counts.items():
        rows = torch.tensor(per_expert, device=device.torch)
        grouped = backward_step(partial(grouped_mm, x, w, rows), dy, [x, w], device)
        looped = backward_step(partial(loop, rows), dy, [x, w], device)
        if not all_close([t.float() for t in grouped()], [t.float() for t in looped()],
                         rtol=tolerance, atol=tolerance):
            raise RuntimeError(f"grouped_mm and the loop over experts disagree ({name} counts)")
        steps[f"grouped {name}"], steps[f"loop {name}"] = grouped, looped
    return alternate(steps, rounds, warmup=1, sync=device.synchronize)


# Each figure: the per-round ratios t(numerator) / t(denominator), or 1 − them (a share).
FIGURES = {"moe_vs_dense": ("moe", "dense", False),
           "experts_vs_dense": ("experts", "dense", False),
           "routing_share": ("experts", "moe", True),
           "grouped_balanced": ("loop balanced", "grouped balanced", False),
           "grouped_skewed": ("loop skewed", "grouped skewed", False)}
REPORTED = {"moe_vs_dense": "t(moe)/t(dense)", "routing_share": "1-t(experts)/t(moe)",
            "grouped_balanced": "t(loop)/t(grouped)", "grouped_skewed": "t(loop)/t(grouped)"}


def figure(times: dict[str, list[float]], numerator: str, denominator: str,
           share: bool) -> Spread:
    """The spread of the per-round ratios, or with ``share`` of 1 − each: the part of the
    denominator's time that the numerator does not account for."""
    each = ratios(times, numerator, denominator)
    return Spread.of([1 - r for r in each] if share else each)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_arguments(parser)
    parser.add_argument("--rounds", type=int, default=20)
    for field in dataclasses.fields(Shape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int,
                            help="default: the device's shape (module docstring)")
    args = parser.parse_args(argv)
    device = require_device(args.device, args.dtype, args.threads)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)}
    shape = dataclasses.replace(SHAPES[device.type],
                                **{k: v for k, v in given.items() if v is not None})
    flops = matmul_flops(shape)
    print(f"(j) mixture of experts on {device.describe()}: hidden {shape.hidden}, "
          f"{shape.experts} experts of {shape.expert_ffn} units, top-{shape.topk}, against a "
          f"dense SwiGLU MLP of {shape.topk * shape.expert_ffn}; {shape.batch} × {shape.seq} "
          f"tokens; forward + backward")
    print(f"  matmul FLOPs a step: experts {flops['experts'] / 1e9:.2f} G (the dense MLP's "
          f"alike), router {flops['router'] / 1e9:.3f} G")
    layer, per_expert = measure_layer(shape, device, args.rounds)
    grouped = measure_grouped(shape, device, args.rounds)
    times = Timings({**layer.wall, **grouped.wall}, {**layer.cpu, **grouped.cpu})
    ms = {name: 1e3 * Spread.of(t).median for name, t in times.wall.items()}
    print("  rows per expert (this batch's routing): " + ", ".join(map(str, per_expert)))
    print("  median ms: " + ", ".join(f"{name} {t:.1f}" for name, t in ms.items()))
    wall, cpu = ({name: figure(clock, *pair) for name, pair in FIGURES.items()}
                 for clock in (times.wall, times.cpu))
    print(f"  t(experts alone) / t(dense) = {wall['experts_vs_dense'].format()}")
    print("  in CPU time: " + ", ".join(f"{name} {x.median:.3f}" for name, x in cpu.items()))
    config = dict(device=device.describe(), **dataclasses.asdict(shape), ep=1, tp=1)
    extra = {"step_ms": ms, "rows_per_expert": per_expert, "matmul_flops": flops,
             "experts_over_dense": wall["experts_vs_dense"].median,
             "cpu_time": {name: x.median for name, x in cpu.items()}}
    return [report(f"j_{name}_{device.type}", metric, wall[name], "measured", None, config, extra)
            for name, metric in REPORTED.items()]


if __name__ == "__main__":
    main()
