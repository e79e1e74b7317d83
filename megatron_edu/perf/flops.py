"""The papers' counting formulas: parameters, FLOPs per iteration, training time, utilization.

References
- Narayanan et al. 2021, arXiv 2104.04473, §5.1 and Appendix: parameter count P, FLOPs per
  iteration F and the end-to-end training-time estimate 8·T·P / (n·X).
- Shoeybi et al. 2019, arXiv 1909.08053, §5: FLOP/s as the measure of scaling.
- Kaplan et al. 2020, arXiv 2001.08361, §2.1 and Table 1: a training step costs 6 FLOPs per
  token and matmul weight (forward 2, backward 4), plus the attention core's, which no weight
  counts; Llama's block (Touvron et al. 2023, arXiv 2307.09288 §2.2; Grattafiori et al. 2024,
  arXiv 2407.21783 §3.2): SwiGLU's three matmuls (Shazeer 2020, arXiv 2002.05202) and
  grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245), k = num_kv_heads·head_dim
  key and value columns each.
- A mixture of experts in place of the MLP (Shazeer et al. 2017, arXiv 1701.06538; Mixtral,
  Jiang et al. 2024, arXiv 2401.04088 §2.1; shared experts: DeepSeekMoE, arXiv 2401.06066 §3.2):
  a token's FLOPs are those of the parameters it uses, its k of E experts (``active_parameters``).

Notation (the paper's): l transformer layers, h hidden size, V vocabulary, s sequence length,
B global batch (sequences), T tokens, n GPUs, X achieved FLOP/s per GPU; for the block's shape
f the MLP's width (GPT-2: 4h), k the key and value columns (k = h without grouped-query
attention), γ = 1 for SwiGLU's gate matmul (0 for GeLU); for a mixture of experts E experts of
f_e units (``moe_ffn_hidden``), k_e of them a token (``moe_topk``), f_s the shared experts' units.

``num_parameters`` and ``training_flops`` are the papers' GPT forms, in their letters;
``training_flops_of`` reads every shape from a ``GPTConfig`` (a ``LlamaConfig`` too) and agrees
with them on a GPT. Any model's exact count is ``GPTConfig.num_parameters`` (the published count,
on the true vocabulary: with ``make_vocab_size_divisible_by=1``).

Model FLOPs and hardware FLOPs: ``training_flops(..., recompute=False)`` counts what the model
needs (3 passes: forward, and a backward of twice its cost), the numerator of model FLOPs
utilization (MFU); ``recompute=True`` counts what a recomputing run executes (the forward once
more), the numerator of hardware FLOPs utilization (HFU), which 2104.04473 reports as "percent
of peak". Without recomputation the two are equal.

Peaks are plain numbers you pass in; the constants below name the datasheets' dense 16-bit ones,
``datasheet_peak_flops`` looks up a CUDA device's by the name it reports, and
``measure_matmul_flops`` times what this machine's matmuls reach where no datasheet applies.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import torch

from megatron_edu.model.config import GPTConfig

__all__ = ["A100_BF16_PEAK", "H100_SXM_BF16_PEAK", "V100_FP16_PEAK", "DATASHEET_BF16_PEAKS",
           "MATMUL_SIZE", "num_parameters", "expert_parameters", "active_parameters",
           "training_flops",
           "training_flops_of", "training_time_seconds",
           "model_flops_utilization", "datasheet_bf16_peak", "datasheet_peak_flops",
           "measure_matmul_flops"]

# Dense 16-bit tensor-core peaks (FLOP/s per GPU), no sparsity: a datasheet's "with sparsity"
# figure (2:4 structured sparsity, marked * on NVIDIA's sheets) is twice the dense one, halved here.
A100_BF16_PEAK = 312e12
H100_SXM_BF16_PEAK = 989e12
H100_PCIE_BF16_PEAK = 756e12
NVL_BF16_PEAK = 835e12           # H100 NVL and H200 NVL: 1,671 with 2:4 sparsity, halved
V100_FP16_PEAK = 125e12

# Dense bf16 peaks (fp16 on the V100, which has no bf16 tensor cores) by a fragment of the name
# CUDA reports (torch.cuda.get_device_name(), e.g. "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB
# HBM3", "NVIDIA H100 PCIe", "Tesla V100-SXM2-32GB"). A fragment matches as a whole word: "A10"
# not inside "A100" or "A10G", "B200" not inside "GB200", "L4" not inside "L40S". The first
# fragment found wins, so a form factor with its own peak (PCIe, NVL) comes before the name
# that says none (the SXM part). The GPUs megatron-core's users train on, from NVIDIA's
# datasheets (nvidia.com/en-us/data-center/<gpu>/, "<GPU> datasheet"):
DATASHEET_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    # Blackwell. GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS with sparsity for 72 GPUs, 2.5 dense
    # each; HGX B200 datasheet: 36 PFLOPS with sparsity for 8 GPUs, 2.25 dense each.
    ("GB200", 2500e12),
    ("B200", 2250e12),
    # Hopper. H100 datasheet: SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS with sparsity; H200:
    # the H100 SXM's tensor cores with more memory (H200 NVL as the H100 NVL); GH200 datasheet:
    # 1,979 with sparsity; H800 (export part, NVLink and FP64 cut): the H100's tensor cores;
    # H20 (export part, HGX H20 specification): 296 with sparsity.
    ("H100 PCIe", H100_PCIE_BF16_PEAK),
    ("H800 PCIe", H100_PCIE_BF16_PEAK),
    ("H100 NVL", NVL_BF16_PEAK),
    ("H200 NVL", NVL_BF16_PEAK),
    ("H100", H100_SXM_BF16_PEAK),
    ("H200", H100_SXM_BF16_PEAK),
    ("GH200", H100_SXM_BF16_PEAK),
    ("H800", H100_SXM_BF16_PEAK),
    ("H20", 148e12),
    # Ada. L40S datasheet: BF16 362.05 (733 with sparsity); L40: 181.05 (362.1); L4: 242 with
    # sparsity.
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    # Ampere. A100 datasheet (SXM and PCIe): 312 (624 with sparsity); A800 (export part): the
    # A100's; A40: 149.7 (299.4); A30: 165 (330); A10: 125 (250); RTX A6000 (GA102 whitepaper,
    # bf16 with fp32 accumulation): 154.8 (309.7).
    ("A100", A100_BF16_PEAK),
    ("A800", A100_BF16_PEAK),
    ("A40", 149.7e12),
    ("A30", 165e12),
    ("A10", 125e12),
    ("A6000", 154.8e12),
    # Volta, fp16 tensor cores. V100 datasheet: SXM2 125, PCIe 112, V100S PCIe 130.
    ("V100S", 130e12),
    ("V100-PCIE", 112e12),
    ("V100", V100_FP16_PEAK),
)

# The square matmul ``measure_matmul_flops`` times by default: on a GPU as large as bench (e)'s,
# so that its tensor cores run full tiles in full waves (a 1024³ product keeps an H100 busy for
# ~3 µs: launch and tail effects would dominate); on a CPU small enough to take a moment.
MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}


def num_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) = 12lh² + 13lh + Vh + sh  (2104.04473 §5.1).

    Per layer 12h² weights (QKV 3h², projection h², MLP 8h²) and 13h biases and layer-norm
    parameters; V·h word embeddings (tied with the output layer) and s·h position embeddings.
    The final layer norm (2h) is left out, as in the paper. Exact integer arithmetic.
    """
    l, h = layers, hidden
    return 12 * l * h * h + 13 * l * h + vocab * h + seq_len * h


