"""The blocks GPT and BERT share, built from tensor-parallel layers (1909.08053 §3, Figures 2–3),
and the pipeline stage that holds some of them (2104.04473 §2.2). At tp = 1 every layer is the
plain PyTorch layer: an ordinary transformer, like nanoGPT's. Over t tp ranks (Figure 3)
attention is split by heads (qkv column-parallel, output projection row-parallel) and the MLP
column (fc) then row (proj), so a block makes 2 all-reduces forward (``g``) and 2 backward
(``f``). The word table is split by vocabulary and tied to the output layer, whose logits stay
split, [b, s, V/t], into the vocab-parallel cross entropy.

Each technique is an object picked once from the configuration when a layer is built: the tp
style (``tensor_parallel.STYLES``), the attention core (``attention.attention_core``), the
layer-norm placement (``LN_PLACEMENTS``, Figure 7), the bias kernels (``fused.kernels``) and
recomputation (``RECOMPUTE_BLOCK``, ``attention.RECOMPUTE_CORE``).

A stage keys its blocks by global index, so its parameter names are the serial model's
(``blocks.5.attn.qkv.weight``) and each is initialised from the same seed by name. A last stage
that is not the first holds its own copy of ``embedding.word.weight``; PTD-P (``ptdp.py``)
sums its gradient with the first stage's over ``grid.embedding_group`` (2104.04473's tied
embeddings). Layers are built on the meta device; a stage initialises its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_edu.comm import CommGroup
from megatron_edu.context_parallel import parts_held, positions_of
from megatron_edu.expert_parallel import gather_experts, own_experts
from megatron_edu.grid import ParallelGrid
from megatron_edu.model.attention import Attention, KVCache, LayerKV
from megatron_edu.model.config import GPTConfig
from megatron_edu.model.fused import bias_swiglu, kernels
from megatron_edu.model.moe import ExpertGroups, MoE
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
    TensorParallel,
    VocabParallelEmbedding,
    in_compute_dtype,
    serial_group,
)
from megatron_edu.tensor_parallel.random import Dropout, DropoutKey, checkpoint
from megatron_edu.tensor_parallel.sequence_parallel import STYLES

__all__ = ["WORD_EMBEDDING", "OUTPUT_LAYER", "IGNORE_INDEX", "reduce_loss", "layer_norm",
           "sequence_parts", "Embedding", "Attention", "KVCache", "MLP", "Block",
           "TransformerStage", "compile_blocks"]

WORD_EMBEDDING = "embedding.word.weight"  # the same name on the first and the last stage
OUTPUT_LAYER = "output.weight"            # an untied output layer's (Llama), on the last stage
IGNORE_INDEX = -100                       # labels equal to this add nothing to the loss


def reduce_loss(total: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """The summed losses ``total`` as asked: "sum", or "mean" over the labels that are not −100."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    return total if reduction == "sum" else total / (labels != IGNORE_INDEX).sum()


def layer_norm(config: GPTConfig) -> nn.Module:
    """The norm ``config.norm`` names over the hidden size, whole on every tp rank: LayerNorm
    (weight one, bias zero) or RMSNorm (Zhang & Sennrich 2019: x / rms(x) · weight, Llama's)."""
    if config.norm == "rmsnorm":
        return mark_all(nn.RMSNorm(config.hidden, eps=config.layernorm_eps, device="meta"))
    return mark_all(nn.LayerNorm(config.hidden, eps=config.layernorm_eps, device="meta"))


def mark_all(norm: nn.Module) -> nn.Module:
    """A norm's parameters marked whole on every tp rank: weights one, a bias zero."""
    mark(norm.weight, None, ones)
    if getattr(norm, "bias", None) is not None:
        mark(norm.bias, None, zeros)
    return norm


def sequence_parts(style: TensorParallel, cp_group: CommGroup) -> tuple[tuple[int, int], ...]:
    """The parts (r, n) of the sequence (part r of n) a rank holds outside the tp regions:
    ``context_parallel.parts_held`` with sequence parallelism's split over tp (2205.05198 §4.2.2;
    t = 1 without it)."""
    t = style.sequence_split
    return parts_held(cp_group, t, style.group.rank % t)


def word_table(config: GPTConfig, group: CommGroup) -> VocabParallelEmbedding:
    """The word embedding, split by vocabulary (its padded rows: ``config.padded_vocab``)."""
    return VocabParallelEmbedding(config.vocab_size, config.hidden, group,
                                  padded_vocab=config.padded_vocab(group.size),
                                  init_std=config.init_std,
                                  style=STYLES[config.sequence_parallel, config.async_tp])


class TiedCopy(nn.Module):
    """A last stage's copy of the word table, for its tied output layer (2104.04473)."""

    def __init__(self, config: GPTConfig, group: CommGroup) -> None:
        super().__init__()
        self.word = word_table(config, group)


