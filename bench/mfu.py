"""(e) Model FLOPs utilization of a megatron-edu training step, against this machine's matmul rate.

MFU = (model FLOPs of one step / step time) / (FLOP/s of a large matmul, measured in the same run).
The model FLOPs are 2104.04473 §5.1's without recomputation (``perf.training_flops(...,
recompute=False)`` = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))): what the model needs, not what a
recomputing run executes. The denominator is measured rather than a datasheet peak, and the
benchmark alternates steps and matmuls so that both see the same machine. Target ≥ 60 %.

    python -m bench.mfu                                 # CPU, fp32, hidden 512
    python -m bench.mfu --device cuda --dtype bf16      # one GPU, a 350M GPT (also vs datasheet)
    python -m bench.mfu --predict                       # the advisor's MFU for gpu-check's run

``advisor_prediction`` is what the performance model (``perf.advisor``) expects of gpu-check's
training run (bench/gpu_check.py: GPT-2 medium, bf16, micro-batch 4, one GPU, the fused
attention core), set beside the measured MFU in gpu-check's table and in bench/README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from bench.common import DTYPES, Device, Spread, alternate, device_arguments, report, require_device
from bench.overhead import GPU_MODEL, random_batch, training_step
from megatron_edu.grid import Layout
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.perf import DGX_H100, Hardware, datasheet_peak_flops, predict, training_flops_of
from megatron_edu.perf.advisor import GEMM_EFFICIENCY
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import Parallelism

CPU_MODEL = dict(vocab_size=8192, seq_len=256, num_layers=4, hidden=512, num_heads=8)
BATCH = {"cpu": 2, "cuda": 8}  # short steps, many rounds: each pair sees the same machine
# Square matmul size and how many make one timed call (about a training step's duration).
MATMUL = {"cpu": (2048, 3), "cuda": (8192, 30)}
TARGET_PERCENT = 60.0
# The GPUs bench/README.md gives the advisor's prediction for: the H100 SXM of a DGX H100, and
# the H200 (the same tensor cores; HBM3e at 4.8 TB/s, its datasheet's).
GPU_CHECK_HARDWARE = {"H100 SXM": DGX_H100,
                      "H200": replace(DGX_H100, name="H200", memory_bandwidth=4.8e12)}


def matmuls(device: Device) -> tuple[Callable[[], None], float]:
    """A callable running ``count`` n×n×n matmuls in the benchmark's dtype, and its FLOPs."""
    n, count = MATMUL[device.type]
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device.torch, DTYPES[device.dtype])
            for _ in range(2))

    def run() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return run, 2.0 * n**3 * count


def datasheet_peak(device: Device) -> float | None:
    """The GPU's dense bf16 datasheet peak (perf.DATASHEET_BF16_PEAKS), for bf16 runs only."""
    return datasheet_peak_flops(device.torch) if device.dtype == "bf16" else None


@dataclass(frozen=True)
class AdvisorMFU:
    """The performance model's MFU for a training run, and what it assumed to get it."""

    mfu: float            # model FLOPs (2104.04473 §5.1, no recomputation) / (time · peak)
    tokens_per_s: float
    assumptions: str

    def __str__(self) -> str:
        return (f"MFU {self.mfu:.1%}, {self.tokens_per_s:,.0f} tokens/s per GPU, assuming "
                f"{self.assumptions}")