def expert_parameters(config: GPTConfig) -> int:
    """One routed expert's parameters: a SwiGLU of f_e units, 3·h·f_e (its gate, up and down
    matrices, no biases: ``model.moe.Experts``)."""
    return 3 * config.hidden * config.moe_ffn_hidden


def active_parameters(config: GPTConfig) -> int:
    """The parameters one token uses: all of ``config.num_parameters()`` but, in each layer, the
    E − k routed experts the router did not choose for it. Attention, the norms, the router
    (E·h: it scores every expert), the shared experts and both word tables count, as in the
    published figures: Mixtral-8x7B 46.7 B total, 12.9 B active (Mistral AI's announcement;
    "47B … 13B active", 2401.04088 §2.1); Qwen1.5-MoE-A2.7B 14.3 B total, 2.7 B active (Qwen's
    blog, whose "2.0 B non-embedding" leaves out both tables: 2.07 B here). A dense model's are
    all its parameters; the true vocabulary's with ``make_vocab_size_divisible_by=1``."""
    skipped = config.moe_experts - config.moe_topk if config.moe_experts else 0
    return config.num_parameters() - config.num_layers * skipped * expert_parameters(config)


def training_flops(
    batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
    recompute: bool | str = True, *, ffn_hidden: int | None = None,
    kv_hidden: int | None = None, gated: bool = False, experts: int = 0, topk: int = 1,
    shared_ffn: int = 0,
) -> float:
    """FLOPs of one training iteration over `batch` sequences (2104.04473 §5.1).

    With activation recomputation: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
    Where it comes from: a layer's forward is 24·B·s·h² (GEMMs) + 4·B·s²·h (attention scores and
    their product with V); backward costs 2 forwards and recomputation 1 more, so 4 forwards:
    96·B·s·l·h² + 16·B·s²·l·h. The logit layer (2·B·s·h·V forward) is never recomputed:
    forward + 2x backward = 6·B·s·h·V, which is the V/(16·l·h) term (96·B·s·l·h²·V/(16lh)).

    Without recomputation the transformer layers cost 3 forwards instead of 4:
    72·B·s·l·h² + 12·B·s²·l·h, while the logit term stays 6·B·s·h·V; so
    F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).

    Selective recomputation (2205.05198 §5) repeats only the attention core's 4·B·s²·h per layer.

    Any block (keyword-only; the defaults are GPT-2's, and give the paper's figures exactly):
    ``ffn_hidden`` f (None: 4h), ``kv_hidden`` k = num_kv_heads·head_dim (None: h; grouped-query
    attention, 2305.13245), ``gated`` (SwiGLU, 2002.05202: a gate matmul beside the up one). A
    layer's forward GEMMs are then

        2·B·s·(h·(h + 2k) + h² + (2 + γ)·h·f)     QKV, projection, MLP (γ = 1 if gated)

    (24·B·s·h² for k = h, f = 4h, γ = 0), the attention core's 4·B·s²·h whatever k (every query
    head scores against its group's key). Without recomputation that is Kaplan et al.'s
    6 FLOPs per token and matmul weight (2001.08361 §2.1) plus the core:
    F = 6·B·s·(l·(h·(h + 2k) + h² + (2 + γ)·h·f) + V·h) + 12·B·s²·l·h.

    A mixture of experts in place of the MLP (``experts`` E > 0): a token passes the router's
    E·h weights, ``topk`` k_e SwiGLU experts of f = ``ffn_hidden`` units each and the shared
    experts' SwiGLU of ``shared_ffn`` f_s units, so (2 + γ)·h·f becomes

        (3·(k_e·f + f_s) + E)·h          (the router: 2·h·E FLOPs a token forward)

    the weights it uses, whatever E: 6·B·s per active matmul weight. The shared experts' gate
    (one output column, sigmoid(x·w)) is elementwise work, left out as the norms are.

    ``recompute``: True or "full", "selective", False or "none". False is the model's FLOPs (the
    numerator of MFU, for any run); the others the hardware FLOPs of a run that recomputes so
    (the numerator of its HFU).
    """
    b, s, l, h = batch, seq_len, layers, hidden
    f = 4 * h if ffn_hidden is None else ffn_hidden
    k = h if kv_hidden is None else kv_hidden
    mode = {True: "full", False: "none"}.get(recompute, recompute)
    mlp = (3 * (topk * f + shared_ffn) + experts) * h if experts else (2 + int(gated)) * h * f
    weights = h * (h + 2 * k) + h * h + mlp   # 12h² for GPT-2
    gemms, core = 2 * b * s * l * weights, 4 * b * s * s * l * h
    transformer = 3 * (gemms + core) + {"none": 0, "selective": core, "full": gemms + core}[mode]
    logits = 6 * b * s * h * vocab
    return float(transformer + logits)


