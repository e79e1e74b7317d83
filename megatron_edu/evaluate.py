"""Validation loss and perplexity of a checkpoint: ``python -m megatron_edu.evaluate``.

    python -m megatron_edu.evaluate --checkpoint runs/default --nproc 2 --tp 2

Perplexity is exp(mean cross entropy per token), the measure of 1909.08053 §5.1 (WikiText-103).
Each rank reads only its slices of the checkpoint, for any layout
(``checkpoint.load_model_chunks``); the text is the validation split of the corpus the run
trained on (or ``--data``), tokenized with the checkpoint's own tokenizer. Forward passes only:
the pipeline runs the forward half of its 1F1B schedule (``schedules.forward_only``), each
data-parallel replica its slice of each batch.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch

from megatron_edu import comm
from megatron_edu.checkpoint import load_model_chunks, read_metadata
from megatron_edu.data import prepare_data
from megatron_edu.grid import ParallelGrid, validate_layout
from megatron_edu.launch import RankError, run
from megatron_edu.model import GPTConfig
from megatron_edu.pipeline.engine import build_chunks, run_schedule
from megatron_edu.pipeline.schedules import forward_only, one_f_one_b

__all__ = ["evaluate", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_edu.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a run folder or a checkpoint folder")
    p.add_argument("--data", nargs="+", help="default: the corpus the run trained on")
    p.add_argument("--cache-dir", help="default ~/.cache/megatron_edu")
    p.add_argument("--batches", type=int, default=8, help="batches of the validation split")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    return p


def _check(args: argparse.Namespace) -> dict[str, Any]:
    """Everything before any rank starts: layout, batch, checkpoint."""
    if args.tp < 1 or args.pp < 1 or args.nproc % (args.tp * args.pp):
        raise ValueError(f"{args.nproc} ranks do not divide into tp·pp = {args.tp}·{args.pp}")
    args.dp = args.nproc // (args.tp * args.pp)
    validate_layout(args.tp, args.pp, args.dp, args.nproc)
    if args.batch % (args.dp * args.micro_batch):
        raise ValueError(f"--batch {args.batch} is not divisible by dp·micro-batch = "
                         f"{args.dp}·{args.micro_batch}")
    if args.batches < 1:
        raise ValueError("--batches must be at least 1")
    meta = read_metadata(args.checkpoint)
    GPTConfig(**meta["config"]).validate(args.tp, args.pp)
    if meta["tokenizer"] is None:
        raise ValueError(f"checkpoint {meta['path']} holds no tokenizer")
    return meta


def evaluate(args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, float]:
    """Run on every rank: the mean validation loss and its perplexity (equal on all ranks)."""
    grid = ParallelGrid(args.tp, args.pp, args.dp)
    config = GPTConfig(**meta["config"])
    chunks = build_chunks(config, grid)
    load_model_chunks(meta["path"], chunks, grid)
    for chunk in chunks:
        chunk.eval()
    source = args.data or meta["state"].get("data", ["default"])
    _, _, val = prepare_data(source[0] if source[0] in ("default", "wikitext103") else source,
                             config.vocab_size, config.seq_len, args.cache_dir,
                             tokenizer_path=meta["tokenizer"])
    m = args.batch // (grid.dp * args.micro_batch)
    schedule = forward_only(one_f_one_b(grid.pp, m))
    losses = []
    with torch.no_grad():
        for i in range(args.batches):
            ids, labels = val.fixed_batch(i, args.batch, grid.dp_rank, grid.dp)
            result = run_schedule(schedule, chunks, grid, ids.to(grid.device),
                                  labels.to(grid.device), m, config.hidden)
            losses.append(comm.all_reduce(result.loss, grid.dp_group, "dp loss") / grid.dp)
    loss = torch.stack(losses).mean().item()
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": args.batches * args.batch
            * config.seq_len, "step": meta["step"]}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        meta = _check(args)
    except ValueError as err:  # CheckpointError is a ValueError too
        parser.error(str(err))
    try:
        result = run(evaluate, args.nproc, args, meta)[0]
    except RankError as err:
        print(f"error: evaluation failed on {err}", file=sys.stderr)
        return 1
    print(f"step {result['step']}: validation loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.2f} over {result['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
