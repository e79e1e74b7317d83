"""A performance model of one training iteration, and a configuration advisor built on it.

References
- Narayanan et al. 2021, arXiv 2104.04473: §2.2 pipeline bubble (p-1)/m and (p-1)/(v·m);
  §3 the takeaways this model must reproduce (tensor parallelism up to the GPUs of a node, then
  pipeline; interleaving pays at small batch; the microbatch size trades arithmetic intensity
  against bubble and memory); §3.3-3.5 communication volumes; §4.1 scatter/gather; §5.1 Table 1.
- Shoeybi et al. 2019, arXiv 1909.08053 §3: 2 all-reduces forward and 2 backward per layer.
- Korthikanti et al. 2022, arXiv 2205.05198: sequence parallelism (elementwise work split by t).

Time per iteration = compute + bubble + tensor-parallel all-reduces + pipeline p2p
                     + data-parallel all-reduce (the part not overlapped) + optimizer step.

Compute is a roofline over the operators of a layer: an operator takes
max(FLOPs / (η·peak), bytes / HBM bandwidth) plus a fixed kernel-launch cost. The backward costs
2 forwards for GEMMs (input and weight gradients) and 1.5 for elementwise operators (they read
the output gradient and the saved input and write one gradient, where the forward read one
tensor and wrote one); recomputation runs the forward again. Communication is α-β: a ring
all-reduce over t ranks takes 2(t-1)·α + 2(t-1)/t · bytes / bandwidth. Larger microbatches
amortise the fixed costs (launches, α) over more tokens: that is their only gain here.

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

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from .flops import A100_BF16_PEAK, H100_SXM_BF16_PEAK, V100_FP16_PEAK
from .memory import (
    GIB,
    MIXED_FP32_GRADS,
    Layout,
    MemoryEstimate,
    ModelShape,
    Precision,
    layout_error,
    memory_per_rank,
    parameters_per_rank,
)

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
    pipeline_p2p: float
    data_parallel: float
    optimizer: float

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tensor_parallel + self.pipeline_p2p
                + self.data_parallel + self.optimizer)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    time: TimeBreakdown
    flops_per_iteration: float  # executed, recomputation included (as 2104.04473 counts)
    tflops_per_gpu: float
    percent_of_peak: float
    memory: MemoryEstimate

    def __str__(self) -> str:
        lay = self.layout
        sched = lay.schedule + (f" v={lay.chunks}" if lay.chunks > 1 else "")
        return (f"tp={lay.tp} pp={lay.pp} dp={lay.dp} b={lay.microbatch} {sched}: "
                f"{self.time.total:.2f} s/iter, {self.tflops_per_gpu:.0f} TFLOP/s per GPU "
                f"({self.percent_of_peak:.0f}% of peak), {self.memory.total / GIB:.1f} GiB")


# ---- compute: a roofline over the operators of one layer, per tensor-parallel rank ----


@dataclass(frozen=True)
class _Op:
    flops: float  # forward
    bytes: float  # forward, through HBM
    gemm: bool
    attention_core: bool = False  # recomputed by selective recomputation


def _gemm(m: int, n: int, k: int, batch: int = 1, core: bool = False) -> _Op:
    """C[m, n] = A[m, k] · B[k, n], 16-bit operands."""
    return _Op(2 * batch * m * n * k, WORD * batch * (m * k + k * n + m * n), True, core)


def _elementwise(values: float, bytes_per_value: float, core: bool = False) -> _Op:
    return _Op(0.0, values * bytes_per_value, False, core)


def _layer_ops(model: ModelShape, b: int, t: int, sp: bool) -> list[_Op]:
    """Forward operators of one transformer layer on one tensor rank (Megatron's fused kernels)."""
    s, h, a = model.seq_len, model.hidden, model.heads
    tokens, d = b * s, h // a
    replicated = tokens * h // (t if sp else 1)  # layer norms, dropout-add: split only under sp
    scores = b * (a // t) * s * s  # [b, a/t, s, s]
    return [
        _elementwise(replicated, 2 * WORD),  # layer norm 1: read x, write y
        _gemm(tokens, 3 * h // t, h),  # QKV, column-parallel
        _gemm(s, s, d, batch=b * a // t, core=True),  # Q·Kᵀ
        _elementwise(scores, 2 * WORD, core=True),  # fused scale-mask-softmax
        _elementwise(scores, 2 * WORD + 1, core=True),  # dropout: read, write, 1-byte mask
        _gemm(s, d, s, batch=b * a // t, core=True),  # softmax · V
        _gemm(tokens, h, h // t),  # projection, row-parallel
        _elementwise(replicated, 3 * WORD + 1),  # bias-dropout-add: out, residual -> sum, mask
        _elementwise(replicated, 2 * WORD),  # layer norm 2
        _gemm(tokens, 4 * h // t, h),  # MLP h -> 4h, column-parallel
        _elementwise(4 * tokens * h // t, 2 * WORD),  # fused bias-GeLU
        _gemm(tokens, h, 4 * h // t),  # MLP 4h -> h, row-parallel
        _elementwise(replicated, 3 * WORD + 1),  # bias-dropout-add
    ]


def _output_ops(model: ModelShape, b: int, t: int, sp: bool) -> list[_Op]:
    """Final layer norm, logits and the vocabulary-parallel cross entropy (last stage)."""
    tokens = b * model.seq_len
    return [
        _elementwise(tokens * model.hidden // (t if sp else 1), 2 * WORD),
        _gemm(tokens, model.vocab // t, model.hidden),
        _elementwise(tokens * model.vocab // t, WORD + 4 + 4),  # read 16-bit, fp32 exp, sum
    ]


def _op_time(op: _Op, hw: Hardware, gemm_efficiency: float) -> float:
    roofline = max(op.flops / (gemm_efficiency * hw.peak_flops), op.bytes / hw.memory_bandwidth)
    return roofline + hw.kernel_launch


def _train_cost(ops: list[_Op], recompute: str, hw: Hardware, eta: float) -> tuple[float, float]:
    """(seconds, FLOPs) of forward + backward + recomputed forward of `ops`, one microbatch."""
    seconds = flops = 0.0
    for op in ops:
        recomputed = recompute == "full" or (recompute == "selective" and op.attention_core)
        passes = 1 + (BACKWARD_GEMMS if op.gemm else BACKWARD_ELEMENTWISE) + recomputed
        seconds += passes * _op_time(op, hw, eta)
        flops += (1 + BACKWARD_GEMMS + recomputed) * op.flops
    return seconds, flops


# ---- communication: α-β costs of rings and point-to-point sends ----


def _group_bandwidth(hw: Hardware, size: int, stride: int) -> float:
    """Per-rank bandwidth of a ring over `size` ranks `stride` apart (tp fastest, then dp, pp)."""
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


def _tensor_parallel_time(model: ModelShape, layout: Layout, hw: Hardware, layers: int) -> float:
    """All-reduces of one microbatch on the last stage (1909.08053 §3, Fig. 4).

    Per layer: 2 in the forward (`g` after attention and after the MLP), 2 in the backward
    (`f` before each), and 2 more in the recomputed forward under full recomputation: 6.
    Under sequence parallelism each becomes a reduce-scatter + all-gather pair, the same bytes.
    The output layer adds its input gradient (b·s·h) and the cross entropy's three b·s-float
    all-reduces (max, sum of exponentials, target logit).
    """
    t = layout.tp
    activation = layout.microbatch * model.seq_len * model.hidden * WORD
    bandwidth = _group_bandwidth(hw, t, 1)
    per_layer = 6 if layout.recompute == "full" else 4
    loss_bytes = layout.microbatch * model.seq_len * 4
    return ((layers * per_layer + 1) * _all_reduce(activation, t, bandwidth, hw)
            + 3 * _all_reduce(loss_bytes, t, bandwidth, hw))


def _pipeline_p2p_time(
    model: ModelShape, layout: Layout, hw: Hardware, scatter_gather: bool
) -> float:
    """Sends on a stage's critical path per microbatch: one forward + one backward per chunk.

    The message is b·s·h values. Across nodes each tensor rank sends only 1/t of it over its own
    adapter and the receivers all-gather it over NVLink (2104.04473 §4.1); under sequence
    parallelism the tensor is already split by t and needs no gathering.
    """
    t, sp = layout.tp, layout.sequence_parallel
    if layout.pp == 1:
        return 0.0
    message = layout.microbatch * model.seq_len * model.hidden * WORD
    if layout.gpus <= hw.gpus_per_node:
        one_send = hw.latency + message / hw.intra_node_bandwidth
    else:
        split = t if scatter_gather or sp else 1
        one_send = hw.latency + message / split / (hw.inter_node_bandwidth / hw.gpus_per_node)
        if split > 1 and not sp:
            one_send += (t - 1) * hw.latency + (t - 1) / t * message / hw.intra_node_bandwidth
    return 2 * layout.chunks * one_send


def _data_parallel_time(
    model: ModelShape, layout: Layout, hw: Hardware, precision: Precision
) -> float:
    """Gradient all-reduce over dp (ZeRO-1's reduce-scatter + all-gather moves the same bytes)."""
    grad_bytes = parameters_per_rank(model, layout.tp, layout.pp, 0) * precision.grads
    bandwidth = _group_bandwidth(hw, layout.dp, layout.tp)
    return _all_reduce(grad_bytes, layout.dp, bandwidth, hw)


def _optimizer_time(model: ModelShape, layout: Layout, hw: Hardware, precision: Precision,
                    zero1: bool) -> float:
    """Adam is memory-bound: read gradient, master weight and moments, write them back."""
    states = (precision.master + precision.adam) / (layout.dp if zero1 else 1)
    per_param = precision.grads + 2 * states + precision.weights
    return parameters_per_rank(model, layout.tp, layout.pp, 0) * per_param / hw.memory_bandwidth


# ---- the whole iteration ----


def predict(
    model: ModelShape,
    layout: Layout,
    global_batch: int,
    hw: Hardware = SELENE_A100,
    *,
    precision: Precision = MIXED_FP32_GRADS,
    zero1: bool = False,
    scatter_gather: bool = True,
    gemm_efficiency: float = GEMM_EFFICIENCY,
    dp_overlap: float = DP_OVERLAP,
) -> Prediction:
    """Time, throughput and memory of one iteration, for any layout that divides the model
    (tensor parallelism across nodes included; memory is reported, not enforced).

    `precision` defaults to Megatron's: 16-bit weights, fp32 gradient accumulation, fp32 master
    weights and Adam moments (18 bytes per parameter).
    """
    error = layout_error(model, layout, global_batch)
    if error:
        raise ValueError(error)
    b, t, sp, eta = layout.microbatch, layout.tp, layout.sequence_parallel, gemm_efficiency
    p, v, m = layout.pp, layout.chunks, layout.num_microbatches(global_batch)
    layers = model.layers // p
    layer_s, layer_flops = _train_cost(_layer_ops(model, b, t, sp), layout.recompute, hw, eta)
    out_s, out_flops = _train_cost(_output_ops(model, b, t, sp), "none", hw, eta)
    # the last stage paces the pipeline: its layers plus the logits and the loss
    compute = layers * layer_s + out_s
    tensor = _tensor_parallel_time(model, layout, hw, layers)
    p2p = _pipeline_p2p_time(model, layout, hw, scatter_gather)
    time = TimeBreakdown(
        compute=m * compute,
        bubble=(p - 1) / v * (compute + tensor + p2p),  # 2104.04473 §2.2: (p-1)/(v·m) of ideal
        tensor_parallel=m * tensor,
        pipeline_p2p=m * p2p,
        data_parallel=(1 - dp_overlap) * _data_parallel_time(model, layout, hw, precision),
        optimizer=_optimizer_time(model, layout, hw, precision, zero1),
    )
    flops = global_batch // b * t * (model.layers * layer_flops + out_flops)
    achieved = flops / (layout.gpus * time.total)
    return Prediction(
        layout=layout,
        time=time,
        flops_per_iteration=flops,
        tflops_per_gpu=achieved / 1e12,
        percent_of_peak=100 * achieved / hw.peak_flops,
        memory=memory_per_rank(model, layout, global_batch, precision=precision, zero1=zero1),
    )


# ---- the advisor ----


def rejection_reason(
    model: ModelShape,
    layout: Layout,
    global_batch: int,
    num_gpus: int,
    hw: Hardware = SELENE_A100,
    *,
    precision: Precision = MIXED_FP32_GRADS,
    zero1: bool = False,
) -> str | None:
    """Why the advisor would not propose `layout`, or None."""
    error = layout_error(model, layout, global_batch)
    if error:
        return error
    if layout.gpus != num_gpus:
        return f"tp·pp·dp = {layout.tp}·{layout.pp}·{layout.dp} != {num_gpus} GPUs"
    if hw.gpus_per_node % layout.tp:
        return f"tp {layout.tp} does not divide the {hw.gpus_per_node} GPUs of a node"
    memory = memory_per_rank(model, layout, global_batch, precision=precision, zero1=zero1)
    if memory.total > hw.memory_bytes:
        return f"needs {memory.total / GIB:.1f} GiB > {hw.memory_bytes / GIB:.0f} GiB per GPU"
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _chunk_options(model: ModelShape, pp: int, schedule: str) -> list[int]:
    """v = 1 unless interleaved; interleaving needs pp > 1 and v ≥ 2 dividing the stage's layers."""
    if schedule != "interleaved":
        return [1]
    if pp == 1 or model.layers % pp:
        return []
    return _divisors(model.layers // pp)[1:]


def candidate_layouts(
    model: ModelShape,
    global_batch: int,
    num_gpus: int,
    hw: Hardware,
    schedules: tuple[str, ...] = ("1f1b", "interleaved"),
    recompute: tuple[str, ...] = ("full",),
    sequence_parallel: tuple[bool, ...] = (False,),
) -> Iterator[Layout]:
    """Every tp (within a node) × pp × dp = num_gpus, microbatch, schedule and chunk count."""
    for tp in _divisors(math.gcd(hw.gpus_per_node, num_gpus)):
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            if global_batch % dp:
                continue
            microbatches = _divisors(global_batch // dp)
            for b, schedule, rc, sp in product(microbatches, schedules, recompute,
                                               sequence_parallel):
                for v in _chunk_options(model, pp, schedule):
                    yield Layout(tp, pp, dp, b, schedule, v, rc, sp)


def advise(
    model: ModelShape,
    global_batch: int,
    num_gpus: int,
    hw: Hardware = SELENE_A100,
    *,
    tp: int | None = None,
    pp: int | None = None,
    precision: Precision = MIXED_FP32_GRADS,
    zero1: bool = False,
    schedules: tuple[str, ...] = ("1f1b", "interleaved"),
    recompute: tuple[str, ...] = ("full",),
    sequence_parallel: tuple[bool, ...] = (False,),
    gemm_efficiency: float = GEMM_EFFICIENCY,
    dp_overlap: float = DP_OVERLAP,
) -> list[tuple[Layout, Prediction]]:
    """Layouts that divide the model and fit in memory, fastest first (ties: least memory).

    `tp` / `pp` pin those sizes. GPipe is left out by default: the same bubble as 1F1B with m
    microbatches in flight instead of p (2104.04473 §2.2.1), so it never ranks higher.
    """
    ranked = []
    for layout in candidate_layouts(model, global_batch, num_gpus, hw, schedules, recompute,
                                    sequence_parallel):
        if (tp and layout.tp != tp) or (pp and layout.pp != pp):
            continue
        if rejection_reason(model, layout, global_batch, num_gpus, hw, precision=precision,
                            zero1=zero1):
            continue
        prediction = predict(model, layout, global_batch, hw, precision=precision, zero1=zero1,
                             gemm_efficiency=gemm_efficiency, dp_overlap=dp_overlap)
        ranked.append((layout, prediction))
    return sorted(ranked, key=lambda lp: (lp[1].time.total, lp[1].memory.total))
