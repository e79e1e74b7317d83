"""Evaluation: a run's validation loss, and 1909.08053's zero-shot tasks (§5.2).

    python -m megatron_edu.evaluate --checkpoint runs/default --nproc 2 --tp 2      # validation
    python -m megatron_edu.evaluate --task wikitext103 --data wikitext-103/wiki.test.tokens \\
        --checkpoint runs/default --nproc 2 --pp 2
    python -m megatron_edu.evaluate --task lambada --data lambada_test.jsonl --hf path/to/gpt2

Without ``--task``: the mean loss over batches of the validation split of the corpus the run
trained on (or ``--data``), and its perplexity, exp(mean cross entropy per token).

``--task wikitext103``: perplexity as Megatron-LM computes it (``data/zeroshot.py``): the
detokenized test text is encoded with the model's own tokenizer and scored in overlapping
sliding windows of ``--seq-len`` tokens, window k starting at k · ``--stride`` (the last one
padded), the first scoring all its targets, each later one only its last ``--stride`` — every
token once. The summed loss L over the N BPE tokens is exponentiated per word and per token:

* ``word_perplexity`` = exp(L / (W − 1)), W the original word-level tokens of the test file:
  Megatron-LM's code (``tasks/zeroshot_gpt/evaluate.py``, its "adjusted ppl");
* ``word_perplexity_paper`` = exp(L / W): 1909.08053's text, which normalises by the number of
  original tokens — word_perplexity ^ ((W − 1) / W): on WikiText-103's quarter of a million
  test words the two differ by about 1e-5 relative (both are the paper's 10.8 to its
  precision), on a tiny file by much more;
* ``token_perplexity`` = exp(L / (N − 1)), Megatron-LM's "ppl".

A BPE splits words, so N > W: per token, each prediction is easier (a word's later pieces are
nearly certain), per word the same total surprise is shared by fewer units — the per-word
number is larger, and the only one comparable across tokenizers.

``--task lambada``: last-word accuracy. The passage's context is fed and the last word must be
produced whole: every one of its subword tokens must be the model's greedy (argmax) choice given
the context and the word's earlier tokens — teacher forcing, which gives exactly the tokens
greedy decoding would. ``accuracy_without_filter`` is Megatron-LM's ``--strict-lambada`` (no
filter): 1909.08053's 66.5 %. ``accuracy_with_filter`` applies GPT-2's stop-word filter
(Radford et al. 2019 §3.3: 52.66 % without, 63.24 % with it, the number of their Table 3):
stop words are removed from the candidates for the word's first token — there the choice is the
best token that is not a stop word on its own (" the", " and", …), whatever the target, so a
stop-word target never counts, and neither does a word whose first token is a stop word's
(" a" + "lready" in a small vocabulary). A token is judged from its text alone: the model's
continuation after a token it was not fed is not known. ``--stop-word-filter`` makes
``accuracy`` the filtered one; both are always reported.

Both tasks take a checkpoint of any layout (``--checkpoint``: each rank reads only its slices,
``checkpoint.load_model_chunks``) or a Hugging Face GPT-2 or Llama directory (``--hf``; the
``tokenizer.model`` an export wrote, else its own ``tokenizer.json``), on any
tp × pp × dp. The batches run through the pipeline engine's forward-only schedule; for LAMBADA
the last stage counts right answers instead of summing losses (the engine adds up whatever the
last stage returns), from a vocabulary-parallel argmax — the logits are never gathered. The
last line printed for a task is one JSON object (``task``; for wikitext103 the three
perplexities, ``tokens``, ``words``, ``loss_sum``; for lambada ``accuracy``, ``n`` and both
accuracies).

Refused before any rank starts, in one line naming the argument (exit status 2): a number out
of its range, an option the chosen evaluation would not use, a layout the model does not split
into, a BERT for a task, a test file that is empty or not the task's. On the ranks, logits that
are not finite (a NaN or an infinity at a scored position) end the evaluation with where they
were, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.checkpoint import load_model_chunks, read_metadata
from megatron_edu.cli import DTYPES, Parser, at_least, autocast, positive_int
from megatron_edu.comm import CommGroup
from megatron_edu.data import prepare_data, zeroshot
from megatron_edu.generate import NonFiniteLogits
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import RankError, run
from megatron_edu.model import BertConfig, GPTConfig, config_from_dict
from megatron_edu.model.transformer import IGNORE_INDEX
from megatron_edu.pipeline.engine import Batch, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import forward_only, one_f_one_b
from megatron_edu.ptdp import Parallelism
from megatron_edu.sources import Source, checkpoint_source, hf_source
from megatron_edu.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_range

__all__ = ["evaluate", "main", "vocab_parallel_argmax", "lambada_correct"]

TASKS = ("wikitext103", "lambada")


def build_parser() -> Parser:
    """The command line of ``python -m megatron_edu.evaluate``."""
    p = Parser(prog="python -m megatron_edu.evaluate", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", help="a run folder or a checkpoint folder")
    model.add_argument("--hf", help="a Hugging Face GPT-2 or Llama directory (with --task)")
    p.add_argument("--task", choices=TASKS, help="a zero-shot task of 1909.08053 §5.2 "
                   "(default: the validation loss of the run's corpus)")
    p.add_argument("--data", nargs="+", help="the task's test file or its folder; without "
                   "--task, the corpus (default: the one the run trained on)")
    p.add_argument("--seq-len", type=at_least(2), help="with --task: the window length "
                   "(default: the model's)")
    p.add_argument("--stride", type=positive_int, help="wikitext103: tokens each window "
                   f"moves on (Megatron-LM's --overlapping-eval; default {STRIDE}, or the "
                   "window if shorter)")
    p.add_argument("--stop-word-filter", action="store_true", help="lambada: the accuracy "
                   "key is the one with GPT-2's stop-word filter (both are reported)")
    p.add_argument("--cache-dir", help="default ~/.cache/megatron_edu")
    p.add_argument("--batches", type=positive_int, help="without --task: batches of the "
                   f"validation split (default {BATCHES})")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences per batch")
    p.add_argument("--micro-batch", type=positive_int, default=2)
    p.add_argument("--nproc", type=positive_int, default=1)
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="as train's: auto is bf16 "
                   "autocast on GPUs, fp32 on CPUs")
    return p


STRIDE, BATCHES = 32, 8


def _check_applicable(args: argparse.Namespace) -> None:
    """Refuse an option the chosen evaluation would ignore."""
    only = {"--seq-len": (args.seq_len, args.task is not None, "needs a --task"),
            "--stride": (args.stride, args.task == "wikitext103", "applies to --task "
                         "wikitext103"),
            "--stop-word-filter": (args.stop_word_filter or None, args.task == "lambada",
                                   "applies to --task lambada"),
            "--batches": (args.batches, args.task is None, "applies to the validation loss "
                          "(without --task)")}
    for name, (value, applies, where) in only.items():
        if value is not None and not applies:
            raise ValueError(f"{name} {where}")
    if args.task is not None and args.data is not None and len(args.data) > 1:
        raise ValueError(f"--task {args.task} reads one --data file or folder, got "
                         f"{len(args.data)}: {' '.join(args.data)}")


# --- the model and its tokenizer, wherever they come from ----------------------------------------

def _source(args: argparse.Namespace) -> tuple[Source, Any]:
    """The model's source and its tokenizer, checked before any rank starts."""
    if args.hf is not None:
        return hf_source(args.hf)
    if args.checkpoint is None:
        raise ValueError("name the model: --checkpoint RUN or --hf DIR")
    config = config_from_dict(read_metadata(args.checkpoint)["config"])
    check_left_to_right(config, args.task)                 # the model's kind first
    return checkpoint_source(args.checkpoint)


