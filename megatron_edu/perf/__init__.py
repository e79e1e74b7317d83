"""The papers' cost model: FLOPs and parameter formulas, a memory model, a performance model
and a configuration advisor (2104.04473 §3, §5.1; 1909.08053 §5; 2205.05198 §4; context
parallelism: 2310.01889 and megatron-core's CP; mixtures of experts and expert parallelism:
GShard, 2006.16668, and megatron-core's EP).

The model is a ``model.GPTConfig`` (its recomputation and sequence parallelism included; a
``LlamaConfig``'s block too, or a preset's name: ``advisor.model_config``), its
split a ``ptdp.Parallelism`` (a ``grid.Layout`` of tp, cp, pp, dp, ep; a
``pipeline.PipelineConfig``; the ZeRO stage): the same values a training run takes.

flops.py     the papers' counting formulas: parameters (a mixture's total and active), FLOPs,
             training time, utilization; the GPUs' datasheet peaks, and a measured one
memory.py    weights, gradients, optimizer states and activations per GPU; the exact parameter
             count; microbatches in flight, read off the schedule
bubble.py    the papers' pipeline bubbles as formulas, beside what the simulator plays
advisor.py   the time of one iteration, the advisor that ranks every layout, and why it chose
sweeps.py    the model swept over one setting: the experiments of 2104.04473 §3 and §5
traffic.py   bytes on the wire from ``comm.record()`` logs, by purpose; the experts' all-to-alls
papers.py    the papers' tables shipped in docs/papers/, as numbers and models
measure.py   memory and MFU measured on this machine
ring.py      ring attention's steps, simulated: what notebook 12's timelines compare with
"""

from .advisor import (
    DGX2H_V100,
    DGX_H100,
    SELENE_A100,
    Hardware,
    Prediction,
    advise,
    candidates,
    explain,
    model_config,
    predict,
    rejection_reason,
)
from .flops import (
    A100_BF16_PEAK,
    H100_SXM_BF16_PEAK,
    V100_FP16_PEAK,
    active_parameters,
    datasheet_bf16_peak,
    datasheet_peak_flops,
    expert_parameters,
    measure_matmul_flops,
    model_flops_utilization,
    num_parameters,
    training_flops,
    training_flops_of,
    training_time_seconds,
)
from .measure import measure_mfu
from .memory import (
    FP32,
    GIB,
    MIXED,
    MIXED_FP32_GRADS,
    MemoryEstimate,
    Precision,
    activation_bytes_per_layer,
    activation_bytes_per_rank,
    embedding_activation_bytes,
    expert_parameters_per_rank,
    forwards_in_flight,
    memory_per_rank,
    output_layer_activation_bytes,
    parameters_per_rank,
)
from .papers import megatron_core_activation_bytes, read_paper_table, table1_config
from .sweeps import best_per_split, interleaving_speedup, microbatch_tradeoff, tp_sweep
from .traffic import (
    PURPOSES,
    all_to_all_bytes,
    all_to_alls,
    expert_parallel_bytes,
    wire_bytes_by_group,
)

__all__ = [
    "A100_BF16_PEAK", "DGX2H_V100", "DGX_H100", "FP32", "GIB",
    "H100_SXM_BF16_PEAK", "MIXED", "MIXED_FP32_GRADS", "PURPOSES", "SELENE_A100",
    "V100_FP16_PEAK", "Hardware", "MemoryEstimate", "Precision", "Prediction",
    "activation_bytes_per_layer", "activation_bytes_per_rank", "active_parameters", "advise",
    "all_to_all_bytes", "all_to_alls", "best_per_split",
    "candidates", "datasheet_bf16_peak", "datasheet_peak_flops",
    "embedding_activation_bytes", "expert_parallel_bytes", "expert_parameters",
    "expert_parameters_per_rank", "explain", "forwards_in_flight", "interleaving_speedup",
    "measure_matmul_flops", "measure_mfu",
    "megatron_core_activation_bytes", "memory_per_rank", "microbatch_tradeoff", "model_config",
    "model_flops_utilization", "num_parameters",
    "output_layer_activation_bytes",
    "parameters_per_rank", "predict", "read_paper_table", "rejection_reason", "table1_config",
    "tp_sweep", "training_flops", "training_flops_of", "training_time_seconds",
    "wire_bytes_by_group",
]
