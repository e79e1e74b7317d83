"""1909.08053 §5.3 (Figure 7), tried small: a deep, thin BERT trained with the original
layer-norm placement (post-LN, Figure 7a) against the rearranged one (pre-LN, Figure 7b), at the
same learning rate, on the package's default corpus.

    python -m megatron_edu.course.ln_placement --save      # → data/ln_placement_curves.json
    python -m megatron_edu.course.ln_placement --steps 40  # a shorter look, printed only

The paper's observation (Figure 7): the original BERT trains well at 336M parameters but not at
752M; rearranged, both train stably and the larger one reaches the lower loss. The mechanism
proposed for it is depth and a learning rate that the post-LN arrangement cannot take: in
post-LN every residual path runs through a layer norm, so the gradient reaching the early layers
is the product of l layer norms' Jacobians, and Adam's first steps at full learning rate (no
warm-up) move a deep post-LN stack into a state it does not recover from (Xiong et al. 2020,
arXiv 2002.04745, analyse it); pre-LN keeps an untouched identity path from the loss to every
layer.

**At this scale it does not show.** ``SETTINGS`` (24 layers, h = 64, lr 1e-2, no warm-up, 200
steps, ~4 CPU minutes per curve) are those the shipped curves were trained with: both placements
end within ~0.05 of each other. So did every other setting tried: lr 1e-3 to 1e-1, init_std
0.02 to 0.2, 40 to 200 steps, and output projections drawn unscaled (Xavier-like, std 0.125).
Five times longer (``--steps 1000``), where the models reach the words' frequency level (≈ 5.8),
the original placement was as good or better: last-200-step means 5.63 vs 5.79 at lr 1e-3,
5.85 vs 5.87 at 4e-3, 5.81 vs 5.81 at 1.5e-2 (notebook 11 has the table).
Narrow layers whose residual branches start small (0.02/√(2l), as in Megatron-LM) leave
LN(x + f(x)) ≈ LN(x); the paper's gap appears between a 336M and a 752M model over a long
run. ``train_curve`` runs one (serial, one process: tensor parallelism does not change the
numbers, notebook 11 checks it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from megatron_edu.data.bert import prepare_bert_data
from megatron_edu.model import BERT, BertConfig
from megatron_edu.optim import build_param_groups

__all__ = ["SETTINGS", "train_curve", "load_curves"]

CURVES = Path(__file__).parents[1] / "data" / "ln_placement_curves.json"

# The model and the run: 24 thin layers, a high learning rate without warm-up, no clipping.
SETTINGS: dict[str, Any] = dict(num_layers=24, hidden=64, num_heads=4, seq_len=64,
                                vocab_size=4096, batch=16, lr=1e-2, warmup=0, clip=0.0,
                                init_std=0.02, steps=200, seed=0)


def train_curve(ln_placement: str, steps: int | None = None, log_every: int = 1,
                cache_dir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """Train one BERT of ``SETTINGS`` (with ``overrides``) for ``steps`` steps, serially:
    {"ln_placement", "steps", "loss" (one per step, the training batch's), "settings"}.
    AdamW (β = 0.9, 0.999, weight decay 0.01), a constant learning rate after the warm-up,
    dropout off; the same data and initial weights for either placement. ``cache_dir``: the
    data's (default ~/.cache/megatron_edu)."""
    s = {**SETTINGS, **overrides, "steps": steps or SETTINGS["steps"]}
    config = BertConfig(vocab_size=s["vocab_size"], seq_len=s["seq_len"],
                        num_layers=s["num_layers"], hidden=s["hidden"],
                        num_heads=s["num_heads"], dropout=0.0, seed=s["seed"],
                        init_std=s["init_std"],
                        ln_placement=ln_placement)
    _, train, _ = prepare_bert_data("default", s["vocab_size"], s["seq_len"], cache_dir,
                                    seed=s["seed"])
    model = BERT(config)
    optimizer = torch.optim.AdamW(build_param_groups(model, 0.01), lr=s["lr"],
                                  betas=(0.9, 0.999))
    losses = []
    model.train()
    for step in range(s["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = s["lr"] * min(1.0, (step + 1) / s["warmup"]) if s["warmup"] else s["lr"]
        first = step * s["batch"]
        ids, labels = train.batch([(first + j) % len(train) for j in range(s["batch"])])
        loss = model(ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if s["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        optimizer.step()
        value = loss.item()
        losses.append(round(value, 4) if math.isfinite(value) else None)
    return {"ln_placement": ln_placement, "steps": s["steps"], "loss": losses[::log_every],
            "settings": s}


def load_curves(path: str | Path = CURVES) -> dict[str, Any]:
    """The shipped curves: {"settings", "curves": {placement: [loss per step]}}."""
    return json.loads(Path(path).read_text())


def smooth(losses: list[float | None], window: int = 20) -> list[float]:
    """A trailing mean over ``window`` steps (None, a non-finite loss, stays out)."""
    out = []
    for i in range(len(losses)):
        part = [v for v in losses[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_edu.course.ln_placement``: train both placements, print (or save)."""
    p = argparse.ArgumentParser(prog="python -m megatron_edu.course.ln_placement",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=SETTINGS["steps"])
    p.add_argument("--lr", type=float, default=SETTINGS["lr"])
    p.add_argument("--warmup", type=int, default=SETTINGS["warmup"])
    p.add_argument("--layers", type=int, default=SETTINGS["num_layers"])
    p.add_argument("--hidden", type=int, default=SETTINGS["hidden"])
    p.add_argument("--clip", type=float, default=SETTINGS["clip"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the curves here (default: print only, unless the "
                   "settings are the shipped ones' and --save is given)")
    p.add_argument("--save", action="store_true", help=f"write {CURVES.name} in the package")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = dict(lr=args.lr, warmup=args.warmup, num_layers=args.layers,
                     hidden=args.hidden, clip=args.clip)
    curves, settings = {}, None
    for placement in ("original", "rearranged"):
        start = time.perf_counter()
        result = train_curve(placement, args.steps, **overrides)
        curves[placement], settings = result["loss"], result["settings"]
        tail = [v for v in result["loss"][-20:] if v is not None]
        print(f"{placement:>10}: first {result['loss'][0]}, min "
              f"{min(v for v in result['loss'] if v is not None):.3f}, mean of last 20 "
              f"{sum(tail) / max(1, len(tail)):.3f} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    out = Path(args.out) if args.out else CURVES if args.save else None
    if out is not None:
        out.write_text(json.dumps({"settings": settings, "curves": curves}) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
