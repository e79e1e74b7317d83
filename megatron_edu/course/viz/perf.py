"""Pictures of the papers' cost model: memory, bubbles, predicted throughput, the advisor.

References: Narayanan et al. 2021, arXiv 2104.04473 — §2.2 bubbles and memory in flight, §3 the
takeaways (Fig. 13: tensor parallelism peaks at the GPUs of a node; Fig. 12: interleaving pays at
small batch; §3.4: the microbatch size), §5.1 Table 1; Korthikanti et al. 2022, arXiv 2205.05198
§4 activation memory. Every number drawn comes from ``megatron_edu.perf`` (the sweeps from
``perf.sweeps``, the papers' tables from ``perf.papers``); nothing is computed or fitted here.

draw_activation_memory               bytes a layer saves, by recomputation and sequence parallelism
draw_forwards_in_flight              microbatches each pipeline stage holds, per schedule
draw_table1                          predicted vs reported TFLOP/s per GPU, and where time goes
draw_split_sweep                     throughput of every tp × pp split (memory fit marked)
draw_bubble_vs_microbatches          bubble share of an iteration as m grows, vs (p-1)/(v·m)
draw_bubble_vs_dp                    Fig. 6: the bubble (p-1)/m against d at fixed n, t and B/b
draw_memory_per_gpu                  weights, gradients, optimizer, activations per layout
draw_advisor_vs_table1               the advisor's free choice against the paper's layout
draw_tp_sweep                        Fig. 13: throughput vs tp at fixed GPUs, several batches
draw_interleaving_speedup            Fig. 12: interleaved over 1F1B as the batch grows
draw_microbatch_tradeoff             §3.4: bubble, memory and busy time vs microbatch size
show_advice / explore_advisor        the notebook's static call and its ipywidgets explorer
show_machine_mfu                     this machine's MFU, measured live (``perf.measure_mfu``)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from megatron_edu.grid import Layout
from megatron_edu.model.config import RECOMPUTE, GPTConfig
from megatron_edu.perf import (
    DGX_H100,
    GIB,
    SELENE_A100,
    Hardware,
    Prediction,
    activation_bytes_per_layer,
    advise,
    best_per_split,
    forwards_in_flight,
    interleaving_speedup,
    measure_mfu,
    microbatch_tradeoff,
    predict,
    table1_config,
    tp_sweep,
)
from megatron_edu.perf.bubble import bubble_formula
from megatron_edu.pipeline.schedules import PipelineConfig
from megatron_edu.ptdp import Parallelism

__all__ = ["MIB", "PARTS", "draw_activation_memory", "draw_forwards_in_flight",
           "draw_memory_per_gpu", "draw_table1", "draw_advisor_vs_table1", "draw_split_sweep",
           "draw_bubble_vs_microbatches", "bubble_vs_dp", "draw_bubble_vs_dp", "draw_tp_sweep",
           "draw_interleaving_speedup", "draw_microbatch_tradeoff", "show_advice",
           "explore_advisor", "show_machine_mfu"]

MIB = 2**20
PARTS = ("compute", "bubble", "tensor_parallel", "pipeline_p2p", "data_parallel", "optimizer")
HARDWARE = {hw.name: hw for hw in (SELENE_A100, DGX_H100)}


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    return ax if ax is not None else plt.subplots(figsize=size)[1]


def _finish(ax: Axes, xlabel: str, ylabel: str, title: str, legend: int = 8) -> Axes:
    """The axes' labels, title and legend (at ``legend`` points), the figure laid out."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=legend)
    ax.figure.tight_layout()
    return ax


# ---- memory -------------------------------------------------------------------------------------