def _check_layout(args: argparse.Namespace, config: GPTConfig) -> None:
    if args.nproc % (args.tp * args.pp):
        raise ValueError(f"--nproc {args.nproc} ranks do not divide into tp·pp = "
                         f"{args.tp}·{args.pp}")
    args.dp = args.nproc // (args.tp * args.pp)
    if args.batch % (args.dp * args.micro_batch):
        raise ValueError(f"--batch {args.batch} must be divisible by dp·micro-batch = "
                         f"{args.dp}·{args.micro_batch}")
    try:
        Parallelism(Layout(args.tp, args.pp, args.dp)).check(config)
    except ValueError as err:
        raise ValueError(f"--tp {args.tp} --pp {args.pp}: {err}") from None


# --- running batches through the pipeline, forward only -----------------------------------------

def _run_batches(chunks, grid: ParallelGrid, ids: np.ndarray, labels: np.ndarray,
                 args: argparse.Namespace) -> float:
    """Σ over all rows of what the last stage returns (summed losses, or counts), equal on
    every rank. Each step takes ``--batch`` rows (padded with unscored rows), dp replicas a
    slice each, run as microbatches of ``--micro-batch`` by the forward half of 1F1B; the
    last stage is told which rows it sees (``first_sample``: its microbatch's first row)."""
    m = args.batch // (grid.dp * args.micro_batch)
    schedule = forward_only(one_f_one_b(grid.pp, m))
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    local = args.batch // grid.dp
    for first in range(0, len(ids), args.batch):
        mine = first + grid.dp_rank * local
        rows = slice(mine, mine + local)
        batch_ids, batch_labels = _padded(ids[rows], local), _padded(labels[rows], local,
                                                                     IGNORE_INDEX)
        batch = Batch(batch_ids.to(grid.device), batch_labels.to(grid.device),
                      first_sample=mine, num_tokens=1)   # the last stage's sums, undivided
        with torch.no_grad(), autocast(args.dtype, grid.device):
            result = run_schedule(schedule, chunks, grid, batch)
        total += result.loss.double()
    return comm.all_reduce(total, grid.dp_group, "dp sum").item()