class Embedding(nn.Module):
    """Word embedding (split by vocabulary) + learned positions (replicated; none under rotary
    positions, which turn q and k instead: ``attention.Rotary``), then dropout. Under sequence
    or context parallelism the output is this rank's parts of the sequence."""

    def __init__(self, config: GPTConfig, group: CommGroup, *,
                 cp_group: CommGroup | None = None) -> None:
        super().__init__()
        style, cp_group = STYLES[config.sequence_parallel, config.async_tp], cp_group or \
            serial_group("cp")
        self.parts, self.cp = sequence_parts(style(group), cp_group), cp_group.size
        self.word = word_table(config, group)
        self.position = None
        if config.positions == "learned":
            self.position = nn.Embedding(config.seq_len, config.hidden, device="meta")
            mark(self.position.weight, None, normal(config.init_std))
        self.dropout = Dropout(config.dropout, config.seed, -1, "embedding", parts=self.parts)

    def forward(self, ids: torch.Tensor, offset: int = 0, dropout_key: DropoutKey | None = None,
                extra: torch.Tensor | None = None) -> torch.Tensor:
        """``extra``: [b, s, h] added before the dropout (BERT's token-type embeddings)."""
        whole, parts = ids.shape[1] * self.cp, self.parts[0][1]      # the sequence's length
        if whole % parts:
            raise ValueError(f"the sequence is split into {parts} parts here (sequence and "
                             f"context parallelism): {whole} tokens do not divide")
        x = self.word(ids)                                               # [b, its part, h]
        if self.position is not None:
            x = x + self.position(positions_of(self.parts, whole, offset, ids.device))
        x = in_compute_dtype(x if extra is None else x + extra)          # the residual stream
        return self.dropout(x, dropout_key)


class MLP(nn.Module):
    """act(X·A)·B with A split by columns and B by rows (§3, eq. 3 and Figure 3a): GeLU (GPT-2)
    or SwiGLU (Llama), whose A holds a gate and an up column per unit (``fused.bias_swiglu``)."""

    def __init__(self, config: GPTConfig, group: CommGroup) -> None:
        super().__init__()
        style = STYLES[config.sequence_parallel, config.async_tp]
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        swiglu = config.mlp == "swiglu"
        self.activation = bias_swiglu if swiglu else kernels(config).bias_gelu
        self.fc = ColumnParallelLinear(config.hidden, (1 + swiglu) * config.ffn_hidden, group,
                                       bias=config.bias, init_std=config.init_std, style=style)
        self.proj = RowParallelLinear(config.ffn_hidden, config.hidden, group, bias=config.bias,
                                      init_std=residual_std, style=style)

    @property
    def bias(self) -> torch.Tensor | None:
        """The output bias, which ``add_bias=False`` leaves to the caller."""
        return self.proj.bias

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x [b, s, h] → [b, s, h]; ``add_bias=False`` leaves proj's bias to the caller."""
        y = self.activation(self.fc(x, add_bias=False), self.fc.bias)  # [b, s, ffn/t], f inside
        return self.proj(y, add_bias)                                  # [b, s, h], g inside


def feed_forward(config: GPTConfig, group: CommGroup, experts: ExpertGroups) -> nn.Module:
    """The block's second half: the MLP, or with ``moe_experts`` a mixture of experts."""
    if not config.moe_experts:
        return MLP(config, group)
    return MoE(config, STYLES[config.sequence_parallel, config.async_tp](group), experts, MLP)


