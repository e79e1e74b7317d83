"""Train a GPT (or a BERT) with PTD-P: ``python -m megatron_edu.train`` on a laptop, ``torchrun``
on a cluster.

    python -m megatron_edu.train --nproc 4 --tp 2 --pp 2 --out runs/tiny
    torchrun --nproc-per-node 8 -m megatron_edu.train --tp 8 --preset gpt2-medium ...
    python -m megatron_edu.train --model bert --ln-placement original --nproc 2 --tp 2 ...

``--model bert`` trains the BERT of 1909.08053 §5.3 on the same corpus (``data/bert.py``:
sentence pairs, order swaps, 15 % masking; ``model/bert.py``), through the same PTD-P step;
``--ln-placement`` chooses Figure 7's layer-norm arrangement.

One script for both: under torchrun every process is one rank already; otherwise ``--nproc N``
starts N local ranks (``launch.run``). Everything is checked before any rank starts
(docs/principles.md, principle 7): the layout against the world size, the model against tp and
pp, the batch against dp and the microbatches, the data and the checkpoint to resume from.

Each step: the global batch of B sequences is cut into dp slices, each slice into m = B/(dp·b)
microbatches of b; the pipeline schedule runs them; gradients are averaged over dp once; the
global norm is clipped; AdamW steps with warm-up and cosine decay (2104.04473 §5 trains so).
Rank 0 shows a progress bar (loss, tokens/s, MFU), appends one JSON record per step and per
validation to ``OUT/log.jsonl``, saves checkpoints to ``OUT/checkpoints/`` and finally draws
``OUT/loss.png`` and samples some text.

**When it goes wrong** (docs/troubleshooting.md). Before launch: every number is checked as it
is read (``megatron_edu.cli``), their relations and the data by ``validate``/``check_data``; the
run takes a lock on ``--out``, which must be writable with room for a checkpoint
(``run_folder``). During the run a *bad step* — a non-finite loss, or a step skipped for a
non-finite gradient norm — is reported, in a line and in its record's ``reason``;
``--max-bad-steps`` of them in a row stop every rank together with one line: since when, the
likely cause, the last good checkpoint. No checkpoint is written after a bad step or of
non-finite weights; one written just before the first bad step is withdrawn. A checkpoint
write that fails (a full disk) stops the run with one line, the previous checkpoint intact.
Exit status: 0 trained, 2 refused before any rank started, 1 failed or stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron_edu import cli, comm
from megatron_edu.checkpoint import (
    BackgroundWriter,
    CheckpointError,
    NonFiniteError,
    Writer,
    check_model,
    checkpoint_bytes,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
    withdraw_checkpoint,
)
from megatron_edu.cli import (
    DTYPES,
    Parser,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    rate,
)
from megatron_edu.data import BatchSampler, TokenDataset, prepare_data, unigram_entropy
from megatron_edu.data.bert import prepare_bert_data
from megatron_edu.data.tokenizer import Tokenizer
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.hf import config_from_hf, read_hf
from megatron_edu.launch import RankError, resolve_backend, run, under_torchrun
from megatron_edu.model import BertConfig, GPTConfig, LlamaConfig, compile_blocks
from megatron_edu.model.config import (
    ATTENTION,
    LN_PLACEMENTS,
    MOE_GROUPS,
    PRESETS,
    RECOMPUTE,
    ROUTERS,
)
from megatron_edu.optim import DynamicLossScale, warmup_cosine
from megatron_edu.perf import model_flops_utilization, training_flops_of
from megatron_edu.perf.flops import datasheet_peak_flops, measure_matmul_flops
from megatron_edu.pipeline.engine import build_chunks
from megatron_edu.pipeline.schedules import SCHEDULES, PipelineConfig
from megatron_edu.ptdp import PTDP, Parallelism, PTDPOptions, StepResult
from megatron_edu.run_folder import (
    RunFolderError,
    acquire_lock,
    check_space,
    exit_on_sigterm,
    format_bytes,
    prepare_folder,
    refresh_lock,
    release_lock,
)
from megatron_edu.tools import StepProfiler, flags_from_file, step_range, write_run_record

__all__ = ["parse_args", "validate", "main", "train"]

BACKENDS = ("auto", "gloo", "nccl")
CONFIGS = {"gpt": GPTConfig, "bert": BertConfig, "llama": LlamaConfig}  # --model
TRAINED = {"sentencepiece": "bpe", "byte-bpe": "byte-bpe"}  # --tokenizer: trained on the corpus


# --- the command line ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The command line: layout, model, optimisation, data and run flags."""
    p = Parser(prog="python -m megatron_edu.train", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    layout = p.add_argument_group("layout (2104.04473 §3)")
    layout.add_argument("--nproc", type=positive_int, help="local ranks to start (default "
                        "tp·cp·pp·dp; ignored under torchrun)")
    layout.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    layout.add_argument("--cp", type=positive_int, default=1, help="context-parallel size: "
                        "each sequence split over cp ranks, attention as a ring (notebook 12)")
    layout.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size: "
                        "the experts split over ep of the dp × cp ranks (it divides dp·cp)")
    layout.add_argument("--dp", type=positive_int, help="data-parallel size (default: world / "
                        "(tp·cp·pp))")
    layout.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                        help="zb-*: zero-bubble schedules (2401.10241), the backward split into "
                        "input and weight gradients; zb-v places 2 chunks per rank in a V")
    layout.add_argument("--chunks", type=positive_int, help="model chunks per pipeline rank v "
                        "(the interleaved schedule needs it; default: the schedule's own, zb-v 2, "
                        "others 1)")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage: 1 shards the optimizer state over dp (× cp), 2 the "
                        "gradients too, 3 the weights too (FSDP); 2 and 3 need pp = 1")
    layout.add_argument("--zero1", action="store_const", dest="zero", const=1,
                        help="the same as --zero 1")
    layout.add_argument("--no-scatter-gather", action="store_true",
                        help="send whole activations between stages (§4.1 off)")
    model = p.add_argument_group("model")
    model.add_argument("--model", choices=list(CONFIGS), default="gpt",
                       help="GPT-2; BERT with masked-LM and sentence-order losses (§5.3); a "
                       "Llama block (RMSNorm, rotary positions, SwiGLU, grouped-query "
                       "attention, untied output layer)")
    model.add_argument("--ln-placement", choices=list(LN_PLACEMENTS), default="rearranged",
                       help="layer norm before each sublayer, x + f(LN(x)) (rearranged; GPT-2, "
                       "Megatron-BERT) or after the residual add, LN(x + f(x)) (original BERT); "
                       "1909.08053 Figure 7")
    model.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in ("layers", "hidden", "heads", "kv-heads", "seq-len", "vocab-size"):
        model.add_argument(f"--{name}", type=positive_int, help="override the preset")
    model.add_argument("--dropout", type=rate, default=0.0)
    moe = p.add_argument_group("mixture of experts (model/moe.py): each flag given replaces the "
                               "preset's (llama-moe-tiny, mixtral-8x7b, qwen1.5-moe-a2.7b)")
    moe.add_argument("--moe-experts", type=nonnegative_int, metavar="E",
                     help="routed experts in place of each MLP (0: a dense MLP)")
    moe.add_argument("--moe-topk", type=positive_int, metavar="K", help="experts per token (2)")
    moe.add_argument("--moe-ffn-hidden", type=positive_int, help="units per expert (the MLP's)")
    moe.add_argument("--moe-router", choices=ROUTERS,
                     help="softmax (Mixtral; the default) or sigmoid (DeepSeek-V3) scores")
    moe.add_argument("--moe-groups", type=positive_int, metavar="G",
                     help="group-limited routing (DeepSeek-V3): the experts in G groups …")
    moe.add_argument("--moe-topk-groups", type=positive_int, metavar="M",
                     help="… a token's k chosen from its best M groups")
    moe.add_argument("--moe-shared-experts", type=nonnegative_int, metavar="N",
                     help="always-on experts beside the routed ones (DeepSeekMoE, Qwen-MoE)")
    moe.add_argument("--moe-shared-gate", action="store_true", default=None,
                     help="gate the shared experts by a sigmoid (Qwen-MoE)")
    moe.add_argument("--moe-aux-loss", type=nonnegative_float, metavar="ALPHA",
                     help="the load-balancing loss's coefficient (Switch, GShard; 0.01 where "
                     "--moe-experts gives a dense preset experts)")
    moe.add_argument("--moe-group", choices=MOE_GROUPS,
                     help="the tokens each balance loss and each capacity covers (sequence)")
    moe.add_argument("--moe-capacity", type=nonnegative_float, metavar="CF",
                     help="capacity factor: each expert takes at most ceil(CF·k·|group|/E) "
                     "of a group's choices, the rest dropped (0: dropless)")
    moe.add_argument("--moe-z-loss", type=nonnegative_float, metavar="BETA",
                     help="the router z-loss's coefficient (ST-MoE)")
    moe.add_argument("--moe-bias-rate", type=nonnegative_float, metavar="GAMMA",
                     help="DeepSeek-V3's loss-free balance: each expert's selection bias moves "
                     "by GAMMA a step toward the mean load (0: no bias)")
    model.add_argument("--recompute", nargs="?", const="full", default="none",
                       choices=list(RECOMPUTE),
                       help="activation recomputation: the whole layer (full; the flag alone) or "
                       "only the attention core (selective) (2104.04473 §3.5, 2205.05198 §5)")
    model.add_argument("--sequence-parallel", action="store_true", help="split the sequence over "
                       "tp outside the tensor-parallel regions (2205.05198 §4.2.2; needs tp > 1)")
    model.add_argument("--fused", action="store_true", help="fused kernels: bias+GeLU, "
                       "bias+dropout+add (2104.04473 §4.2; torch.compile on first use), and the "
                       "fused attention core unless --attention says otherwise")
    model.add_argument("--attention", choices=["auto", *ATTENTION], default="auto",
                       help="the attention core: eager (op by op; the serial model's dropout "
                       "masks at every layout) or fused (one kernel, flash attention on a GPU; "
                       "its dropout the device's); auto: fused on GPUs or with --fused, else "
                       "eager (context parallelism runs the ring)")
    model.add_argument("--compile", action="store_true", help="torch.compile each transformer "
                       "block (its elementwise chains fused into generated kernels; the first "
                       "steps compile: MFU counts from later ones)")
    model.add_argument("--async-tp", action="store_true", help="overlap the backward's "
                       "tensor-parallel all-reduce (or reduce-scatter) of dX with dW, as "
                       "Megatron-LM does (not with the zero-bubble schedules)")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=positive_int, default=600)
    opt.add_argument("--micro-batch", type=positive_int, default=4,
                     help="sequences per microbatch (b)")
    opt.add_argument("--global-batch", type=positive_int, default=16,
                     help="sequences per step (B)")
    opt.add_argument("--lr", type=positive_float, default=3e-3)
    opt.add_argument("--min-lr", type=nonnegative_float, default=1e-4)
    opt.add_argument("--warmup", type=nonnegative_int, default=60)
    opt.add_argument("--weight-decay", type=nonnegative_float, default=0.1)
    opt.add_argument("--clip", type=nonnegative_float, default=1.0,
                     help="max global gradient norm; 0: no clipping")
    opt.add_argument("--seed", type=nonnegative_int, default=1234)
    opt.add_argument("--dtype", choices=DTYPES, default="auto",
                     help="auto: bf16 autocast on GPUs, fp32 on CPUs; fp16: autocast with "
                     "dynamic loss scaling (1909.08053); weights stay fp32")
    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", default=["default"],
                      help="'default' (built-in corpus), 'wikitext103', or .txt and .jsonl "
                      "files, or folders of them, or a Hugging Face dataset: a folder "
                      "save_to_disk wrote, or hf:NAME from the hub (needs datasets)")
    data.add_argument("--text-field", default="text", help="the field of each .jsonl line "
                      "that holds its document")
    data.add_argument("--tokenizer", default="sentencepiece", metavar="KIND_OR_PATH",
                      help="'sentencepiece' (a BPE trained on the corpus), 'byte-bpe' (GPT-2's "
                      "kind, trained on the corpus with the tokenizers library), or a file: a "
                      "Hugging Face tokenizer.json or a folder holding one, or a sentencepiece "
                      ".model; a file's vocabulary is the model's (--vocab-size ignored)")
    data.add_argument("--cache-dir", type=Path, help="default ~/.cache/megatron_edu")
    run_ = p.add_argument_group("run")
    run_.add_argument("--out", type=Path, default=Path("runs/default"))
    run_.add_argument("--eval-interval", type=positive_int, default=50)
    run_.add_argument("--eval-batches", type=positive_int, default=4)
    run_.add_argument("--save-interval", type=positive_int, default=100)
    run_.add_argument("--keep-last", type=positive_int, metavar="N", help="keep only the N "
                      "newest checkpoints (never the one just written nor the one latest names), "
                      "deleting older ones once the new one is published; default: keep all")
    run_.add_argument("--async-save", action="store_true", help="write each checkpoint in a "
                      "background thread from a host copy while training goes on; the next "
                      "save and the end of the run wait for it")
    run_.add_argument("--init-from-hf", type=Path, metavar="DIR", help="start from a Hugging "
                      "Face GPT-2 or Llama folder's weights, at any layout, its sizes the "
                      "model's; the corpus read with the folder's tokenizer.model or "
                      "tokenizer.json (a folder checkpoint export-hf wrote holds both)")
    run_.add_argument("--resume", nargs="?", const="auto", default=None,
                      help="resume from OUT's latest checkpoint (the flag alone, or 'auto'; "
                      "none there yet: start afresh, so a requeued job can always pass it), or "
                      "from the given one (any layout; the lr schedule follows this run's --steps)")
    run_.add_argument("--config", type=Path, metavar="FILE", help="a .toml, .yaml or .json file "
                      "of flags, named without the dashes; the command line overrides it")
    run_.add_argument("--profile", type=step_range, metavar="START:END", help="a torch.profiler "
                      "trace of steps START … END−1 in OUT/profile_rank{r}.json (Perfetto)")
    run_.add_argument("--profile-ranks", choices=["0", "all"], default="0",
                      help="the ranks --profile traces")
    run_.add_argument("--tensorboard", action="store_true", help="also write each step's "
                      "record (loss, lr, gradient norm, loss scale, tokens/s, MFU, memory) as "
                      "TensorBoard scalars in OUT/tensorboard (needs the tensorboard package)")
    run_.add_argument("--peak-tflops", type=_peak_tflops, help="per-rank peak for MFU: TFLOP/s, "
                      "or 'measured' (a matmul timed on every rank); default: the GPU's "
                      "datasheet dense bf16 peak (perf.DATASHEET_BF16_PEAKS: Blackwell, Hopper, "
                      "Ada, Ampere; V100 in fp16), measured where none applies (a CPU, a GPU not "
                      "in the table)")
    run_.add_argument("--sample-tokens", type=nonnegative_int, default=60,
                      help="text to generate at the end")
    run_.add_argument("--no-progress", action="store_true", help="no progress bar")
    run_.add_argument("--backend", choices=BACKENDS, default="auto",
                      help="auto: NCCL when every local rank has a GPU, else gloo (CPU)")
    run_.add_argument("--max-bad-steps", type=positive_int, default=5,
                      help="stop after this many bad steps in a row (a non-finite loss, or a "
                      "skipped step: a non-finite gradient norm; under fp16, skips count only "
                      "once the loss scale is down to 1)")
    run_.add_argument("--collective-timeout", type=positive_float, default=30.0,
                      metavar="MINUTES", help="how long a collective may wait for its peers "
                      "before the rank fails (a stuck or dead peer)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line's), over those of ``--config FILE``."""
    parser = build_parser()
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", type=Path)
    file = config.parse_known_args(argv)[0].config
    if file is not None:
        try:
            parser.set_defaults(**flags_from_file(file, parser))
        except ValueError as err:
            parser.error(str(err))
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model the flags describe: the preset, with the sizes and switches given; or with
    ``--init-from-hf``, the folder's model with the switches."""
    switches = dict(dropout=args.dropout, recompute=args.recompute, fused=args.fused,
                    sequence_parallel=args.sequence_parallel, attention=args.attention,
                    async_tp=args.async_tp, seed=args.seed, **_experts(args))
    if args.init_from_hf is not None:
        hf = json.loads((args.init_from_hf / "config.json").read_text())
        return config_from_hf(hf, **switches)
    overrides = {field: getattr(args, attr) for field, attr in (
        ("num_layers", "layers"), ("hidden", "hidden"), ("num_heads", "heads"),
        ("num_kv_heads", "kv_heads"), ("seq_len", "seq_len"), ("vocab_size", "vocab_size"))
        if getattr(args, attr) is not None}
    if args.tokenizer not in TRAINED:                 # a file: its vocabulary is the model's
        overrides["vocab_size"] = Tokenizer.load(args.tokenizer).vocab_size
    if "hidden" in overrides:
        overrides["ffn_hidden"] = 0  # back to the model's rule: 4h, or Llama's 8h/3
    if "num_heads" in overrides and "num_kv_heads" not in overrides:
        overrides["num_kv_heads"] = 0  # one per head, unless said
    config = CONFIGS[args.model].preset(args.preset, ln_placement=args.ln_placement, **switches,
                                        **overrides)
    if _experts(args) and not config.moe_experts:
        raise ValueError(f"--{'/--'.join(n.replace('_', '-') for n in _experts(args))} describe "
                         f"experts, and {args.preset} has none: give --moe-experts E, or an MoE "
                         "preset (llama-moe-tiny, mixtral-8x7b, qwen1.5-moe-a2.7b)")
    return config


MOE_FLAGS = ("moe_experts", "moe_topk", "moe_ffn_hidden", "moe_router", "moe_groups",
             "moe_topk_groups", "moe_shared_experts", "moe_shared_gate", "moe_aux_loss",
             "moe_group", "moe_capacity", "moe_z_loss", "moe_bias_rate")


def _experts(args: argparse.Namespace) -> dict:
    """The mixture-of-experts fields the --moe-* flags give (the preset's for the others); a
    dense preset given experts balances them at 0.01 unless told."""
    given = {name: getattr(args, name) for name in MOE_FLAGS if getattr(args, name) is not None}
    if given.get("moe_experts"):
        given.setdefault("moe_aux_loss", 0.01)
    return given


@dataclass
class Plan:
    """What validation derives: how the run is split, and the model; then ``data``, the
    tokenizer and the datasets, built once by the process that checked the run and handed to
    the ranks it launches (memory maps, pickled as their paths: no rank reads or hashes the
    corpus again)."""

    parallelism: Parallelism
    config: GPTConfig
    data: tuple | None = None


def validate(args: argparse.Namespace, world_size: int | None = None) -> Plan:
    """Every check that can fail, before any rank starts; a ValueError names the numbers.

    The parser has checked each number on its own (``megatron_edu.cli``); here are the checks
    that involve several of them, the data files and the checkpoint to resume from. The data's
    size needs the data: ``check_data``."""
    split = args.tp * args.cp * args.pp                  # the ranks of one model replica
    world = world_size or args.nproc or split * (args.dp or 1)
    if args.dp is None:
        if world % split:
            sizes = (f"tp·pp = {args.tp}·{args.pp}" if args.cp == 1
                     else f"tp·cp·pp = {args.tp}·{args.cp}·{args.pp}")
            raise ValueError(f"{world} ranks do not divide into {sizes}")
        args.dp = world // split
    if args.global_batch % (args.dp * args.micro_batch):
        raise ValueError(f"global batch {args.global_batch} is not divisible by dp·micro-batch "
                         f"= {args.dp}·{args.micro_batch}: each replica runs whole microbatches")
    if args.attention == "auto":                          # flash attention where there is one
        gpu = resolve_backend(args.backend, world) == "nccl"
        args.attention = "fused" if args.fused or gpu else "eager"
    pipeline = PipelineConfig(args.schedule, args.chunks, args.micro_batch,
                              args.global_batch // (args.dp * args.micro_batch))
    parallelism = Parallelism(Layout(args.tp, args.pp, args.dp, args.cp, args.ep), pipeline,
                              args.zero)
    parallelism.layout.check_world(world)
    _check_hf_start(args)
    config = model_config(args)
    parallelism.check(config)
    if args.sequence_parallel and args.tp == 1:
        raise ValueError("--sequence-parallel splits the sequence over the tensor-parallel "
                         "ranks: it needs --tp > 1")
    if args.tensorboard:
        try:
            import tensorboard  # noqa: F401 (torch.utils.tensorboard needs it)
        except ImportError:
            raise ValueError("--tensorboard needs the optional tensorboard package: pip install "
                             "tensorboard") from None
    if not args.min_lr <= args.lr:
        raise ValueError(f"--min-lr {args.min_lr:g} must be at most --lr {args.lr:g}")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA GPUs, and this machine shows none "
                         "(torch.cuda.is_available() is False): use --backend gloo or auto")
    for source in args.data:
        if source not in ("default", "wikitext103") and not source.startswith("hf:") \
                and not Path(source).exists():
            raise FileNotFoundError(f"--data {source}: no such file or folder")
    resume_from = args.out if args.resume == "auto" else args.resume
    if args.resume not in (None, "auto") or (args.resume == "auto" and
                                              (args.out / "checkpoints" / "latest").exists()):
        check_model(read_metadata(resume_from), config)  # missing, incomplete or another model
    return Plan(parallelism, config)


def _check_hf_start(args: argparse.Namespace) -> None:
    """``--init-from-hf DIR``: a Hugging Face folder with the tokenizer its corpus is read with
    (tokenizer.model or tokenizer.json, as ``checkpoint export-hf`` writes them), no other
    ``--tokenizer``, and a fresh run (not a resumed one)."""
    if args.init_from_hf is None:
        return
    if args.resume is not None:
        raise ValueError("--init-from-hf starts a run from a Hugging Face folder's weights, "
                         "--resume continues a run from its checkpoint: give one of them")
    if args.tokenizer != "sentencepiece":      # the default: nothing asked
        raise ValueError("--init-from-hf reads the folder's own tokenizer, which its model's "
                         f"vocabulary is of: drop --tokenizer {args.tokenizer}")
    if not (args.init_from_hf / "config.json").exists():
        raise FileNotFoundError(f"--init-from-hf {args.init_from_hf} holds no config.json (a "
                                f"folder checkpoint export-hf wrote has one)")
    Tokenizer.load(args.init_from_hf)    # tokenizer.model or tokenizer.json, or a clear error


def check_data(args: argparse.Namespace, train_set: TokenDataset) -> None:
    """Raise a ValueError unless the training split holds one global batch of sequences."""
    if args.global_batch > len(train_set):
        raise ValueError(f"--global-batch {args.global_batch} is larger than the training data: "
                         f"it holds {len(train_set)} sequences of {train_set.seq_len} tokens "
                         f"(give a smaller --global-batch or --seq-len, or more --data)")


# --- one rank's training loop --------------------------------------------------------------------

def train(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """Run on every rank; returns a summary, the same on every rank. A run that stops early —
    it diverged (``--max-bad-steps``), or a checkpoint could not be written — returns only
    ``{"error": one line saying why}``: no text is sampled from broken weights, no curve drawn.
    """
    parallelism = plan.parallelism
    grid = ParallelGrid(parallelism.layout, embedding_ranks=parallelism.stages.ends)
    torch.manual_seed(args.seed)
    config = plan.config
    tokenizer, train_set, val_set = plan.data or _data(args, config)  # built by main, or here
    trainer = PTDP(config, grid, PTDPOptions(
        scatter_gather=not args.no_scatter_gather, lr=args.lr, weight_decay=args.weight_decay,
        clip=args.clip, loss_scaling=args.dtype == "fp16"),
        pipeline=parallelism.pipeline, zero=parallelism.zero)
    if args.init_from_hf is not None:            # this rank's slices of the folder's weights
        state = read_hf(args.init_from_hf)[1]
        with trainer.gathered():
            for chunk in trainer.chunks:
                chunk.load_full_state_dict(state)
    if args.compile:
        for chunk in trainer.chunks:
            compile_blocks(chunk)
    sampler = BatchSampler(len(train_set), args.global_batch, grid.dp_rank, grid.dp, args.seed)
    start, resumed_from = _resume(args, trainer, sampler)
    saved: list[Path] = []                               # the checkpoints this run wrote
    writer = BackgroundWriter() if args.async_save else Writer()  # every rank: a collective
    log = _Log(args.out / "log.jsonl", grid.rank == 0, start, args.tensorboard)
    meter = _Meter(args, config, grid, log, start)
    autocast = cli.autocast(args.dtype, grid.device)
    streak = _Streak(args.dtype == "fp16", grid)
    traced = args.profile_ranks == "all" or grid.rank == 0
    profiler = StepProfiler(args.profile if traced else None,
                            args.out / f"profile_rank{grid.rank}.json", grid.device)
    for step in range(start, args.steps):
        profiler.at(step + 1)
        ids, labels = train_set.batch(next(sampler))
        lr = warmup_cosine(step, args.warmup, args.steps, args.lr, args.min_lr)
        with autocast:
            result = trainer.train_step(ids, labels, lr)
        if grid.rank == 0:
            refresh_lock(args.out)
        meter.step(step + 1, result, lr, streak.update(step + 1, result))
        if streak.count == args.max_bad_steps:
            break
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            with autocast:
                meter.validation(step + 1, _validate(args, trainer, val_set, grid))
        if (step + 1) % args.save_interval == 0 or step + 1 == args.steps:
            try:
                saved += _save(args, step + 1, trainer, sampler, tokenizer, streak, meter,
                               writer)
            except CheckpointError as err:  # a write failed on some rank: every rank stops
                meter.close()
                log.close()
                return {"error": str(err)}
    meter.close()
    log.close()
    profiler.close()
    try:
        writer.wait()                           # --async-save: the last save is published
    except CheckpointError as err:
        return {"error": str(err)}
    if streak.count:
        return {"error": _diverged(args, streak, resumed_from, saved, grid.rank == 0)}
    return _finish(args, trainer, tokenizer, log, train_set)


def _save(args, step: int, trainer: PTDP, sampler: BatchSampler, tokenizer, streak: _Streak,
          meter: _Meter, writer: Writer) -> list[Path]:
    """The checkpoint of ``step``, unless the step was bad or the weights are not finite (then
    it says so, and none): never a checkpoint of broken weights."""
    if streak.count:
        meter.say(f"step {step}: checkpoint not saved: the step was bad ({streak.reason})")
        return []
    scale = asdict(trainer.loss_scale) if trainer.options.loss_scaling else None
    try:
        return [save_checkpoint(args.out, step, trainer, {
            "sampler": sampler.state_dict(), "data": args.data, "loss_scale": scale},
            tokenizer.path, args.keep_last, writer)]
    except NonFiniteError as err:
        meter.say(f"step {step}: {err}")
        return []


def _diverged(args, streak: _Streak, resumed_from: Path | None, saved: list[Path],
              rank0: bool) -> str:
    """The one line that ends a diverged run. A checkpoint this run saved right before the
    first bad step holds the weights that went bad: rank 0 withdraws it, ``latest`` going back
    to the good one before (``checkpoint.withdraw_checkpoint``)."""
    note = ""
    if saved and saved[-1].name == f"step_{streak.first - 1:06d}":
        bad = saved.pop()
        if rank0:
            withdraw_checkpoint(args.out, streak.first - 1, saved[-1] if saved else resumed_from)
        note = (f" ({bad.name}, saved just before step {streak.first}, holds the weights that "
                f"diverged: renamed {bad.name}.diverged)")
    good = saved[-1] if saved else resumed_from
    where = f"last good checkpoint: {good}" if good else "no good checkpoint was saved"
    return f"{streak.describe(args)}; {where}{note}"


class _Streak:
    """Bad steps in a row, decided together by every rank.

    A step is bad when its loss is not finite, or when it was skipped (a non-finite gradient
    norm: no rank updated). Under fp16 a skip with a finite loss is the loss scale settling —
    reported, not counted — unless the scale is already down to 1 (the unscaled gradients
    overflow). Every rank holds the same loss and norm (all-reduced); the one all-reduce of
    the verdict makes the agreement explicit, so that all stop at the same step and none waits
    for a peer that has stopped.
    """

    def __init__(self, fp16: bool, grid: ParallelGrid) -> None:
        self.fp16, self.grid = fp16, grid
        self.count, self.first, self.loss, self.reason = 0, 0, 0.0, ""

    def update(self, step: int, result: StepResult) -> str | None:
        """Count ``step``; what was wrong with it (None: nothing)."""
        reason = ("non-finite loss" if not math.isfinite(result.loss) else
                  "non-finite gradient norm" if result.skipped else None)
        counts = reason is not None and (reason == "non-finite loss" or not self.fp16
                                         or result.loss_scale <= 1)
        flag = torch.tensor(float(counts), device=self.grid.device)
        if comm.all_reduce(flag, comm.world(), "bad step").item() > 0:
            if not self.count:
                self.first = step
            self.count, self.loss, self.reason = self.count + 1, result.loss, reason or ""
        else:
            self.count = 0
        return reason

    def describe(self, args: argparse.Namespace) -> str:
        """What went wrong, since when, and the likely cause."""
        if math.isfinite(self.loss):
            what = f"the gradient norm is not finite (the loss {self.loss:.3f})"
        else:
            what = f"the loss is {'NaN' if math.isnan(self.loss) else self.loss}"
        until = "" if self.count == args.max_bad_steps else ", up to the last step"
        hint = " (or fp16 overflows: try --dtype bf16)" if self.fp16 else ""
        return (f"{what} since step {self.first} ({self.count} steps in a row{until}); the "
                f"learning rate --lr {args.lr:g} is likely too high{hint}")


def _data(args, config: GPTConfig):
    source = args.data[0] if args.data[0] in ("default", "wikitext103") else args.data
    if isinstance(config, BertConfig):   # sentence pairs, masked (data/bert.py)
        return prepare_bert_data(source, config.vocab_size, config.seq_len, args.cache_dir,
                                 seed=args.seed)
    tokenizer = args.init_from_hf or (None if args.tokenizer in TRAINED else args.tokenizer)
    return prepare_data(source, config.vocab_size, config.seq_len, args.cache_dir,
                        model_type=TRAINED.get(args.tokenizer, "bpe"), tokenizer_path=tokenizer,
                        text_field=args.text_field)


def _resume(args, trainer: PTDP, sampler: BatchSampler) -> tuple[int, Path | None]:
    """The step to start from, and the checkpoint read (None: a fresh start)."""
    if args.resume is None:
        return 0, None
    path = args.out if args.resume == "auto" else Path(args.resume)
    if args.resume == "auto" and not (path / "checkpoints" / "latest").exists():
        return 0, None  # nothing saved yet: start afresh
    meta = load_checkpoint(path, trainer)
    sampler.load_state_dict(meta["state"]["sampler"])
    if trainer.options.loss_scaling and meta["state"].get("loss_scale"):  # fp16: the scale
        trainer.loss_scale = DynamicLossScale(**meta["state"]["loss_scale"])
    return meta["step"], Path(meta["path"])


def _validate(args, trainer: PTDP, val_set: TokenDataset, grid: ParallelGrid) -> float:
    """Mean loss over ``eval_batches`` fixed global batches of the validation split."""
    losses = [trainer.evaluate(*val_set.fixed_batch(i, args.global_batch, grid.dp_rank, grid.dp))
              for i in range(args.eval_batches)]
    return sum(losses) / len(losses)


# --- what rank 0 shows and writes ----------------------------------------------------------------

class _Log:
    """OUT/log.jsonl, appended by rank 0; a resumed run first drops records after its step.
    ``tensorboard``: every number of a record also a TensorBoard scalar of its step, in
    OUT/tensorboard (a resumed run's event files purged past its step, as the log is)."""

    def __init__(self, path: Path, active: bool, start: int, tensorboard: bool = False) -> None:
        self.path, self.active, self.board = path, active, None
        self.records: list[dict] = []
        if active:
            path.parent.mkdir(parents=True, exist_ok=True)
            if start and path.exists():
                self.records = [r for r in map(json.loads, path.read_text().splitlines())
                                if r["step"] <= start]
            path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        if active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.board = SummaryWriter(path.parent / "tensorboard", purge_step=start + 1)

    def write(self, record: dict) -> None:
        if self.active:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self.board.add_scalar(key, float(value), record["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


class _Meter:
    """Tokens/s, MFU and HFU per step (2104.04473 §5.1 FLOPs), a tqdm bar and the log records.

    MFU counts the model's FLOPs (no recomputation, whatever the run does); HFU the FLOPs the run
    executes (with ``--recompute``, the forward once more): equal without recomputation.
    """

    def __init__(self, args, config: GPTConfig, grid: ParallelGrid, log: _Log,
                 start: int) -> None:
        self.log, self.tokens = log, args.global_batch * config.seq_len
        self.skipped = sum(bool(r.get("skipped")) for r in log.records)  # before a resume
        self.model_flops = training_flops_of(config, args.global_batch)   # the block's own
        self.hardware_flops = training_flops_of(config, args.global_batch, config.recompute)
        self.recompute = config.recompute != "none"
        self.fp16 = args.dtype == "fp16"
        self.peak_total = _peak_flops(args, grid)
        self.device = grid.device
        self.bar = None
        if log.active and not args.no_progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=args.steps, initial=start, desc="training", unit="step",
                            file=sys.stdout, dynamic_ncols=True)
        self.last = time.perf_counter()

    def step(self, step: int, result: StepResult, lr: float, problem: str | None) -> None:
        """One record per step; a step skipped (a non-finite gradient norm) or with a
        non-finite loss says so — ``problem`` — in its record and in a line, and every record
        counts the steps skipped so far."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        mfu = model_flops_utilization(self.model_flops, seconds, self.peak_total)
        hfu = model_flops_utilization(self.hardware_flops, seconds, self.peak_total)
        self.skipped += result.skipped
        record = {"step": step, "loss": result.loss, "lr": lr,
                  "grad_norm": None if result.skipped else result.grad_norm,
                  "skipped": result.skipped, "skipped_steps": self.skipped,
                  "tokens_per_s": self.tokens / seconds, "mfu": mfu, "hfu": hfu,
                  "max_memory_gib": _max_memory_gib(self.device)}
        if problem:
            record["reason"] = problem
        if self.fp16:
            record["loss_scale"] = result.loss_scale
        record.update(result.moe or {})                   # experts: their load, balance
        self.log.write(record)
        if problem:
            scale = f" at loss scale {result.loss_scale:g}" if self.fp16 else ""
            self.say(f"step {step}: {'skipped: ' if result.skipped else ''}{problem}{scale}")
        if self.bar is not None:
            shown = dict(loss=f"{result.loss:.3f}", tok_s=f"{self.tokens / seconds:,.0f}",
                         mfu=f"{mfu:.0%}")
            if self.recompute:
                shown["hfu"] = f"{hfu:.0%}"
            if self.skipped:
                shown["skipped"] = self.skipped
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update()

    def validation(self, step: int, val_loss: float) -> None:
        self.log.write({"step": step, "val_loss": val_loss, "val_ppl": _perplexity(val_loss)})
        if self.bar is not None:
            self.bar.write(f"step {step}: validation loss {val_loss:.3f}, "
                           f"perplexity {_perplexity(val_loss):.1f}")
        self.last = time.perf_counter()  # validation time is not training throughput

    def say(self, line: str) -> None:
        """A line from rank 0, above the bar (or plain, without one)."""
        if self.bar is not None:
            self.bar.write(line)
        elif self.log.active:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _max_memory_gib(device: torch.device) -> float:
    """Rank 0's peak memory so far: allocated on its GPU (a host-side counter, no sync), or
    its process's resident set on a CPU (``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _peak_tflops(text: str) -> float | str:
    """``--peak-tflops``: a finite number of TFLOP/s > 0, or 'measured'."""
    if text == "measured":
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be TFLOP/s > 0 or 'measured', "
                                         f"got {text}") from None


def _peak_flops(args, grid: ParallelGrid) -> float:
    """The machine's peak FLOP/s, the sum of every rank's: ``--peak-tflops N``; by default its
    GPU's datasheet dense bf16 peak (``perf.datasheet_peak_flops``); with ``--peak-tflops
    measured``, or where no datasheet applies (a CPU), the rate of a matmul that every rank
    times at the same moment: honest when ranks share cores (a laptop)."""
    if isinstance(args.peak_tflops, float):
        mine = args.peak_tflops * 1e12
    else:
        mine = None if args.peak_tflops == "measured" else datasheet_peak_flops(grid.device)
    torch.distributed.barrier()
    if mine is None:
        dtype = torch.bfloat16 if grid.device.type == "cuda" else torch.float32
        mine = measure_matmul_flops(grid.device, dtype)
    total = torch.tensor(mine, dtype=torch.float64, device=grid.device)
    return comm.all_reduce(total, comm.world(), "peak flops").item()


def _finish(args, trainer: PTDP, tokenizer, log: _Log, train_set: TokenDataset) -> dict:
    """Loss curve, a text sample, and a summary every rank returns."""
    prompt = tokenizer.encode("The ")
    bert = isinstance(trainer.config, BertConfig)
    generates = not bert and trainer.grid.cp == 1        # a KV cache holds whole sequences
    sample = tokenizer.decode(prompt + _sample(args, trainer, prompt)) if generates else None
    records = log.records
    summary = {
        "out": str(args.out),
        "final_loss": next((r["loss"] for r in reversed(records) if "loss" in r), None),
        "final_val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r),
                               None),
        "unigram_entropy": unigram_entropy(train_set.tokens),
        "tokens_per_s": _median([r["tokens_per_s"] for r in records if "tokens_per_s" in r]),
        "mfu": _median([r["mfu"] for r in records if "mfu" in r]),
        "hfu": _median([r["hfu"] for r in records if "hfu" in r]),
        "sample": sample,                          # None for a BERT, and at cp > 1
    }
    if log.active:
        import matplotlib.pyplot as plt

        from megatron_edu.course.viz.training import draw_loss_curve
        plt.close(draw_loss_curve(records, summary["unigram_entropy"], args.out / "loss.png"))
    return summary


def _sample(args, trainer: PTDP, prompt: list[int]) -> list[int]:
    """A few tokens from the trained model (top-k sampling), on the training layout (without
    sequence parallelism, which a KV cache cannot use: the same weights in twin chunks)."""
    room = trainer.config.seq_len - len(prompt)  # the KV cache holds at most seq_len tokens
    if min(args.sample_tokens, room) <= 0:
        return []
    from megatron_edu.generate import generate
    with trainer.gathered():                          # ZeRO-3: the whole weights, for a moment
        chunks = trainer.chunks
        if trainer.config.sequence_parallel:
            chunks = build_chunks(replace(trainer.config, sequence_parallel=False), trainer.grid,
                                  trainer.schedule.stages)
            for twin, chunk in zip(chunks, trainer.chunks, strict=True):
                twin.load_state_dict(chunk.state_dict())
        return generate(chunks, trainer.grid, prompt, min(args.sample_tokens, room), top_k=20,
                        seed=args.seed, stages=trainer.schedule.stages)


def _perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows (a diverging run)."""
    return math.inf if loss > 700 else math.exp(loss)


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


# --- entry point ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_edu.train``: check, launch the ranks, report; the exit status:
    0 trained; 2 refused before any rank started (a bad argument, too little data, the output
    folder locked by another run, not writable or too small for a checkpoint); 1 the run failed
    or stopped (a rank's error, divergence, a checkpoint that could not be written)."""
    try:
        args = parse_args(argv)
    except SystemExit as exit_:                  # a bad argument (one line printed), --help
        return int(exit_.code or 0)
    torchrun = under_torchrun()
    owner = not torchrun or int(os.environ["RANK"]) == 0   # takes the lock, checks the folder
    try:
        plan = validate(args, int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if owner:
            prepare_folder(args.out)
            acquire_lock(args.out)
            write_run_record(args.out, args, plan.parallelism)
    except (ValueError, OSError, RunFolderError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with exit_on_sigterm():               # SIGTERM (SLURM, torchrun) reaches the finally too
            try:
                plan.data = _data(args, plan.config)      # build the caches once, here
                check_data(args, plan.data[1])
                if owner:
                    _check_space(args, plan)
            except (ValueError, OSError, RuntimeError) as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            return _launch(args, plan, torchrun)
    finally:
        if owner:
            release_lock(args.out)


def _check_space(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse if one checkpoint cannot fit in ``--out``; warn if all of them cannot."""
    one = checkpoint_bytes(plan.config, plan.parallelism)
    free = check_space(args.out, one, "one checkpoint (weights and AdamW state)")
    saves = len({*range(args.save_interval, args.steps + 1, args.save_interval), args.steps})
    if args.keep_last is not None:           # at most N kept and one being written
        saves = min(saves, args.keep_last + 1)
    if saves * one > free:
        print(f"warning: the {saves} checkpoints of this run take about "
              f"{format_bytes(saves * one)}, {format_bytes(free)} are free in {args.out}: the "
              f"disk fills before the end (delete old checkpoints, or raise --save-interval)",
              file=sys.stderr)


def _launch(args: argparse.Namespace, plan: Plan, torchrun: bool) -> int:
    """Run ``train`` on the ranks; report; the exit status."""
    if plan.config.attention == "fused" and (not torchrun or int(os.environ["RANK"]) == 0):
        print(_attention_line(plan), flush=True)        # not the default on a CPU: say so
    if plan.config.async_tp:
        # A GPU then runs kernels in launch order across streams, so dX's all-reduce starts
        # before the dW GEMM fills the GPU and overlaps it (megatron-core requires it for async
        # TP). Read when each rank creates its CUDA context, after this; the ranks inherit it.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        summaries = run(train, plan.parallelism.world_size, args, plan, backend=args.backend,
                        timeout=None, collective_timeout=60 * args.collective_timeout,
                        capture_output=False)
    except RankError as err:  # the failing rank's traceback, without the launcher's own
        print(f"error: training failed on {err}", file=sys.stderr)
        return 1
    shown = not torchrun or int(os.environ["RANK"]) == 0
    if "error" in summaries[0]:                  # diverged, or a checkpoint write failed
        if shown:
            print(f"error: {summaries[0]['error']}", file=sys.stderr)
        return 1
    if shown:
        _report(summaries[0])
    return 0


def _attention_line(plan: Plan) -> str:
    """Which attention core the run computes with, and what that means for its dropout."""
    config = plan.config
    core = "ring (context parallelism)" if plan.parallelism.cp > 1 else config.attention
    masks = ("" if config.dropout == 0 else "; dropout masks from the device's generator, "
             "not the serial model's" if core == "fused" else "; the serial model's dropout masks")
    return f"attention core: {core}{masks}"


def _report(s: dict[str, Any]) -> None:
    print(f"\nfinal training loss {s['final_loss']:.3f}, validation loss "
          f"{s['final_val_loss']:.3f} (perplexity {_perplexity(s['final_val_loss']):.1f}); "
          f"unigram entropy of the corpus {s['unigram_entropy']:.3f}")
    recomputed = s["hfu"] is not None and s["hfu"] > s["mfu"]
    hfu = f", HFU {s['hfu']:.0%} (with the recomputed forward)" if recomputed else ""
    print(f"throughput {s['tokens_per_s']:,.0f} tokens/s (median), MFU {s['mfu']:.0%}{hfu}")
    print(f"\nsample: {s['sample']!r}\n" if s["sample"] is not None else "")
    print(f"log         {s['out']}/log.jsonl\nloss curve  {s['out']}/loss.png\n"
          f"checkpoints {s['out']}/checkpoints/")


if __name__ == "__main__":
    sys.exit(main())
