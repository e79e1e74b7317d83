"""PTD-P: one GPT trained on a tp × pp × dp grid of ranks (2104.04473 §3, Figure 5 idea).

How the run is split is ``Parallelism``; how it optimises, ``PTDPOptions``. Each parallelism is
its package's — tensor (1909.08053 §3, ``tensor_parallel/``), pipeline (2104.04473 §2.2,
``pipeline/engine.py``), data (§2.1, ``data_parallel``) — and they compose without knowing much
of each other. What only the composition does, in ``train_step``:

1. **the loss** is the mean over the global batch's target tokens (labels ≠ −100): each replica
   divides its tokens' losses by the global count (one all-reduce), so its gradients are its
   *share* — summed over dp, not averaged — and a padded microbatch weighs by its tokens;
2. the **tied embedding** (GPT-2's output layer is its input embedding): the first and the last
   stage each hold a copy, kept equal by summing their gradients over ``grid.embedding_group``
   (Megatron-LM's ``_allreduce_word_embedding_grads``);
3. **sequence parallelism** (2205.05198): the replicated parameters' gradients, each tp rank's
   from its part of the sequence, are summed over tp;
4. **fp16 loss scaling** (1909.08053, ``optim.DynamicLossScale``): the gradients are unscaled;
5. **clipping by the global norm** across tp, pp and dp (``optim.clip_grad_norm_``); a non-finite
   norm skips the step on every rank together, and halves the loss scale;
6. the optimizer step, identical on every replica.

Under **context parallelism** each rank runs its two chunks of every sequence
(``context_parallel.split``): token count, loss and gradients are summed over the dp × cp ranks
(``grid.dp_cp_group``, megatron-core's data-parallel-with-context group). ``iteration`` and each
sample's position in the global batch seed the dropout masks, so every layout draws the serial
model's masks and, from the same seed, takes its steps (tests/test_ptdp.py).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from megatron_edu import comm
from megatron_edu.context_parallel import split
from megatron_edu.data_parallel import STAGES
from megatron_edu.grid import Layout, ParallelGrid, to_device
from megatron_edu.model import GPTConfig
from megatron_edu.model.gpt import IGNORE_INDEX
from megatron_edu.model.moe import step_stats
from megatron_edu.optim import DynamicLossScale, FixedLossScale, build_param_groups
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import PipelineConfig, forward_only
from megatron_edu.pipeline.stages import StageMap
from megatron_edu.tensor_parallel.sequence_parallel import sum_replicated_grads_

__all__ = ["Parallelism", "PTDPOptions", "PTDP", "StepResult"]


@dataclass(frozen=True)
class Parallelism:
    """How one run is split: the mesh, how each pipeline runs, and the ZeRO stage (1 shards the
    optimizer state over the dp × cp ranks, 2 the gradients too, 3 the parameters too). Checked
    against ``layout.pp`` when made; ``check(config)`` adds the model's rules."""

    layout: Layout = field(default_factory=Layout)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    zero: int = 0

    def __post_init__(self) -> None:
        if self.zero not in STAGES:
            raise ValueError(f"zero is a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        self.pipeline.check(self.layout.pp)

    # The sizes, read through (the memory model and the advisor read little else).
    tp = property(lambda self: self.layout.tp)
    cp = property(lambda self: self.layout.cp)
    ep = property(lambda self: self.layout.ep)
    pp = property(lambda self: self.layout.pp)
    dp = property(lambda self: self.layout.dp)
    world_size = property(lambda self: self.layout.world_size)
    schedule = property(lambda self: self.pipeline.schedule)
    chunks = property(lambda self: self.pipeline.chunks)
    microbatch = property(lambda self: self.pipeline.microbatch)
    num_microbatches = property(lambda self: self.pipeline.num_microbatches)

    @property
    def global_batch(self) -> int:
        """B = dp · m · b sequences per optimizer step."""
        return self.layout.dp * self.pipeline.num_microbatches * self.pipeline.microbatch

    @property
    def stages(self) -> StageMap:
        """Where the schedule puts the pp · v virtual stages."""
        return self.pipeline.stages(self.layout.pp)

    def make_schedule(self):
        """The schedule every pipeline runs: p stages, m microbatches, v chunks per rank."""
        return self.pipeline.make_schedule(self.layout.pp)

    def check(self, config: GPTConfig) -> None:
        """A ValueError naming the numbers if ``config``'s model cannot be split this way."""
        config.validate(self.layout.tp, self.layout.pp, self.pipeline.chunks, self.layout.cp,
                        self.layout.ep)
        splits = self.pipeline.splits_backward
        if self.zero >= 2 and (self.layout.pp > 1 or splits):
            raise ValueError(f"ZeRO-{self.zero} reduce-scatters the gradients in every backward "
                             f"pass (and ZeRO-3 gathers the weights for each): with pp = "
                             f"{self.layout.pp} and the {self.pipeline.schedule} schedule that is "
                             "every microbatch's; Megatron-LM's code pairs pipelines with ZeRO-1, "
                             "as DeepSpeed does: use zero = 1, or pp = 1 with 1f1b")
        if config.async_tp and splits:  # B and W: one node here
            raise ValueError(f"async_tp computes dX and dW in one node: {self.pipeline.schedule}'s "
                             "B/W split would run it, and its collectives, twice")


@dataclass(kw_only=True)
class PTDPOptions:
    """How to optimise (how to split is ``Parallelism``; the model a ``GPTConfig``)."""

    scatter_gather: bool = True      # 2104.04473 §4.1, used when tp > 1
    bucket_mb: float = 25.0
    overlap: bool = True             # launch gradient all-reduces during backward
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8                # Adam's ε
    clip: float = 1.0                # max global gradient norm; 0 disables clipping
    loss_scaling: bool = False       # fp16: dynamic loss scaling (optim.DynamicLossScale)


@dataclass
class StepResult:
    """What one ``train_step`` did, the same on every rank."""

    loss: float                      # mean over the global batch's tokens (equal on every rank)
    grad_norm: float                 # the global norm before clipping (inf: not finite)
    skipped: bool = False            # the norm was not finite: no rank updated its weights
    loss_scale: float = 1.0          # the loss scale this step used (fp16)
    moe: dict | None = None          # a mixture of experts' routing (``moe.step_stats``)


class PTDP:
    """This rank's share of a GPT — model chunks, dp wrapper, optimizer — and the collective
    training step. Build it on every rank of the grid with the same arguments."""

    def __init__(self, config: GPTConfig, grid: ParallelGrid,
                 options: PTDPOptions | None = None, *,
                 pipeline: PipelineConfig | None = None, zero: int = 0) -> None:
        self.config, self.grid = config, grid
        self.parallelism = Parallelism(grid.layout, pipeline or PipelineConfig(), zero)
        self.parallelism.check(config)
        self.options = options = options or PTDPOptions()
        self.schedule = self.parallelism.make_schedule()
        if grid.embedding_ranks != self.schedule.stages.ends:
            raise ValueError(f"the {self.parallelism.schedule} schedule holds the tied embedding "
                             f"on pipeline ranks {self.schedule.stages.ends}, the grid's embedding "
                             f"group on {grid.embedding_ranks}: build the grid with "
                             "ParallelGrid(layout, embedding_ranks=pipeline.stages(pp).ends)")
        self.chunks = build_chunks(config, grid, self.schedule.stages)
        self.iteration = 0                # optimizer steps taken (skipped ones included)
        tied = [w for c in self.chunks for w in c.tied_word_tables()]
        self.tied = tied if self.schedule.stages.num_stages > 1 else []
        # the last stage's copy: its original, on the first stage, is the one the norm counts
        self.tied_copies = [w for c in self.chunks if c.last and not c.first and self.tied
                            for w in c.tied_word_tables()]
        self.ddp = STAGES[zero](self.chunks, grid.dp_cp_group, options.bucket_mb, options.overlap,
                                average=False, alone=self.tied,
                                units=[b for c in self.chunks for b in c.blocks.values()],
                                experts=(grid.ep_group, grid.edp_group))
        self.optimizer = self.ddp.optimizer(
            build_param_groups(self.chunks, options.weight_decay), torch.optim.AdamW,
            lr=options.lr, betas=options.betas, eps=options.eps)
        self.loss_scale = DynamicLossScale() if options.loss_scaling else FixedLossScale()
        # sequence parallelism: each tp rank's replicated parameters saw its part of the sequence
        self.replicated = ([p for p in self.parameters() if p.tp_dim is None and p.requires_grad]
                           if config.sequence_parallel else [])

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    @property
    def has_experts(self) -> bool:
        """Does this rank hold experts (a mixture-of-experts model, every block's: model/moe.py)?"""
        return self.config.moe_experts > 0

    def gathered(self) -> AbstractContextManager:
        """Inside, every parameter is whole (ZeRO-3 gathers, keeps writes): save, load, sample."""
        return self.ddp.gathered()

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float) -> StepResult:
        """One optimizer step on this replica's slice [b/dp, s] of the global batch."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scale = self.loss_scale.scale
        result = self._run(self.schedule, input_ids, labels, scale,
                           grad_sync=lambda chunk, last: self.ddp.sync(last))
        self.ddp.finish_grad_sync()                      # dp sum, once per step (§2.1)
        self._sum_tied_embedding_grads()
        # 2205.05198 §4.2.2: sum the replicated parameters' gradients over tp
        sum_replicated_grads_(self.ddp.local_grads(self.replicated), self.grid.tp_group)
        torch._foreach_mul_(self.ddp.held_grads(), 1.0 / scale)  # all live in buckets
        # the step's one host sync: the loss and the norm (inf: a replica's gradient was not)
        loss, grad_norm = torch.stack((self._dp_sum(result.loss), self._clip())).tolist()
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.loss_scale.update(overflow=skipped)
        self.ddp.zero_grad()
        self.iteration += 1
        return StepResult(loss, grad_norm, skipped, scale, self._routing())

    def _routing(self) -> dict | None:
        """The step's routing of a mixture of experts (None for a dense model): its counts,
        summed over the ranks that split the batch's tokens, and every stage's layers, per
        expert and per ep rank (the tokens each receives)."""
        if not self.has_experts:
            return None
        token_group = self.chunks[0].expert_groups.tokens     # cp, or tp × cp under SP
        stats = step_stats(self.chunks, self.config,
                           [token_group, self.grid.dp_group, self.grid.pp_group])
        n = self.config.moe_experts // self.grid.ep                 # each ep rank's experts
        stats["moe_rank_load"] = [[sum(layer[r * n:(r + 1) * n]) for r in range(self.grid.ep)]
                                  for layer in stats["moe_load"]]
        return stats

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean loss over the target tokens of a global batch, forward passes only."""
        result = self._run(forward_only(self.schedule), input_ids, labels)
        return self._dp_sum(result.loss).item()

    def _run(self, schedule, input_ids, labels, loss_scale=1.0, grad_sync=None):
        device, b = self.grid.device, input_ids.shape[0]
        if self.grid.cp > 1:                               # this rank's chunks of each sequence
            input_ids, labels = (split(x, self.grid.cp_rank, self.grid.cp)
                                 for x in (input_ids, labels))
        input_ids, labels = to_device(input_ids, device), to_device(labels, device)
        tokens = comm.all_reduce((labels != IGNORE_INDEX).sum().float(), self.grid.dp_cp_group,
                                 "dp tokens")                # stays on the device: no sync
        batch = Batch(input_ids, labels, self.iteration, self.grid.dp_rank * b, tokens)
        settings = RunSettings(self.options.scatter_gather and not self.config.sequence_parallel,
                               grad_sync=grad_sync, loss_scale=loss_scale, timeline=False)
        return run_schedule(schedule, self.chunks, self.grid, batch, settings)

    @torch.no_grad()
    def _sum_tied_embedding_grads(self) -> None:
        """Both copies of the word embedding get the sum of their gradients, so they stay equal:
        under ZeRO only this rank's shard (buckets laid out alike); under ZB-V, on rank 0 alone."""
        grads = self.ddp.local_grads(self.tied)           # ZeRO: the shard this rank owns
        if grads:
            total = comm.all_reduce(sum(grads), self.grid.embedding_group, "embedding grads")
            for grad in grads:
                grad.copy_(total)

    def _clip(self) -> torch.Tensor:
        """Clip by the global norm (``clip`` 0: never); return the norm (inf: not finite)."""
        max_norm = self.options.clip if self.options.clip > 0 else math.inf
        return self.ddp.clip_grad_norm_(max_norm, self.grid, self.tied_copies)

    def _dp_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """The replicas' (and cp ranks') shares of the token mean, added up: the global mean."""
        return comm.all_reduce(loss, self.grid.dp_cp_group, "dp loss")
