"""A mixture of experts in place of the MLP (Shazeer et al. 2017; GShard; Switch; Mixtral, Jiang et
al. 2024; DeepSeekMoE and DeepSeek-V3): a router sends each token to k of E SwiGLU experts, and
the token's output is the weighted sum of theirs. Parameters grow E-fold; a token's FLOPs by k.

* **Router**: a fp32 gate [E, h]. "softmax" scores (Mixtral: the k largest probabilities,
  renormalised to sum to one with ``moe_norm_topk``) or "sigmoid" scores (DeepSeek-V3, always
  renormalised over the k).
* **Balance**: without a push the router sends most tokens to a few experts. The auxiliary loss
  α · E · Σ_i f_i · P_i (Switch eq. 4, GShard), f_i the fraction of the group's k·S choices
  that went to expert i, P_i its mean probability, is 1 under uniform routing; the group is a
  "sequence" (DeepSeek-V3's sequence-wise loss) or a "microbatch" of whole sequences. The
  z-loss β · logsumexp(logits)² (ST-MoE, Zoph et al. 2022) keeps the logits small. Both are
  defined on whole sequences, never on the tokens a rank happens to hold: the selection counts
  are summed over the ranks that split a sequence (cp, and tp under SP), so values and gradients
  are the same at any layout. Their gradient enters at the router's output as the step's loss
  does (``aux_loss_scale``: the engine's loss scale / the batch's target tokens, megatron-core's
  ``MoEAuxLossAutoScaler``), per token: Σ_t over the layer's tokens, then / the token count.
* **Experts**: E/ep of them on this rank (``expert_parallel.py`` carries the tokens), each split
  over tp as the MLP is (its fc by columns, its proj by rows: one ``g`` after the sum), all
  computed by one grouped GEMM.
* **Shared experts** (DeepSeekMoE; Qwen-MoE): an MLP every token passes through, gated by
  sigmoid(x·w) with ``moe_shared_gate``.

Inside the tp region every tp rank routes the whole sequence the same way: the router runs on
the tokens this rank holds outside it (under SP its part: the router's gradient is then summed
over tp as any replicated weight's), and its decisions enter the region as x does (``f``, or
the sequence all-gathered under SP).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.context_parallel import positions_of
from megatron_edu.expert_parallel import ExpertDispatcher
from megatron_edu.model.config import GPTConfig
from megatron_edu.model.fused import bias_swiglu
from megatron_edu.tensor_parallel.init import check_initialised, normal, placeholder, zeros
from megatron_edu.tensor_parallel.layers import TensorParallel, serial_group

__all__ = ["ExpertGroups", "Router", "group_limited", "Dropless", "Capacity",
           "keep_within_capacity", "Experts",
           "MoE", "aux_loss_scale", "routers", "step_stats"]

_AUX_SCALE: list[float | torch.Tensor | None] = [None]


@contextmanager
def aux_loss_scale(scale: float | torch.Tensor | None) -> Iterator[None]:
    """Inside, the balance losses' gradients enter backward × ``scale`` (per token: the loss
    scale / the target tokens, as the LM loss's). Outside (evaluation, generation), not at all."""
    previous, _AUX_SCALE[0] = _AUX_SCALE[0], scale
    try:
        yield
    finally:
        _AUX_SCALE[0] = previous


@dataclass(frozen=True)
class ExpertGroups:
    """What an MoE layer needs besides tp: ``ep`` splits its experts; ``tokens`` splits each
    sequence outside the tp region (cp, and tp under SP: where the selection counts are summed);
    ``parts``, the parts of the sequence this rank holds (``context_parallel.parts_held``)."""

    ep: CommGroup
    tokens: CommGroup
    parts: tuple[tuple[int, int], ...] = ((0, 1),)

    @classmethod
    def serial(cls) -> ExpertGroups:
        return cls(serial_group("ep"), serial_group("cp"))