def _padded(rows: np.ndarray, n: int, fill: int = 0) -> torch.Tensor:
    out = np.full((n, rows.shape[1] if rows.ndim == 2 else 1), fill, dtype=np.int64)
    out[: len(rows)] = rows
    return torch.from_numpy(out)


# --- WikiText-103 -------------------------------------------------------------------------------

def _wikitext_inputs(args, tokenizer, config: GPTConfig) -> dict[str, Any]:
    file = zeroshot.find_data_file(args.data[0], zeroshot.WIKITEXT103)
    raw = zeroshot.read_wikitext(file)
    words = zeroshot.count_words(raw) if raw.split() else 0
    tokens = np.asarray(tokenizer.encode(zeroshot.wikitext_detokenize(raw)), dtype=np.int64)
    if words < 2 or len(tokens) < 2:
        raise ValueError(f"--data {file} holds {words} word-level tokens and {len(tokens)} "
                         f"BPE tokens: a perplexity needs at least 2 of each (the first is "
                         f"never predicted)")
    length = args.seq_len or config.seq_len
    stride = min(STRIDE, length) if args.stride is None else args.stride
    if stride > length:
        raise ValueError(f"--stride must be in 1 … the window length {length} (--seq-len), "
                         f"got {stride}")
    windows = zeroshot.sliding_windows(len(tokens), length, stride)
    ids, labels = zeroshot.window_batch(tokens, windows, length)   # padding: never seen, causal
    return {"ids": ids, "labels": labels, "tokens": len(tokens), "words": words,
            "window": length, "stride": stride, "starts": [w.start for w in windows]}


def wikitext_result(loss_sum: float, tokens: int, words: int) -> dict[str, Any]:
    """WikiText-103's result record from the summed loss L over ``tokens`` BPE tokens (N) of a
    text of ``words`` original word-level tokens (W), the first of each never predicted:

    * ``word_perplexity``: exp(L / (W − 1)), Megatron-LM's "adjusted ppl" (its
      ``tasks/zeroshot_gpt/evaluate.py``: the loss per token times (N − 1) / (W − 1));
    * ``word_perplexity_paper``: exp(L / W), 1909.08053's text (it normalises by the number of
      original tokens): word_perplexity ^ ((W − 1) / W);
    * ``token_perplexity``: exp(L / (N − 1)), Megatron-LM's "ppl"."""
    return {"task": "wikitext103", "word_perplexity": _exp(loss_sum / (words - 1)),
            "word_perplexity_paper": _exp(loss_sum / words),
            "token_perplexity": _exp(loss_sum / (tokens - 1)), "tokens": tokens,
            "words": words, "loss_sum": loss_sum}


