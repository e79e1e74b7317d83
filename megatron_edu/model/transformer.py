"""The blocks GPT and BERT share, from tensor-parallel layers (1909.08053 §3, Figures 2–3), and
the stage of them a pipeline holds (2104.04473 §2.2). With ``grid=None`` (or tp=1) every layer
is the plain PyTorch layer: an ordinary transformer, like nanoGPT's. With t tp ranks (Figure 3):

* attention is split by heads: the qkv projection is column-parallel (each rank computes q, k
  and v of its num_heads/t heads), attention runs on those heads only, the output projection is
  row-parallel;
* the MLP is split column (fc) then row (proj);
* so each block communicates exactly 2 all-reduces forward (``g`` after attention and after the
  MLP) and 2 backward (``f`` before them) — §3, "Figure 4";
* the embedding table is split by vocabulary and the output layer reuses it: logits stay split
  [b, s, V/t] and go straight into the vocab-parallel cross entropy.

Layout of the fused qkv weight: stored [3h, h] (nn.Linear's [out, in]) with the output rows
grouped *per head* — head 0's q, k, v rows, then head 1's, … (Megatron's [np, 3, hn] layout).
A column split into t equal blocks then gives each rank whole heads with their own q, k and v,
at every t; and because the layout does not depend on t, the whole tensor is the same at tp = 1,
2, 4 (layout-independent initialisation and checkpoints). Hugging Face's c_attn is [h, 3h] as
q | k | v blocks; ``megatron_edu/hf.py`` permutes it. For BERT, ``Attention`` takes a ``causal``
switch and a padding mask, ``Block`` the layer-norm placement of 1909.08053 Figure 7.

Pipeline stages (``TransformerStage``, of which ``GPT`` and ``BERT`` are kinds): blocks live in
an ``nn.ModuleDict`` keyed by their global index, so a stage's parameter names are exactly the
serial model's (``blocks.5.attn.qkv.weight``), each initialised from the same seed by name. A
last stage that is not also the first holds its own copy of ``embedding.word.weight`` for the
output layer; its gradient must be all-reduced with the first stage's over
``grid.embedding_group`` (2104.04473's tied embeddings across stages; PTD-P's job, ``ptdp.py``).
Layers are built on the meta device; a stage initialises its own (``init_parameters``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu import comm
from megatron_edu.comm import CommGroup
from megatron_edu.context_parallel import chunk_ids, ring_attention
from megatron_edu.grid import ParallelGrid
from megatron_edu.model.config import GPTConfig
from megatron_edu.model.fused import bias_dropout_add, bias_gelu
from megatron_edu.tensor_parallel.cross_entropy import mask_padded_vocab
from megatron_edu.tensor_parallel.init import (
    check_initialised,
    gather_full,
    init_parameters,
    mark,
    normal,
    ones,
    shard,
    zeros,
)
from megatron_edu.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sequence_gather_linear,
    serial_group,
)
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey, checkpoint

__all__ = ["WORD_EMBEDDING", "IGNORE_INDEX", "reduce_loss", "LayerKV", "KVCache",
           "layer_norm", "Embedding", "Attention", "MLP", "Block", "TransformerStage"]

WORD_EMBEDDING = "embedding.word.weight"  # the same name on the first and the last stage
IGNORE_INDEX = -100                       # labels equal to this add nothing to the loss


def reduce_loss(total: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """The summed losses ``total`` as asked: "sum", or "mean" over the labels that are not −100."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    return total if reduction == "sum" else total / (labels != IGNORE_INDEX).sum()


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
    """The keys and values of the ``length`` positions seen so far, per block of one stage.

    Pass the same cache to successive forwards (the prompt, then one token at a time): each
    block attends over its cached positions plus the new ones, so a new token costs the work
    of one position, not of the whole sequence.
    """

    length: int = 0
    layers: dict[str, LayerKV] = field(default_factory=dict)

    def layer(self, name: str) -> LayerKV:
        """The cache of the block called ``name`` (empty the first time)."""
        return self.layers.setdefault(name, LayerKV())


def layer_norm(config: GPTConfig) -> nn.LayerNorm:
    """A layer norm over the hidden size: weight one, bias zero, whole on every tp rank."""
    ln = nn.LayerNorm(config.hidden, eps=config.layernorm_eps, device="meta")
    mark(ln.weight, None, ones)   # replicated on every tp rank
    mark(ln.bias, None, zeros)
    return ln


