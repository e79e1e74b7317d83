"""Text generation with a KV cache on any tp × pp layout (1909.08053 §3; 2104.04473 §2.2).

Autoregressive decoding runs the prompt through the model once (the prefill), then one token at
a time. Each block keeps the keys and values of the positions already seen
(``model.gpt.KVCache``), so a new token costs the work of one position, not of the whole text.

On a tp × pp grid one step is one forward pass through the pipeline: there is nothing to
pipeline, since token t+1 needs token t, so no microbatches and no schedule —

* the first stage embeds the ids; every stage sends its hidden state [1, s, h] to the next with a
  blocking send/recv (each tp rank to its peer: the activation is replicated over tp);
* the last stage holds its vocabulary shard of the logits (1909.08053 §3, output embedding);
  only the last position's, [1, V_padded/t], are all-gathered over tp and the padding trimmed;
* one rank (tp rank 0 of the last stage) samples the next token with a ``torch.Generator``
  seeded from ``seed`` and broadcasts it over the model-parallel group, so the first stage can
  embed it and every rank knows when to stop.

Sampling on one rank from one seed makes the text the same at every layout (the logits agree to
rounding). Data-parallel replicas, if any, each generate the same text on their own.

Sampling: the temperature divides the logits; top-k keeps the k most likely tokens (Fan et al.
2018, arXiv 1805.04833); top-p keeps the smallest set of most likely tokens whose probability
reaches p (nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751); greedy takes the argmax.
Logits that are not finite (a NaN or an infinity: broken weights) are never sampled from: the
sampler broadcasts a sentinel instead of a token and every rank raises ``NonFiniteLogits``,
which names the position.

The command line refuses, before launching any rank, in one line naming the argument (exit
status 2): a number out of its range (``megatron_edu.cli``), a layout the model does not
split into, a prompt and new tokens longer than the model's context, a BERT's checkpoint.

    python -m megatron_edu.generate --checkpoint runs/tiny --prompt "The " --max-new-tokens 40 \\
        --top-p 0.9 --nproc 4 --tp 2 --pp 2
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from megatron_edu import comm
from megatron_edu.checkpoint import resolve_checkpoint
from megatron_edu.cli import (
    Parser,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
    random_seed,
)
from megatron_edu.data.tokenizer import JsonTokenizer, Tokenizer
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import RankError, run
from megatron_edu.model import GPT, BertConfig, GPTConfig
from megatron_edu.model.gpt import KVCache
from megatron_edu.pipeline.schedules import Action, messages_of
from megatron_edu.pipeline.stages import Message, StageMap
from megatron_edu.sources import Source, checkpoint_source, hf_source

__all__ = ["Sampling", "sample", "generate", "main", "NonFiniteLogits"]


# --- logits a broken checkpoint gives ------------------------------------------------------------

class NonFiniteLogits(ValueError):
    """The model's logits hold a NaN or an infinity: its weights do (a diverged or damaged
    checkpoint). Generation and evaluation stop on it rather than print what it would give."""

    def __init__(self, kind: str, where: str) -> None:
        super().__init__(f"the model's logits are not finite ({kind}) at {where}: the checkpoint "
                         f"holds non-finite weights?")


def non_finite(logits: torch.Tensor) -> str | None:
    """"NaN" or "inf" if some of ``logits`` are (NaN first), else None."""
    if bool(torch.isnan(logits).any()):
        return "NaN"
    return None if bool(torch.isfinite(logits).all()) else "inf"


# --- choosing the next token ---------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits; checked on construction."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature} "
                             f"(use greedy for the argmax)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer ≥ 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the logits [V] of the last position. −inf rules a token out; a NaN,
    a +inf, or nothing but −inf is refused (``NonFiniteLogits``)."""
    if bool(torch.isnan(logits).any()):
        raise NonFiniteLogits("NaN", "the position sampled from")
    if bool(torch.isposinf(logits).any()) or not bool(torch.isfinite(logits).any()):
        raise NonFiniteLogits("inf", "the position sampled from")
    if sampling.greedy:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None:
        kth = logits.topk(min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        logits = _nucleus(logits, sampling.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches top_p (always the first)."""
    probs, order = torch.softmax(logits, dim=-1).sort(descending=True)
    before = probs.cumsum(0) - probs               # the mass of the more likely tokens
    return logits.index_fill(0, order[before >= top_p], float("-inf"))


# --- one step through the pipeline ---------------------------------------------------------------

def _forward_step(chunks: Sequence[GPT], grid: ParallelGrid | None, stages: StageMap,
                  ids: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor | None:
    """Run ids [1, s] through this rank's (virtual) stages, placed as ``stages`` says; on the
    last stage return the last position's logits [V] (vocabulary whole, padding trimmed),
    elsewhere None."""
    piped = grid is not None and grid.pp > 1
    x = ids
    for c, (chunk, cache) in enumerate(zip(chunks, caches, strict=True)):
        prev, next_ = _neighbours(grid, stages, c) if piped else (None, None)
        if prev is not None:                         # 2104.04473 §2.2: from the previous stage
            buffer = torch.empty(1, ids.shape[1], chunk.config.hidden, device=ids.device,
                                 dtype=next(chunk.parameters()).dtype)
            x = comm.recv(buffer, prev, "pp activation")
        x = chunk(x, cache=cache)                    # [1, s, h], or [1, s, V_padded/t] if last
        if next_ is not None:
            comm.send(x, next_, "pp activation")
    if not chunks[-1].last:
        return None
    logits = comm.all_gather(x[0, -1], chunks[-1].tp_group, dim=-1, label="logits")  # [V_padded]
    return logits[: chunks[-1].config.vocab_size]


def _neighbours(grid: ParallelGrid, stages: StageMap, chunk: int) -> tuple[int | None, int | None]:
    """The global ranks that chunk ``chunk`` of this rank receives from and sends to: the
    messages of its forward on the stage map, as the pipeline engine has them
    (``schedules.messages_of``). None at the model's two ends, and at ZB-V's turn, where the
    message stays on this rank (``x`` flows on into the other chunk in ``_forward_step``)."""
    receive, send = messages_of(Action("F", 0, chunk), grid.pp_rank, stages)

    def peer(message: Message | None, rank_of_stage) -> int | None:
        if message is None or stages.is_local(message):
            return None
        return grid.pp_group.ranks[rank_of_stage(message)]

    return peer(receive, stages.sender), peer(send, stages.receiver)


def _stage_map(chunks: Sequence[GPT], grid: ParallelGrid | None,
               stages: StageMap | None) -> StageMap:
    """The stage map the chunks were built on: ``stages``, or one chunk per rank (None, as
    ``build_chunks``'s default)."""
    stages = stages or StageMap.plain(grid.pp if grid is not None else 1)
    if len(chunks) != stages.v:
        raise ValueError(f"{len(chunks)} chunks on this rank, but the stage map places "
                         f"{stages.v} per rank ({stages}): pass generate the stage map that "
                         "build_chunks(config, grid, stages) built them on")
    return stages


def _next_token(logits: torch.Tensor | None, grid: ParallelGrid | None, sampling: Sampling,
                generator: torch.Generator, device: torch.device, last_stage_rank: int,
                position: int) -> int:
    """Sample on tp rank 0 of the last stage (pipeline rank ``last_stage_rank``), then
    broadcast to every model-parallel rank. Logits that are not finite (at ``position``) are
    broadcast as a negative token, so that every rank raises the same ``NonFiniteLogits``."""
    token = torch.zeros(1, dtype=torch.long, device=device)
    if grid is None or (grid.pp_rank == last_stage_rank and grid.tp_rank == 0):
        kind = non_finite(logits)
        token[0] = _BROKEN.index(kind) - len(_BROKEN) if kind else sample(
            logits.cpu(), sampling, generator)                 # on the CPU: same on any device
    if grid is not None:
        sampler = grid.layout.rank_of(0, last_stage_rank, grid.dp_rank)
        comm.broadcast(token, sampler, grid.mp_group, "next token")
    if int(token) < 0:
        raise NonFiniteLogits(_BROKEN[int(token)], f"position {position}")
    return int(token)


_BROKEN = ("NaN", "inf")          # token −2, −1: the logits held a NaN, an infinity


@contextmanager
def _eval_mode(chunks: Sequence[GPT]) -> Iterator[None]:
    """Dropout off while generating; each chunk's mode restored afterwards."""
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, modes, strict=True):
            chunk.train(mode)


# --- generation -----------------------------------------------------------------------------------

def check_length(config: GPTConfig, prompt_len: int, max_new_tokens: int) -> None:
    """Raise a ValueError unless the prompt and the new tokens fit in ``config.seq_len``."""
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > config.seq_len:
        raise ValueError(f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens = "
                         f"{prompt_len + max_new_tokens} is longer than seq_len = "
                         f"{config.seq_len}")


def _prompt(prompt_ids: list[int] | torch.Tensor, max_new_tokens: int,
            config: GPTConfig) -> torch.Tensor:
    """The prompt as ids [1, s], checked against the vocabulary and the context length."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"one prompt at a time: a list of ids or a 1-D tensor, got shape "
                         f"{tuple(ids.shape)}")
    check_length(config, ids.numel(), max_new_tokens)
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"prompt ids must be in 0..{config.vocab_size - 1}, got "
                         f"{ids.min().item()}..{ids.max().item()}")
    return ids[None]


def _as_chunks(model: GPT | Sequence[GPT], grid: ParallelGrid | None) -> list[GPT]:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    if grid is None and not (len(chunks) == 1 and chunks[0].first and chunks[0].last):
        raise ValueError("without a grid, pass one whole model (first and last stage)")
    return chunks


@torch.no_grad()
def generate(model: GPT | Sequence[GPT], grid: ParallelGrid | None,
             prompt_ids: list[int] | torch.Tensor, max_new_tokens: int, *,
             stages: StageMap | None = None, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
             seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The tokens that follow ``prompt_ids``: ``max_new_tokens`` of them, or fewer ending with
    ``eos_id``. ``model``: a whole GPT (grid None) or this rank's chunks, built on the stage
    map ``stages`` (``build_chunks(config, grid, stages)``; None: one chunk per rank). Under a
    grid, a collective: every rank calls it alike and gets the same list — or raises the same
    ``NonFiniteLogits`` where the logits hold a NaN or an infinity."""
    chunks = _as_chunks(model, grid)
    sampling = Sampling(temperature, top_k, top_p, greedy)
    device = grid.device if grid is not None else next(chunks[0].parameters()).device
    ids = _prompt(prompt_ids, max_new_tokens, chunks[0].config).to(device)   # [1, s]
    generator = torch.Generator().manual_seed(seed)
    caches = [KVCache() for _ in chunks]
    stages = _stage_map(chunks, grid, stages)
    tokens: list[int] = []
    with _eval_mode(chunks):
        for _ in range(max_new_tokens):
            logits = _forward_step(chunks, grid, stages, ids, caches)
            position = len(prompt_ids) + len(tokens) - 1          # whose logits these are
            tokens.append(_next_token(logits, grid, sampling, generator, device,
                                      stages.last_rank, position))
            if tokens[-1] == eos_id:
                break
            ids = torch.tensor([[tokens[-1]]], device=device)            # [1, 1]: the cache
    return tokens                                                          # holds the rest


# --- the command line -----------------------------------------------------------------------------

def _parser() -> Parser:
    parser = Parser(prog="python -m megatron_edu.generate",
                    description="Continue a prompt with a trained GPT or Llama: a checkpoint "
                    "or a Hugging Face folder.")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint",
                       help="a checkpoint folder, or a run folder (its latest checkpoint)")
    model.add_argument("--hf", help="a Hugging Face GPT-2 or Llama folder (its tokenizer with "
                       "it: a tokenizer.model, or a Hugging Face tokenizer)")
    parser.add_argument("--step", type=nonnegative_int,
                        help="the checkpoint of this step of the run")
    parser.add_argument("--tokenizer", help="a sentencepiece .model or a tokenizer.json "
                        "(default: the checkpoint's)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=positive_int, default=50)
    parser.add_argument("--temperature", type=positive_float, default=1.0)
    parser.add_argument("--top-k", type=positive_int)
    parser.add_argument("--top-p", type=probability)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=random_seed, default=0)
    parser.add_argument("--nproc", type=positive_int, default=1, help="ranks to launch: tp·pp")
    parser.add_argument("--tp", type=positive_int, default=1)
    parser.add_argument("--pp", type=positive_int, default=1)
    return parser


def _source(args: argparse.Namespace) -> tuple[Source, Tokenizer | JsonTokenizer]:
    if args.hf is not None:
        return hf_source(args.hf)
    return checkpoint_source(resolve_checkpoint(args.checkpoint, args.step), args.tokenizer)


def _prepare(args: argparse.Namespace) -> tuple[Source, Tokenizer, list[int], Sampling]:
    """Every check before launching (docs/principles.md, 7): a ValueError naming the numbers."""
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.greedy)
    if args.nproc != args.tp * args.pp:
        raise ValueError(f"--nproc {args.nproc} ≠ tp·pp = {args.tp}·{args.pp} = "
                         f"{args.tp * args.pp}")
    source, tokenizer = _source(args)
    config = source.config
    if isinstance(config, BertConfig) or not config.causal:
        raise ValueError(f"--checkpoint {args.checkpoint} holds a {type(config).__name__} with "
                         f"bidirectional attention: generate continues text with a left-to-right"
                         f" GPT")
    config.validate(args.tp, args.pp)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model "
                         f"{config.vocab_size}: not the model's tokenizer")
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens: give at least one")
    try:
        check_length(config, len(prompt), args.max_new_tokens)
    except ValueError as err:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: {err}") from None
    return source, tokenizer, prompt, sampling


