"""Evaluation: a run's validation loss, and 1909.08053's zero-shot tasks (§5.2).

    python -m megatron_edu.evaluate --checkpoint runs/default --nproc 2 --tp 2      # validation
    python -m megatron_edu.evaluate --task wikitext103 --data wikitext-103/wiki.test.tokens \\
        --checkpoint runs/default --nproc 2 --pp 2
    python -m megatron_edu.evaluate --task lambada --data lambada_test.jsonl --hf path/to/gpt2

Without ``--task``: the mean loss over batches of the validation split of the corpus the run
trained on (or ``--data``), and its perplexity, exp(mean cross entropy per token).

``--task wikitext103``: perplexity as the paper computes it (``data/zeroshot.py``): the
detokenized test text is encoded with the model's own tokenizer and scored in overlapping
sliding windows of ``--seq-len`` tokens moving ``--stride`` at a time, each token once with as
much context as its window holds; the summed loss L over the N BPE tokens is exponentiated per
word, exp(L / (W − 1)) with W the original word-level tokens of the test file — the paper's
10.8 — and per token, exp(L / (N − 1)), beside it. A BPE splits words, so N > W: per token,
each prediction is easier (a word's later pieces are nearly certain), per word the same total
surprise is shared by fewer units — the per-word number is larger, and the only one comparable
across tokenizers.

``--task lambada``: last-word accuracy. The passage's context is fed and the last word must be
produced whole: every one of its subword tokens must be the model's greedy (argmax) choice given
the context and the word's earlier tokens — teacher forcing, which gives exactly the tokens
greedy decoding would. ``--stop-word-filter``: GPT-2's post-processing (Radford et al. 2019
§3.3): where the model's first choice is a stop word on its own (" the", " and", …), the next
choice that is not one is taken instead. (A first choice is judged a whole word from that
token alone: the model's continuation after a token it was not fed is not known.) The paper's
66.5 % is without the filter; both are reported.

Both tasks take a checkpoint of any layout (``--checkpoint``: each rank reads only its slices,
``checkpoint.load_model_chunks``) or a Hugging Face GPT-2 directory (``--hf``; its own
tokenizer through ``transformers``, offline, or the ``tokenizer.model`` an export wrote), on any
tp × pp × dp. The batches run through the pipeline engine's forward-only schedule; for LAMBADA
the last stage counts right answers instead of summing losses (the engine adds up whatever the
last stage returns), from a vocabulary-parallel argmax — the logits are never gathered. The
last line printed for a task is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.checkpoint import load_model_chunks, read_metadata
from megatron_edu.comm import CommGroup
from megatron_edu.data import Tokenizer, prepare_data, zeroshot
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.hf import read_hf_gpt2
from megatron_edu.launch import RankError, run
from megatron_edu.model import BertConfig, GPTConfig, config_from_dict
from megatron_edu.model.transformer import IGNORE_INDEX
from megatron_edu.pipeline.engine import build_chunks, run_schedule
from megatron_edu.pipeline.schedules import forward_only, one_f_one_b
from megatron_edu.tensor_parallel.cross_entropy import vocab_range

__all__ = ["evaluate", "main", "vocab_parallel_argmax", "lambada_correct", "check_left_to_right",
           "TASKS"]

TASKS = ("wikitext103", "lambada")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m megatron_edu.evaluate``."""
    p = argparse.ArgumentParser(prog="python -m megatron_edu.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", help="a run folder or a checkpoint folder")
    model.add_argument("--hf", help="a Hugging Face GPT-2 directory (with --task)")
    p.add_argument("--task", choices=TASKS, help="a zero-shot task of 1909.08053 §5.2 "
                   "(default: the validation loss of the run's corpus)")
    p.add_argument("--data", nargs="+", help="the task's test file or its folder; without "
                   "--task, the corpus (default: the one the run trained on)")
    p.add_argument("--seq-len", type=int, help="window length (default: the model's)")
    p.add_argument("--stride", type=int, default=32, help="wikitext103: tokens each window "
                   "moves on (Megatron-LM's --overlapping-eval)")
    p.add_argument("--stop-word-filter", action="store_true",
                   help="lambada: report the accuracy with GPT-2's stop-word filter")
    p.add_argument("--cache-dir", help="default ~/.cache/megatron_edu")
    p.add_argument("--batches", type=int, default=8, help="batches of the validation split")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    return p