class _AuxGradient(torch.autograd.Function):
    """Identity on the router's weights; backward also gives ``loss`` the gradient ``scale``, so
    that the balance losses' gradient flows from the router output (MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, weights, loss, scale):
        ctx.scale = scale
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), device=grad.device) * ctx.scale, None


class Dropless:
    """Every choice is kept (the default; megatron-core's dropless MoE)."""

    def __init__(self, config: GPTConfig, groups: ExpertGroups) -> None:
        pass

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return ids

    def kept(self, ids: torch.Tensor) -> int:
        """The choices of ``ids`` to dispatch: all, known without reading the device."""
        return ids.numel()


class Capacity:
    """Each expert takes at most C = ceil(cf·k·|G|/E) of a group G's choices (GShard §2.2;
    Switch's capacity factor cf), the group a "sequence" or a "microbatch" of whole sequences
    (``moe_group``): defined by the data, so the same tokens are dropped at any layout, where
    production systems count the tokens a rank happens to hold (which tp + SP, cp and the
    microbatch split change). Priority: the router's score, descending, then the token's index
    in the group (a stable sort: a total order). The choices of a group are gathered over the
    ranks that split it (``tokens``), never over ep, dp or pp; a dropped choice's expert id is
    E (nothing receives it) and its weight 0: the token keeps its residual (and shared) path."""

    def __init__(self, config: GPTConfig, groups: ExpertGroups) -> None:
        self.config, self.tokens, self.parts = config, groups.tokens, groups.parts

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        c, (b, s, k) = self.config, ids.shape
        whole = s * self.tokens.size                                   # the sequence's length
        index = positions_of(self.parts, whole, 0, ids.device).expand(b, s)
        if c.moe_group == "microbatch":
            index = index + whole * torch.arange(b, device=ids.device).unsqueeze(1)
        gathered = [comm.all_gather(t.contiguous(), self.tokens, dim=1, label="moe capacity")
                    for t in (ids, scores, index.unsqueeze(-1).expand(b, s, k))]
        per = k * (whole if c.moe_group == "sequence" else b * whole)  # choices of a group
        ids_g, scores_g, index_g = (t.reshape(-1, per) for t in gathered)
        capacity = math.ceil(c.moe_capacity * per / c.moe_experts)
        keep = keep_within_capacity(ids_g, scores_g, index_g, c.moe_experts, capacity)
        mine = keep.view(b, self.tokens.size, s, k)[:, self.tokens.rank]
        return torch.where(mine, ids, c.moe_experts)

    def kept(self, ids: torch.Tensor) -> int:
        """The choices kept (one host read a layer: the dispatch cuts its rows there)."""
        return int((ids < self.config.moe_experts).sum())


def keep_within_capacity(ids: torch.Tensor, scores: torch.Tensor, index: torch.Tensor,
                         experts: int, capacity: int) -> torch.Tensor:
    """Per row (a group's choices: expert ``ids``, ``scores``, token ``index``), which choices
    each expert keeps: its ``capacity`` best by score, then by lower index. [G, n] bool."""
    order = index.argsort(dim=-1, stable=True)
    order = order.gather(-1, (-scores.gather(-1, order)).argsort(dim=-1, stable=True))
    order = order.gather(-1, ids.gather(-1, order).argsort(dim=-1, stable=True))
    by_expert = ids.gather(-1, order)                        # sorted: expert, score, index
    counts = F.one_hot(ids, experts).sum(-2)                 # [G, E]
    first = counts.cumsum(-1) - counts                       # each expert's first place
    place = torch.arange(ids.shape[-1], device=ids.device) - first.gather(-1, by_expert)
    return torch.empty_like(ids, dtype=torch.bool).scatter_(-1, order, place < capacity)


def group_limited(scores: torch.Tensor, groups: int, best: int) -> torch.Tensor:
    """The scores outside each token's ``best`` groups of experts set to −inf (DeepSeek-V3
    §2.1.2: a group scores the sum of its two best experts), so top-k chooses inside them."""
    if groups == 1:
        return scores
    per_group = scores.unflatten(-1, (groups, -1))                   # [.., groups, E/groups]
    score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    kept = torch.zeros_like(score, dtype=torch.bool).scatter_(
        -1, score.topk(best, dim=-1).indices, True)
    return per_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)


