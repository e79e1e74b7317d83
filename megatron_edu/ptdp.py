"""PTD-P: one GPT trained on a tp × pp × dp grid of ranks (2104.04473 §3, Figure 5 idea).

The three parallelisms compose without knowing much of each other:

* **tensor** (1909.08053 §3): every matrix of a stage is split over the tp ranks; the layers
  do their own ``f``/``g`` all-reduces (``tensor_parallel/``).
* **pipeline** (2104.04473 §2.2): the layers are cut into pp·v virtual stages; the engine runs
  the schedule's F and B actions over microbatches with send/recv (``pipeline/engine.py``).
* **data** (2104.04473 §2.1): dp replicas of that pipeline, each on its slice of the global batch;
  gradients are averaged once per step, in buckets overlapped with the last microbatch's
  backward (``data_parallel.py``), optionally with a ZeRO-1 sharded optimizer.

What only the composition has to do, in ``train_step``:

1. the **tied embedding** (GPT-2's output layer is the input embedding): the first and the last
   pipeline stage each hold a copy, which must stay equal, so their gradients are summed over
   ``grid.embedding_group`` before the update (Megatron-LM's ``_allreduce_word_embedding_grads``);
2. **gradient clipping by the global norm** across tp, pp and dp, counting every parameter once
   (``optim.clip_grad_norm_``);
3. the optimizer step, identical on every replica.

Started from the same seed, every layout takes the serial model's steps (tests/test_ptdp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_edu import comm
from megatron_edu.data_parallel import DataParallel, DistributedOptimizer
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPTConfig
from megatron_edu.optim import build_param_groups, clip_grad_norm_
from megatron_edu.pipeline.engine import build_chunks, run_schedule
from megatron_edu.pipeline.schedules import Action, forward_only, make_schedule

__all__ = ["PTDPOptions", "PTDP", "StepResult"]


@dataclass
class PTDPOptions:
    """How to split and how to optimise (the model itself is a ``GPTConfig``)."""

    schedule: str = "1f1b"           # "gpipe" | "1f1b" | "interleaved"
    num_chunks: int = 1              # v, model chunks per pipeline rank (interleaved only)
    num_microbatches: int = 1        # m, per data-parallel replica and step
    scatter_gather: bool = True      # 2104.04473 §4.1, used when tp > 1
    zero1: bool = False              # shard the optimizer state over dp
    bucket_mb: float = 25.0
    overlap: bool = True             # launch gradient all-reduces during backward
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8                # Adam's ε
    clip: float = 1.0                # max global gradient norm; 0 disables clipping


@dataclass
class StepResult:
    loss: float                      # mean over the global batch (equal on every rank)
    grad_norm: float                 # the global norm before clipping
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


class PTDP:
    """This rank's share of a GPT — its model chunks, its dp wrapper, its optimizer — and the
    collective training step. Build it on every rank of the grid with the same arguments."""

    def __init__(self, config: GPTConfig, grid: ParallelGrid, options: PTDPOptions) -> None:
        self.config, self.grid, self.options = config, grid, options
        self.schedule = make_schedule(options.schedule, grid.pp, options.num_microbatches,
                                      options.num_chunks)
        self.chunks = build_chunks(config, grid, options.num_chunks)
        self.ddp = DataParallel(self.chunks, grid.dp_group, options.bucket_mb, options.overlap,
                                sharded=options.zero1)
        groups = build_param_groups(self.chunks, options.weight_decay)
        adamw = dict(lr=options.lr, betas=options.betas, eps=options.eps)
        self.optimizer = (DistributedOptimizer(groups, self.ddp, torch.optim.AdamW, **adamw)
                          if options.zero1 else torch.optim.AdamW(groups, **adamw))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float) -> StepResult:
        """One optimizer step on this replica's slice [b/dp, s] of the global batch."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        result = self._run(self.schedule, input_ids, labels,
                           grad_sync=lambda chunk, last: self.ddp.sync(last))
        self.ddp.finish_grad_sync()                      # dp average, once per step (§2.1)
        self._sum_tied_embedding_grads()
        grad_norm = self._clip()
        self.optimizer.step()
        self.ddp.zero_grad()
        return StepResult(self._dp_mean(result.loss), grad_norm, result.timeline)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean loss of a batch, forward passes only."""
        result = self._run(forward_only(self.schedule), input_ids, labels)
        return self._dp_mean(result.loss)

    def _run(self, schedule, input_ids, labels, grad_sync=None):
        device = self.grid.device
        return run_schedule(schedule, self.chunks, self.grid, input_ids.to(device),
                            labels.to(device), self.options.num_microbatches, self.config.hidden,
                            scatter_gather=self.options.scatter_gather and self.grid.tp > 1,
                            grad_sync=grad_sync)

    @torch.no_grad()
    def _sum_tied_embedding_grads(self) -> None:
        """Both copies of the word embedding get the sum of their gradients (the serial model's
        gradient of the one shared matrix), so that they stay equal after the step."""
        copies = [c.embedding.word.weight for c in self.chunks if c.first or c.last]
        if self.grid.pp * self.options.num_chunks == 1 or not copies:
            return  # one stage holds both ends: one matrix, nothing to tie
        total = comm.all_reduce(sum(p.grad for p in copies), self.grid.embedding_group,
                                "embedding grads")
        for p in copies:
            p.grad.copy_(total)

    def _clip(self) -> float:
        max_norm = self.options.clip if self.options.clip > 0 else float("inf")
        if self.options.zero1:
            return self.optimizer.clip_grad_norm_(max_norm, self.grid)
        return clip_grad_norm_(self.parameters(), max_norm, self.grid)

    def _dp_mean(self, loss: torch.Tensor) -> float:
        return comm.all_reduce(loss, self.grid.dp_group, "dp loss").item() / self.grid.dp