# --- the model and its tokenizer, wherever they come from ----------------------------------------

@dataclass(frozen=True)
class Source:
    """Where the weights are: a checkpoint (meta.json's contents) or a Hugging Face directory."""

    config: GPTConfig
    checkpoint: dict[str, Any] | None = None
    hf: str | None = None

    def chunks(self, grid: ParallelGrid) -> list[nn.Module]:
        """This rank's pipeline stage, weights loaded (its slices only, from a checkpoint)."""
        chunks = build_chunks(self.config, grid, grid.layout.stages)
        if self.checkpoint is not None:
            load_model_chunks(self.checkpoint["path"], chunks, grid)
        else:
            state = read_hf_gpt2(self.hf)[1]
            for chunk in chunks:
                chunk.load_full_state_dict(state)
        for chunk in chunks:
            chunk.eval()
        return chunks


class _HFTokenizer:
    """A Hugging Face tokenizer saved with the model (``transformers``, offline), spoken to as
    this package's ``Tokenizer``: ids without special tokens, text back."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (ImportError, OSError, ValueError) as error:
            raise ValueError(f"no tokenizer in {path}: save one there (tokenizer.save_pretrained"
                             f", or the tokenizer.model of an export) — {error}") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)


def _source(args: argparse.Namespace) -> tuple[Source, Any]:
    """The model's source and its tokenizer, checked before any rank starts."""
    if args.hf is not None:
        config = read_hf_gpt2(args.hf)[0]
        own = Path(args.hf) / "tokenizer.model"          # what export-hf copies in
        tokenizer = Tokenizer.load(own) if own.exists() else _HFTokenizer(args.hf)
        return Source(config, hf=args.hf), tokenizer
    if args.checkpoint is None:
        raise ValueError("name the model: --checkpoint RUN or --hf DIR")
    meta = read_metadata(args.checkpoint)
    if meta["tokenizer"] is None:
        raise ValueError(f"checkpoint {meta['path']} holds no tokenizer")
    return Source(config_from_dict(meta["config"]), checkpoint=meta), \
        Tokenizer.load(meta["tokenizer"])


def _check_layout(args: argparse.Namespace, config: GPTConfig) -> None:
    if args.tp < 1 or args.pp < 1 or args.nproc % (args.tp * args.pp):
        raise ValueError(f"{args.nproc} ranks do not divide into tp·pp = {args.tp}·{args.pp}")
    args.dp = args.nproc // (args.tp * args.pp)
    if args.batch % (args.dp * args.micro_batch):
        raise ValueError(f"--batch {args.batch} is not divisible by dp·micro-batch = "
                         f"{args.dp}·{args.micro_batch}")
    Layout(args.tp, args.pp, args.dp).check(config)


# --- running batches through the pipeline, forward only -----------------------------------------

def _run_batches(chunks, grid: ParallelGrid, ids: np.ndarray, labels: np.ndarray,
                 args: argparse.Namespace, hidden: int) -> float:
    """Σ over all rows of what the last stage returns (summed losses, or counts), equal on
    every rank. Each step takes ``--batch`` rows (padded with unscored rows), dp replicas a
    slice each, run as microbatches of ``--micro-batch`` by the forward half of 1F1B."""
    m = args.batch // (grid.dp * args.micro_batch)
    schedule = forward_only(one_f_one_b(grid.pp, m))
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    local = args.batch // grid.dp
    for first in range(0, len(ids), args.batch):
        rows = slice(first + grid.dp_rank * local, first + (grid.dp_rank + 1) * local)
        batch_ids, batch_labels = _padded(ids[rows], local), _padded(labels[rows], local,
                                                                     IGNORE_INDEX)
        with torch.no_grad():
            result = run_schedule(schedule, chunks, grid, batch_ids.to(grid.device),
                                  batch_labels.to(grid.device), hidden,
                                  num_tokens=1)   # the last stage's sums, undivided
        total += result.loss.double()
    return comm.all_reduce(total, grid.dp_group, "dp sum").item()