def draw_activation_memory(config: GPTConfig, microbatch: int, tp: int,
                           ax: Axes | None = None, bytes_per_value: int = 2,
                           measured: dict[tuple[str, bool], int] | None = None) -> Axes:
    """MiB one layer of ``config``'s model saves per GPU (2205.05198 §4; 16-bit values unless
    ``bytes_per_value``) for each recomputation × sequence parallelism; ``measured[(mode, sp)]``
    bytes drawn as dots."""
    ax = _axes(ax, (7, 3.2))
    modes = RECOMPUTE
    for i, sp in enumerate((False, True)):
        mib = [activation_bytes_per_layer(replace(config, recompute=r, sequence_parallel=sp),
                                          microbatch, tp=tp, bytes_per_value=bytes_per_value)
               / MIB for r in modes]
        bars = ax.bar(np.arange(3) + 0.4 * i, mib, 0.4,
                      label="sequence parallel" if sp else "tensor parallel only")
        ax.bar_label(bars, fmt="%.2f" if max(mib) < 10 else "%.0f", fontsize=8)
        if measured is not None:
            ax.plot(np.arange(3) + 0.4 * i, [measured[r, sp] / MIB for r in modes], "o",
                    color="black", label="measured" if i else None, gid=f"measured sp={sp}")
    ax.set_xticks(np.arange(3) + 0.2, [f"recompute: {r}" for r in modes])
    ax.set_ylabel("MiB per layer per GPU")
    ax.set_title(f"activations one layer keeps (h={config.hidden}, a={config.num_heads}, "
                 f"s={config.seq_len}, b={microbatch}, t={tp})", fontsize=10)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def draw_forwards_in_flight(p: int, m: int, v: int, ax: Axes | None = None) -> Axes:
    """Per pipeline stage, the microbatches whose activations it holds at its peak, in whole
    stages' worth (an interleaved chunk is 1/v of a stage), for GPipe, 1F1B and interleaved."""
    ax = _axes(ax, (7, 3.2))
    stages = np.arange(p)
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", v)):
        pipeline = PipelineConfig(schedule, chunks, num_microbatches=m)
        held = [sum(forwards_in_flight(pipeline, p, s)) / chunks for s in stages]
        label = schedule + (f" v={chunks}" if chunks > 1 else "")
        ax.plot(stages, held, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("microbatches in flight")
    ax.set_title(f"activation memory per stage, p={p}, m={m}")
    ax.legend()
    ax.figure.tight_layout()
    return ax


def draw_memory_per_gpu(predictions: Sequence[Prediction], hw: Hardware = SELENE_A100,
                        ax: Axes | None = None) -> Axes:
    """Stacked GiB per GPU of each prediction's split (the fuller of first and last stage)
    with the GPU's capacity."""
    ax = _axes(ax, (8, 3.4))
    bottom = np.zeros(len(predictions))
    for part in ("weights", "grads", "optimizer", "activations"):
        gib = np.array([getattr(pred.memory, part) / GIB for pred in predictions])
        ax.bar(range(len(predictions)), gib, bottom=bottom, label=part)
        bottom += gib
    ax.axhline(hw.memory_bytes / GIB, color="black", linestyle="--", linewidth=1,
               label=f"{hw.memory_bytes / GIB:.0f} GiB")
    ax.set_xticks(range(len(predictions)), [_short(x) for x in predictions], fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("memory per GPU")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=8)
    ax.figure.tight_layout()
    return ax


def _short(prediction: Prediction) -> str:
    split = prediction.parallelism
    schedule = "il" if split.schedule == "interleaved" else split.schedule
    tail = f" v{split.chunks}" if split.chunks > 1 else ""
    rc = prediction.config.recompute
    recompute = "" if rc == "full" else f"\nrc={rc}"
    return f"t{split.tp} p{split.pp} d{split.dp}\nb{split.microbatch} {schedule}{tail}" \
           + recompute


# ---- Table 1 and the advisor --------------------------------------------------------------------


def draw_table1(rows: Sequence[dict], predictions: Sequence[Prediction]) -> Figure:
    """Left: reported vs predicted TFLOP/s per GPU with the error; right: where time goes."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    x = np.arange(len(rows))
    names = [f"{r['params_billion']:g}B" for r in rows]
    reported = [r["tflops_per_gpu"] for r in rows]
    predicted = [p.tflops_per_gpu for p in predictions]
    left.bar(x - 0.2, reported, 0.4, label="Table 1 (measured)")
    bars = left.bar(x + 0.2, predicted, 0.4, label="predicted")
    left.bar_label(bars, [f"{100 * (p / r - 1):+.0f}%" for p, r in zip(predicted, reported,
                                                                       strict=True)], fontsize=7)
    left.set_xticks(x, names, rotation=45)
    left.set_ylabel("TFLOP/s per GPU")
    left.set_ylim(0, 200)
    left.set_title("each row's own tp and pp")
    left.legend(loc="lower right", fontsize=8)
    _draw_breakdown(right, names, predictions)
    fig.tight_layout()
    return fig


def _draw_breakdown(ax: Axes, names: Sequence[str], predictions: Sequence[Prediction]) -> None:
    bottom = np.zeros(len(predictions))
    for part in PARTS:
        share = np.array([getattr(p.time, part) / p.time.total for p in predictions])
        ax.bar(names, share, bottom=bottom, label=part.replace("_", " "))
        bottom += share
    ax.tick_params(axis="x", rotation=45)
    ax.set_ylabel("share of an iteration")
    ax.set_title("predicted time breakdown")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=8)


def draw_advisor_vs_table1(rows: Sequence[dict], own: Sequence[Prediction],
                           free: Sequence[Prediction], ax: Axes | None = None) -> Axes:
    """Per row: reported TFLOP/s, predicted for the paper's (tp, pp) (``own``), and predicted
    for the advisor's free choice (``free``, labelled with its tp and pp)."""
    ax = _axes(ax, (10, 3.6))
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["tflops_per_gpu"] for r in rows], 0.27, label="Table 1 (measured)")
    ax.bar(x, [p.tflops_per_gpu for p in own], 0.27, label="predicted, paper's tp × pp")
    bars = ax.bar(x + 0.27, [p.tflops_per_gpu for p in free], 0.27,
                  label="predicted, advisor's choice")
    ax.bar_label(bars, [f"t{p.parallelism.tp}p{p.parallelism.pp}" for p in free], fontsize=6)
    ax.set_xticks(x, [f"{r['params_billion']:g}B" for r in rows])
    ax.set_ylim(0, 200)
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_title("the advisor against Table 1")
    ax.legend(loc="lower right", fontsize=8)
    ax.figure.tight_layout()
    return ax


