"""A performance model of one training iteration, and a configuration advisor built on it.

References
- Narayanan et al. 2021, arXiv 2104.04473: §2.2 pipeline bubble (p-1)/m and (p-1)/(v·m);
  §3 the takeaways this model must reproduce (tensor parallelism up to the GPUs of a node, then
  pipeline; interleaving pays at small batch; the microbatch size trades arithmetic intensity
  against bubble and memory); §3.3-3.5 communication volumes; §4.1 scatter/gather; §5.1 Table 1.
- Shoeybi et al. 2019, arXiv 1909.08053 §3: 2 all-reduces forward and 2 backward per layer.
- Korthikanti et al. 2022, arXiv 2205.05198: sequence parallelism (elementwise work split by t).
- Qi et al. 2023, arXiv 2401.10241: the zero-bubble schedules, whose W passes fill the bubble.
- Liu et al. 2023, arXiv 2310.01889 (ring attention), and megatron-core's context parallelism:
  each of cp ranks holds s/cp tokens of every sequence, attention is a ring (``context_parallel``).
- Lepikhin et al. 2020, GShard (arXiv 2006.16668 §2), and megatron-core's expert parallelism: a
  mixture of experts' E experts split over ep of the dp·cp ranks, each token carried to its k
  experts and back by all-to-alls (``expert_parallel``).

The model is a ``GPTConfig`` (its recomputation and sequence parallelism included; a
``LlamaConfig``'s block too: grouped-query attention, SwiGLU, rotary positions, an untied output
layer; or a preset's name, ``model_config``) and its split a
``ptdp.Parallelism`` (the layout's tp, cp, pp, dp; the pipeline's schedule, chunks and
microbatches; the ZeRO stage): what a training run takes.

Time per iteration = compute + bubble + tensor-parallel all-reduces + context-parallel ring (the
                     part the attention core does not hide) + expert-parallel all-to-alls
                     + pipeline p2p + data-parallel all-reduce (the part not overlapped)
                     + optimizer step.

Context parallelism (cp > 1): every operator of a rank sees b·s/cp tokens; the attention core
computes its s/cp queries' scores against all s keys, chunk pair by chunk pair (the masked ones
counted, as at cp = 1: ``_attention_core_ops``), and recomputes them in backward as flash
attention does (costed as selective recomputation of the core). Its ring
sends, per layer and microbatch, cp − 1 hops of the K, V block forward (2·b·s·h/(t·cp) 16-bit
values each), twice that backward (K, V again and their gradients), once more under full
recomputation; it runs while the core computes, so only max(0, ring − core) of it shows, per
pass. Gradients are all-reduced over the dp·cp ranks that hold the same weights.

A mixture of experts (``moe_experts`` > 0; routing assumed uniform, so no expert waits for
another and nothing is dropped): each tp rank routes its tokens (fp32 router, E columns),
permutes the k copies of each by expert, runs its E/ep experts as one grouped GEMM over the
b·(s/cp)·k rows that arrive (as many as leave), and un-permutes and weighs them; shared experts
are an MLP beside them, with their own tensor-parallel all-reduces. Under ep > 1 each of the
layer's all-to-alls (``traffic.all_to_alls``: 2 forward, 2 backward, 2 more under full
recomputation) sends (ep − 1)/ep of the b·(s/cp)·k·h rows to the ep ranks tp apart, on the
critical path (the experts wait for their rows): NVLink within a node, the node's adapters
beyond it (each GPU 1/gpus_per_node of them: every GPU exchanges at once). The experts'
gradients are all-reduced over the dp·cp/ep ranks that hold the same experts, the rest over
dp·cp. The advisor searches ep (every divisor of dp·cp and E) for MoE models only.

The bubble is (p-1)/(v·m) of the ideal time for GPipe, 1F1B and interleaved (§2.2); a schedule
that splits the backward into B and W is simulated (``pipeline.simulate``) with the stage's
t_F, t_B, t_W.

Compute is a roofline over the operators of a layer: an operator takes
max(FLOPs / (η·peak), bytes / HBM bandwidth) plus a fixed kernel-launch cost. The backward costs
2 forwards for GEMMs (input and weight gradients) and 1.5 for elementwise operators (they read
the output gradient and the saved input and write one gradient, where the forward read one
tensor and wrote one); recomputation runs the forward again. The fused attention core (flash
attention) moves no [s, s] scores through HBM and recomputes them in backward. Communication is
α-β: a ring all-reduce over t ranks takes 2(t-1)·α + 2(t-1)/t · bytes / bandwidth. Larger
microbatches amortise the fixed costs (launches, α) over more tokens: that is their only gain
here.

Calibrated once, for all rows of Table 1 (no per-row factor): η = GEMM_EFFICIENCY = 0.62, the
fraction of peak that large 16-bit GEMMs sustain end to end; it also absorbs what is not
modelled (data loading, logging, the CPU: Table 1 times whole iterations). With it every row's
own (tp, pp) lands within 7% of the measured throughput. DP_OVERLAP = 0: Megatron of 2021
all-reduced gradients after the backward pass. Everything else is a datasheet number or a count.

Where this model diverges from a real run, and why:
- One η for every GEMM: real efficiency also depends on shapes (tile and wave quantization), and
  the paper measured its per-microbatch times t(b) (§3.4) where this model derives them.
- The slowest pipeline stage (the last: it also computes the logits and the loss) paces every
  stage, and p2p is on the critical path (Megatron 2021 waits for its sends and receives).
- Left out, each well under 1% here: the tied-embedding gradient all-reduce between the first
  and last stages, the embedding lookup, data loading.
- Communication never slows computation (no contention for HBM or SMs), and a node's adapters
  are shared evenly by the groups that cross it at the same time.
- So pipelines cost little beyond their bubble and interleaving shrinks that: given a free
  choice at large batch (Table 1's 18B and 39B rows), the advisor prefers tp = 2 with a deeper
  interleaved pipeline to Table 1's tp = 8 and predicts 12–16 % more, where the paper followed its
  rule of thumb. The rule itself (§5.4.1, Fig. 13: fixed batch, no data parallelism) holds here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import product

from megatron_edu.grid import Layout
from megatron_edu.model.config import PRESETS, BertConfig, GPTConfig, LlamaConfig
from megatron_edu.pipeline.schedules import PipelineConfig
from megatron_edu.pipeline.simulate import simulate
from megatron_edu.ptdp import Parallelism

from .bubble import bubble_formula
from .flops import A100_BF16_PEAK, H100_SXM_BF16_PEAK, V100_FP16_PEAK
from .memory import (
    GIB,
    MIXED_FP32_GRADS,
    MemoryEstimate,
    Precision,
    expert_parameters_per_rank,
    memory_per_rank,
    parameters_per_rank,
)
from .traffic import all_to_all_bytes, all_to_alls

__all__ = ["Hardware", "SELENE_A100", "DGX_H100", "DGX2H_V100", "Prediction", "model_config",
           "predict", "rejection_reason", "candidates", "advise", "explain"]

GEMM_EFFICIENCY = 0.62
DP_OVERLAP = 0.0
BACKWARD_GEMMS = 2.0  # input gradient + weight gradient, each as costly as the forward GEMM
BACKWARD_ELEMENTWISE = 1.5  # 3 tensors moved (dY, saved X, dX) where the forward moved 2
WORD = 2  # bytes of a 16-bit value


@dataclass(frozen=True)
class Hardware:
    """A cluster of identical nodes; bandwidths in bytes/s, one direction."""

    name: str
    gpus_per_node: int
    memory_bytes: int  # per GPU
    peak_flops: float  # dense 16-bit, per GPU
    memory_bandwidth: float  # HBM, per GPU
    intra_node_bandwidth: float  # NVLink / NVSwitch, per GPU
    inter_node_bandwidth: float  # InfiniBand, per node: all its adapters together
    latency: float = 10e-6  # per message, per step of a ring
    kernel_launch: float = 5e-6  # fixed cost of every kernel, however small


# Selene: DGX A100 80GB nodes, NVLink 3 (12 links × 25 GB/s per direction), 8 × HDR 200 Gb/s.
SELENE_A100 = Hardware("DGX A100 80GB (Selene)", 8, 80 * GIB, A100_BF16_PEAK, 2.039e12,
                       300e9, 8 * 25e9)
DGX_H100 = Hardware("DGX H100 80GB", 8, 80 * GIB, H100_SXM_BF16_PEAK, 3.35e12, 450e9, 8 * 50e9)
# 1909.08053 §5: DGX-2H, 16 V100 32GB, NVSwitch 300 GB/s (both directions), 8 × 100 Gb/s IB.
DGX2H_V100 = Hardware("DGX-2H V100 32GB", 16, 32 * GIB, V100_FP16_PEAK, 900e9, 150e9, 8 * 12.5e9)


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per iteration spent in each part; they add up to the iteration time."""

    compute: float
    bubble: float
    tensor_parallel: float
    context_parallel: float  # the ring's time not hidden behind the attention core (cp > 1)
    expert_parallel: float  # the experts' all-to-alls (ep > 1)
    pipeline_p2p: float
    data_parallel: float
    optimizer: float

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tensor_parallel + self.context_parallel
                + self.expert_parallel + self.pipeline_p2p + self.data_parallel + self.optimizer)