def _padded(rows: np.ndarray, n: int, fill: int = 0) -> torch.Tensor:
    out = np.full((n, rows.shape[1] if rows.ndim == 2 else 1), fill, dtype=np.int64)
    out[: len(rows)] = rows
    return torch.from_numpy(out)


# --- WikiText-103 -------------------------------------------------------------------------------

def _wikitext_inputs(args, tokenizer, config: GPTConfig) -> dict[str, Any]:
    raw = zeroshot.read_wikitext(args.data[0])
    tokens = np.asarray(tokenizer.encode(zeroshot.wikitext_detokenize(raw)), dtype=np.int64)
    length = args.seq_len or config.seq_len
    windows = zeroshot.sliding_windows(len(tokens), length, min(args.stride, length))
    ids, labels = zeroshot.window_batch(tokens, windows, length)
    return {"ids": ids, "labels": labels, "tokens": len(tokens),
            "words": zeroshot.count_words(raw), "window": length, "stride": args.stride}


def wikitext_result(loss_sum: float, tokens: int, words: int) -> dict[str, Any]:
    """Megatron-LM's normalisation: the first token is never predicted, hence the − 1s."""
    return {"task": "wikitext103", "word_perplexity": math.exp(loss_sum / (words - 1)),
            "token_perplexity": math.exp(loss_sum / (tokens - 1)), "tokens": tokens,
            "words": words, "loss_sum": loss_sum}


# --- LAMBADA ------------------------------------------------------------------------------------

def _lambada_inputs(args, tokenizer, config: GPTConfig) -> dict[str, Any]:
    passages = zeroshot.read_lambada(args.data[0])
    limit = args.seq_len or config.seq_len
    examples = [zeroshot.lambada_example(text, tokenizer.encode) for text in passages]
    if any(not context or len(word) >= limit for context, word in examples):
        raise ValueError(f"a LAMBADA passage has no context before its last word, or a last "
                         f"word of {limit} tokens or more: is {args.data[0]} LAMBADA?")
    length = min(limit, max(len(c) + len(w) - 1 for c, w in examples))
    ids = np.zeros((len(examples), length), dtype=np.int64)
    labels = np.full((len(examples), length), IGNORE_INDEX, dtype=np.int64)
    for row, (context, word) in enumerate(examples):
        tokens = (context + word)[-length - 1:]              # the word, and the context it fits
        n = len(tokens) - 1
        ids[row, :n] = tokens[:-1]
        labels[row, n - len(word) : n] = word                # the last word's tokens
    return {"ids": ids, "labels": labels, "n": len(passages),
            "stop_tokens": _stop_tokens(tokenizer, config.vocab_size)}


def _stop_tokens(tokenizer, vocab_size: int) -> np.ndarray:
    """[V] bool: tokens that are a stop word on their own, starting a word (" the")."""
    stop = np.zeros(vocab_size, dtype=bool)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        text = tokenizer.decode([i])
        stop[i] = text[:1].isspace() and text.strip().lower() in zeroshot.STOP_WORDS
    return stop


