"""The memory calculator: what one GPU holds for a layout, part by part, from the package's model.

    choice = MemoryChoice(tp=8, pp=8, sequence_parallel=True, recompute="selective")
    calculate(config, choice, global_batch=1536)   # a MemoryEstimate: weights, grads, ...
    draw_memory_calculator(config, [choice, …], global_batch=1536, capacity=80 * 2**30)
    explore_memory(config, global_batch=1536, capacity=80 * 2**30)   # the same, with sliders

Notebook 10 moves what activations cost (recomputation, sequence parallelism); notebook 13 what
the model states cost (the ZeRO stage over dp). Both read ``perf.memory.memory_per_rank``, the
same model the advisor sizes layouts with, so a bar here is what the advisor believes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from megatron_edu.course.viz.data_parallel import draw_memory_per_rank
from megatron_edu.grid import Layout
from megatron_edu.model import GPTConfig
from megatron_edu.perf.memory import MemoryEstimate, memory_per_rank
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import Parallelism

__all__ = ["MemoryChoice", "calculate", "draw_memory_calculator", "explore_memory"]

POWERS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class MemoryChoice:
    """One setting of the calculator's controls: the layout, the activations' treatment and the
    ZeRO stage (1F1B, microbatches of ``microbatch`` sequences)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    zero: int = 0
    microbatch: int = 1

    @property
    def label(self) -> str:
        extras = ["SP" if self.sequence_parallel else "", "" if self.recompute == "none"
                  else self.recompute, f"ZeRO-{self.zero}" if self.zero else ""]
        return "\n".join([f"t{self.tp} p{self.pp} d{self.dp}"] + [e for e in extras if e])


def calculate(config: GPTConfig, choice: MemoryChoice, global_batch: int) -> MemoryEstimate:
    """The peak bytes of one GPU under ``choice``: m = global_batch / (dp · b) microbatches. A
    ValueError naming the numbers where the layout cannot split the model or the batch."""
    if global_batch % (choice.dp * choice.microbatch):
        raise ValueError(f"a global batch of {global_batch} sequences does not split into dp = "
                         f"{choice.dp} replicas of microbatches of {choice.microbatch}")
    pipeline = PipelineConfig(num_microbatches=global_batch // (choice.dp * choice.microbatch),
                              microbatch=choice.microbatch)
    model = replace(config, sequence_parallel=choice.sequence_parallel, recompute=choice.recompute)
    split = Parallelism(Layout(tp=choice.tp, pp=choice.pp, dp=choice.dp), pipeline, choice.zero)
    return memory_per_rank(model, split)


def draw_memory_calculator(config: GPTConfig, choices: Sequence[MemoryChoice], global_batch: int,
                           capacity: int | None = None, title: str = "") -> Figure:
    """One stacked bar per choice: weights, gradients, optimizer state and activations (GiB)
    beside the GPU's ``capacity``; a layout that cannot split the model is left out, named."""
    estimates, refused = {}, []
    for choice in choices:
        try:
            estimates[choice.label] = calculate(config, choice, global_batch)
        except ValueError as error:
            refused.append(f"{choice.label.replace(chr(10), ' ')}: {error}")
    for line in refused:
        print("cannot split:", line)
    if not estimates:
        return plt.figure(figsize=(4, 1))
    _, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(estimates) + 2.0), 3.8))
    draw_memory_per_rank(estimates, capacity, ax, title or f"{config.num_layers} layers, h = "
                         f"{config.hidden}, s = {config.seq_len}, B = {global_batch}")
    return ax.figure


def explore_memory(config: GPTConfig, global_batch: int, capacity: int | None = None,
                   start: MemoryChoice = MemoryChoice()) -> None:
    """The ipywidgets explorer: every control of ``MemoryChoice``; one bar, the choice's. p runs
    over the divisors of the layers (each stage holds as many)."""
    import ipywidgets as widgets  # imported here: only the notebooks' explorer needs it

    def update(**controls) -> None:
        draw_memory_calculator(config, [MemoryChoice(**controls)], global_batch, capacity)
        plt.show()

    widgets.interact(
        update,
        tp=widgets.SelectionSlider(options=POWERS[:4], value=start.tp),
        pp=widgets.SelectionSlider(options=[p for p in range(1, config.num_layers + 1)
                                            if config.num_layers % p == 0], value=start.pp),
        dp=widgets.SelectionSlider(options=POWERS, value=start.dp),
        sequence_parallel=widgets.Checkbox(value=start.sequence_parallel, description="SP"),
        recompute=widgets.ToggleButtons(options=["none", "selective", "full"],
                                        value=start.recompute),
        zero=widgets.SelectionSlider(options=[0, 1, 2, 3], value=start.zero, description="ZeRO"),
        microbatch=widgets.SelectionSlider(options=POWERS[:4], value=start.microbatch,
                                           description="b"))