@dataclass(frozen=True)
class Prediction:
    """What the performance model predicts for ``config``'s model split as ``parallelism``
    says."""

    config: GPTConfig
    parallelism: Parallelism
    time: TimeBreakdown
    flops_per_iteration: float  # executed, recomputation included (as 2104.04473 counts)
    tflops_per_gpu: float
    percent_of_peak: float
    memory: MemoryEstimate

    def __str__(self) -> str:
        split = self.parallelism
        sched = split.schedule + (f" v={split.chunks}" if split.chunks > 1 else "")
        cp = f" cp={split.cp}" if split.cp > 1 else ""
        ep = f" ep={split.ep}" if split.ep > 1 else ""
        return (f"tp={split.tp}{cp} pp={split.pp} dp={split.dp}{ep} b={split.microbatch} {sched}: "
                f"{self.time.total:.2f} s/iter, {self.tflops_per_gpu:.0f} TFLOP/s per GPU "
                f"({self.percent_of_peak:.0f}% of peak), {self.memory.total / GIB:.1f} GiB")


def model_config(model: GPTConfig | str, **overrides: object) -> GPTConfig:
    """``model`` as a configuration: one already (with ``overrides`` replaced), or a preset's
    name (``model.config``'s module docstring) as the model it names: a ``LlamaConfig`` for the
    Llama presets ("llama-tiny", "smollm-135m", "llama3-8b": those that name kv heads), a
    ``BertConfig`` for the BERTs, else a ``GPTConfig``."""
    if isinstance(model, GPTConfig):
        return replace(model, **overrides) if overrides else model
    if model not in PRESETS:
        raise ValueError(f"unknown preset {model!r}; choose from {sorted(PRESETS)}")
    kind = (LlamaConfig if "num_kv_heads" in PRESETS[model]
            else BertConfig if "bert" in model else GPTConfig)
    return kind.preset(model, **overrides)


