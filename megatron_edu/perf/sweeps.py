"""The performance model swept over one setting at a time: the experiments of 2104.04473 §3 and
§5.3–5.4 that the notebook draws (``course/viz/perf.py`` only draws them).

best_per_split         the fastest layout of every tp × pp split, fitting in memory if any does
tp_sweep               Fig. 13: throughput against tp at a fixed GPU count, no data parallelism
interleaving_speedup   Fig. 12: interleaved 1F1B over plain 1F1B at one batch size
microbatch_tradeoff    §3.4: bubble, activations and busy time against the microbatch size
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_edu.grid import Layout
from megatron_edu.model.config import GPTConfig
from megatron_edu.pipeline.schedules import PipelineConfig
from megatron_edu.ptdp import Parallelism

from .advisor import SELENE_A100, Hardware, Prediction, candidates, predict
from .memory import GIB

__all__ = ["best_per_split", "tp_sweep", "interleaving_speedup", "microbatch_tradeoff"]


def best_per_split(config: GPTConfig, global_batch: int, num_gpus: int,
                   hw: Hardware = SELENE_A100) -> dict[tuple[int, int], Prediction]:
    """For each (tp, pp), the fastest microbatch and schedule that fits in memory, or, when none
    fits, the fastest of all (check ``prediction.memory.total`` against the GPU's)."""

    def rank(pred: Prediction) -> tuple[bool, float]:
        return pred.memory.total > hw.memory_bytes, pred.time.total

    best: dict[tuple[int, int], Prediction] = {}
    for variant, parallelism in candidates(config, global_batch, num_gpus, hw):
        try:
            parallelism.check(variant)
        except ValueError:  # this split cannot hold the model
            continue
        pred = predict(variant, parallelism, hw)
        key = (parallelism.tp, parallelism.pp)
        if key not in best or rank(pred) < rank(best[key]):
            best[key] = pred
    return best


def tp_sweep(config: GPTConfig, num_gpus: int, global_batch: int, tps: Sequence[int],
             hw: Hardware = SELENE_A100) -> dict[int, float]:
    """2104.04473 Fig. 13: TFLOP/s per GPU for tp × (num_gpus/tp) pipelines, no data parallel,
    microbatches of one sequence."""
    pipeline = PipelineConfig(num_microbatches=global_batch)  # 1F1B, b = 1
    return {t: predict(config, Parallelism(Layout(t, num_gpus // t), pipeline),
                       hw).tflops_per_gpu for t in tps}


def interleaving_speedup(config: GPTConfig, tp: int, pp: int, chunks: int, global_batch: int,
                         hw: Hardware = SELENE_A100) -> float:
    """2104.04473 Fig. 12: 1F1B iteration time over interleaved (dp = 1, b = 1)."""
    def iteration_time(pipeline: PipelineConfig) -> float:
        return predict(config, Parallelism(Layout(tp, pp), pipeline), hw).time.total

    return (iteration_time(PipelineConfig("1f1b", num_microbatches=global_batch))
            / iteration_time(PipelineConfig("interleaved", chunks,
                                            num_microbatches=global_batch)))


def microbatch_tradeoff(config: GPTConfig, tp: int, pp: int, global_batch: int,
                        microbatches: Sequence[int],
                        hw: Hardware = SELENE_A100) -> dict[str, list[float]]:
    """§3.4: per microbatch size b (dp = 1, 1F1B), the bubble's share of the iteration, the
    activation GiB, and the busy milliseconds per sequence."""
    preds = [predict(config, Parallelism(Layout(tp, pp), PipelineConfig(
        microbatch=b, num_microbatches=global_batch // b)), hw) for b in microbatches]
    return {
        "bubble share": [p.time.bubble / p.time.total for p in preds],
        "activations (GiB)": [p.memory.activations / GIB for p in preds],
        "busy ms per sequence": [1e3 * (p.time.total - p.time.bubble) / global_batch
                                 for p in preds],
    }