def advisor_prediction(peak_flops: float, hardware: Hardware = DGX_H100, *,
                       preset: str = "gpt2-medium", micro_batch: int = 4, batch: int = 16,
                       attention: str = "fused") -> AdvisorMFU:
    """What ``perf.predict`` expects of one GPU training ``preset`` in 16-bit on ``batch``
    sequences a step, ``micro_batch`` at a time (gradient accumulation, no recomputation,
    dropout 0): gpu-check's training run by default. ``peak_flops`` is the GPU's (its datasheet
    peak, or a measured one where none applies); the rest of ``hardware`` (HBM bandwidth, the
    cost of a kernel launch) is taken as it is: a DGX H100's by default. The MFU counts the
    same FLOPs as the training log's (the unpadded vocabulary)."""
    config = GPTConfig.preset(preset, attention=attention)
    pipeline = PipelineConfig(microbatch=micro_batch, num_microbatches=batch // micro_batch)
    gpu = replace(hardware, gpus_per_node=1, peak_flops=peak_flops)
    seconds = predict(config, Parallelism(Layout(), pipeline), gpu).time.total
    flops = training_flops_of(config, batch)
    core = "flash attention (no scores through HBM)" if attention == "fused" else \
        "attention scores through HBM"
    assumptions = (f"{peak_flops / 1e12:.0f} TFLOP/s peak, GEMMs at η = {GEMM_EFFICIENCY} of "
                   f"it (calibrated on 2104.04473 Table 1), other kernels at "
                   f"{gpu.memory_bandwidth / 1e12:.2f} TB/s of HBM and "
                   f"{gpu.kernel_launch * 1e6:.0f} µs each, fused bias-GeLU and "
                   f"bias-dropout-add (Megatron's), {core}, Adam over fp32 master weights "
                   f"and moments")
    return AdvisorMFU(flops / (seconds * peak_flops), batch * config.seq_len / seconds,
                      assumptions)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device_arguments(parser)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--predict", action="store_true", help="print the advisor's MFU for "
                        "gpu-check's training run on an H100 SXM and an H200, and stop")
    args = parser.parse_args(argv)
    if args.predict:
        for name, hardware in GPU_CHECK_HARDWARE.items():
            print(f"{name}: {advisor_prediction(hardware.peak_flops, hardware)}")
        return {}
    device = require_device(args.device, args.dtype, args.threads)
    config = GPTConfig(**(CPU_MODEL if device.type == "cpu" else GPU_MODEL), dropout=0.1)
    batch = BATCH[device.type]
    model = GPT(config).to(device.torch)
    step = training_step(model, device, *random_batch(config, batch, device))
    matmul, matmul_flops = matmuls(device)
    step_flops = training_flops_of(config, batch, vocab=config.padded_vocab())
    print(f"(e) MFU on {device.describe()}: GPT {config.num_layers} layers, hidden "
          f"{config.hidden}, seq {config.seq_len}, batch {batch}: {step_flops / 1e9:.1f} GFLOP "
          f"per step; matmul {MATMUL[device.type][0]}³")
    times = alternate({"step": step, "matmul": matmul}, args.rounds, warmup=1,
                      sync=device.synchronize)
    achieved = [step_flops / t for t in times.wall["step"]]
    peak = [matmul_flops / t for t in times.wall["matmul"]]
    mfu = Spread.of([100 * a / p for a, p in zip(achieved, peak, strict=True)])
    extra = {"achieved_gflops": Spread.of(achieved).median / 1e9,
             "matmul_gflops": Spread.of(peak).median / 1e9}
    print(f"  achieved {extra['achieved_gflops']:.1f} GFLOP/s; matmul "
          f"{extra['matmul_gflops']:.1f} GFLOP/s")
    if datasheet := datasheet_peak(device):
        extra["percent_of_datasheet_peak"] = 100 * Spread.of(achieved).median / datasheet
        print(f"  {extra['percent_of_datasheet_peak']:.1f} % of the datasheet's "
              f"{datasheet / 1e12:.0f} TFLOP/s")
    return report(
        f"e_mfu_{device.type}", "mfu_percent_of_measured_matmul", mfu,
        f">= {TARGET_PERCENT:g} %", mfu.median >= TARGET_PERCENT,
        config=dict(device=device.describe(), batch=batch, layers=config.num_layers,
                    hidden=config.hidden, heads=config.num_heads, seq=config.seq_len,
                    vocab=config.padded_vocab(), step_gflop=step_flops / 1e9),
        extra=extra)


if __name__ == "__main__":
    main()
