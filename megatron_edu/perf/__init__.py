"""The papers' cost model: FLOPs and parameter formulas, a memory model, a performance model
and a configuration advisor (2104.04473 §3, §5.1; 1909.08053 §5; 2205.05198 §4)."""

from .advisor import (
    DGX2H_V100,
    DGX_H100,
    SELENE_A100,
    Hardware,
    Prediction,
    TimeBreakdown,
    advise,
    candidate_layouts,
    predict,
    rejection_reason,
)
from .flops import (
    A100_BF16_PEAK,
    H100_PCIE_BF16_PEAK,
    H100_SXM_BF16_PEAK,
    V100_FP16_PEAK,
    datasheet_bf16_peak,
    datasheet_peak_flops,
    model_flops_utilization,
    num_parameters,
    training_flops,
    training_time_seconds,
)
from .memory import (
    FP32,
    MIXED,
    MIXED_FP32_GRADS,
    Layout,
    MemoryEstimate,
    ModelShape,
    Precision,
    activation_bytes_per_layer,
    activation_bytes_per_rank,
    embedding_activation_bytes,
    forwards_in_flight,
    layout_error,
    memory_per_rank,
    output_layer_activation_bytes,
    parameters_per_rank,
)

__all__ = [
    "A100_BF16_PEAK", "DGX2H_V100", "DGX_H100", "FP32", "H100_PCIE_BF16_PEAK",
    "H100_SXM_BF16_PEAK", "MIXED",
    "MIXED_FP32_GRADS", "SELENE_A100", "V100_FP16_PEAK", "Hardware", "Layout", "MemoryEstimate",
    "ModelShape", "Precision", "Prediction", "TimeBreakdown", "activation_bytes_per_layer",
    "activation_bytes_per_rank", "advise", "candidate_layouts", "datasheet_bf16_peak",
    "datasheet_peak_flops", "embedding_activation_bytes",
    "forwards_in_flight", "layout_error", "memory_per_rank", "model_flops_utilization",
    "num_parameters", "output_layer_activation_bytes", "parameters_per_rank", "predict",
    "rejection_reason", "training_flops", "training_time_seconds",
]
