"""(a) megatron-edu's GPT at tp = pp = dp = 1 against a plain PyTorch GPT of the same math.

Both models hold the same weights (copied in by name), see the same batch and take an AdamW
step; the benchmark alternates their training steps and reports the overhead of megatron-edu's,
    overhead = t(megatron-edu) / t(plain) − 1,     target ≤ 3 %.
At size 1 every parallel layer should *be* the plain layer (docs/principles.md, 1), so what is left
is the price of the abstractions: the no-op f/g calls, the layout-independent dropout masks
(hashed, where the plain GPT calls ``F.dropout``; ``--dropout 0`` leaves them out), the
vocabulary-parallel cross entropy at one rank. Like with like: ``--attention explicit`` (the CPU's
default) holds the unfused model against the plain GPT with the same explicit attention core;
``--attention sdpa`` (a GPU's default) holds ``fused=True`` against the plain GPT's
``scaled_dot_product_attention`` — a GPU would otherwise time attention kernels, not overhead.

    python -m bench.overhead                              # CPU, fp32: 6 layers, hidden 384
    python -m bench.overhead --device cuda --dtype bf16   # one GPU: a 350M GPT-2 medium shape
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from bench import nanogpt
from bench.common import (
    Device,
    Spread,
    alternate,
    device_arguments,
    ratios,
    report,
    require_device,
)
from megatron_edu.model import GPT, GPTConfig

# On a CPU the plain PyTorch GPT first timed as the development machine's baseline (2 cores:
# ~1,580 tokens/s at batch 8 on 2 threads, ~85 % of its matmul rate); on a GPU, GPT-2 medium
# (354M) with a padded vocabulary.
CPU_MODEL = dict(vocab_size=8192, seq_len=256, num_layers=6, hidden=384, num_heads=6)
GPU_MODEL = dict(vocab_size=50304, seq_len=1024, num_layers=24, hidden=1024, num_heads=16)
BATCH = {"cpu": 2, "cuda": 8}  # short steps, many rounds: each pair sees the same machine
TARGET_PERCENT = 3.0


def model_config(device: Device, **overrides) -> GPTConfig:
    sizes = CPU_MODEL if device.type == "cpu" else GPU_MODEL
    return GPTConfig(**{**sizes, "dropout": 0.1, **overrides})


def random_batch(config: GPTConfig, batch: int, device: Device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device.torch), tokens[:, 1:].to(device.torch)


def training_step(model: nn.Module, device: Device, ids: torch.Tensor,
                  labels: torch.Tensor) -> Callable[[], None]:
    """One forward, backward and AdamW step of ``model`` on (ids, labels), as a callable."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step() -> None:
        with device.autocast():
            loss = model(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def twin_models(config: GPTConfig, device: Device) -> tuple[GPT, nanogpt.GPT]:
    """megatron-edu's GPT and the plain one, with the same weights and the same kind of
    attention core (fused: SDPA on both sides; unfused: the explicit core), on ``device``."""
    ours = GPT(config)
    plain = nanogpt.GPT(config, explicit_attention=not config.fused)
    plain.load_state_dict(ours.full_state_dict())
    return ours.to(device.torch), plain.to(device.torch)


@torch.no_grad()
def check_same_math(ours: nn.Module, plain: nn.Module, ids, labels, device: Device) -> float:
    """Both models' loss on one batch, dropout off: they must agree (else nothing is compared)."""
    ours.eval(), plain.eval()
    with device.autocast():
        a, b = ours(ids, labels).float(), plain(ids, labels).float()
    ours.train(), plain.train()
    tolerance = 1e-5 if device.dtype == "fp32" else 2e-2
    if not torch.allclose(a, b, rtol=tolerance):
        raise RuntimeError(f"the two models disagree: loss {a.item()} vs {b.item()}")
    return a.item()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_arguments(parser)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--attention", choices=("explicit", "sdpa"),
                        help="the attention core on both sides (default: explicit on a CPU, "
                        "sdpa — megatron-edu's fused=True — on a GPU)")
    parser.add_argument("--dropout", type=float, default=0.1, help="on both sides (default 0.1)")
    args = parser.parse_args(argv)
    device = require_device(args.device, args.dtype, args.threads)
    attention = args.attention or ("explicit" if device.type == "cpu" else "sdpa")
    config = model_config(device, fused=attention == "sdpa", dropout=args.dropout)
    batch = BATCH[device.type]
    ids, labels = random_batch(config, batch, device)
    ours, plain = twin_models(config, device)
    loss = check_same_math(ours, plain, ids, labels, device)
    print(f"(a) overhead at tp=pp=dp=1 on {device.describe()}: {config.num_layers} layers, "
          f"hidden {config.hidden}, seq {config.seq_len}, batch {batch}, {attention} attention "
          f"on both sides; same loss {loss:.4f}")
    times = alternate({"megatron-edu": training_step(ours, device, ids, labels),
                       "plain": training_step(plain, device, ids, labels)},
                      args.rounds, warmup=1, sync=device.synchronize)
    overhead = Spread.of([100 * (r - 1) for r in ratios(times.wall, "megatron-edu", "plain")])
    cpu_overhead = Spread.of([100 * (r - 1) for r in ratios(times.cpu, "megatron-edu", "plain")])
    print(f"  in CPU time: {cpu_overhead.format('.2f')} %")
    step_s = {name: Spread.of(t).median for name, t in times.wall.items()}
    tokens = batch * config.seq_len
    return report(
        f"a_overhead_{device.type}", "overhead_percent", overhead, f"<= {TARGET_PERCENT:g} %",
        overhead.median <= TARGET_PERCENT,
        config=dict(device=device.describe(), batch=batch, layers=config.num_layers,
                    hidden=config.hidden, heads=config.num_heads, seq=config.seq_len,
                    vocab=config.vocab_size, dropout=config.dropout, attention=attention),
        extra={"cpu_time_overhead_percent": cpu_overhead.median, "step_s": step_s,
               "tokens_per_s": {name: tokens / s for name, s in step_s.items()}},
    )


if __name__ == "__main__":
    main()