class PreLN:
    """"rearranged" (pre-LN; GPT-2, Megatron-BERT; 1909.08053 Figure 7b): x + f(ln(x)). The
    residual stream is never normalised: a clean identity path from the loss to every layer."""

    @staticmethod
    def residual(x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return x


class PostLN:
    """"original" (post-LN; BERT, Figure 7a): u + f(u), u = ln(x) (Megatron-LM's
    ``apply_residual_connection_post_layernorm``). Chained, this is Figure 7a exactly: block i's
    ln2 and block i+1's ln1 are LN(x + attn(x)) and LN(x + mlp(x)); block 0's ln1 normalises the
    embeddings; the final layer norm is the last block's."""

    @staticmethod
    def residual(x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed


LN_PLACEMENTS = {"rearranged": PreLN, "original": PostLN}


class Block(nn.Module):
    """Attention, then the MLP, each with a layer norm and a residual add (Figure 2), placed as
    ``config.ln_placement`` says. ``layer``: the global index (dropout masks depend on it, not on
    the stage). Under sequence parallelism x is [b, s/t, h]: layer norms, dropouts and residual
    adds run on it; attention and the MLP gather the sequence."""

    def __init__(self, config: GPTConfig, group: CommGroup, layer: int = 0,
                 cp_group: CommGroup | None = None, experts: ExpertGroups | None = None) -> None:
        super().__init__()
        cp_group = cp_group or serial_group("cp")
        self.placement = LN_PLACEMENTS[config.ln_placement]
        self.bias_dropout_add = kernels(config).bias_dropout_add   # 2104.04473 §4.2
        self.ln1 = layer_norm(config)
        self.attn = Attention(config, group, layer, cp_group)
        self.ln2 = layer_norm(config)
        self.mlp = feed_forward(config, group, experts or ExpertGroups.serial())
        # Outside the split regions: the same masks on every tp rank.
        parts = sequence_parts(STYLES[config.sequence_parallel, config.async_tp](group), cp_group)
        self.attn_dropout = Dropout(config.dropout, config.seed, layer, "attention output",
                                    parts=parts)
        self.mlp_dropout = Dropout(config.dropout, config.seed, layer, "mlp output", parts=parts)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None,
                dropout_key: DropoutKey | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] → [b, s, h] (or [b, s/t, h]); ``mask``: the keys' padding mask."""
        check_initialised(self)
        u = self.ln1(x)                                  # [b, s, h]
        y = self.attn(u, kv, dropout_key, add_bias=False, mask=mask)
        x = self.bias_dropout_add(y, self.attn.proj.bias, self.attn_dropout, dropout_key,
                                  self.placement.residual(x, u))
        u = self.ln2(x)
        y = self.mlp(u, add_bias=False)
        return self.bias_dropout_add(y, self.mlp.bias, self.mlp_dropout, dropout_key,
                                     self.placement.residual(x, u))     # [b, s, h]


def compile_blocks(model: nn.Module, **options) -> None:
    """``torch.compile`` each transformer block's forward, in place (``train --compile``): the
    elementwise chains between matmuls fuse into a few kernels (2104.04473 §4.2's fusions,
    generated). Only ``forward``: hooks on the block (ZeRO-3's gathers) stay eager, as do the
    collectives and the dropout keys' host work, where the graph breaks. ``options`` go to
    ``torch.compile`` (tests on CPU use ``backend="aot_eager"``: the same capture, no C++ build)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = torch.compile(module.forward, **options)


def _block(block: Block, h: torch.Tensor, dropout_key: DropoutKey | None,
           mask: torch.Tensor | None) -> torch.Tensor:
    return block(h, None, dropout_key, mask)


def _recomputed_block(block: Block, h: torch.Tensor, dropout_key: DropoutKey | None,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Full recomputation (2104.04473 §3.5): only the block's input is kept for backward."""
    return (checkpoint(block, h, None, dropout_key, mask) if torch.is_grad_enabled()
            else block(h, None, dropout_key, mask))


# How each recomputation option runs a block (the attention core's part: RECOMPUTE_CORE).
RECOMPUTE_BLOCK = {"none": _block, "selective": _block, "full": _recomputed_block}


def _hidden_in(x: torch.Tensor, *args) -> tuple[torch.Tensor, None]:
    """A stage without the embeddings takes hidden states: as they are, no padding mask."""
    return x, None


def _hidden_out(h: torch.Tensor, *args) -> torch.Tensor:
    """A stage without the heads sends its hidden states on."""
    return h


class TransformerStage(nn.Module):
    """A model whole (the defaults) or one pipeline stage of it, tensor-parallel over ``grid``
    (None: serial); ``GPT`` and ``BERT`` add their inputs, heads and ``forward``.

    ``layers``: global indices of the blocks held (default all). ``first``: holds the embeddings,
    takes ids [b, s]; else hidden states [b, s, h] ([b, s/t, h] under sequence parallelism).
    ``last``: holds the final layer norm and the tied output layer. Parameters are drawn from
    ``config.seed`` by name: the same at any tp and pp. The ends, ``enter`` and ``leave``
    (embeddings and heads, or hidden states passed through), are chosen once, here.
    """

    config_class = GPTConfig        # the configuration it is built from, exactly (BERT: its own)
    vocab_rows = (WORD_EMBEDDING, OUTPUT_LAYER)  # of padded_vocab rows (``full_state_dict`` trims)

    def __init__(self, config: GPTConfig, grid: ParallelGrid | None = None, *,
                 layers: range | None = None, first: bool = True, last: bool = True) -> None:
        super().__init__()
        if type(config) is not self.config_class:
            raise TypeError(f"a {type(self).__name__} is built from a {self.config_class.__name__}"
                            f", not a {type(config).__name__} (model.build_model picks the model)")
        self.tp_group = grid.tp_group if grid is not None else serial_group()
        self.cp_group = grid.cp_group if grid is not None else serial_group("cp")
        self.style = STYLES[config.sequence_parallel, config.async_tp](self.tp_group)
        self.expert_groups = ExpertGroups.serial() if grid is None else ExpertGroups(
            grid.ep_group, self.style.token_group(grid.cp_group, grid.tp_cp_group),
            sequence_parts(self.style, grid.cp_group))
        config.validate(self.tp_group.size, cp=self.cp_group.size,
                        ep=self.expert_groups.ep.size)
        self.config, self.first, self.last = config, first, last
        self.layers = range(config.num_layers) if layers is None else layers
        if not all(0 <= i < config.num_layers for i in self.layers):
            raise ValueError(f"layers {self.layers} are not all in 0..{config.num_layers - 1}")
        self.training_calls = 0  # numbers the steps of a model trained without DropoutKeys
        self.run_block = RECOMPUTE_BLOCK[config.recompute]
        self.enter, self.leave = _hidden_in, _hidden_out
        self._build(config)
        init_parameters(self, config.seed, self.tp_group,
                        device=grid.device if grid is not None else "cpu")

    def _build(self, config: GPTConfig) -> None:
        """The stage's modules; each model adds its ends (``_build_first``, ``_build_last``)."""
        if self.first:                    # the embeddings, whose word table the output layer uses
            self.embedding = Embedding(config, self.tp_group, cp_group=self.cp_group)
            self.enter = self._build_first(config)
        elif self.last and config.tie_embeddings:     # (the same name: ``WORD_EMBEDDING``)
            self.embedding = TiedCopy(config, self.tp_group)
        self.blocks = nn.ModuleDict({str(i): Block(config, self.tp_group, i, self.cp_group,
                                                   self.expert_groups) for i in self.layers})
        if self.last:
            self.ln_f = layer_norm(config)
            if not config.tie_embeddings:             # Llama's: an output layer of its own
                self.output = word_table(config, self.tp_group)
            self.leave = self._build_last(config)

    def _dropout_key(self, x: torch.Tensor, key: DropoutKey | None) -> DropoutKey | None:
        """The key given; without one, a model in training numbers its calls as steps."""
        if key is None and self.training:
            key = DropoutKey.first(x.shape[0], step=self.training_calls)
            self.training_calls += 1
        return key

    def _blocks(self, h: torch.Tensor, dropout_key: DropoutKey | None,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks in order; ``mask``: the keys' padding mask [b, s]; ``cache``: generation's."""
        for name, block in self.blocks.items():
            h = (block(h, cache.layer(name)) if cache is not None
                 else self.run_block(block, h, dropout_key, mask))
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
        """The output layer: column-parallel, the word table or (untied) its own (gathers h
        under SP)."""
        logits = self.style.column_linear(h, self.output_table().weight, None)  # [b, s, V/t]
        return mask_padded_vocab(logits, self.config.vocab_size, self.tp_group)

    def output_table(self) -> VocabParallelEmbedding:
        """The last stage's output layer, [V/t, h]: the tied word table, or its own."""
        return self.embedding.word if self.config.tie_embeddings else self.output

    def tied_word_tables(self) -> list[nn.Parameter]:
        """The word table's copies this stage holds whose gradients PTD-P sums with the other
        end's (2104.04473's tied embeddings): none when untied."""
        ends = self.config.tie_embeddings and (self.first or self.last)
        return [self.embedding.word.weight] if ends else []

    def boundary_shape(self, ids: torch.Size) -> torch.Size:
        """What this stage sends on for token ids of shape ``ids`` [b, s]: the residual stream
        [b, s, h] of this rank's part of the sequence (s/t under sequence parallelism)."""
        parts = self.style.sequence_split
        if ids[1] % parts:
            raise ValueError(f"{ids[1]} tokens do not split into {parts} parts")
        return torch.Size((ids[0], ids[1] // parts, self.config.hidden))

    def num_parameters(self) -> int:
        """Parameters held by this rank (its shards; padded vocabulary included)."""
        return sum(p.numel() for p in self.parameters())

    # --- whole tensors, as the serial model holds them (checkpoints, tests, Hugging Face) ----

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Each parameter (or its gradient) of this stage whole, the vocabulary trimmed to
        ``vocab_size`` rows: independent of tp. A collective: every tp rank must call it."""
        state = {}
        for name, param in self.named_parameters():
            if grads and not param.requires_grad:         # not trained (an expert bias)
                continue
            tensor = param.grad if grads else param
            if tensor is None:
                raise ValueError(f"{name} has no gradient: run backward first")
            full = gather_full(tensor, param.tp_dim, self.tp_group, param.tp_replicas)
            full = gather_experts(full, param, self.expert_groups.ep)
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
            full = own_experts(full, param)
            param.copy_(shard(full, param.tp_dim, self.tp_group, param.tp_replicas))