def _sequence_parts(config: GPTConfig, group: CommGroup,
                    cp_group: CommGroup | None = None) -> tuple[tuple[int, int], ...]:
    """The parts (r, n) of the sequence a rank holds outside the tp regions, in order — part r of
    n equal parts: under sequence parallelism part r of t (2205.05198 §4.2.2); under context
    parallelism the zig-zag chunks of 2·cp (``context_parallel.chunk_ids``); under both, SP
    splits the cp rank's two chunks, in order, into t parts: of the 2·cp·t pieces of the sequence
    (t in each chunk) tp rank r holds the cp rank's local pieces 2r and 2r + 1."""
    t = group.size if config.sequence_parallel else 1
    if cp_group is None or cp_group.size == 1:
        return ((group.rank, t),) if t > 1 else ((0, 1),)
    chunks = chunk_ids(cp_group.rank, cp_group.size)
    local = (2 * group.rank, 2 * group.rank + 1) if t > 1 else (0, 1)   # of its 2·t pieces
    return tuple((chunks[k // t] * t + k % t, 2 * cp_group.size * t) for k in local)


class Embedding(nn.Module):
    """Word embedding (split by vocabulary) + learned positions (replicated), then dropout.

    Under sequence parallelism the rank's output is its part of the sequence, [b, s/t, h];
    under context parallelism ids hold the rank's two chunks, embedded at their positions.
    """

    def __init__(self, config: GPTConfig, group: CommGroup, *, positions: bool = True,
                 cp_group: CommGroup | None = None) -> None:
        super().__init__()
        self.parts = _sequence_parts(config, group, cp_group)
        self.cp = 1 if cp_group is None else cp_group.size   # ids hold s/cp of each sequence
        self.word = VocabParallelEmbedding(config.vocab_size, config.hidden, group,
                                           padded_vocab=config.padded_vocab(group.size),
                                           init_std=config.init_std,
                                           sequence_parallel=config.sequence_parallel)
        if positions:  # a last stage's copy of the embedding needs the word table only
            self.position = nn.Embedding(config.seq_len, config.hidden, device="meta")
            mark(self.position.weight, None, normal(config.init_std))
        self.dropout = Dropout(config.dropout, config.seed, -1, "embedding",  # one for all tp
                               sequence_parts=self.parts)

    def forward(self, ids: torch.Tensor, offset: int = 0, dropout_key: DropoutKey | None = None,
                extra: torch.Tensor | None = None) -> torch.Tensor:
        """``extra``: [b, s, h] added before the dropout (BERT's token-type embeddings)."""
        whole, parts = ids.shape[1] * self.cp, self.parts[0][1]      # the sequence's length
        if whole % parts:
            raise ValueError(f"the sequence is split into {parts} parts here (sequence and "
                             f"context parallelism): {whole} tokens do not divide")
        seq = torch.arange(offset, offset + whole, device=ids.device)
        seq = torch.cat([seq.chunk(t)[r] for r, t in self.parts])        # this rank's positions
        x = self.word(ids) + self.position(seq)                          # [b, its part, h]
        return self.dropout(x if extra is None else x + extra, dropout_key)


class Attention(nn.Module):
    """Self-attention split by heads: each tp rank computes h/t of the heads (§3).

    ``config.causal``: each position attends to itself and the positions before it (GPT);
    otherwise to every position (BERT). ``mask``, a keep-mask of the keys [b, t] (False: padding),
    keeps padded positions out of every query's softmax, causal or not.

    ``layer``: the block's global index, which (with this tp rank) keys the dropout masks of
    the attention probabilities — a different mask on each tp rank (Appendix B.2).
    The attention core — softmax(q·kᵀ/√d, causal)·v with dropout on the probabilities — runs
    op by op (what 2205.05198 counts: 5·a·s²·b saved per layer), or fused into one kernel
    (``config.fused``, without dropout); ``config.recompute == "selective"`` keeps none of it
    for backward and runs it again there (2205.05198 §5). With a ``cp_group`` of cp > 1 ranks
    each holds two chunks of the sequence and the core is ``ring_attention`` (the same masks),
    which keeps no scores for backward: selective recomputation has nothing left to drop.
    """

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int = 0,
                 cp_group: CommGroup | None = None) -> None:
        super().__init__()
        self.cp_group = cp_group
        self.ring = cp_group is not None and cp_group.size > 1     # context-parallel attention
        self.local_heads = config.num_heads // group.size
        self.head_dim = config.head_dim
        self.fused, self.selective = config.fused, config.recompute == "selective"
        self.causal = config.causal
        self.dropout = Dropout(config.dropout, config.seed, layer, "attention probs",
                               tp_rank=group.rank)
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)  # GPT-2 §2.3
        sp = config.sequence_parallel
        self.qkv = ColumnParallelLinear(config.hidden, 3 * config.hidden, group,
                                        init_std=config.init_std, sequence_parallel=sp,
                                        async_tp=config.async_tp)
        self.proj = RowParallelLinear(config.hidden, config.hidden, group, init_std=residual_std,
                                      sequence_parallel=sp)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None,
                dropout_key: DropoutKey | None = None, add_bias: bool = True,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] → [b, s, h]; ``kv``: this block's cache, extended by x's keys and values;
        ``add_bias=False`` leaves the output bias to the caller (fused bias+dropout+add)."""
        qkv = self.qkv(x)                                        # [b, s, 3h/t], f inside
        b, s, _ = qkv.shape                                      # (s: the whole sequence)
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)  # per head: q | k | v
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)          # each [b, heads/t, s, d]
        if kv is not None:
            k, v = kv.extend(k, v)                               # [b, heads/t, t, d], t ≥ s
        if self.selective and torch.is_grad_enabled() and not self.ring:  # the ring keeps no
            y = checkpoint(self.core, q, k, v, dropout_key, mask)  # scores; 2205.05198 §5
        else:
            y = self.core(q, k, v, dropout_key, mask)            # [b, heads/t, s, d]
        y = y.transpose(1, 2).reshape(b, s, -1)                  # [b, s, h/t]
        return self.proj(y, add_bias)                            # [b, s, h], g inside

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             dropout_key: DropoutKey | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q·kᵀ/√d + masks)·v, dropout on the probabilities; [b, heads/t, s, d].
        Causal: the s queries are the last of the t keys' positions, query i sees keys
        0 … t−s+i. ``mask`` [b, t]: keys where it is False are seen by no query."""
        s, t = q.shape[2], k.shape[2]
        if self.ring:                                             # causal, no padding: checked
            return ring_attention(q, k, v, self.cp_group, dropout=self.dropout, key=dropout_key)
        if self.fused and not (self.training and self.dropout.p > 0):
            return self._fused_core(q, k, v, mask)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))  # [b, a/t, s, t]
        if self.causal:
            future = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(t - s + 1)
            scores = scores.masked_fill(future, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))  # [b, 1, 1, t]
        probs = scores.softmax(-1)
        return self.dropout(probs, dropout_key) @ v

    def _fused_core(self, q, k, v, mask) -> torch.Tensor:
        """The same in one kernel (``scaled_dot_product_attention``), which takes the masks as
        one boolean ``attn_mask`` (True: attend) — or none at all for plain causal attention.

        Without dropout only. The kernel's dropout draws its own mask from the device's
        generator: no way to pass it ours, so its masks would depend on the batch a sample came
        in, unless it ran once per sample. Nor can ``attn_mask`` or flex_attention's ``score_mod``
        carry one: they act before the softmax, the mask after it (the softmax renormalises over
        what is left). With dropout in training ``core`` therefore runs op by op, on the whole
        batch — the unfused path's own code, so its masks too (on a CPU about as fast as one
        kernel call per sample, and half the code)."""
        s, t = q.shape[2], k.shape[2]
        allowed = None                                           # [s, t] or [b, 1, 1|s, t]
        if self.causal and (t != s or mask is not None):         # else: is_causal, no tensor
            allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
        if mask is not None:
            keys = mask[:, None, None, :]                        # [b, 1, 1, t]
            allowed = keys if allowed is None else keys & allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                              is_causal=self.causal and allowed is None)