def _generate_on_rank(source: Source, tp: int, pp: int, prompt: list[int], max_new_tokens: int,
                      sampling: Sampling, seed: int, eos_id: int) -> list[int] | str:
    """The new tokens, or the message of non-finite logits (every rank meets them alike)."""
    grid = ParallelGrid(tp=tp, pp=pp)
    chunks = source.chunks(grid)
    try:
        return generate(chunks, grid, prompt, max_new_tokens, seed=seed, eos_id=eos_id,
                        **asdict(sampling))
    except NonFiniteLogits as err:
        return str(err)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_edu.generate``: the prompt and its continuation, printed; the exit
    status (2: refused before launching, 1: failed on the ranks)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        source, tokenizer, prompt, sampling = _prepare(args)
    except (ValueError, OSError) as err:          # CheckpointError is a ValueError too
        parser.error(str(err))
    try:
        tokens = run(_generate_on_rank, args.nproc, source, args.tp, args.pp, prompt,
                     args.max_new_tokens, sampling, args.seed, tokenizer.eos_id,
                     capture_output=True)[0]
    except RankError as err:
        print(f"error: generation failed on {err}", file=sys.stderr)
        return 1
    if isinstance(tokens, str):
        print(f"error: {tokens}", file=sys.stderr)
        return 1
    print(args.prompt + tokenizer.decode(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
