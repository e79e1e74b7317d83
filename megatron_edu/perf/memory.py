"""Memory per GPU: weights, gradients, optimizer states and activations of a model (a
``GPTConfig``) split as a ``ptdp.Parallelism`` says.

References
- Korthikanti et al. 2022, arXiv 2205.05198 §4: activations saved per transformer layer,
  s·b·h·(34 + 5·a·s/h) bytes with 16-bit values and 1-byte dropout masks; with tensor
  parallelism s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallelism s·b·h/t·(34 + 5·a·s/h);
  selective recomputation drops the 5·a·s/h term; full recomputation keeps the 2·s·b·h input.
  The same count for the other blocks a config builds, tensor by tensor as the code saves them
  (``activation_bytes_per_layer``): Llama's RMSNorm, rotary positions, SwiGLU, grouped-query
  attention and no dropout (Touvron et al. 2023, arXiv 2307.09288 §2.2).
- Narayanan et al. 2021, arXiv 2104.04473 §2.2, and Qi et al. 2023, arXiv 2401.10241 §2.3: how
  many microbatches a pipeline rank holds is read off its schedule (``pipeline.schedules``): a
  forward stores its activations, the backward frees them — or, when the schedule splits the
  backward, the weight-gradient pass W does (GPipe m, 1F1B p − rank, ZB-H1 p, ZB-H2 2p − 1).
- Rajbhandari et al. 2019, ZeRO (arXiv 1910.02054) §3: 2 + 2 + 12 = 16 bytes per parameter in
  mixed precision; stage 1 (Megatron's distributed optimizer) shards the optimizer over the ranks
  that hold the same weights: dp, and under context parallelism dp·cp (megatron-core's); stage 2
  the gradients too, stage 3 (FSDP) the weights too.
- Liu et al. 2023, ring attention (arXiv 2310.01889), and megatron-core's context parallelism:
  a cp rank holds s/cp tokens of every sequence, so every s·b·h and s·b·V term is (s/cp)·b·h and
  (s/cp)·b·V. The attention core is a ring (``context_parallel.ring_attention``) that never
  stores the [s, s] scores: instead of the 5·a·s²·b/t of the softmax, its dropout mask and
  output it keeps its output (s/cp)·b·h/t and the log-sum-exp a·(s/cp)·b/t (fp32), recomputing
  the scores and the masks block by block in backward (flash attention's way). Selective
  recomputation has nothing left to drop there; full recomputation keeps the layer input.
- A mixture of experts in place of the MLP (``model.moe``; GShard, Lepikhin et al. 2020, arXiv
  2006.16668 §2; megatron-core's expert parallelism): a GPU holds E/ep of each layer's experts,
  each split over tp as the MLP. ZeRO shards their state over the dp·cp/ep ranks that hold the
  same experts (the expert-data-parallel group), the rest of the model's over dp·cp. Saved for
  backward, under uniform routing: the router's fp32 input and scores, the b·(s/cp)·k rows
  dispatched to the experts (each token's k copies, whole on every tp rank, whatever ep) and
  returned from them, and the experts' SwiGLU intermediates of those rows, f_e/t wide.

The model's sizes, its recomputation and sequence parallelism come from the config, the split
from the parallelism — its layout's tp, cp, pp, dp, its pipeline's schedule, chunks and
microbatches, its ZeRO stage —, and whether it can split the model is its rule
(``Parallelism.check``), asked once. Bytes are exact integers; ``str(estimate)`` reads in GiB.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache

import numpy as np

from megatron_edu.model.config import RECOMPUTE, GPTConfig
from megatron_edu.pipeline.schedules import PipelineConfig, Schedule, make_schedule
from megatron_edu.ptdp import Parallelism

from .flops import expert_parameters

__all__ = ["GIB", "FP32", "MIXED", "MIXED_FP32_GRADS", "Precision", "MemoryEstimate",
           "parameters_per_rank", "expert_parameters_per_rank", "activation_bytes_per_layer",
           "output_layer_activation_bytes",
           "embedding_activation_bytes", "forwards_in_flight", "activation_bytes_per_rank",
           "memory_per_rank"]

GIB = 2**30


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for each copy the training keeps, and per saved activation value."""

    weights: int
    grads: int
    master: int  # the optimizer's fp32 copy of the weights (0 when the weights are fp32)
    adam: int  # Adam's two moments
    activation: int  # dropout masks are 1 byte whatever this is