class MLP(nn.Module):
    """GeLU(X·A)·B with A split by columns and B by rows (§3, eq. 3 and Figure 3a)."""

    def __init__(self, config: GPTConfig, group: CommGroup) -> None:
        super().__init__()
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        sp = config.sequence_parallel
        self.fused = config.fused
        self.fc = ColumnParallelLinear(config.hidden, config.ffn_hidden, group,
                                       init_std=config.init_std, sequence_parallel=sp,
                                       async_tp=config.async_tp)
        self.proj = RowParallelLinear(config.ffn_hidden, config.hidden, group,
                                      init_std=residual_std, sequence_parallel=sp)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x [b, s, h] → [b, s, h]; ``add_bias=False`` leaves proj's bias to the caller."""
        if self.fused:                                   # bias + GeLU in one kernel (§4.2)
            y = bias_gelu(self.fc(x, add_bias=False), self.fc.bias)
        else:
            y = F.gelu(self.fc(x), approximate="tanh")   # [b, s, ffn/t], f inside; gelu_new
        return self.proj(y, add_bias)                    # [b, s, h], g inside


class Block(nn.Module):
    """A transformer block: attention, then the MLP, each with a layer norm and a residual add
    (Figure 2). Where the layer norm sits is ``config.ln_placement`` (1909.08053 §5.3, Figure 7):

    * "rearranged" (pre-LN; GPT-2, Megatron-BERT): x + attn(ln1(x)), then x + mlp(ln2(x)). The
      residual stream is never normalised: a clean identity path from the loss to every layer.
    * "original" (post-LN; BERT): the residual starts *after* the layer norm, u + attn(u) with
      u = ln1(x) (Megatron-LM's ``apply_residual_connection_post_layernorm``). Chained, this is
      exactly original BERT: ln1 of block 0 normalises the embeddings, the ln2 of block i and
      the ln1 of block i+1 are LN(x + attn(x)) and LN(x + mlp(x)) of Figure 7a, and the final
      layer norm is the last block's. Every residual path passes through a layer norm.

    Both have the same parameters (two layer norms per block, one final), so the switch changes
    where they act, nothing else. ``layer``: the block's global index (dropout masks depend on
    it, not on the stage holding it). Under sequence parallelism x is this rank's part of the
    sequence, [b, s/t, h]: the layer norms, dropouts and residual adds run on it; attention
    and the MLP gather the sequence in. ``mask``: the keys' padding mask, for attention.
    """

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int = 0,
                 cp_group: CommGroup | None = None) -> None:
        super().__init__()
        self.fused = config.fused
        self.post_ln = config.ln_placement == "original"
        self.ln1 = layer_norm(config)
        self.attn = Attention(config, group, layer, cp_group)
        self.ln2 = layer_norm(config)
        self.mlp = MLP(config, group)
        # Outside the split regions: the same masks on every tp rank.
        parts = _sequence_parts(config, group, cp_group)
        self.attn_dropout = Dropout(config.dropout, config.seed, layer, "attention output",
                                    sequence_parts=parts)
        self.mlp_dropout = Dropout(config.dropout, config.seed, layer, "mlp output",
                                   sequence_parts=parts)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None,
                dropout_key: DropoutKey | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] → [b, s, h] (or this rank's part, [b, s/t, h])."""
        check_initialised(self)
        u = self.ln1(x)                                  # [b, s, h]
        y = self.attn(u, kv, dropout_key, add_bias=not self.fused, mask=mask)
        x = self._residual(u if self.post_ln else x, y, self.attn.proj.bias,
                           self.attn_dropout, dropout_key)
        u = self.ln2(x)
        y = self.mlp(u, add_bias=not self.fused)
        return self._residual(u if self.post_ln else x, y, self.mlp.proj.bias,
                              self.mlp_dropout, dropout_key)            # [b, s, h]

    def _residual(self, residual, y, bias, dropout: Dropout, key) -> torch.Tensor:
        """residual + dropout(y); fused, y comes without its bias, and bias + dropout + add run
        as one kernel (2104.04473 §4.2)."""
        if not self.fused:
            return residual + dropout(y, key)
        drop = dropout.training and dropout.p > 0
        keep = dropout.keep(key, y) if drop else None
        return bias_dropout_add(y, bias, keep, 1.0 / (1.0 - dropout.p), residual)


class TransformerStage(nn.Module):
    """A model whole (the defaults) or one pipeline stage of it, tensor-parallel over ``grid``
    (None → serial); ``GPT`` and ``BERT`` add their inputs, heads and ``forward``.

    ``layers``: global indices of the blocks held (default all). ``first``: holds the embeddings
    and takes input ids [b, s]; otherwise hidden states [b, s, h] ([b, s/t, h] under sequence
    parallelism). ``last``: holds the final layer norm and the output layer (tied to the word
    embedding). Parameters are drawn from ``config.seed`` by name (the same at any tp and pp),
    on the grid's device.
    """

    config_class = GPTConfig        # the configuration it is built from, exactly (BERT: its own)
    vocab_rows = (WORD_EMBEDDING,)  # tensors of padded_vocab rows (``full_state_dict`` trims)

    def __init__(self, config: GPTConfig, grid: ParallelGrid | None = None, *,
                 layers: range | None = None, first: bool = True, last: bool = True) -> None:
        super().__init__()
        if type(config) is not self.config_class:
            raise TypeError(f"a {type(self).__name__} is built from a {self.config_class.__name__}"
                            f", not a {type(config).__name__} (model.build_model picks the model)")
        self.tp_group = grid.tp_group if grid is not None else serial_group()
        self.cp_group = grid.cp_group if grid is not None else serial_group()
        config.validate(self.tp_group.size, cp=self.cp_group.size)
        self.config, self.first, self.last = config, first, last
        self.sequence_parallel = config.sequence_parallel and self.tp_group.size > 1
        self.layers = range(config.num_layers) if layers is None else layers
        if not all(0 <= i < config.num_layers for i in self.layers):
            raise ValueError(f"layers {self.layers} are not all in 0..{config.num_layers - 1}")
        self.training_calls = 0  # numbers the steps of a model trained without DropoutKeys
        self._build(config)
        init_parameters(self, config.seed, self.tp_group,
                        device=grid.device if grid is not None else "cpu")

    def _build(self, config: GPTConfig) -> None:
        """The modules of this stage, on the meta device until initialised (BERT adds its own)."""
        if self.first or self.last:
            self.embedding = Embedding(config, self.tp_group, positions=self.first,
                                       cp_group=self.cp_group)
        self.blocks = nn.ModuleDict({str(i): Block(config, self.tp_group, i, self.cp_group)
                                     for i in self.layers})
        if self.last:
            self.ln_f = layer_norm(config)

    def _dropout_key(self, x: torch.Tensor, key: DropoutKey | None) -> DropoutKey | None:
        """The key given; without one, a model in training numbers its calls as steps."""
        if key is None and self.training:
            key = DropoutKey.first(x.shape[0], step=self.training_calls)
            self.training_calls += 1
        return key

    def _blocks(self, h: torch.Tensor, dropout_key: DropoutKey | None,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's blocks in order; ``mask``: the keys' padding mask [b, s] (BERT)."""
        for name, block in self.blocks.items():
            if cache is not None:
                h = block(h, cache.layer(name))
            elif self.config.recompute == "full" and torch.is_grad_enabled():
                h = checkpoint(block, h, None, dropout_key, mask)    # 2104.04473 §3.5
            else:
                h = block(h, None, dropout_key, mask)
        return h

    def _embed(self, ids: torch.Tensor, offset: int, dropout_key: DropoutKey | None,
               extra: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dtype != torch.long or ids.dim() != 2:
            raise ValueError(f"the first stage takes token ids [b, s] int64, got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        if offset + ids.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {offset + ids.shape[1]} tokens is longer than "
                             f"seq_len = {self.config.seq_len}")
        return self.embedding(ids, offset, dropout_key, extra)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer: a column-parallel linear sharing the embedding table (tied)."""
        weight = self.embedding.word.weight
        if self.sequence_parallel:                           # h: [b, s/t, h], gathered inside
            logits = sequence_gather_linear(h, weight, None, self.tp_group)
        else:
            h = comm.f(h, self.tp_group)                     # [b, s, h]; grad all-reduced
            logits = F.linear(h, weight)                     # [b, s, V_padded/t]
        return mask_padded_vocab(logits, self.config.vocab_size, self.tp_group)

    def num_parameters(self) -> int:
        """Parameters held by this rank (its shards; padded vocabulary included)."""
        return sum(p.numel() for p in self.parameters())

    # --- whole tensors, as the serial model holds them (checkpoints, tests, Hugging Face) ----

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Each parameter (or its gradient) of this stage whole, the vocabulary trimmed to
        ``vocab_size`` rows: independent of tp. A collective: every tp rank must call it."""
        state = {}
        for name, param in self.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                raise ValueError(f"{name} has no gradient: run backward first")
            full = gather_full(tensor, param.tp_dim, self.tp_group)
            state[name] = full[: self.config.vocab_size] if name in self.vocab_rows else full
        return {name: t.detach().clone() for name, t in state.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (as ``full_state_dict`` returns): pad the vocabulary, keep this
        rank's slices. Names of blocks other stages hold are ignored; a missing name raises."""
        missing = [name for name, _ in self.named_parameters() if name not in state]
        if missing:
            raise ValueError(f"state has no tensor for {missing}")
        for name, param in self.named_parameters():
            full = state[name].to(param.device, param.dtype)
            if name in self.vocab_rows:                      # pad the vocabulary (dim 0)
                rows = self.config.padded_vocab(self.tp_group.size) - full.shape[0]
                full = F.pad(full, (0, 0) * (full.dim() - 1) + (0, rows))
            param.copy_(shard(full, param.tp_dim, self.tp_group))
