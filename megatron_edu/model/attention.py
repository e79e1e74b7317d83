"""Self-attention split by heads (1909.08053 §3, Figure 3b), and the cores that compute it.

``Attention`` is the qkv projection (column-parallel: q, k and v of this rank's num_heads/t
heads), a core, and the output projection (row-parallel). The core, softmax(q·kᵀ/√d + masks)·v
with dropout on the probabilities, is one of three objects with one interface, ``core(q, k, v,
dropout_key, mask)``, chosen once when the layer is built:

* ``EagerCore``: op by op, as the papers count it (2205.05198: 5·a·s²·b bytes saved per layer).
  Its dropout masks are the serial model's, keyed by the global head index: a tp rank draws its
  heads' part of the one mask (``tensor_parallel/random.py``), so any tp equals the serial model
  with dropout on (Megatron-LM seeds a stream per tp rank, App. B.2: its masks depend on tp).
* ``FusedCore``: one kernel (``scaled_dot_product_attention``; flash or memory-efficient on a
  GPU, no [s, s] tensor kept), its dropout drawn inside from the device's generator, seeded per
  call from the step, samples, layer and tp rank, so a recomputation replays it. Equal to the
  serial model at dropout 0, not with dropout on; the training script's GPU default.
* ``RingCore``: context parallelism, ``context_parallel.ring_attention`` over the cp ranks (the
  serial masks too). Chosen whenever cp > 1; it keeps no scores for backward, so selective
  recomputation (2205.05198 §5, ``Recomputed``) wraps only the other two.

The qkv weight is stored [3h, h] (nn.Linear's [out, in]) with rows grouped per head: head 0's q,
k, v, then head 1's, … (Megatron's [np, 3, hn]). A column split into t blocks then gives each
rank whole heads at every t, and the whole tensor does not depend on t (layout-independent
initialisation and checkpoints). ``megatron_edu/hf.py`` permutes Hugging Face's q | k | v c_attn.
With fewer kv heads than query heads (grouped-query attention) q and kv are two weights, since
kv may be split fewer ways than q (``GroupedQKV``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.context_parallel import each_head, parts_held, positions_of, ring_attention
from megatron_edu.model.config import GPTConfig
from megatron_edu.tensor_parallel.init import check_initialised, normal, placeholder, zeros
from megatron_edu.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    serial_group,
)
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey, checkpoint, mask_seed
from megatron_edu.tensor_parallel.sequence_parallel import STYLES

__all__ = ["LayerKV", "KVCache", "EagerCore", "FusedCore", "RingCore", "Recomputed", "Rotary",
           "GroupedQKV", "Attention"]


@dataclass
class LayerKV:
    """One block's cached keys and values, each [b, heads/t, length, d] on this tp rank."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' k and v; return all of them (cached first)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


@dataclass
class KVCache:
    """The keys and values of the ``length`` positions seen so far, per block of one stage. Pass
    the same cache to successive forwards (the prompt, then one token at a time): a new token
    costs the work of one position, not of the whole sequence."""

    length: int = 0
    layers: dict[str, LayerKV] = field(default_factory=dict)

    def layer(self, name: str) -> LayerKV:
        """The cache of the block called ``name`` (empty the first time)."""
        return self.layers.setdefault(name, LayerKV())


# --- which keys each query sees -----------------------------------------------------------------