class Router(nn.Module):
    """Scores [.., E] of the tokens, in fp32; each token's top k experts and their weights.
    With ``moe_bias_rate`` (DeepSeek-V3's auxiliary-loss-free balance) a fp32 ``expert_bias``
    [E] is added to the scores to choose the experts, never to weigh them, and moved once a step
    toward balance (``update_bias``): not trained, but kept in checkpoints."""

    def __init__(self, config: GPTConfig, groups: ExpertGroups) -> None:
        super().__init__()
        self.config, self.tokens = config, groups.tokens
        self.weight = placeholder((config.moe_experts, config.hidden), None,
                                  normal(config.init_std))
        self.expert_bias = None
        if config.moe_bias_rate:
            self.expert_bias = placeholder((config.moe_experts,), None, zeros)
            self.expert_bias.requires_grad_(False)
        self.capacity = (Capacity if config.moe_capacity else Dropless)(config, groups)
        self.reset_stats()

    def reset_stats(self) -> None:
        """The step's record: selections per expert and the balance losses' sums (local)."""
        self.load = torch.zeros(self.config.moe_experts, dtype=torch.long)
        self.aux, self.z = torch.zeros(()), torch.zeros(())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, h] → ids [b, s, k] (int64; E: dropped) and weights [b, s, k] (fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight)               # [b, s, E] fp32
        c = self.config
        scores = logits.softmax(-1) if c.moe_router == "softmax" else logits.sigmoid()
        chosen = scores if self.expert_bias is None else scores + self.expert_bias
        ids = group_limited(chosen, c.moe_groups, c.moe_topk_groups).topk(c.moe_topk, -1).indices
        picked = weights = scores.gather(-1, ids)
        if c.moe_router == "sigmoid" or c.moe_norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores / scores.sum(-1, keepdim=True)               # softmax's are already
        loss = self._balance(logits, probs, ids)
        if torch.is_grad_enabled() and _AUX_SCALE[0] is not None:
            weights = _AuxGradient.apply(weights, loss, _AUX_SCALE[0])
        kept = self.capacity(ids, picked.detach())
        return kept, weights * (kept == ids)

    def _balance(self, logits: torch.Tensor, probs: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        """α · Σ_groups Σ_i f_i · (Σ_t p_ti) + β · Σ_t logsumexp_t² over this rank's tokens (the
        module docstring); f_i from the whole group's counts (summed over ``tokens``)."""
        c, (b, s, _) = self.config, ids.shape
        chosen = F.one_hot(ids, c.moe_experts).sum(2)                 # [b, s, E]
        per = s if c.moe_group == "sequence" else b * s               # a group's tokens here
        counts = comm.all_reduce(chosen.view(-1, per, c.moe_experts).sum(1), self.tokens,
                                 "moe counts")                       # [groups, E]
        f = counts * c.moe_experts / (c.moe_topk * per * self.tokens.size)
        p = probs.view(-1, per, c.moe_experts).sum(1)                # Σ_t p_ti, this rank's
        aux = (f * p).sum()
        z = logits.logsumexp(-1).square().sum()
        if torch._C._current_graph_task_id() == -1:    # not a recomputation inside backward
            self.load = self.load.to(ids.device) + chosen.flatten(0, 1).sum(0)
            self.aux = self.aux.to(aux.device) + aux.detach()
            self.z = self.z.to(z.device) + z.detach()
        return c.moe_aux_loss * aux + c.moe_z_loss * z

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3 §2.1.2: each expert's bias up by γ if it got fewer than the mean of the
        step's choices (``load``: whole, summed over every microbatch and rank), down if more."""
        if self.expert_bias is not None:
            self.expert_bias += self.config.moe_bias_rate * (load.mean() - load).sign()


class _ContiguousGrad(torch.autograd.Function):
    """The identity whose backward makes the gradient contiguous: grouped_mm's backward fails
    on a stride-0 gradient (the one ``y.sum().backward()`` gives)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [N, in] in groups of ``rows`` [G] consecutive rows, group g times weight[g]ᵀ ([out, in]
    each): [N, out], one kernel. ``F.grouped_mm`` wants int32 end offsets, rows and weights
    whose strides are multiples of 16 bytes (in, out multiples of 4 in fp32) and covering all
    of x (it leaves rows past the last offset unwritten: here there are none); autocast does
    not cover it, so both are cast to the compute dtype here."""
    dtype = comm.compute_dtype(x.device.type, x.dtype)
    offsets = rows.cumsum(0).to(torch.int32)
    y = F.grouped_mm(x.to(dtype).contiguous(), weight.to(dtype).transpose(1, 2), offs=offsets)
    return _ContiguousGrad.apply(y)


class Experts(nn.Module):
    """This rank's E/ep SwiGLU experts (global ids ``ids``), each split over tp as the MLP:
    fc [E/ep, 2f/t, h] (each unit's gate and up side by side: ``fused.bias_swiglu``) by rows,
    proj [E/ep, h, f/t] by columns. Each expert is drawn from the seed by its global id, so the
    experts are the same at any ep."""

    def __init__(self, config: GPTConfig, group: CommGroup, ids: range) -> None:
        super().__init__()
        t, f, h = group.size, config.moe_ffn_hidden, config.hidden
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        self.fc = placeholder((len(ids), 2 * f // t, h), 1, normal(config.init_std), experts=ids)
        self.proj = placeholder((len(ids), h, f // t), 2, normal(residual_std), experts=ids)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [N, h] grouped by expert, ``rows`` [E/ep] of each → [N, h], partial over tp."""
        y = bias_swiglu(grouped_mm(x, self.fc, rows), None)           # [N, f/t]
        return grouped_mm(y, self.proj, rows)


class MoE(nn.Module):
    """The MoE layer in place of the MLP: router, dispatched experts, shared experts."""

    bias = None                                     # no output bias for the block to add

    def __init__(self, config: GPTConfig, style: TensorParallel, groups: ExpertGroups,
                 mlp: type[nn.Module]) -> None:
        super().__init__()
        ep, per_rank = groups.ep, config.moe_experts // groups.ep.size
        self.style = style
        self.router = Router(config, groups)
        self.experts = Experts(config, style.group,
                               range(ep.rank * per_rank, (ep.rank + 1) * per_rank))
        self.dispatcher = ExpertDispatcher(config.moe_experts, ep)
        shared = dataclasses.replace(config, mlp="swiglu", ffn_hidden=config.moe_ffn_hidden *
                                     max(config.moe_shared_experts, 1))
        self.shared = mlp(shared, style.group) if config.moe_shared_experts else None
        self.shared_gate = (placeholder((1, config.hidden), None, normal(config.init_std))
                            if config.moe_shared_experts and config.moe_shared_gate else None)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x [b, s, h] (this rank's part of the sequence under SP) → the same shape."""
        check_initialised(self)
        ids, weights = self.router(x)                                # [b, s, k], this rank's
        tokens = self.style.enter(x)                                 # [b, S, h], whole in tp
        weights, ids = self.style.enter(weights), self.style.gather_sequence(ids)
        y = self.dispatcher(tokens.flatten(0, 1), ids.flatten(0, 1), weights.flatten(0, 1),
                            self.experts, self.router.capacity.kept(ids))
        y = self.style.reduce(y.view_as(tokens))                     # [b, s, h]: g
        return y + self._shared(x)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | float:
        if self.shared is None:
            return 0.0
        y = self.shared(x)
        return y if self.shared_gate is None else y * F.linear(x, self.shared_gate).sigmoid()


def routers(chunks: list[nn.Module]) -> dict[int, Router]:
    """The router of every MoE layer of a rank's model chunks, by global layer index."""
    return {int(i): block.mlp.router for chunk in chunks for i, block in chunk.blocks.items()
            if isinstance(block.mlp, MoE)}


@torch.no_grad()
def step_stats(chunks: list[nn.Module], config: GPTConfig, groups: list[CommGroup]
               ) -> dict[str, object]:
    """The step's routing, whole, and each router's record reset: ``moe_load`` [layer][expert],
    the selections summed over every token of the batch (the ranks that split them: ``groups``),
    and per layer and token the balance loss Σ_i f_i·P_i (1 when uniform; ``moe_aux``) and the
    z-loss (``moe_z``), averaged over the layers. One host sync."""
    held = routers(chunks)
    device = next(chunks[0].parameters()).device
    load = torch.zeros(config.num_layers, config.moe_experts, device=device, dtype=torch.float64)
    losses = torch.zeros(2, config.num_layers, device=device, dtype=torch.float64)
    for layer, router in held.items():
        load[layer], losses[0, layer], losses[1, layer] = router.load, router.aux, router.z
        router.reset_stats()
    packed = torch.cat([load.flatten(), losses.flatten()])
    for group in groups:
        packed = comm.all_reduce(packed, group, "moe stats")
    load, losses = packed.split([load.numel(), losses.numel()])
    load = load.view(config.num_layers, -1)
    for layer, router in held.items():
        router.update_bias(load[layer])
    per_token = (losses.view(2, -1) / (load.sum(1) / config.moe_topk).clamp(min=1)).mean(1)
    aux, z, *counts = torch.cat([per_token, load.flatten()]).tolist()
    return {"moe_load": [[round(n) for n in counts[i:i + config.moe_experts]]
                         for i in range(0, len(counts), config.moe_experts)],
            "moe_aux": aux, "moe_z": z}