def draw_split_sweep(config: GPTConfig, global_batch: int, num_gpus: int,
                     hw: Hardware = SELENE_A100, ax: Axes | None = None) -> Axes:
    """Predicted TFLOP/s per GPU against pp, one line per tp (``perf.best_per_split``): filled,
    the split's fastest layout that fits in memory; hollow, none fits (the fastest, memory
    ignored)."""
    ax = _axes(ax, (7, 3.4))
    best = best_per_split(config, global_batch, num_gpus, hw)
    for tp in sorted({t for t, _ in best}):
        pps = sorted(p for t, p in best if t == tp)
        preds = [best[tp, p] for p in pps]
        line, = ax.plot(pps, [x.tflops_per_gpu for x in preds], label=f"tp={tp}")
        fits = [x.memory.total <= hw.memory_bytes for x in preds]
        for p, x, ok in zip(pps, preds, fits, strict=True):
            ax.plot(p, x.tflops_per_gpu, "o", color=line.get_color(),
                    markerfacecolor=line.get_color() if ok else "white")
    ax.set_xscale("log", base=2)
    pps = sorted({p for _, p in best})
    ax.set_xticks(pps, [str(p) for p in pps])
    return _finish(ax, "pipeline-parallel size pp  (dp = GPUs / (tp·pp))", "TFLOP/s per GPU",
                   f"{num_gpus} GPUs, B={global_batch}; hollow: no layout fits in "
                   f"{hw.memory_bytes / GIB:.0f} GiB")


# ---- the takeaways (2104.04473 §3 and §5.4-5.8) ------------------------------------------------