def causal_mask(s: int, t: int, keys: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """[s, t] (or [b, 1, s, t] with ``keys`` [b, t]) True where a query may attend: the s queries
    are the last s of t positions, query i sees keys 0 … t − s + i, and none sees padding."""
    allowed = torch.ones(s, t, dtype=torch.bool, device=device).tril(t - s)
    return allowed if keys is None else allowed & keys[:, None, None, :]


def bidirectional_mask(s: int, t: int, keys: torch.Tensor | None,
                       device: torch.device) -> torch.Tensor | None:
    """Bidirectional attention (BERT): every query sees every key but padding; None: all."""
    return None if keys is None else keys[:, None, None, :]


def mask_of(config: GPTConfig):
    """The mask ``config``'s attention applies: causal (GPT) or padding only (BERT)."""
    return causal_mask if config.causal else bidirectional_mask


# --- the cores ------------------------------------------------------------------------------------

def _probs_dropout(config: GPTConfig, group: CommGroup, layer: int) -> Dropout:
    """Dropout on the attention probabilities: the serial model's masks, of which this rank's
    heads are part r of t (keyed by the global head, so any tp draws the serial ones)."""
    return Dropout(config.dropout, config.seed, layer, "attention probs",
                   parts=((group.rank, group.size),))


class EagerCore(nn.Module):
    """softmax(q·kᵀ/√d + masks)·v op by op, dropout on the probabilities: the serial model's
    masks, this rank's heads being part r of t of them."""

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.mask = mask_of(config)
        self.dropout = _probs_dropout(config, group, layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dropout_key: DropoutKey | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [b, heads/t, s, d], k and v [b, groups/t, t, d] → [b, heads/t, s, d]."""
        k, v = each_head(k, q), each_head(v, q)                       # inside: recomputable
        scores = q @ k.transpose(-2, -1) * self.scale                  # [b, a/t, s, t]
        allowed = self.mask(q.shape[2], k.shape[2], mask, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return self.dropout(scores.softmax(-1), dropout_key) @ v


class FusedCore(nn.Module):
    """The same in one kernel (``scaled_dot_product_attention``), given no mask for plain causal
    attention so that a GPU may run flash attention. Its dropout comes from the device's
    generator seeded per call and tp rank (``_seeded``): a recomputation replays it."""

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int) -> None:
        super().__init__()
        self.p, self.seed, self.layer = config.dropout, config.seed, layer
        self.tp_rank = group.rank
        self.causal, self.mask = config.causal, mask_of(config)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dropout_key: DropoutKey | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``EagerCore.forward``, in one kernel."""
        s, t = q.shape[2], k.shape[2]
        whole = self.causal and s == t and mask is None      # the kernel's own causal mask
        allowed = None if whole else self.mask(s, t, mask, q.device)
        p = self.p if self.training else 0.0
        with _seeded(q.device, self._seed(dropout_key, p)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=whole,
                                                  dropout_p=p, enable_gqa=True)  # kv heads kept

    def _seed(self, key: DropoutKey | None, p: float) -> int | None:
        """This call's seed, from the step, first sample, layer and tp rank; None: no dropout."""
        if p == 0.0:
            return None
        if key is None:
            raise ValueError("dropout in training needs a DropoutKey naming the samples")
        return mask_seed(self.seed, key.step, key.samples[0], self.layer,
                         f"fused attention probs/{self.tp_rank}") >> 1


@contextmanager
def _seeded(device: torch.device, seed: int | None) -> Iterator[None]:
    """Inside, the device's generator is seeded with ``seed``; outside it is as before (None:
    untouched). Megatron-LM's ``get_cuda_rng_tracker().fork()``, keyed instead of advanced."""
    if seed is None:
        yield
        return
    gpus = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus, device_type=device.type):
        torch.manual_seed(seed)
        yield


class RingCore(nn.Module):
    """Causal attention over the sequence split across ``cp_group``: ``ring_attention`` passes
    K, V around the ring, with the serial dropout masks (its heads'). No padding, no cache."""

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int,
                 cp_group: CommGroup) -> None:
        super().__init__()
        self.cp_group = cp_group
        self.dropout = _probs_dropout(config, group, layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dropout_key: DropoutKey | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v [b, heads/t, s/cp, d]: this rank's two zig-zag chunks → its output."""
        if k.shape[2] != q.shape[2] or mask is not None:
            raise ValueError("context parallelism attends causally within the sequence: no "
                             "padding mask and no KV cache (generate at cp = 1)")
        return ring_attention(q, k, v, self.cp_group, dropout=self.dropout, key=dropout_key)


class Recomputed(nn.Module):
    """Selective recomputation (2205.05198 §5): ``core`` reruns in backward, its masks replayed."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(self, *args) -> torch.Tensor:
        """The core's output; under autograd, only its inputs kept."""
        return checkpoint(self.core, *args) if torch.is_grad_enabled() else self.core(*args)


CORES = {"eager": EagerCore, "fused": FusedCore}
# What each recomputation option does to the core (to the whole block: the stage's, "full").
RECOMPUTE_CORE = {"none": lambda core: core, "selective": Recomputed, "full": lambda core: core}


def attention_core(config: GPTConfig, group: CommGroup, layer: int,
                   cp_group: CommGroup) -> nn.Module:
    """The core ``config`` asks for on this rank, chosen once: the ring under context
    parallelism (it keeps no scores: nothing to recompute), else ``config.attention``'s."""
    if cp_group.size > 1:
        return RingCore(config, group, layer, cp_group)
    return RECOMPUTE_CORE[config.recompute](CORES[config.attention](config, group, layer))


class Rotary(nn.Module):
    """Rotary positions (RoPE, Su et al. 2021; Llama): the query and key of position m turned
    by m·θ^(−2i/d) in each plane i of d/2, so q·k depends on positions only through m − n.
    Planes pair dimension i with i + d/2 (Hugging Face's layout, so its weights load as they
    are). The positions are this rank's: under context parallelism its two zig-zag chunks
    (sequence parallelism has gathered the sequence before attention); with a cache, after it."""

    def __init__(self, config: GPTConfig, cp_group: CommGroup) -> None:
        super().__init__()
        self.theta, self.dim, self.cp = config.rope_theta, config.head_dim, cp_group.size
        self.parts = parts_held(cp_group)                  # the whole sequence's, after SP

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, d] of this rank's positions, ``past`` cached before them."""
        m = positions_of(self.parts, q.shape[2] * self.cp, past, q.device).float()   # [s]
        planes = torch.arange(0, self.dim, 2, device=q.device, dtype=torch.float32)
        angles = torch.outer(m, self.theta ** (-planes / self.dim))                    # [s, d/2]
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(q.dtype) for f in (torch.cos, torch.sin))
        return _turn(q, cos, sin), _turn(k, cos, sin)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)                          # plane i: (x1_i, x2_i)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _unturned(q: torch.Tensor, k: torch.Tensor, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k                                          # learned positions: in the embeddings