# --- LAMBADA ------------------------------------------------------------------------------------

def _lambada_inputs(args, tokenizer, config: GPTConfig) -> dict[str, Any]:
    file = zeroshot.find_data_file(args.data[0], zeroshot.LAMBADA)
    try:
        passages = zeroshot.read_lambada(file)
    except ValueError as err:
        raise ValueError(f"--data {err}") from None
    limit = args.seq_len or config.seq_len
    examples = [zeroshot.lambada_example(text, tokenizer.encode) for text in passages]
    for i, (context, word) in enumerate(examples):
        if not context or not word or len(word) >= limit:
            raise ValueError(f"--data {file}: passage {i + 1} ({passages[i][-40:]!r}) encodes "
                             f"to a context of {len(context)} tokens and a last word of "
                             f"{len(word)}: LAMBADA needs a context and a word shorter than the "
                             f"window of {limit} tokens")
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


def lambada_correct(predicted: torch.Tensor, filtered: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example [b]: is the last word right — every target token the argmax (``predicted``)
    — and is it right with GPT-2's stop-word filter, which removes the stop words from the
    choices of the word's first token: there the choice is ``filtered``, the best token that is
    not a stop word on its own, whatever the target (a stop-word target is then always wrong);
    the word's later tokens are the argmax as without the filter."""
    targets = labels != IGNORE_INDEX                                  # [b, s]
    first = targets & (targets.cumsum(1) == 1)                        # each word's first token
    hit = (predicted == labels) | ~targets
    hit_filtered = torch.where(first, filtered == labels, hit)
    has_word = targets.any(1)
    return hit.all(1) & has_word, hit_filtered.all(1) & has_word


class _LastStage(nn.Module):
    """The last pipeline stage, its logits checked: on the positions it scores, a NaN or an
    infinity in any tp rank's slice is noted (``broken``: the first one's row, position and
    kind; the rows are the batch's global rows, from the pipeline's dropout keys). Returns
    the summed losses (``is_stop`` None), or the number of examples right without the
    stop-word filter, keeping the number right with it in ``filtered``."""

    def __init__(self, chunk: nn.Module, vocab_size: int,
                 is_stop: torch.Tensor | None = None) -> None:
        super().__init__()
        self.chunk, self.vocab_size, self.is_stop = chunk, vocab_size, is_stop
        self.filtered = 0.0
        self.broken: tuple[int, int, int] | None = None       # row, position, 0 NaN / 1 inf

    def boundary_shape(self, ids: torch.Size) -> torch.Size:
        """What the wrapped stage sends on: the engine asks the first chunk, this one at pp = 1."""
        return self.chunk.boundary_shape(ids)

    def forward(self, x, labels=None, dropout_key=None, **kwargs) -> torch.Tensor:
        """The summed losses, or the count of right answers, of this microbatch."""
        kwargs.pop("loss_reduction", None)
        logits = self.chunk(x, dropout_key=dropout_key, **kwargs)    # [b, s, V/t]
        group = self.chunk.tp_group
        start, end = vocab_range(logits.shape[-1], group)
        self._check(logits[..., : max(0, min(end, self.vocab_size) - start)], labels,
                    group, dropout_key.samples[0] if dropout_key is not None else 0)
        if self.is_stop is None:
            return vocab_parallel_cross_entropy(logits, labels, group,
                                                ignore_index=IGNORE_INDEX).sum()
        predicted = vocab_parallel_argmax(logits, group)
        stop = torch.zeros(end - start, dtype=torch.bool, device=logits.device)
        stop[: max(0, min(end, len(self.is_stop)) - start)] = self.is_stop[start:end]
        filtered = vocab_parallel_argmax(logits.masked_fill(stop, float("-inf")), group)
        right, right_filtered = lambada_correct(predicted, filtered, labels)
        self.filtered += float(right_filtered.sum())
        return right.sum().float()

    def _check(self, logits: torch.Tensor, labels: torch.Tensor, group: CommGroup,
               first_row: int) -> None:
        scored = labels != IGNORE_INDEX                                           # [b, s]
        bad = torch.stack([torch.isnan(logits).any(-1), ~torch.isfinite(logits).all(-1)])
        bad = comm.all_reduce(bad.float(), group, "non-finite logits") > 0        # [2, b, s]
        bad &= scored
        if self.broken is None and bool(bad[1].any()):
            row, position = (int(i) for i in bad[1].nonzero()[0])
            self.broken = (first_row + row, position, 0 if bad[0, row, position] else 1)


def _first_broken(last: nn.Module, grid: ParallelGrid) -> tuple[int, int, str] | None:
    """The first (row, position, kind) any last stage found not finite, on every rank."""
    found = getattr(last, "broken", None)
    mine = torch.tensor([found if found is not None else (math.inf, 0, 0)],
                        dtype=torch.float64, device=grid.device)                   # [1, 3]
    every = comm.all_gather(comm.all_gather(mine, grid.pp_group, dim=0, label="non-finite"),
                            grid.dp_group, dim=0, label="non-finite")
    row, position, kind = min(every.tolist())
    return None if row == math.inf else (int(row), int(position), ("NaN", "inf")[int(kind)])


def lambada_result(correct: float, correct_filtered: float, n: int,
                   stop_word_filter: bool) -> dict[str, Any]:
    """LAMBADA's result record from the counts of correct predictions over ``n`` samples:
    ``accuracy_without_filter`` (1909.08053's 66.5 %, Megatron-LM's ``--strict-lambada``),
    ``accuracy_with_filter`` (GPT-2's stop-word filter: Radford et al. 2019 report 52.66 %
    without, 63.24 % with it), ``accuracy`` the one ``--stop-word-filter`` asks for."""
    plain, filtered = correct / n, correct_filtered / n
    return {"task": "lambada", "accuracy": filtered if stop_word_filter else plain, "n": n,
            "stop_word_filter": stop_word_filter, "accuracy_without_filter": plain,
            "accuracy_with_filter": filtered}


# --- on every rank ------------------------------------------------------------------------------

def evaluate(args: argparse.Namespace, source: Source, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run on every rank: the task's result (equal on all ranks), or ``{"task", "error"}``
    where the model's logits are not finite (``NonFiniteLogits``' message)."""
    grid = ParallelGrid(tp=args.tp, pp=args.pp, dp=args.dp)
    chunks = source.chunks(grid)
    lambada = args.task == "lambada"
    is_stop = torch.from_numpy(inputs["stop_tokens"]).to(grid.device) if lambada else None
    if chunks[-1].last:
        chunks[-1] = _LastStage(chunks[-1], source.config.vocab_size, is_stop)
    total = _run_batches(chunks, grid, inputs["ids"], inputs["labels"], args)
    broken = _first_broken(chunks[-1], grid)
    if broken is not None:
        row, position, kind = broken
        token = None if lambada else inputs["starts"][row] + position
        where = (f"position {position} of passage {row + 1}" if lambada else
                 f"position {position} of window {row + 1} (token {token} of the text)")
        return {"task": args.task, "error": str(NonFiniteLogits(kind, where))}
    if not lambada:
        return wikitext_result(total, inputs["tokens"], inputs["words"])
    filtered = getattr(chunks[-1], "filtered", 0.0)                   # on the last stage only
    filtered = torch.tensor(filtered, dtype=torch.float64, device=grid.device)
    filtered = comm.all_reduce(comm.all_reduce(filtered, grid.pp_group, "pp count"),
                               grid.dp_group, "dp count").item()
    return lambada_result(total, filtered, inputs["n"], args.stop_word_filter)


def validation_loss(args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, float]:
    """Run on every rank: the mean validation loss and its perplexity (equal on all ranks)."""
    grid = ParallelGrid(tp=args.tp, pp=args.pp, dp=args.dp)
    config = config_from_dict(meta["config"])
    chunks = build_chunks(config, grid)
    load_model_chunks(meta["path"], chunks, grid)
    for chunk in chunks:
        chunk.eval()
    source = args.data or meta["state"].get("data", ["default"])
    _, _, val = _validation_data(source, config, args.cache_dir, meta)
    m = args.batch // (grid.dp * args.micro_batch)
    schedule = forward_only(one_f_one_b(grid.pp, m))
    losses = []
    with torch.no_grad(), autocast(args.dtype, grid.device):
        for i in range(args.batches):
            ids, labels = val.fixed_batch(i, args.batch, grid.dp_rank, grid.dp)
            result = run_schedule(schedule, chunks, grid,
                                  Batch(ids.to(grid.device), labels.to(grid.device)))
            losses.append(comm.all_reduce(result.loss, grid.dp_group, "dp loss") / grid.dp)
    loss = torch.stack(losses).mean().item()
    if not math.isfinite(loss):
        kind = "NaN" if math.isnan(loss) else "inf"
        return {"error": f"the validation loss is not finite ({kind}): the checkpoint holds "
                         f"non-finite weights?"}
    return {"loss": loss, "perplexity": _exp(loss), "tokens": args.batches * args.batch
            * config.seq_len, "step": meta["step"]}


def _exp(x: float) -> float:
    """exp(x), infinite where it overflows (a perplexity of a model that knows nothing)."""
    return math.exp(x) if x < 709 else math.inf


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
    if args.seq_len is not None and args.seq_len > source.config.seq_len:
        raise ValueError(f"--seq-len must be in 2 … {source.config.seq_len} (the model's "
                         f"seq_len), got {args.seq_len}")
    prepare = _wikitext_inputs if args.task == "wikitext103" else _lambada_inputs
    return source, prepare(args, tokenizer, source.config)


def check_left_to_right(config: GPTConfig, task: str) -> None:
    """Raise unless ``config`` is a left-to-right (causal) language model, as ``task`` needs."""
    if isinstance(config, BertConfig) or not config.causal:
        raise ValueError(f"--task {task} scores a left-to-right language model; this "
                         f"checkpoint holds a {type(config).__name__} (bidirectional attention)")


def _prepare_validation(args: argparse.Namespace) -> dict[str, Any]:
    if args.checkpoint is None:
        raise ValueError("name a run: --checkpoint RUN (--hf needs a --task)")
    args.batches = args.batches or BATCHES
    meta = read_metadata(args.checkpoint)
    _check_layout(args, config_from_dict(meta["config"]))
    if meta["tokenizer"] is None:
        raise ValueError(f"checkpoint {meta['path']} holds no tokenizer")
    return meta


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_edu.evaluate: evaluate a checkpoint or a Hugging Face GPT-2; the exit
    status (2: refused before any rank starts, one line naming the argument; 1: failed on the
    ranks, or the model's logits are not finite)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_applicable(args)
        if args.task is None:
            meta = _prepare_validation(args)
        else:
            source, inputs = _prepare_task(args)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError too
        parser.error(str(err))
    try:
        if args.task is None:
            result = run(validation_loss, args.nproc, args, meta)[0]
        else:
            result = run(evaluate, args.nproc, args, source, inputs)[0]
    except RankError as err:
        print(f"error: evaluation failed on {err}", file=sys.stderr)
        return 1
    if "error" in result:                                   # the logits were not finite
        print(f"error: {result['error']}", file=sys.stderr)
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
        return (f"WikiText-103: perplexity per word {r['word_perplexity']:.2f} (exp(L/(W−1)), "
                f"Megatron-LM's), {r['word_perplexity_paper']:.2f} (exp(L/W), 1909.08053's "
                f"text) over W = {r['words']:,} words; per token {r['token_perplexity']:.2f} "
                f"(exp(L/(N−1))) over N = {r['tokens']:,} tokens")
    return (f"LAMBADA: accuracy {r['accuracy_without_filter']:.2%} without the stop-word filter, "
            f"{r['accuracy_with_filter']:.2%} with it, over {r['n']:,} passages")


if __name__ == "__main__":
    sys.exit(main())