def draw_bubble_vs_microbatches(config: GPTConfig, tp: int, pp: int, chunks: int,
                                microbatch_counts: Sequence[int], hw: Hardware = SELENE_A100,
                                ax: Axes | None = None) -> Axes:
    """Predicted bubble over the rest of an iteration (dp = 1, b = 1) against m, beside the
    paper's t_pb / t_id = (p-1)/(v·m) (2104.04473 §2.2)."""
    ax = _axes(ax, (7, 3.2))
    for schedule, v in (("1f1b", 1), ("interleaved", chunks)):
        preds = [predict(config, Parallelism(Layout(tp, pp), PipelineConfig(
            schedule, v, num_microbatches=m)), hw) for m in microbatch_counts]
        label = schedule + (f" v={v}" if v > 1 else "")
        ratio = [p.time.bubble / (p.time.total - p.time.bubble) for p in preds]
        line, = ax.plot(microbatch_counts, ratio, marker="o", label=f"{label}: predicted")
        ax.plot(microbatch_counts, [(pp - 1) / (v * m) for m in microbatch_counts], "--",
                color=line.get_color(), label=f"{label}: (p-1)/(v·m)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(microbatch_counts), [str(m) for m in microbatch_counts])
    return _finish(ax, "microbatches per iteration m", "bubble / rest of iteration",
                   f"tp={tp}, pp={pp}: the bubble shrinks as 1/m", legend=7)


def bubble_vs_dp(num_gpus: int, batch_ratio: int, tp: int = 1) -> dict[int, float]:
    """{d: the 1F1B bubble (p − 1)/m} for every d that splits ``num_gpus`` = t·p·d GPUs and
    ``batch_ratio`` B/b microbatches (2104.04473 §3.3.1: p = n/(t·d), m = B/(b·d))."""
    return {d: float(bubble_formula("1f1b", num_gpus // (tp * d), batch_ratio // d))
            for d in range(1, num_gpus // tp + 1)
            if num_gpus % (tp * d) == 0 and batch_ratio % d == 0}


def draw_bubble_vs_dp(num_gpus: Sequence[int], batch_ratios: Sequence[int], tp: int = 1,
                      ax: Axes | None = None) -> Axes:
    """Fig. 6 of 2104.04473: the bubble (p − 1)/m = (n/(t·d) − 1)·(b·d)/B against d, one line
    per n and B/b, from ``perf.bubble.bubble_formula``."""
    ax = _axes(ax, (6, 3.4))
    for n in num_gpus:
        for ratio in batch_ratios:
            bubble = bubble_vs_dp(n, ratio, tp)
            ax.plot(list(bubble), list(bubble.values()), marker="o", label=f"n={n}, B/b={ratio}")
    ax.set_xscale("log", base=2)
    return _finish(ax, "data-parallel size d", "bubble (p − 1)/m",
                   f"t={tp}: more data parallelism, a shorter pipeline, a smaller bubble")


def draw_tp_sweep(config: GPTConfig, num_gpus: int, batches: Sequence[int],
                  tps: Sequence[int], hw: Hardware = SELENE_A100, ax: Axes | None = None) -> Axes:
    """Fig. 13: ``perf.tp_sweep``'s TFLOP/s per GPU against (tp, pp), one line per batch."""
    ax = _axes(ax, (7, 3.2))
    for batch in batches:
        by_tp = tp_sweep(config, num_gpus, batch, tps, hw)
        ax.plot(list(by_tp), list(by_tp.values()), marker="o", label=f"batch {batch}")
    ax.axvline(hw.gpus_per_node, color="grey", linestyle=":", label="GPUs per node")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(tps), [f"({t}, {num_gpus // t})" for t in tps])
    return _finish(ax, "(tensor, pipeline) parallel size", "TFLOP/s per GPU",
                   f"Fig. 13: {num_gpus} GPUs, no data parallelism")


def draw_interleaving_speedup(config: GPTConfig, tp: int, pp: int, chunks: int,
                              batches: Sequence[int], hw: Hardware = SELENE_A100,
                              ax: Axes | None = None) -> Axes:
    """Fig. 12: ``perf.interleaving_speedup`` against the global batch."""
    ax = _axes(ax, (7, 3.0))
    speedups = [interleaving_speedup(config, tp, pp, chunks, b, hw) for b in batches]
    ax.plot(batches, speedups, marker="o")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("global batch size (microbatches of 1)")
    ax.set_ylabel("speedup over 1F1B")
    ax.set_title(f"Fig. 12: interleaved (v={chunks}) over 1F1B, tp={tp}, pp={pp}")
    ax.figure.tight_layout()
    return ax


def draw_microbatch_tradeoff(config: GPTConfig, tp: int, pp: int, global_batch: int,
                             microbatches: Sequence[int], hw: Hardware = SELENE_A100) -> Figure:
    """§3.4: ``perf.microbatch_tradeoff``'s three curves against the microbatch size."""
    curves = microbatch_tradeoff(config, tp, pp, global_batch, microbatches, hw)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.0))
    for ax, (name, values) in zip(axes, curves.items(), strict=True):
        ax.plot(microbatches, values, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(microbatches), [str(b) for b in microbatches])
        ax.set_xlabel("microbatch size b")
        ax.set_title(name)
    fig.suptitle(f"§3.4: tp={tp}, pp={pp}, B={global_batch}", fontsize=10)
    fig.tight_layout()
    return fig


# ---- the advisor, static and interactive --------------------------------------------------------


def show_advice(config: GPTConfig, global_batch: int, num_gpus: int,
                hw: Hardware = SELENE_A100, top: int = 5) -> None:
    """The advisor's best layouts, printed; throughput of every split and their memory, drawn."""
    ranked = advise(config, global_batch, num_gpus, hw)
    print(f"{len(ranked)} layouts fit; the best {min(top, len(ranked))}:")
    for _, prediction in ranked[:top]:
        print("  ", prediction)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.6))
    draw_split_sweep(config, global_batch, num_gpus, hw, ax=left)
    if ranked:
        draw_memory_per_gpu([prediction for _, prediction in ranked[:top]], hw, ax=right)
    fig.tight_layout()
    plt.show()