class GroupedQKV(nn.Module):
    """Grouped-query attention's projections: q [a·d, h], cut into t parts of a/t heads, and kv
    [2·g·d, h] (per kv head j: k_j, then v_j), cut into min(t, g) parts. At t ≤ g a rank holds
    g/t whole groups. At t > g (Llama 3 8B's 8 kv heads at t = 16) each kv head is held by the
    r = t/g ranks whose query heads form its group (vLLM's ``num_kv_head_replicas``), each
    using it for its own n/r heads: each copy's gradient is a part of the whole, and ``f`` on
    the weight — the paper's identity forward, all-reduce backward (1909.08053 §3) — sums them
    over those r ranks, 2·d·h values a layer and microbatch, so the copies stay equal. The
    forward puts a rank's rows in ``Attention``'s per-group order (its q heads of group j, k_j,
    v_j) and runs one GEMM behind one ``f`` of the input, as the fused qkv does; that GEMM keeps
    the weight put together for backward, a copy a microbatch (``perf.memory`` counts it)."""

    def __init__(self, config: GPTConfig, group: CommGroup, style: type[TensorParallel]) -> None:
        super().__init__()
        t, d, h = group.size, config.head_dim, config.hidden
        r = max(t // config.num_kv_heads, 1)             # the ranks holding each kv head
        self.local_groups, self.style = config.num_kv_heads * r // t, style(group)
        self.holders = group.block(r)
        q_rows, kv_rows = config.num_heads * d // t, 2 * d * self.local_groups
        self.q_weight = placeholder((q_rows, h), 0, normal(config.init_std))
        self.kv_weight = placeholder((kv_rows, h), 0, normal(config.init_std), replicas=r)
        self.q_bias = placeholder((q_rows,), 0, zeros) if config.qkv_bias else None
        self.kv_bias = placeholder((kv_rows,), 0, zeros, replicas=r) if config.qkv_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, h] → [b, s, (a/t + 2·groups)·d]: per local group its queries, k, v."""
        check_initialised(self)
        bias = None if self.q_bias is None else self._per_group(self.q_bias, self.kv_bias)
        return self.style.column_linear(x, self._per_group(self.q_weight, self.kv_weight), bias)

    def _per_group(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv = comm.f_param(kv, self.holders)              # the copies' gradients summed
        groups = [w.unflatten(0, (self.local_groups, -1)) for w in (q, kv)]
        return torch.cat(groups, dim=1).flatten(0, 1)


def qkv_projection(config: GPTConfig, group: CommGroup, style: type[TensorParallel]) -> nn.Module:
    """The qkv projection of ``config``, chosen once: one weight per head q | k | v (multi-head
    attention, GPT-2), or ``GroupedQKV`` (fewer kv heads than query heads)."""
    if config.num_kv_heads < config.num_heads:
        return GroupedQKV(config, group, style)
    return ColumnParallelLinear(config.hidden, 3 * config.hidden, group, bias=config.qkv_bias,
                                init_std=config.init_std, style=style)


class Attention(nn.Module):
    """Self-attention split by heads: each tp rank computes num_heads/t of them (§3). Causal (GPT)
    or bidirectional (BERT) as ``config.causal`` says; ``mask`` [b, t] (False: padding) keeps
    padded keys out of every softmax. ``layer``: the global index, which keys the dropout masks.

    Grouped-query attention (Ainslie et al. 2023; Llama 2 70B, Llama 3): num_kv_heads keys and
    values, each serving a group of num_heads/num_kv_heads query heads. The projection's rows
    are grouped the same way, per kv head: its group's queries, its key, its value (Megatron-
    LM's query groups; per head q | k | v when every head has its own, GPT-2), so each rank
    computes its query heads with their kv head — g/t whole groups, or a/t of one group's n heads
    and a copy of its kv head when t > g (``GroupedQKV``) — and its kv heads' projection costs
    2·h·max(g/t, 1)·d, not 2·h·h/t.
    What crosses tp does not change: f's all-reduce of dX and g's of Y, b·s·h values each a
    layer and pass (SP: the all-gather and reduce-scatter of as many); the kv heads shrink what
    the ring carries, 2·b·(s/cp)·max(g/t, 1)·d values a hop, and the KV cache."""

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int = 0,
                 cp_group: CommGroup | None = None) -> None:
        super().__init__()
        style, cp_group = STYLES[config.sequence_parallel, config.async_tp], \
            cp_group or serial_group("cp")
        self.local_heads, self.head_dim = config.num_heads // group.size, config.head_dim
        self.local_groups = max(config.num_kv_heads // group.size, 1)
        self.core = attention_core(config, group, layer, cp_group)
        self.rotary = Rotary(config, cp_group) if config.positions == "rope" else _unturned
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)  # GPT-2 §2.3
        self.qkv = qkv_projection(config, group, style)
        self.proj = RowParallelLinear(config.hidden, config.hidden, group, bias=config.bias,
                                      init_std=residual_std, style=style)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None,
                dropout_key: DropoutKey | None = None, add_bias: bool = True,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] → [b, s, h]; ``kv``: this block's cache, extended by x's keys and values;
        ``add_bias=False`` leaves the output bias to the caller (a residual's bias+dropout+add)."""
        qkv = self.qkv(x)                                        # [b, s, (a + 2g)·d/t], f inside
        b, s, _ = qkv.shape                                      # (s: the whole sequence)
        n = self.local_heads // self.local_groups                # query heads per kv head
        qkv = qkv.view(b, s, self.local_groups, n + 2, self.head_dim)  # per group: q… | k | v
        q, k, v = qkv.permute(2, 3, 0, 1, 4).split([n, 1, 1], dim=1)   # [g/t, n|1|1, b, s, d]
        q = q.flatten(0, 1).transpose(0, 1)                      # [b, heads/t, s, d]
        k, v = (t.squeeze(1).transpose(0, 1) for t in (k, v))    # [b, groups/t, s, d]
        q, k = self.rotary(q, k, 0 if kv is None or kv.k is None else kv.k.shape[2])
        if kv is not None:
            k, v = kv.extend(k, v)                               # [b, groups/t, t, d], t ≥ s
        y = self.core(q, k, v, dropout_key, mask)                # [b, heads/t, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)                  # [b, s, h/t]
        return self.proj(y, add_bias)                            # [b, s, h], g inside