def vocab_parallel_argmax(logits: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The global argmax of logits split by vocabulary [.., V/t] over the group: each rank's
    best (value, id), all-gathered, the best of those — t numbers per position, never the
    logits (ties go to the lowest id, as ``torch.argmax`` on the whole row)."""
    value, index = logits.max(dim=-1)                                  # [..] each
    start, _ = vocab_range(logits.shape[-1], group)
    values = comm.all_gather(value.unsqueeze(-1), group, label="argmax values")   # [.., t]
    ids = comm.all_gather((index + start).unsqueeze(-1), group, label="argmax ids")
    return ids.gather(-1, values.argmax(-1, keepdim=True)).squeeze(-1)


def lambada_correct(predicted: torch.Tensor, filtered: torch.Tensor, labels: torch.Tensor,
                    is_stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example [b]: is the last word right — every target token the argmax (``predicted``)
    — and is it right with the stop-word filter: at the word's first token, a stop-word argmax
    gives way to the best non-stop-word token (``filtered``)."""
    targets = labels != IGNORE_INDEX                                  # [b, s]
    first = targets & (targets.cumsum(1) == 1)                        # each word's first token
    hit = (predicted == labels) | ~targets
    instead = is_stop[predicted] & (filtered == labels)               # the filter's second try
    hit_filtered = hit | (first & instead)
    has_word = targets.any(1)
    return hit.all(1) & has_word, hit_filtered.all(1) & has_word


class _CountCorrect(nn.Module):
    """The last stage, counting right answers instead of summing losses: returns the number of
    examples right without the filter (the engine sums it over microbatches) and keeps the
    number right with it in ``filtered``."""

    def __init__(self, chunk: nn.Module, is_stop: torch.Tensor) -> None:
        super().__init__()
        self.chunk, self.is_stop = chunk, is_stop
        self.filtered = 0.0

    def forward(self, x, labels=None, **kwargs) -> torch.Tensor:
        kwargs.pop("loss_reduction", None)
        logits = self.chunk(x, **kwargs)                              # [b, s, V/t]
        group = self.chunk.tp_group
        predicted = vocab_parallel_argmax(logits, group)
        start, end = vocab_range(logits.shape[-1], group)
        stop = torch.zeros(end - start, dtype=torch.bool, device=logits.device)
        stop[: max(0, min(end, len(self.is_stop)) - start)] = self.is_stop[start:end]
        filtered = vocab_parallel_argmax(logits.masked_fill(stop, float("-inf")), group)
        right, right_filtered = lambada_correct(predicted, filtered, labels, self.is_stop)
        self.filtered += float(right_filtered.sum())
        return right.sum().float()


def lambada_result(correct: float, correct_filtered: float, n: int,
                   stop_word_filter: bool) -> dict[str, Any]:
    """LAMBADA's result record from the counts of correct predictions over ``n`` samples."""
    plain, filtered = correct / n, correct_filtered / n
    return {"task": "lambada", "accuracy": filtered if stop_word_filter else plain, "n": n,
            "stop_word_filter": stop_word_filter, "accuracy_without_filter": plain,
            "accuracy_with_filter": filtered}


# --- on every rank ------------------------------------------------------------------------------

def evaluate(args: argparse.Namespace, source: Source, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run on every rank: the task's result (equal on all ranks)."""
    grid = ParallelGrid(tp=args.tp, pp=args.pp, dp=args.dp)
    chunks = source.chunks(grid)
    if args.task == "wikitext103":
        total = _run_batches(chunks, grid, inputs["ids"], inputs["labels"], args,
                             source.config.hidden)
        return wikitext_result(total, inputs["tokens"], inputs["words"])
    is_stop = torch.from_numpy(inputs["stop_tokens"]).to(grid.device)
    if chunks[-1].last:
        chunks[-1] = _CountCorrect(chunks[-1], is_stop)
    correct = _run_batches(chunks, grid, inputs["ids"], inputs["labels"], args,
                           source.config.hidden)
    filtered = getattr(chunks[-1], "filtered", 0.0)                   # on the last stage only
    filtered = torch.tensor(filtered, dtype=torch.float64, device=grid.device)
    filtered = comm.all_reduce(comm.all_reduce(filtered, grid.pp_group, "pp count"),
                               grid.dp_group, "dp count").item()
    return lambada_result(correct, filtered, inputs["n"], args.stop_word_filter)


def validation_loss(args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, float]:
    """Run on every rank: the mean validation loss and its perplexity (equal on all ranks)."""
    grid = ParallelGrid(tp=args.tp, pp=args.pp, dp=args.dp)
    config = config_from_dict(meta["config"])
    chunks = build_chunks(config, grid, grid.layout.stages)
    load_model_chunks(meta["path"], chunks, grid)
    for chunk in chunks:
        chunk.eval()
    source = args.data or meta["state"].get("data", ["default"])
    _, _, val = _validation_data(source, config, args.cache_dir, meta)
    m = args.batch // (grid.dp * args.micro_batch)
    schedule = forward_only(one_f_one_b(grid.pp, m))
    losses = []
    with torch.no_grad():
        for i in range(args.batches):
            ids, labels = val.fixed_batch(i, args.batch, grid.dp_rank, grid.dp)
            result = run_schedule(schedule, chunks, grid, ids.to(grid.device),
                                  labels.to(grid.device), config.hidden)
            losses.append(comm.all_reduce(result.loss, grid.dp_group, "dp loss") / grid.dp)
    loss = torch.stack(losses).mean().item()
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": args.batches * args.batch
            * config.seq_len, "step": meta["step"]}


def _validation_data(source, config: GPTConfig, cache_dir, meta):
    source = source[0] if source[0] in ("default", "wikitext103") else source
    if isinstance(config, BertConfig):
        from megatron_edu.data.bert import prepare_bert_data
        return prepare_bert_data(source, config.vocab_size, config.seq_len, cache_dir,
                                 seed=config.seed, tokenizer_path=meta["tokenizer"])
    return prepare_data(source, config.vocab_size, config.seq_len, cache_dir,
                        tokenizer_path=meta["tokenizer"])


# --- the command line ---------------------------------------------------------------------------

def _prepare_task(args: argparse.Namespace) -> tuple[Source, dict[str, Any]]:
    """Everything before any rank starts: the model, the layout, the data."""
    if not args.data:
        what = zeroshot.WIKITEXT103 if args.task == "wikitext103" else zeroshot.LAMBADA
        raise FileNotFoundError(f"--task {args.task} needs --data: {what.where}")
    source, tokenizer = _source(args)
    check_left_to_right(source.config, args.task)
    _check_layout(args, source.config)
    if args.seq_len is not None and not 2 <= args.seq_len <= source.config.seq_len:
        raise ValueError(f"--seq-len {args.seq_len} must be in 2 … the model's "
                         f"{source.config.seq_len}")
    prepare = _wikitext_inputs if args.task == "wikitext103" else _lambada_inputs
    return source, prepare(args, tokenizer, source.config)


def check_left_to_right(config: GPTConfig, task: str) -> None:
    """Raise unless ``config`` is a left-to-right (causal) language model, as ``task`` needs."""
    if isinstance(config, BertConfig) or not config.causal:
        raise ValueError(f"--task {task} scores a left-to-right language model; this "
                         f"checkpoint holds a {type(config).__name__}")


def _prepare_validation(args: argparse.Namespace) -> dict[str, Any]:
    if args.checkpoint is None:
        raise ValueError("name a run: --checkpoint RUN (--hf needs a --task)")
    if args.batches < 1:
        raise ValueError("--batches must be at least 1")
    meta = read_metadata(args.checkpoint)
    _check_layout(args, config_from_dict(meta["config"]))
    if meta["tokenizer"] is None:
        raise ValueError(f"checkpoint {meta['path']} holds no tokenizer")
    return meta


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_edu.evaluate: evaluate a checkpoint or a Hugging Face GPT-2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.task is None:
            meta = _prepare_validation(args)
        else:
            source, inputs = _prepare_task(args)
    except (ValueError, FileNotFoundError) as err:  # CheckpointError is a ValueError too
        parser.error(str(err))
    try:
        if args.task is None:
            result = run(validation_loss, args.nproc, args, meta)[0]
        else:
            result = run(evaluate, args.nproc, args, source, inputs)[0]
    except RankError as err:
        print(f"error: evaluation failed on {err}", file=sys.stderr)
        return 1
    if args.task is None:
        print(f"step {result['step']}: validation loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f} over {result['tokens']:,} tokens")
    else:
        print(_summary(result))
        print(json.dumps(result))
    return 0


def _summary(r: dict[str, Any]) -> str:
    if r["task"] == "wikitext103":
        return (f"WikiText-103: perplexity {r['word_perplexity']:.2f} per word "
                f"({r['words']:,} words), {r['token_perplexity']:.2f} per token "
                f"({r['tokens']:,} tokens)")
    return (f"LAMBADA: accuracy {r['accuracy_without_filter']:.2%} without the stop-word filter, "
            f"{r['accuracy_with_filter']:.2%} with it, over {r['n']:,} passages")


if __name__ == "__main__":
    sys.exit(main())
