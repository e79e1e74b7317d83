"""(g) Operator fusion (2104.04473 §4.2): megatron-edu's GPT with ``fused=True`` and the fused
attention core against the same model unfused, the same weights and batch, training steps
alternated.

Fused: the attention core as ``F.scaled_dot_product_attention`` (``model.attention.FusedCore``:
scale + mask + softmax + the product with V in one kernel), bias + GeLU and bias + dropout +
residual add each compiled into one kernel by ``torch.compile`` (compiled in the warm-up, not
timed). Reported:
    speed-up = t(unfused) / t(fused),     no target: measured, on this machine.
(Dropout 0: the fused core's dropout is the device's, not the package's masks, and the two
models would not compute the same thing.)

    python -m bench.fused                               # CPU, fp32: 6 layers, hidden 384
    python -m bench.fused --device cuda --dtype bf16    # one GPU: GPT-2 medium's shape
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.common import Spread, alternate, device_arguments, ratios, report, require_device
from bench.overhead import BATCH, model_config, random_batch, training_step
from megatron_edu.model import GPT


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_arguments(parser)
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    device = require_device(args.device, args.dtype, args.threads)
    config = model_config(device, dropout=0.0)
    batch = BATCH[device.type]
    ids, labels = random_batch(config, batch, device)
    unfused = GPT(config).to(device.torch)
    fused = GPT(dataclasses.replace(config, fused=True, attention="fused")).to(device.torch)
    with torch.no_grad(), device.autocast():
        a, b = unfused(ids, labels).float(), fused(ids, labels).float()
    print(f"(g) fused vs unfused on {device.describe()}: {config.num_layers} layers, hidden "
          f"{config.hidden}, seq {config.seq_len}, batch {batch}; loss {a.item():.5f} vs "
          f"{b.item():.5f} (compiling the fused chains in the warm-up)")
    times = alternate({"fused": training_step(fused, device, ids, labels),
                       "unfused": training_step(unfused, device, ids, labels)},
                      args.rounds, warmup=2, sync=device.synchronize)
    speedup = Spread.of(ratios(times.wall, "unfused", "fused"))
    step_s = {name: Spread.of(t).median for name, t in times.wall.items()}
    return report(
        f"g_fused_{device.type}", "speedup_unfused_over_fused", speedup, "measured", None,
        config=dict(device=device.describe(), batch=batch, layers=config.num_layers,
                    hidden=config.hidden, heads=config.num_heads, seq=config.seq_len),
        extra={"step_s": step_s, "loss": {"unfused": a.item(), "fused": b.item()}},
    )


if __name__ == "__main__":
    main()