def training_flops_of(config: GPTConfig, batch: int, recompute: bool | str = False,
                      vocab: int | None = None) -> float:
    """``training_flops`` of ``config``'s block (a GPT-2's, a Llama's: its f, k and MLP) over
    ``batch`` sequences of ``config.seq_len``; ``vocab`` None: the true vocabulary (the logits
    the model needs; pass ``config.padded_vocab()`` for the ones a run computes). By default
    the model's FLOPs (MFU's numerator): ``recompute=config.recompute`` for the hardware's.
    An untied output layer costs what a tied one does (2·B·s·h·V forward); its input embedding
    is a lookup, no FLOPs. A mixture of experts counts its active weights (MFU's numerator for
    an MoE run): k_e experts of ``moe_ffn_hidden``, the shared ones, the router."""
    moe = config.moe_experts > 0
    return training_flops(batch, config.seq_len, config.num_layers, config.hidden,
                          config.vocab_size if vocab is None else vocab, recompute,
                          ffn_hidden=config.moe_ffn_hidden if moe else config.ffn_hidden,
                          kv_hidden=config.num_kv_heads * config.head_dim,
                          gated=config.mlp == "swiglu", experts=config.moe_experts,
                          topk=config.moe_topk,
                          shared_ffn=config.moe_ffn_hidden * config.moe_shared_experts)


