"""The papers' counting formulas: parameters, FLOPs per iteration, training time, utilization.

References
- Narayanan et al. 2021, arXiv 2104.04473, §5.1 and Appendix: parameter count P, FLOPs per
  iteration F and the end-to-end training-time estimate 8·T·P / (n·X).
- Shoeybi et al. 2019, arXiv 1909.08053, §5: FLOP/s as the measure of scaling.

Notation (the paper's): l transformer layers, h hidden size, V vocabulary, s sequence length,
B global batch (sequences), T tokens, n GPUs, X achieved FLOP/s per GPU.

Model FLOPs and hardware FLOPs: ``training_flops(..., recompute=False)`` counts what the model
needs (3 passes: forward, and a backward of twice its cost), the numerator of model FLOPs
utilization (MFU); ``recompute=True`` counts what a recomputing run executes (the forward once
more), the numerator of hardware FLOPs utilization (HFU), which 2104.04473 reports as "percent
of peak". Without recomputation the two are equal.

Peaks are plain numbers you pass in; the constants below name the datasheets' dense 16-bit ones,
and ``datasheet_peak_flops`` looks up a CUDA device's by the name it reports.
"""

import time

import torch

__all__ = ["A100_BF16_PEAK", "H100_SXM_BF16_PEAK", "V100_FP16_PEAK", "DATASHEET_BF16_PEAKS",
           "num_parameters", "training_flops", "training_time_seconds", "model_flops_utilization",
           "datasheet_bf16_peak", "datasheet_peak_flops", "measure_matmul_flops"]

# Dense 16-bit tensor-core peaks (FLOP/s per GPU), no sparsity.
A100_BF16_PEAK = 312e12
H100_SXM_BF16_PEAK = 989e12
H100_PCIE_BF16_PEAK = 756e12
NVL_BF16_PEAK = 835e12           # H100 NVL and H200 NVL: 1,671 with 2:4 sparsity, halved
V100_FP16_PEAK = 125e12

# Dense bf16 peaks by a fragment of the name CUDA reports (torch.cuda.get_device_name(), e.g.
# "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200"); the first
# fragment found wins, so the PCIe and NVL parts come before the SXM name that says no form factor.
# An H200 (SXM) has the H100 SXM's tensor cores and more memory: the same peak.
DATASHEET_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", H100_PCIE_BF16_PEAK),
    ("H100 NVL", NVL_BF16_PEAK),
    ("H200 NVL", NVL_BF16_PEAK),
    ("H100", H100_SXM_BF16_PEAK),
    ("H200", H100_SXM_BF16_PEAK),
    ("A100", A100_BF16_PEAK),
)


def num_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) = 12lh² + 13lh + Vh + sh  (2104.04473 §5.1).

    Per layer 12h² weights (QKV 3h², projection h², MLP 8h²) and 13h biases and layer-norm
    parameters; V·h word embeddings (tied with the output layer) and s·h position embeddings.
    The final layer norm (2h) is left out, as in the paper. Exact integer arithmetic.
    """
    l, h = layers, hidden
    return 12 * l * h * h + 13 * l * h + vocab * h + seq_len * h


def training_flops(
    batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
    recompute: bool | str = True,
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

    ``recompute``: True or "full", "selective", False or "none". False is the model's FLOPs (the
    numerator of MFU, for any run); the others the hardware FLOPs of a run that recomputes so
    (the numerator of its HFU).
    """
    b, s, l, h = batch, seq_len, layers, hidden
    mode = {True: "full", False: "none"}.get(recompute, recompute)
    gemms, core = 24 * b * s * l * h * h, 4 * b * s * s * l * h
    transformer = 3 * (gemms + core) + {"none": 0, "selective": core, "full": gemms + core}[mode]
    logits = 6 * b * s * h * vocab
    return float(transformer + logits)


def training_time_seconds(
    tokens: float, params: float, num_gpus: int, flops_per_gpu: float, recompute: bool = True
) -> float:
    """End-to-end training time ≈ 8·T·P / (n·X)  (2104.04473 §5.1).

    Uses F ≈ 96·B·s·l·h² per iteration and T = B·s tokens, P ≈ 12·l·h²: F ≈ 8·T·P (the s/(6h)
    and V/(16lh) terms are small for large models). Without recomputation it is 6·T·P.
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
    """The dense bf16 peak (FLOP/s) of the GPU called ``gpu_name`` (any case), or None for one
    not in ``DATASHEET_BF16_PEAKS``."""
    name = gpu_name.lower()
    return next((peak for fragment, peak in DATASHEET_BF16_PEAKS if fragment.lower() in name),
                None)


def datasheet_peak_flops(device: torch.device | str) -> float | None:
    """The datasheet's dense bf16 peak of the GPU ``device`` names; None on a CPU (no datasheet
    applies: measure instead, ``measure_matmul_flops``) or on a GPU not in the table."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return datasheet_bf16_peak(torch.cuda.get_device_name(device))


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         size: int = 1024, seconds: float = 0.3) -> float:
    """The FLOP/s this process reaches on square matmuls: a measured peak for MFU where no data
    sheet applies (a laptop CPU), 2·size³ FLOPs each."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):                      # warm-up: allocation, kernel selection
        a @ b
    _synchronize(device)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        a @ b
        count += 1
        _synchronize(device)
    return 2 * size**3 * count / elapsed


def _synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