# ---- compute: a roofline over the operators of one layer, per tensor-parallel rank ----


@dataclass(frozen=True)
class _Op:
    flops: float  # forward
    bytes: float  # forward, through HBM
    gemm: bool
    attention_core: bool = False  # recomputed by selective recomputation; a GEMM without weights


def _gemm(m: float, n: int, k: int, batch: int = 1, core: bool = False) -> _Op:
    """C[m, n] = A[m, k] · B[k, n], 16-bit operands (m: the mean rows of a grouped GEMM's)."""
    return _Op(2 * batch * m * n * k, WORD * batch * (m * k + k * n + m * n), True, core)


def _elementwise(values: float, bytes_per_value: float, core: bool = False) -> _Op:
    return _Op(0.0, values * bytes_per_value, False, core)


def _attention_core_ops(config: GPTConfig, b: int, t: int, cp: int) -> list[_Op]:
    """Q·Kᵀ, softmax, dropout and ·V on one tensor and context rank: [s, s] scores per head at
    cp = 1; at cp > 1 the rank's s/cp queries against all s keys, 4·cp chunk pairs of
    (s/(2·cp))², one pair after the other (each its own kernels). The causally masked scores
    count as computed at every cp, as the calibration's fused softmax computes them (Table 1):
    ``context_parallel``'s ring skips the later pairs, as flash attention skips them at cp = 1 —
    crediting the skip to cp > 1 alone would make cp pay at any sequence length.

    The fused core at cp = 1 (``attention="fused"``: flash attention, Dao et al. 2022, arXiv
    2205.14135) is one kernel that keeps the scores in on-chip memory: its HBM traffic is Q, K,
    V and the output, its softmax and dropout never pass through HBM, and its backward
    recomputes them (``_recomputes_core``)."""
    s, d = config.seq_len, config.head_dim
    q, pairs = (s, 1) if cp == 1 else (s // (2 * cp), 4 * cp)  # query (= key) rows per pair
    heads = b * config.num_heads // t
    scores = heads * q * q
    if config.attention == "fused" and cp == 1:   # one kernel: reads Q, K, V, writes the output
        return [_Op(2 * _gemm(q, q, d, batch=heads).flops, 4 * WORD * heads * q * d, True, True)]
    return [
        _gemm(q, q, d, batch=heads, core=True),  # Q·Kᵀ
        _elementwise(scores, 2 * WORD, core=True),  # fused scale-mask-softmax
        _elementwise(scores, 2 * WORD + 1, core=True),  # dropout: read, write, 1-byte mask
        _gemm(q, d, q, batch=heads, core=True),  # softmax · V
    ] * pairs


def _recomputes_core(config: GPTConfig, cp: int) -> bool:
    """Whether the attention core runs its forward again in backward whatever ``recompute``
    says: ring attention (cp > 1) and flash attention (the fused core) keep no scores."""
    return cp > 1 or config.attention == "fused"


def _layer_ops(config: GPTConfig, b: int, t: int, cp: int = 1, ep: int = 1) -> list[_Op]:
    """Forward operators of one transformer layer on one tensor (and context) rank, Megatron's
    fused kernels; under context parallelism on the rank's b·s/cp tokens; a mixture of experts
    in place of the MLP with ``config.moe_experts`` (``_moe_ops``), E/ep of them on the rank.

    The block's shape as ``perf.training_flops`` counts it: QKV h → h + 2k columns (k the key
    and value columns, num_kv_heads·head_dim: grouped-query attention, 2305.13245), the MLP
    h → f, or h → 2f for SwiGLU's gate and up (2002.05202), whose fused activation reads both
    and writes f. Rotary positions (Llama) turn q and k in one fused pass; grouped-query
    attention copies each kv head to its group's query heads inside the core
    (``context_parallel.each_head``, as megatron-core's unfused core repeats them). A residual
    add keeps a dropout mask only with dropout; without biases (Llama) it is the same pass."""
    h = config.hidden
    tokens = b * config.seq_len // cp
    k = max(config.num_kv_heads, t) * config.head_dim   # at t > g: one kv head a rank
    replicated = tokens * h // (t if config.sequence_parallel else 1)  # split only under sp
    mask = 1 if config.dropout > 0 else 0
    rotary = ([_elementwise(tokens * (h + k) // t, 2 * WORD)]   # q and k turned: read, write
              if config.positions == "rope" else [])
    copies = ([_elementwise(tokens * 2 * h // t, WORD)]          # K, V written per query head
              if config.num_kv_heads < config.num_heads else [])
    return [
        _elementwise(replicated, 2 * WORD),  # norm 1: read x, write y
        _gemm(tokens, (h + 2 * k) // t, h),  # QKV, column-parallel
        *rotary,
        *copies,
        *_attention_core_ops(config, b, t, cp),
        _gemm(tokens, h, h // t),  # projection, row-parallel
        _elementwise(replicated, 3 * WORD + mask),  # bias-dropout-add: out, residual -> sum, mask
        _elementwise(replicated, 2 * WORD),  # norm 2
        *(_moe_ops(config, tokens, t, ep) if config.moe_experts else
          _mlp_ops(tokens, config.ffn_hidden, h, t, 2 if config.mlp == "swiglu" else 1)),
        _elementwise(replicated, 3 * WORD + mask),  # bias-dropout-add
    ]


def _mlp_ops(tokens: int, f: int, h: int, t: int, gates: int) -> list[_Op]:
    """An MLP of f units on ``tokens`` rows, split over t: h → f column-parallel (h → 2f for
    SwiGLU's gate and up, ``gates`` = 2), the fused bias-GeLU or SwiGLU, f → h row-parallel."""
    return [
        _gemm(tokens, gates * f // t, h),
        _elementwise(tokens * f // t, (gates + 1) * WORD),
        _gemm(tokens, h, f // t),
    ]


def _moe_ops(config: GPTConfig, tokens: int, t: int, ep: int) -> list[_Op]:
    """A mixture of experts on one tensor rank holding E/ep experts (``model.moe``), routing
    uniform: the router scores the rank's tokens (its s/t of them under sequence parallelism;
    fp32, but E columns: negligible at any peak), the k copies of every token are gathered by
    expert, the E/ep experts run as one grouped GEMM over the k·tokens rows that arrive (as
    many as leave, k·tokens·ep/E an expert; its weights all read), their rows gathered back,
    weighted and summed; the shared experts are an MLP of f_e·n units beside them, their gated
    output added."""
    h, f, experts = config.hidden, config.moe_ffn_hidden, config.moe_experts
    rows, held = config.moe_topk * tokens, experts // ep
    routed = tokens // (t if config.sequence_parallel else 1)   # the tokens the router scores
    shared = config.moe_shared_experts
    return [
        _gemm(routed, experts, h),                               # router
        _elementwise(rows * h, 2 * WORD),                        # permute: read, write
        _gemm(rows / held, 2 * f // t, h, batch=held),           # gate and up, grouped
        _elementwise(rows * f // t, 3 * WORD),                   # SwiGLU
        _gemm(rows / held, h, f // t, batch=held),               # down, grouped
        _elementwise(rows * h, 2 * WORD),                        # un-permute, weigh, sum the k
        *(_mlp_ops(tokens, f * shared, h, t, 2) if shared else []),
        *([_elementwise(routed * h, 3 * WORD)] if shared else []),   # (gated) shared + routed
    ]


def _output_ops(config: GPTConfig, b: int, t: int, cp: int = 1) -> list[_Op]:
    """Final layer norm, logits over the padded vocabulary and the vocabulary-parallel cross
    entropy (last stage), on b·s/cp tokens."""
    tokens, h, vocab = b * config.seq_len // cp, config.hidden, config.padded_vocab(t)
    return [
        _elementwise(tokens * h // (t if config.sequence_parallel else 1), 2 * WORD),
        _gemm(tokens, vocab // t, h),
        _elementwise(tokens * vocab // t, WORD + 4 + 4),  # read 16-bit, fp32 exp, sum
    ]


def _op_time(op: _Op, hw: Hardware, gemm_efficiency: float) -> float:
    roofline = max(op.flops / (gemm_efficiency * hw.peak_flops), op.bytes / hw.memory_bandwidth)
    return roofline + hw.kernel_launch


@dataclass(frozen=True)
class _Cost:
    """Seconds of one microbatch through some operators, by pass (2401.10241 §1), and FLOPs."""

    forward: float
    backward: float  # the input gradient, after the recomputed forward
    weight: float  # the weights' gradient
    flops: float

    @property
    def seconds(self) -> float:
        return self.forward + self.backward + self.weight

    def times(self, n: int) -> _Cost:
        return _Cost(n * self.forward, n * self.backward, n * self.weight, n * self.flops)

    def plus(self, other: _Cost) -> _Cost:
        return _Cost(self.forward + other.forward, self.backward + other.backward,
                     self.weight + other.weight, self.flops + other.flops)


def _train_cost(ops: list[_Op], recompute: str, hw: Hardware, eta: float,
                flash: bool = False) -> _Cost:
    """Forward, backward and recomputed forward of ``ops``, one microbatch. A GEMM's backward is
    BACKWARD_GEMMS forwards: the input gradient and, for a GEMM with weights, the weights' (W);
    the attention core's two products have no weights, both halves are the input gradient's.
    An elementwise backward costs BACKWARD_ELEMENTWISE forwards; recomputation one more. Ring
    attention (cp > 1) and the fused core (``flash``: ``_recomputes_core``) recompute the core
    in backward whatever ``recompute`` is (flash attention's way; costed as selective
    recomputation of the core)."""
    forward = backward = weight = flops = 0.0
    for op in ops:
        seconds = _op_time(op, hw, eta)
        recomputed = (recompute == "full") + (op.attention_core
                                              and (flash or recompute == "selective"))
        passes = BACKWARD_GEMMS if op.gemm else BACKWARD_ELEMENTWISE
        weight_half = op.gemm and not op.attention_core
        forward += seconds
        backward += (passes - weight_half + recomputed) * seconds
        weight += weight_half * seconds
        flops += (1 + BACKWARD_GEMMS + recomputed) * op.flops
    return _Cost(forward, backward, weight, flops)


# ---- communication: α-β costs of rings and point-to-point sends ----


def _group_bandwidth(hw: Hardware, size: int, stride: int) -> float:
    """Per-rank bandwidth of a ring over `size` ranks `stride` apart (tp fastest, then cp, dp,
    pp)."""
    if size * stride <= hw.gpus_per_node:
        return hw.intra_node_bandwidth
    members_per_node = max(1, hw.gpus_per_node // stride)
    # the node's adapters are shared evenly by the gpus_per_node/members groups crossing it
    share = hw.inter_node_bandwidth * members_per_node / hw.gpus_per_node
    return min(hw.intra_node_bandwidth, share)


def _all_reduce(nbytes: float, size: int, bandwidth: float, hw: Hardware) -> float:
    """Ring all-reduce: reduce-scatter + all-gather, 2(t-1) steps of bytes/t each."""
    if size == 1:
        return 0.0
    return 2 * (size - 1) * hw.latency + 2 * (size - 1) / size * nbytes / bandwidth


def _tensor_parallel_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                          layers: int) -> float:
    """All-reduces of one microbatch on the last stage (1909.08053 §3, Fig. 4).

    Per layer: 2 in the forward (`g` after attention and after the MLP), 2 in the backward
    (`f` before each), and 2 more in the recomputed forward under full recomputation: 6. A
    mixture of experts reduces its experts' output as the MLP does, and its shared experts,
    an MLP of their own, theirs too: one more each way (9 under full recomputation).
    Under sequence parallelism each becomes a reduce-scatter + all-gather pair, the same bytes.
    The output layer adds its input gradient (b·s·h) and the cross entropy's three b·s-float
    all-reduces (max, sum of exponentials, target logit).
    """
    t, s = parallelism.tp, config.seq_len // parallelism.cp  # a context rank's tokens
    activation = parallelism.microbatch * s * config.hidden * WORD
    bandwidth = _group_bandwidth(hw, t, 1)
    pairs = 2 + (config.moe_experts > 0 and config.moe_shared_experts > 0)  # a g and an f each
    per_layer = pairs * (3 if config.recompute == "full" else 2)
    loss_bytes = parallelism.microbatch * s * 4
    return ((layers * per_layer + 1) * _all_reduce(activation, t, bandwidth, hw)
            + 3 * _all_reduce(loss_bytes, t, bandwidth, hw))


def _pipeline_p2p_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                       scatter_gather: bool) -> float:
    """Sends on a stage's critical path per microbatch: one forward + one backward per chunk.

    The message is b·(s/cp)·h values. Across nodes each tensor rank sends only 1/t of it over its
    own adapter and the receivers all-gather it over NVLink (2104.04473 §4.1); under sequence
    parallelism the tensor is already split by t and needs no gathering.
    """
    t, sp = parallelism.tp, config.sequence_parallel
    if parallelism.pp == 1:
        return 0.0
    message = parallelism.microbatch * config.seq_len // parallelism.cp * config.hidden * WORD
    if parallelism.world_size <= hw.gpus_per_node:
        one_send = hw.latency + message / hw.intra_node_bandwidth
    else:
        split = t if scatter_gather or sp else 1
        one_send = hw.latency + message / split / (hw.inter_node_bandwidth / hw.gpus_per_node)
        if split > 1 and not sp:
            one_send += (t - 1) * hw.latency + (t - 1) / t * message / hw.intra_node_bandwidth
    return 2 * parallelism.chunks * one_send


def _context_parallel_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                           core: _Cost) -> float:
    """The ring's seconds per layer and microbatch that the attention core (``core``) does not
    hide: cp − 1 hops of the K, V block (2·b·s·k/(t·cp) 16-bit values, k = num_kv_heads·d, or
    t·d when each rank holds a copy of one: under grouped-query attention the ring carries the
    kv heads only, ``context_parallel.each_head`` copying them per query head inside each step)
    forward,
    twice that backward (K, V and their gradients), one more forward under full recomputation;
    each pass overlapped with the core's own (``core``: its forward and backward, one
    microbatch): max(0, ring − core)."""
    cp = parallelism.cp
    if cp == 1:
        return 0.0
    b, t = parallelism.microbatch, parallelism.tp
    k = max(config.num_kv_heads, t) * config.head_dim
    block = 2 * b * config.seq_len * k // (t * cp) * WORD
    hop = hw.latency + block / _group_bandwidth(hw, cp, t)
    forwards = 2 if config.recompute == "full" else 1
    return (forwards * max(0.0, (cp - 1) * hop - core.forward)
            + max(0.0, 2 * (cp - 1) * hop - core.backward))


def _expert_parallel_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                          layers: int) -> float:
    """The experts' all-to-alls of one microbatch on a stage of ``layers`` MoE layers: each
    ``traffic.all_to_all_bytes`` over the ep ranks tp apart (``_all_to_all``), on the critical
    path."""
    if not config.moe_experts or parallelism.ep == 1:
        return 0.0
    sent = all_to_all_bytes(config, parallelism.microbatch, parallelism.cp, parallelism.ep, WORD)
    one = _all_to_all(sent, parallelism.ep, parallelism.tp, hw)
    return layers * all_to_alls(config) * one


def _all_to_all(sent: float, size: int, stride: int, hw: Hardware) -> float:
    """An all-to-all over ``size`` ranks ``stride`` apart, each sending ``sent`` bytes, evenly,
    to the size − 1 others: one message each (α), the share for the group's ranks on its own
    node over NVLink while the rest crosses the node's adapters, each GPU its 1/gpus_per_node of
    them (every GPU of the node exchanges at the same time)."""
    on_node = min(size, max(1, hw.gpus_per_node // stride))      # the group's ranks a node holds
    inside = sent * (on_node - 1) / (size - 1)
    outside = (sent - inside) * hw.gpus_per_node / hw.inter_node_bandwidth
    return (size - 1) * hw.latency + max(inside / hw.intra_node_bandwidth, outside)


def _data_parallel_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                        precision: Precision) -> float:
    """Gradient all-reduce over the dp·cp ranks holding the same weights, tp apart: a
    reduce-scatter and an all-gather, each half its time (ZeRO-1 runs exactly those). ZeRO-2
    reduce-scatters every microbatch's gradients, m of them, and gathers once; ZeRO-3 gathers
    the weights twice and reduce-scatters for every microbatch: 3m halves, 1.5× at m = 1 (the
    ZeRO paper's §7). Every message is counted at the gradients' width. A mixture's experts
    are reduced after the rest, over the dp·cp/ep ranks that hold them, tp·ep apart."""
    experts = expert_parameters_per_rank(config, parallelism)
    dense = parameters_per_rank(config, parallelism) - experts
    ranks, m = parallelism.dp * parallelism.cp, parallelism.num_microbatches
    tp, ep = parallelism.tp, parallelism.ep
    half = _all_reduce(dense * precision.grads, ranks, _group_bandwidth(hw, ranks, tp), hw) / 2
    if experts:
        half += _all_reduce(experts * precision.grads, ranks // ep,
                            _group_bandwidth(hw, ranks // ep, tp * ep), hw) / 2
    return {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[parallelism.zero] * half


def _optimizer_time(config: GPTConfig, parallelism: Parallelism, hw: Hardware,
                    precision: Precision) -> float:
    """Adam is memory-bound: read gradient, master weight and moments, write them back (ZeRO-1:
    a 1/(dp·cp) shard of the states; of the experts', 1/(dp·cp/ep))."""
    experts = expert_parameters_per_rank(config, parallelism)
    dense = parameters_per_rank(config, parallelism) - experts

    def per_param(owners: int) -> float:
        states = (precision.master + precision.adam) / (owners if parallelism.zero else 1)
        return precision.grads + 2 * states + precision.weights

    owners = parallelism.dp * parallelism.cp
    return (dense * per_param(owners) + experts * per_param(owners // parallelism.ep)
            ) / hw.memory_bandwidth


# ---- the bubble ----


def _bubble(pipeline: PipelineConfig, p: int, stage: _Cost, communication: float) -> float:
    """Seconds every rank idles per iteration of ``pipeline`` on p stages, as 2104.04473 counts
    it (the optimizer step waits for the last rank): ``stage`` is one microbatch through a
    stage, ``communication`` its sends and all-reduces, carried by the forward and the input
    gradient.

    GPipe, 1F1B and interleaved: (p − 1)/(v·m) of the ideal time (§2.2). A schedule that splits
    the backward (2401.10241) fills part of that with its W passes, depending on t_F, t_B, t_W:
    its schedule is simulated with those costs, on at most 2p microbatches — beyond, a steady
    state adds one microbatch's work per microbatch and no idle time.
    """
    name, m, v = pipeline.schedule, pipeline.num_microbatches, pipeline.chunks
    if not pipeline.splits_backward:
        whole = stage.seconds + communication
        return float(bubble_formula(name, p, m, v)) * m * whole
    share = communication / (stage.forward + stage.backward)
    timeline = simulate(replace(pipeline, num_microbatches=min(m, 2 * p)).make_schedule(p),
                        stage.forward * (1 + share), stage.backward * (1 + share),
                        weight_time=stage.weight)
    return float(max(timeline.idle))


# ---- the whole iteration ----


def predict(
    config: GPTConfig | str,
    parallelism: Parallelism,
    hw: Hardware = SELENE_A100,
    *,
    precision: Precision = MIXED_FP32_GRADS,
    scatter_gather: bool = True,
    gemm_efficiency: float = GEMM_EFFICIENCY,
    dp_overlap: float = DP_OVERLAP,
) -> Prediction:
    """Time, throughput and memory of one iteration of ``parallelism.global_batch`` sequences,
    for any ``parallelism`` that can split the model (tensor parallelism across nodes included;
    memory is reported, not enforced). A ValueError if it cannot (``Parallelism.check``).

    `precision` defaults to Megatron's: 16-bit weights, fp32 gradient accumulation, fp32 master
    weights and Adam moments (18 bytes per parameter). ``flops_per_iteration`` sums every rank's:
    each of the t·cp ranks of a replica computes its part of every microbatch. ``config``: a
    configuration, or a preset's name (``model_config``).
    """
    config = model_config(config)
    parallelism.check(config)
    b, t, cp, eta = parallelism.microbatch, parallelism.tp, parallelism.cp, gemm_efficiency
    m, layers = parallelism.num_microbatches, config.num_layers // parallelism.pp
    flash = _recomputes_core(config, cp)
    layer = _train_cost(_layer_ops(config, b, t, cp, parallelism.ep), config.recompute, hw, eta,
                        flash)
    out = _train_cost(_output_ops(config, b, t, cp), "none", hw, eta)
    # the last stage paces the pipeline: its layers plus the logits and the loss
    stage = layer.times(layers).plus(out)
    tensor = _tensor_parallel_time(config, parallelism, hw, layers)
    core = _train_cost(_attention_core_ops(config, b, t, cp), "none", hw, eta, flash)
    ring = layers * _context_parallel_time(config, parallelism, hw, core)
    experts = _expert_parallel_time(config, parallelism, hw, layers)
    p2p = _pipeline_p2p_time(config, parallelism, hw, scatter_gather)
    time = TimeBreakdown(
        compute=m * stage.seconds,
        bubble=_bubble(parallelism.pipeline, parallelism.pp, stage,
                       tensor + ring + experts + p2p),
        tensor_parallel=m * tensor,
        context_parallel=m * ring,
        expert_parallel=m * experts,
        pipeline_p2p=m * p2p,
        data_parallel=(1 - dp_overlap) * _data_parallel_time(config, parallelism, hw, precision),
        optimizer=_optimizer_time(config, parallelism, hw, precision),
    )
    flops = parallelism.global_batch // b * t * cp * (config.num_layers * layer.flops + out.flops)
    achieved = flops / (parallelism.world_size * time.total)
    return Prediction(
        config=config,
        parallelism=parallelism,
        time=time,
        flops_per_iteration=flops,
        tflops_per_gpu=achieved / 1e12,
        percent_of_peak=100 * achieved / hw.peak_flops,
        memory=memory_per_rank(config, parallelism, precision=precision),
    )


# ---- the advisor ----


def rejection_reason(
    config: GPTConfig | str,
    parallelism: Parallelism,
    num_gpus: int,
    hw: Hardware = SELENE_A100,
    *,
    precision: Precision = MIXED_FP32_GRADS,
) -> str | None:
    """Why the advisor would not propose ``parallelism`` for ``config``'s model on ``num_gpus``
    GPUs, or None: the message of its ValueError (``Parallelism.check``,
    ``Layout.check_world``), tensor parallelism beyond a node, or memory beyond the GPU's."""
    config = model_config(config)
    try:
        parallelism.check(config)
        parallelism.layout.check_world(num_gpus)
    except ValueError as error:
        return str(error)
    if hw.gpus_per_node % parallelism.tp:
        return f"tp {parallelism.tp} does not divide the {hw.gpus_per_node} GPUs of a node"
    memory = memory_per_rank(config, parallelism, precision=precision)
    if memory.total > hw.memory_bytes:
        return f"needs {memory.total / GIB:.1f} GiB > {hw.memory_bytes / GIB:.0f} GiB per GPU"
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _chunk_options(config: GPTConfig, pp: int, schedule: str) -> list[int | None]:
    """None (the schedule's own) unless interleaved; interleaved: every v ≥ 2 dividing a rank's
    layers (the search space; whether the model splits so is ``Parallelism.check``'s rule)."""
    if schedule != "interleaved":
        return [None]
    return _divisors(config.num_layers // pp)[1:]


def _expert_options(config: GPTConfig, dp_cp: int, ep: tuple[int, ...] | None) -> list[int]:
    """The ep sizes to try on dp·cp ranks: those of ``ep`` that divide dp·cp; None: for a
    mixture of experts every common divisor of dp·cp and E, for a dense model 1."""
    if ep is not None:
        return [e for e in ep if dp_cp % e == 0]
    return _divisors(math.gcd(dp_cp, config.moe_experts)) if config.moe_experts else [1]


def candidates(
    config: GPTConfig | str,
    global_batch: int,
    num_gpus: int,
    hw: Hardware,
    schedules: tuple[str, ...] = ("1f1b", "interleaved"),
    recompute: tuple[str, ...] | None = None,
    sequence_parallel: tuple[bool, ...] | None = None,
    zero: int = 0,
    cp: tuple[int, ...] = (1,),
    ep: tuple[int, ...] | None = None,
) -> Iterator[tuple[GPTConfig, Parallelism]]:
    """Every tp (within a node) × cp (each of ``cp``) × pp × dp = num_gpus, microbatch b
    (B = dp·m·b), schedule, chunk count and ep (each of ``ep`` dividing dp·cp; None: every
    divisor of dp·cp and E for a mixture of experts, 1 for a dense model) a ``Parallelism``
    accepts, each with ``config`` made to recompute and split the sequence as each of
    ``recompute`` × ``sequence_parallel`` asks (None: as the config does). Not yet checked
    against the model, the node or the memory: ``rejection_reason`` does."""
    config = model_config(config)
    modes = list(product(recompute or (config.recompute,),
                         sequence_parallel or (config.sequence_parallel,)))
    variants = {mode: replace(config, recompute=mode[0], sequence_parallel=mode[1])
                for mode in modes}
    for tp, c in product(_divisors(math.gcd(hw.gpus_per_node, num_gpus)), cp):
        if num_gpus % (tp * c):
            continue
        for pp in _divisors(num_gpus // (tp * c)):
            dp = num_gpus // (tp * c * pp)
            if global_batch % dp:
                continue
            for b, schedule, mode, e in product(_divisors(global_batch // dp), schedules, modes,
                                                _expert_options(config, dp * c, ep)):
                for v in _chunk_options(config, pp, schedule):
                    try:
                        pipeline = PipelineConfig(schedule, v, b, global_batch // (dp * b))
                        parallelism = Parallelism(Layout(tp, pp, dp, c, e), pipeline, zero)
                    except ValueError:  # a schedule this pipeline cannot run
                        continue
                    yield variants[mode], parallelism


def advise(
    config: GPTConfig | str,
    global_batch: int,
    num_gpus: int,
    hw: Hardware = SELENE_A100,
    *,
    tp: int | None = None,
    pp: int | None = None,
    precision: Precision = MIXED_FP32_GRADS,
    zero: int = 0,
    schedules: tuple[str, ...] = ("1f1b", "interleaved"),
    recompute: tuple[str, ...] | None = None,
    sequence_parallel: tuple[bool, ...] | None = None,
    gemm_efficiency: float = GEMM_EFFICIENCY,
    dp_overlap: float = DP_OVERLAP,
    cp: tuple[int, ...] = (1,),
    ep: tuple[int, ...] | None = None,
) -> list[tuple[Parallelism, Prediction]]:
    """The splits of the model that fit in memory, fastest first (ties: least memory), each
    with its prediction (whose ``config`` says how it recomputes and splits the sequence).

    `tp` / `pp` pin those sizes; `cp`: the context-parallel sizes to search (world =
    tp·cp·pp·dp); `ep`: the expert-parallel sizes (None: for a mixture of experts every one
    dividing dp·cp and E, for a dense model none). GPipe is left out by default: the same
    bubble as 1F1B with m microbatches in flight instead of p (2104.04473 §2.2.1), so it never
    ranks higher. ``config``: a configuration (a ``LlamaConfig`` too: its block's FLOPs and
    memory), or a preset's name (``model_config``: "llama3-8b" is the Llama). ``explain``
    says why the first is first.
    """
    config = model_config(config)
    ranked = []
    for variant, parallelism in candidates(config, global_batch, num_gpus, hw, schedules,
                                           recompute, sequence_parallel, zero, cp, ep):
        if (tp and parallelism.tp != tp) or (pp and parallelism.pp != pp):
            continue
        if rejection_reason(variant, parallelism, num_gpus, hw, precision=precision):
            continue
        prediction = predict(variant, parallelism, hw, precision=precision,
                             gemm_efficiency=gemm_efficiency, dp_overlap=dp_overlap)
        ranked.append((parallelism, prediction))
    return sorted(ranked, key=lambda lp: (lp[1].time.total, lp[1].memory.total))


def explain(ranked: list[tuple[Parallelism, Prediction]], hw: Hardware = SELENE_A100, *,
            precision: Precision = MIXED_FP32_GRADS) -> str:
    """Why ``advise``'s first layout (``ranked``: its answer, on ``hw`` at ``precision``) is
    first, in words: where its time goes and what its memory holds. For a mixture of experts,
    what expert parallelism buys: the experts each GPU holds and the memory the same layout
    would need without it, whether the all-to-alls stay on a node's NVLink (the ep group spans
    ep·tp consecutive GPUs) and what they cost, and the fastest layout without it."""
    if not ranked:
        return "No layout fits."
    parallelism, best = ranked[0]
    config, time = best.config, best.time
    parts = {name.replace("_", " "): getattr(time, name) for name in vars(time)}
    rest = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in
                     sorted(parts.items(), key=lambda kv: -kv[1]) if seconds >= 0.01 * time.total)
    lines = [f"Proposed: {best}.",
             f"Of its {time.total:.2f} s per iteration: {rest}.",
             f"Memory per GPU: {best.memory} of {hw.memory_bytes / GIB:.0f} GiB."]
    if not config.moe_experts:
        return "\n".join(lines)
    ep, tp, experts = parallelism.ep, parallelism.tp, config.moe_experts
    held = expert_parameters_per_rank(config, parallelism)
    layers = f"each of its {config.num_layers // parallelism.pp} layers"
    if ep == 1:
        lines.append(f"Experts not split: each GPU holds all {experts} experts of {layers}, "
                     f"{held / 1e9:.2f} B parameters, and sends no token to another.")
        return "\n".join(lines)
    alone = replace(parallelism, layout=replace(parallelism.layout, ep=1))
    without = memory_per_rank(config, alone, precision=precision).total
    verdict = "more than the GPU has" if without > hw.memory_bytes else "which would fit too"
    where = ("stay inside a node, on NVLink" if ep * tp <= hw.gpus_per_node else
             "cross nodes, over the adapters")
    lines += [f"Experts split over ep = {ep}: each GPU holds {experts // ep} of the {experts} "
              f"experts of {layers}, {held / 1e9:.2f} B parameters where ep = 1 holds "
              f"{ep * held / 1e9:.2f} B: the same layout without expert parallelism needs "
              f"{without / GIB:.1f} GiB, {verdict}.",
              f"Its all-to-alls {where}: each ep group spans ep·tp = {ep * tp} consecutive "
              f"GPUs, {hw.gpus_per_node} a node; they take {time.expert_parallel:.2f} s per "
              f"iteration ({time.expert_parallel / time.total:.0%})."]
    dense = next((p for split, p in ranked if split.ep == 1), None)
    lines.append(f"Without expert parallelism no layout fits in {hw.memory_bytes / GIB:.0f} GiB."
                 if dense is None else f"Without expert parallelism the fastest layout that "
                 f"fits, {dense}, is {dense.time.total / time.total - 1:.0%} slower.")
    return "\n".join(lines)