def explore_advisor(rows: Sequence[dict]) -> None:
    """Sliders over a Table 1 model, the GPU count, the batch and the hardware."""
    import ipywidgets as widgets  # imported here: only the notebook's explorer needs it

    models = {f"{r['params_billion']:g}B": table1_config(r) for r in rows}

    def update(model, gpus, batch, hardware):
        show_advice(models[model], batch, gpus, HARDWARE[hardware])

    style = {"description_width": "initial"}
    widgets.interact(
        update,
        model=widgets.Dropdown(options=list(models), value=list(models)[-1], style=style),
        gpus=widgets.Dropdown(options=[64, 256, 512, 1024, 1536, 2048, 3072, 4096],
                              value=3072, description="GPUs", style=style),
        batch=widgets.Dropdown(options=[512, 1024, 1536, 2048, 3072, 4096], value=3072,
                               description="global batch", style=style),
        hardware=widgets.Dropdown(options=list(HARDWARE), style=style),
    )


# ---- this machine ------------------------------------------------------------------------------


def show_machine_mfu(model: torch.nn.Module, batch: int, rounds: int = 3,
                     matmul_size: int = 1024) -> float:
    """Draw this machine's model FLOP/s of ``model``'s training steps beside its matmul FLOP/s
    (``perf.measure_mfu``: one thread, alternately, medians of ``rounds``) and return the MFU,
    their ratio. A measurement: it changes from run to run."""
    achieved, peak = (x / 1e9 for x in measure_mfu(model, batch, rounds, matmul_size))
    _, ax = plt.subplots(figsize=(5, 2.4))
    ax.barh(["training step (model FLOPs)", f"matmul {matmul_size}³"], [achieved, peak])
    ax.set_xlabel("GFLOP/s (one thread)")
    ax.set_title(f"this machine: MFU {100 * achieved / peak:.0f}% of its matmul rate")
    ax.figure.tight_layout()
    plt.show()
    return achieved / peak