def training_time_seconds(
    tokens: float, params: float, num_gpus: int, flops_per_gpu: float, recompute: bool = True
) -> float:
    """End-to-end training time ≈ 8·T·P / (n·X)  (2104.04473 §5.1).

    Uses F ≈ 96·B·s·l·h² per iteration and T = B·s tokens, P ≈ 12·l·h²: F ≈ 8·T·P (the s/(6h)
    and V/(16lh) terms are small for large models). Without recomputation it is 6·T·P. For a
    mixture of experts P is what a token uses (``active_parameters``).
    """
    flops_per_token_param = 8 if recompute else 6
    return flops_per_token_param * tokens * params / (num_gpus * flops_per_gpu)


def model_flops_utilization(
    flops_per_step: float, step_time_s: float, peak_flops: float, num_gpus: int = 1
) -> float:
    """Achieved fraction of peak: F / (t · n · peak).

    What F counts decides the name: `training_flops(..., recompute=False)` counts only the model's
    own FLOPs, whatever the run executes: model FLOPs utilization (MFU). `recompute=True` counts
    the recomputed forward too, as 2104.04473's "percent of peak" does: for a recomputing run
    that is hardware FLOPs utilization (HFU, 2204.02311 Appendix B), 4/3 of its MFU or a little
    less (the logit layer is not recomputed).
    """
    return flops_per_step / (step_time_s * num_gpus * peak_flops)


def datasheet_bf16_peak(gpu_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s; fp16 on a V100) of the GPU called ``gpu_name`` (any case),
    or None for one not in ``DATASHEET_BF16_PEAKS``: its first fragment found as a whole word."""
    name = gpu_name.lower()
    return next((peak for fragment, peak in DATASHEET_BF16_PEAKS
                 if re.search(rf"(?<![a-z0-9]){re.escape(fragment.lower())}(?![a-z0-9])", name)),
                None)


def datasheet_peak_flops(device: torch.device | str) -> float | None:
    """The datasheet's dense bf16 peak of the GPU ``device`` names; None on a CPU (no datasheet
    applies: measure instead, ``measure_matmul_flops``) or on a GPU not in the table (measure:
    an unknown GPU gets its measured rate, never a failure)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return datasheet_bf16_peak(torch.cuda.get_device_name(device))


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         size: int | None = None, seconds: float = 0.3) -> float:
    """The FLOP/s this process reaches on square matmuls of ``size`` (default ``MATMUL_SIZE``
    of the device's type): a measured peak for MFU where no datasheet applies, 2·size³ FLOPs
    each.

    Measured as bench (e) measures it: after a warm-up (kernel selection, a GPU's clocks up),
    as many matmuls as fill about ¾ of ``seconds`` are queued back to back and timed as one
    span, so nothing but the matmuls is timed. A GPU runs its queue asynchronously: a host
    clock read after each product would time a launch and a synchronisation with it (a 1024³
    product keeps an H100 busy for ~3 µs, so timed it reads several times too low); the span is
    two CUDA events instead, recorded on the stream around the queue and read after one
    synchronisation (``_seconds``)."""
    device = torch.device(device)
    n = size or MATMUL_SIZE.get(device.type, MATMUL_SIZE["cuda"])
    gen = torch.Generator(device).manual_seed(0)   # the global generators are left alone
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b, out=out)

    _seconds(matmuls, 2, device)                                 # allocation, kernel selection
    each = max(_seconds(matmuls, 3, device) / 3, 1e-9)          # a first estimate
    _seconds(matmuls, math.ceil(seconds / 4 / each), device)     # a GPU's clocks up: ¼ of the time
    count = max(3, math.ceil(3 * seconds / 4 / each))            # timed: the other ¾
    return 2 * n**3 * count / _seconds(matmuls, count, device)


def _seconds(run: Callable[[int], None], count: int, device: torch.device) -> float:
    """Seconds ``run(count)`` takes on ``device``. A CPU computes as it is called: the host
    clock around the call. A GPU queues: two CUDA events on the device's current stream around
    the queued work, one synchronisation on the second (the timing pattern of
    ``torch.utils.benchmark`` and Triton's ``do_bench``)."""
    if device.type != "cuda":
        start = time.perf_counter()
        run(count)
        return time.perf_counter() - start
    with torch.cuda.device(device):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        run(count)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3               # elapsed_time is in milliseconds