FP32 = Precision(weights=4, grads=4, master=0, adam=8, activation=4)
MIXED = Precision(weights=2, grads=2, master=4, adam=8, activation=2)  # 16 bytes/param
MIXED_FP32_GRADS = Precision(weights=2, grads=4, master=4, adam=8, activation=2)  # 18 bytes/param


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds at its peak."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "total", self.weights + self.grads + self.optimizer + self.activations
        )

    def __str__(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations")
        terms = " + ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)
        return f"{terms} = {self.total / GIB:.2f} GiB"


# ---- parameters ---------------------------------------------------------------------------------


def parameters_per_rank(config: GPTConfig, parallelism: Parallelism, stage: int = 0) -> int:
    """Parameters one GPU of pipeline rank ``stage`` holds: ``config.num_parameters`` (the one
    exact count, Megatron's split of 1909.08053 §3) of each model chunk the rank holds, l/(pp·v)
    layers each, with the embeddings on the chunk of the first stage and the final norm and
    the output layer on the chunk of the last: a copy of the word table, or an untied output
    layer of its own (Llama's), V·h/t either way. Where the chunks are is
    ``parallelism.stages`` (ZB-V's V puts both ends on rank 0, each chunk with its own copy of the
    word table). A mixture of experts: E/ep experts a layer (``expert_parameters_per_rank``). A
    ValueError if it cannot split the model (``Parallelism.check``)."""
    parallelism.check(config)
    stages = parallelism.stages
    layers, last = config.num_layers // stages.num_stages, stages.num_stages - 1
    held = [stages.stage(stage, chunk) for chunk in range(stages.v)]
    return sum(config.num_parameters(parallelism.tp, layers, first=s == 0, last=s == last,
                                     ep=parallelism.ep) for s in held)


def expert_parameters_per_rank(config: GPTConfig, parallelism: Parallelism) -> int:
    """The routed experts' parameters one GPU holds (0 for a dense model): in each of its l/pp
    layers E/ep experts of 3·h·f_e, split over tp as the MLP (``GPTConfig.num_parameters``)."""
    per_layer = config.moe_experts // parallelism.ep * expert_parameters(config)
    return config.num_layers // parallelism.pp * per_layer // parallelism.tp


# ---- activations, per layer (2205.05198 §4) -----------------------------------------------------

_KEPT_UNLESS_FULL = ("none", "selective")  # full recomputation reruns the whole layer
_ATTENTION_CORE = ("none",)  # selective recomputation reruns softmax, its dropout and ·V
# which arrangement of the attention core keeps a row: any; the op-by-op core's scores (cp = 1);
# the ring (cp > 1); the core's inputs as the block passes them, which a checkpoint keeps
# (selective recomputation at cp = 1) and so does the ring (``_RingAttention``)
_ANY, _SCORES, _RING, _INPUTS = "any", "scores", "ring", "inputs"


def _every(config: GPTConfig) -> bool:
    return True


def _gelu(config: GPTConfig) -> bool:
    return config.mlp == "gelu" and not config.moe_experts


def _swiglu(config: GPTConfig) -> bool:
    """A SwiGLU MLP: the block's, or a mixture's shared experts (of width "sbf")."""
    return config.mlp == "swiglu" or config.moe_experts > 0


def _mlp_input(config: GPTConfig) -> bool:
    """Whether an MLP keeps its input: a dense one, or a mixture's shared experts (the router
    keeps its own fp32 copy)."""
    return not config.moe_experts or config.moe_shared_experts > 0


def _moe(config: GPTConfig) -> bool:
    return config.moe_experts > 0


def _shared_gate(config: GPTConfig) -> bool:
    return config.moe_experts > 0 and config.moe_shared_experts > 0 and config.moe_shared_gate


def _rotary(config: GPTConfig) -> bool:
    return config.positions == "rope"


def _grouped(config: GPTConfig) -> bool:
    """Grouped-query attention: several query heads share each kv head."""
    return config.num_kv_heads < config.num_heads


def _q_made_anew(config: GPTConfig) -> bool:
    """Whether the block makes Q anew: turned by rotary positions, or (several query heads a
    group) gathered from its groups; else a view of the QKV output."""
    return _rotary(config) or _grouped(config)


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd keeps for the backward pass (2205.05198 §4.1)."""

    what: str
    count: int  # how many units of `unit` (s: the s/cp tokens of a context-parallel rank)
    unit: str  # "sbh"; "sbf" (the MLP's width f); "sbq" (the QKV output, h + 2k a token);
    #            "qh" (the QKV weight, (h + 2k)·h);
    #            "as2b" (attention scores), "asb" (one per head and token), "sbV" (logits);
    #            "sbE" (router scores), "rh" and "rf" (the k·s·b rows dispatched to experts)
    split: str  # "tp": split over tensor ranks; "seq": split only under sequence parallelism;
    #             "whole": on every tensor rank
    dtype: str  # "value" (activation bytes), "mask" (1 byte), "fp32" (4 bytes)
    kept_with: tuple[str, ...] = RECOMPUTE  # recompute modes under which it stays saved
    needs_dropout: bool = False
    attention: str = _ANY  # _SCORES, _RING, _INPUTS: the core's arrangements that keep it
    block: Callable[[GPTConfig], bool] = _every  # the blocks that save it (MLP, positions, GQA)


_LAYER = (  # one transformer layer; GPT-2, 16-bit: 10·sbh replicated + 24·sbh/t + 5·as²b/t
    _Saved("norm 1 input (= layer input)", 1, "sbh", "seq", "value"),
    _Saved("QKV input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL),
    # Q, K, V: the op-by-op core's batched matmuls keep contiguous copies, a·d = h columns each
    # whatever the kv heads, the core copying each kv head to its query heads (2205.05198's
    # "Q and K" 4 + "V" 2 bytes); the core's inputs, which a checkpoint or the ring keeps
    # instead, hold the g kv heads only: V a view of the QKV output (kept whole, h + 2k a token),
    # Q and K views of it too, or made anew (Q turned or gathered, K turned: k columns)
    _Saved("Q, K and V (the core's matmul copies)", 3, "sbh", "tp", "value", _ATTENTION_CORE,
           attention=_SCORES),
    _Saved("QKV output (V, and Q and K unless made anew, views of it)", 1, "sbq", "tp", "value",
           _KEPT_UNLESS_FULL, attention=_INPUTS),
    _Saved("Q turned by rotary positions, or gathered from its groups", 1, "sbh", "tp", "value",
           _KEPT_UNLESS_FULL, attention=_INPUTS, block=_q_made_anew),
    _Saved("K turned by rotary positions (its kv heads)", 1, "sbk", "tp", "value",
           _KEPT_UNLESS_FULL, attention=_INPUTS, block=_rotary),
    # grouped-query attention's one GEMM takes q's and kv's rows put together (GroupedQKV): a
    # weight-sized copy each microbatch keeps, (h + 2k)·h/t values, not a view of a parameter
    _Saved("the QKV weight, q's and kv's rows put together", 1, "qh", "tp", "value",
           _KEPT_UNLESS_FULL, block=_grouped),
    _Saved("softmax output", 1, "as2b", "tp", "value", _ATTENTION_CORE, attention=_SCORES),
    _Saved("attention dropout mask", 1, "as2b", "tp", "mask", _ATTENTION_CORE, True, _SCORES),
    _Saved("attention dropout output", 1, "as2b", "tp", "value", _ATTENTION_CORE, True, _SCORES),
    _Saved("ring attention output", 1, "sbh", "tp", "value", _KEPT_UNLESS_FULL, attention=_RING),
    _Saved("ring attention log-sum-exp", 1, "asb", "tp", "fp32", _KEPT_UNLESS_FULL,
           attention=_RING),
    _Saved("projection input", 1, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("projection dropout mask", 1, "sbh", "seq", "mask", _KEPT_UNLESS_FULL, True),
    _Saved("norm 2 input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL),
    _Saved("MLP input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL, block=_mlp_input),
    _Saved("GeLU input", 1, "sbf", "tp", "value", _KEPT_UNLESS_FULL, block=_gelu),
    # SwiGLU (fused.bias_swiglu): silu(gate) keeps the gate, a view of the fc output, whole
    _Saved("SwiGLU's gate and up (the fc output)", 2, "sbf", "tp", "value", _KEPT_UNLESS_FULL,
           block=_swiglu),
    _Saved("silu(gate), the product's other factor", 1, "sbf", "tp", "value",
           _KEPT_UNLESS_FULL, block=_swiglu),
    _Saved("MLP output layer input", 1, "sbf", "tp", "value", _KEPT_UNLESS_FULL),
    # a mixture of experts (its shared experts are the MLP above, f = f_e·n wide): the router
    # scores its tokens in fp32 (softmax or sigmoid keeps the scores, the z-loss the logits);
    # each tp rank dispatches the k rows of every token, and weighs the rows that come back
    _Saved("router input, fp32", 1, "sbh", "seq", "fp32", _KEPT_UNLESS_FULL, block=_moe),
    _Saved("router logits and scores", 2, "sbE", "seq", "fp32", _KEPT_UNLESS_FULL, block=_moe),
    _Saved("dispatched rows (the experts' fc input)", 1, "rh", "whole", "value",
           _KEPT_UNLESS_FULL, block=_moe),
    _Saved("the experts' gate and up", 2, "rf", "tp", "value", _KEPT_UNLESS_FULL, block=_moe),
    _Saved("the experts' silu(gate)", 1, "rf", "tp", "value", _KEPT_UNLESS_FULL, block=_moe),
    _Saved("the experts' proj input", 1, "rf", "tp", "value", _KEPT_UNLESS_FULL, block=_moe),
    _Saved("returned rows, for the router weights' gradient", 1, "rh", "whole", "value",
           _KEPT_UNLESS_FULL, block=_moe),
    _Saved("shared experts' output, for their gate", 1, "sbh", "seq", "value",
           _KEPT_UNLESS_FULL, block=_shared_gate),
    _Saved("MLP dropout mask", 1, "sbh", "seq", "mask", _KEPT_UNLESS_FULL, True),
)
_EMBEDDING = (_Saved("embedding dropout mask", 1, "sbh", "seq", "mask", needs_dropout=True),)
_OUTPUT = (  # 2205.05198 §4.3: 4·sbh/t·(1 + V/h) with sequence parallelism
    _Saved("final norm input", 1, "sbh", "seq", "value"),
    _Saved("output layer input", 1, "sbh", "seq", "value"),
    _Saved("logits for the cross entropy", 1, "sbV", "tp", "fp32"),
)


def _saved_bytes(table: tuple[_Saved, ...], config: GPTConfig, microbatch: int, tp: int,
                 recompute: str, bytes_per_value: int, dropout: bool | None, cp: int) -> int:
    """Bytes of the tensors of ``table`` that ``config``'s block saves and that stay saved
    under ``recompute``, per tensor and context rank: s is the s/cp tokens a cp rank holds;
    the attention core's rows are the scores' at cp = 1, the ring's at cp > 1, its inputs' where
    a checkpoint or the ring keeps them."""
    s, b, h, a = config.seq_len // cp, microbatch, config.hidden, config.num_heads
    k = max(config.num_kv_heads, tp) * config.head_dim  # at tp > g: one kv head a rank
    experts = config.moe_experts
    f = config.moe_ffn_hidden * config.moe_shared_experts if experts else config.ffn_hidden
    rows = config.moe_topk * s * b  # dispatched: as many arrive as leave, uniformly routed
    units = {"sbh": s * b * h, "sbf": s * b * f, "sbq": s * b * (h + 2 * k),
             "qh": (h + 2 * k) * h,
             "sbk": s * b * k,
             "as2b": a * s * s * b, "asb": a * s * b, "sbV": s * b * config.padded_vocab(tp),
             "sbE": s * b * experts, "rh": rows * h, "rf": rows * config.moe_ffn_hidden}
    dtype_bytes = {"value": bytes_per_value, "mask": 1, "fp32": 4}
    dropout = config.dropout > 0 if dropout is None else dropout
    cores = {_ANY, _RING, _INPUTS} if cp > 1 else {_ANY, _SCORES}
    if cp == 1 and recompute == "selective":   # the checkpointed core keeps its inputs
        cores.add(_INPUTS)
    total = 0
    for x in table:
        if (recompute not in x.kept_with or (x.needs_dropout and not dropout)
                or x.attention not in cores or not x.block(config)):
            continue
        shards = tp if x.split == "tp" or (x.split == "seq" and config.sequence_parallel) else 1
        total += x.count * units[x.unit] // shards * dtype_bytes[x.dtype]
    return total


def activation_bytes_per_layer(config: GPTConfig, microbatch: int, *, tp: int = 1,
                               bytes_per_value: int = 2, dropout: bool | None = None,
                               cp: int = 1) -> int:
    """Bytes one transformer layer saves for its backward, per tensor rank (2205.05198 §4), under
    ``config.recompute`` and ``config.sequence_parallel``; ``dropout`` None: whether the config
    has dropout (its 1-byte masks are saved). At ``cp`` > 1, per context rank: s/cp tokens,
    and ring attention's output and log-sum-exp where the scores were (2310.01889).

    Any block ``config`` builds, row by row as its code saves (``_LAYER``); GPT-2's is the
    paper's s·b·h·(10 + 24/t + 5·a·s/(h·t)). A Llama block (RMSNorm, rotary positions, SwiGLU
    of width f, no dropout, any number of kv heads), 16-bit, without sequence parallelism:

        s·b·h·(8 + (8 + 8·f/h)/t) + 2·a·s²·b/t

    8·sbh whole: both norms' inputs, the QKV and the MLP inputs (/t under sequence parallelism);
    per tensor rank 6·sbh/t of Q, K, V (the core's matmuls keep copies, a·d = h columns each:
    grouped-query attention saves no activations here, the core copies its K and V per query
    head, ``context_parallel.each_head``), 2·sbh/t of projection input, 2·a·s²·b/t of softmax
    output (no dropout: no mask, no second copy), and SwiGLU's fc output [gate | up], silu(gate)
    and their product, 2·(2 + 1 + 1)·sbf/t. Selective recomputation drops the scores and keeps
    the core's inputs, the g kv heads only: the QKV output whole (V is a view of it, h + 2k a
    token), the turned Q and the turned K (k = num_kv_heads·d), 2·(2h + 3k)·sb/t (10·sbh/t with
    one kv head per query head, Llama-2-7B). Full recomputation keeps the layer's input.

    A mixture of experts in place of the MLP (E experts of f_e units, k a token, no shared
    experts), the same block otherwise:

        s·b·(h·(10 + 4k) + 8·E) + s·b·(8h + 8k·f_e)/t + 2·a·s²·b/t

    whole: no MLP input but the router's fp32 copy of it (4·sbh) and its logits and scores
    (2 × 4·sbE), the k·s·b dispatched rows and the k·s·b rows returned (2·k·sbh each: every tp
    rank dispatches all its tokens); per tensor rank the experts' SwiGLU over those rows,
    8·k·sb·f_e/t. Uniform routing: however ep splits the experts, as many rows arrive as leave.
    n shared experts add an MLP's input (2·sbh) and its SwiGLU, 8·sb·f_e·n/t, and their gate its
    output (2·sbh); the router's [sb, k] weights and the dispatcher's row indices (a few bytes a
    row) are rounded away as the norms' statistics are.

    A norm's statistics (a float or two per token) are rounded away, as the paper does for
    LayerNorm's. A fused RMSNorm keeps only its input (megatron-core's; PyTorch's
    ``_fused_rms_norm``, whose backward reads the input and 1/rms); PyTorch's composite
    rms_norm, the one a CPU runs, also keeps x/rms(x) for the weight's gradient (one sbh more
    per norm), and rotary positions keep their cos and sin (2·s·d). megatron-core keeps less
    where its kernels do: flash attention takes the g kv heads uncopied (2·s·b·k/t for K and
    V), its fused SwiGLU recomputes silu(gate) (3·sbf/t)."""
    return _saved_bytes(_LAYER, config, microbatch, tp, config.recompute, bytes_per_value,
                        dropout, cp)


def output_layer_activation_bytes(config: GPTConfig, microbatch: int, *, tp: int = 1,
                                  bytes_per_value: int = 2, cp: int = 1) -> int:
    """Final layer norm, output layer and the fp32 logits over the padded vocabulary (never
    recomputed; 2205.05198 §4.3), of the s/cp tokens of a context rank."""
    return _saved_bytes(_OUTPUT, config, microbatch, tp, "none", bytes_per_value, False, cp)


def embedding_activation_bytes(config: GPTConfig, microbatch: int, *, tp: int = 1,
                               dropout: bool | None = None, cp: int = 1) -> int:
    """The embedding's dropout mask (2205.05198 §4.3) of the s/cp tokens of a context rank; the
    lookup itself saves only indices."""
    return _saved_bytes(_EMBEDDING, config, microbatch, tp, "none", 1, dropout, cp)


# ---- activations, per pipeline rank: read off the schedule --------------------------------------


@cache
@lru_cache(maxsize=1)
def _schedule(schedule: str, p: int, m: int, v: int) -> Schedule:
    """The last schedule made: the first and the last rank are read off the same one."""
    return make_schedule(schedule, p, m, v)


@lru_cache(maxsize=4096)
def _held_after_forwards(schedule: str, p: int, m: int, v: int, rank: int) -> np.ndarray:
    """[states, v]: how many microbatches pipeline rank ``rank`` holds per model chunk right
    after each of its forwards — where any peak is —, each distinct state once, in the order
    the schedule first reaches it.

    The schedule's own walk (``Schedule.in_flight``, which the simulator's peak counts too).
    Cached: a sweep asks the same schedules again and again, and a rank repeats a few states
    however many microbatches it runs.
    """
    made = _schedule(schedule, p, m, v)
    seen = {held: None for action, held in zip(made[rank], made.in_flight(rank), strict=True)
            if action.kind == "F"}
    return np.array(list(seen), dtype=np.int64).reshape(-1, v)


def _held(pipeline: PipelineConfig, p: int, stage: int) -> np.ndarray:
    return _held_after_forwards(pipeline.schedule, p, pipeline.num_microbatches, pipeline.chunks,
                                stage)


def forwards_in_flight(pipeline: PipelineConfig, p: int, stage: int = 0) -> list[int]:
    """Per model chunk, the microbatches whose activations pipeline rank ``stage`` of p holds when
    it holds the most, read off ``pipeline.make_schedule(p)``: GPipe m; 1F1B p − rank
    (2104.04473 §2.2.1); interleaved, on rank 0, p + (p − 1)/v stages' worth (§2.2.2); ZB-H1 p on
    every rank, ZB-H2 2p − 1 (2401.10241 §2). Their sum is
    ``simulate(...).peak_activations[stage]``."""
    held = _held(pipeline, p, stage)
    return held[held.sum(axis=1).argmax()].tolist()


def activation_bytes_per_rank(config: GPTConfig, parallelism: Parallelism, stage: int = 0, *,
                              bytes_per_value: int = 2, dropout: bool | None = None) -> int:
    """Activations a GPU of pipeline rank ``stage`` holds at its peak (of its s/cp tokens under
    context parallelism, ``parallelism.cp``).

    Each chunk's microbatch weighs its layers' bytes, plus the embedding's on the chunk of the
    first stage and the output layer's on the chunk of the last; the peak is the heaviest moment
    of the schedule (right after a forward). While one layer runs its backward, what
    recomputation rebuilt for it is alive too.
    """
    b, t, cp, stages = parallelism.microbatch, parallelism.tp, parallelism.cp, parallelism.stages

    def layer(keeping: GPTConfig) -> int:
        return activation_bytes_per_layer(keeping, b, tp=t, bytes_per_value=bytes_per_value,
                                          dropout=dropout, cp=cp)

    kept = layer(config)
    per_chunk = []
    for chunk in range(stages.v):
        held = stages.stage(stage, chunk)
        weight = config.num_layers // stages.num_stages * kept
        if held == 0:
            weight += embedding_activation_bytes(config, b, tp=t, dropout=dropout, cp=cp)
        if held == stages.num_stages - 1:
            weight += output_layer_activation_bytes(config, b, tp=t,
                                                    bytes_per_value=bytes_per_value, cp=cp)
        per_chunk.append(weight)
    held = _held(parallelism.pipeline, parallelism.pp, stage)
    peak = int((held @ np.array(per_chunk, dtype=np.int64)).max())
    # while one layer runs its backward, what recomputation rebuilt for it is alive too
    rebuilt = kept if config.recompute == "none" else layer(replace(config, recompute="none"))
    return peak + rebuilt - kept


def memory_per_rank(config: GPTConfig, parallelism: Parallelism, *,
                    precision: Precision = MIXED, dropout: bool | None = None,
                    stage: int | None = None) -> MemoryEstimate:
    """Peak bytes on one GPU of pipeline rank ``stage``; by default the fuller of the ranks that
    hold the first and the last stage (middle ranks hold the same layers, no embedding and no
    more microbatches). ZeRO (``parallelism.zero``, 1910.02054 Figure 1) shards over the dp·cp ranks
    that hold the same weights: stage 1 the master weights and Adam's moments, stage 2 the
    gradients too, stage 3 the weights too — the paper's model, without the whole copies of
    the one or two units a rank is computing at a moment (ZeRO-3's gathered blocks, a
    gradient bucket before its reduce-scatter). A mixture of experts' routed experts are held by
    the dp·cp/ep ranks of their expert-data-parallel group: ZeRO shards their state over those.
    A ValueError if ``parallelism`` cannot split ``config``'s model (``Parallelism.check``)."""
    parallelism.check(config)
    if stage is None:
        ends = sorted(set(parallelism.stages.ends))
        return max((memory_per_rank(config, parallelism, precision=precision, dropout=dropout,
                                    stage=rank) for rank in ends), key=lambda e: e.total)
    experts = expert_parameters_per_rank(config, parallelism)
    dense = parameters_per_rank(config, parallelism, stage) - experts
    owners = parallelism.dp * parallelism.cp

    def sharded(per_parameter: int, from_stage: int) -> int:
        if parallelism.zero < from_stage:
            return (dense + experts) * per_parameter
        # ceil: padding
        return -(-dense * per_parameter // owners) - (-experts * per_parameter
                                                       // (owners // parallelism.ep))

    activations = activation_bytes_per_rank(config, parallelism, stage,
                                            bytes_per_value=precision.activation, dropout=dropout)
    return MemoryEstimate(sharded(precision.weights, 3), sharded(precision.grads, 2),
                          sharded(precision.master + precision.adam, 1), activations)
