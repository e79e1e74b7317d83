"""The model configurations: sizes, presets from the papers, and the checks tensor and pipeline
parallelism need, run in the parent before any process starts (a ValueError naming the numbers,
never a crash on some rank). ``BertConfig`` is the BERT of 1909.08053 §5.3, on the GPT's blocks.

Presets:
  tiny                    a model a 2-core laptop trains in minutes (the notebooks' and tests' size)
  gpt2-small … gpt2-xl    Radford et al. 2019, Table 2 (117M, 345M, 762M, 1542M)
  megatron-1.2b … 8.3b    1909.08053 Table 1, the weak-scaling series (vocab 51,200, seq 1024;
                          docs/papers/1909.08053_configs.csv)
  bert-base, bert-large   Devlin et al. 2019 (110M, 340M; WordPiece vocab 30,522, seq 512)
  megatron-bert-336m … 3.9b   1909.08053 Table 4, the BERTs of Figure 7 and §5.3
  llama-tiny              tiny as a Llama (4 heads, 2 kv heads, SwiGLU 3h; tied: 1.31 M parameters
                          against tiny's 1.33 M, to compare the two blocks)
  smollm-135m             SmolLM-135M's shape (30 layers, 576 hidden, 9 heads, 3 kv heads, tied)
  llama3-8b               Llama-3-8B's shape (32 layers, 4096 hidden, 32 heads, 8 kv heads)
  llama-moe-tiny          llama-tiny with 8 experts of 192 units, 2 a token (as many active
                          FLOPs as llama-tiny's MLP of 384)
  mixtral-8x7b            Mixtral-8x7B's shape (Llama-2-7B-like blocks, 8 experts, 2 a token)
  qwen1.5-moe-a2.7b       Qwen1.5-MoE-A2.7B's shape (60 experts, 4 a token, a gated shared
                          expert of 4 experts' width, q/k/v biases)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

__all__ = ["GPTConfig", "BertConfig", "LlamaConfig", "PRESETS", "RECOMPUTE", "LN_PLACEMENTS",
           "ATTENTION", "ROUTERS", "MOE_GROUPS", "config_from_dict"]

RECOMPUTE = ("none", "selective", "full")
LN_PLACEMENTS = ("rearranged", "original")
ATTENTION = ("eager", "fused")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ROUTERS = ("softmax", "sigmoid")
MOE_GROUPS = ("sequence", "microbatch")


@dataclass
class GPTConfig:
    """A GPT-2-style model. ``ffn_hidden`` = 0 means 4·hidden, resolved at construction (so
    ``dataclasses.replace(config, hidden=…)`` keeps the old value: pass ``ffn_hidden=0`` too).

    Activation memory (2205.05198; ``perf.memory`` counts it): ``recompute`` "full" keeps only
    each block's input and reruns the block in backward (2104.04473 §3.5); "selective" reruns
    only the attention core, the 5·a·s²·b part that grows with s²; "none" keeps everything (True
    and False mean "full" and "none"). ``attention``: "eager" (op by op, the serial model's
    dropout masks at any layout) or "fused" (one kernel, the device's dropout: ``model.attention``).
    ``ln_placement`` (1909.08053 §5.3, Figure 7): "rearranged", x + f(LN(x)), GPT-2's and
    Megatron-BERT's; "original", LN(x + f(x)), the original BERT's (``transformer.PostLN``).

    The block's parts, each picked once when a layer is built (``LlamaConfig`` picks the other
    ones): ``norm`` "layernorm" | "rmsnorm"; ``mlp`` "gelu" | "swiglu"; ``positions`` "learned"
    (a table added to the embeddings) | "rope" (rotary, θ = ``rope_theta``, applied to q and k);
    ``num_kv_heads`` (0 → num_heads) key/value heads, each shared by num_heads/num_kv_heads
    query heads (grouped-query attention); ``bias`` (``qkv_bias`` for q, k and v alone: Qwen2);
    ``tie_embeddings`` (the output layer is the word table).

    A mixture of experts in place of each MLP (``model.moe``), with ``moe_experts`` > 0: each
    token goes to ``moe_topk`` of them (SwiGLU experts of ``moe_ffn_hidden`` units, 0 → ffn_hidden)
    chosen by a fp32 router, "softmax" (Mixtral; the k weights renormalised) or "sigmoid"
    (DeepSeek-V3); ``moe_shared_experts`` always-on experts beside them (DeepSeekMoE, Qwen-MoE),
    gated by a sigmoid with ``moe_shared_gate``. Balance: the auxiliary loss (coefficient
    ``moe_aux_loss``), the router z-loss (``moe_z_loss``) and DeepSeek-V3's loss-free expert bias
    (updated by ``moe_bias_rate`` a step). Group-limited routing (DeepSeek-V3 §2.1.2, its node
    limit): the experts in ``moe_groups`` groups, a token's k chosen from its best
    ``moe_topk_groups`` groups (a group's score: its two best experts'). Dropless, or with
    ``moe_capacity`` = cf > 0 each expert takes at most ceil(cf·k·|G|/E) of a group G's choices.
    The balance loss and the capacity cover a group of whole tokens defined by the data, never
    by the layout (``moe_group``): each "sequence", or each "microbatch".
    """

    vocab_size: int = 50257
    seq_len: int = 1024
    num_layers: int = 12
    hidden: int = 768
    num_heads: int = 12
    ffn_hidden: int = 0                  # 0 → 4·hidden (GPT-2)
    dropout: float = 0.1
    layernorm_eps: float = 1e-5
    seed: int = 1234
    recompute: str = "none"              # "none" | "selective" | "full"
    sequence_parallel: bool = False      # split the sequence outside the tp regions (2205.05198)
    fused: bool = False                  # compiled bias+GeLU, bias+dropout+add (2104.04473 §4.2)
    attention: str = "eager"             # the attention core: "eager" | "fused"
    async_tp: bool = False               # overlap dX's tp collective with dW (layers.py)
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # Megatron's padding unit, times tp
    causal: bool = True                  # False: bidirectional attention (BERT)
    ln_placement: str = "rearranged"     # "rearranged" (pre-LN) | "original" (post-LN), Figure 7
    norm: str = "layernorm"
    mlp: str = "gelu"
    positions: str = "learned"
    rope_theta: float = 10000.0
    num_kv_heads: int = 0                # 0 → num_heads (multi-head attention)
    bias: bool = True
    qkv_bias: bool | None = None         # None → bias (Qwen2: q, k, v biases, no others)
    tie_embeddings: bool = True
    moe_experts: int = 0                 # 0: a dense MLP
    moe_topk: int = 2
    moe_ffn_hidden: int = 0              # 0 → ffn_hidden
    moe_router: str = "softmax"          # "softmax" | "sigmoid"
    moe_norm_topk: bool = True           # softmax: the k weights renormalised (Mixtral)
    moe_groups: int = 1                  # group-limited routing (DeepSeek-V3): groups of experts,
    moe_topk_groups: int = 1             # of which each token's k come from the best so many
    moe_shared_experts: int = 0
    moe_shared_gate: bool = False
    moe_aux_loss: float = 0.0
    moe_group: str = "sequence"          # "sequence" | "microbatch"
    moe_capacity: float = 0.0            # 0: dropless
    moe_z_loss: float = 0.0
    moe_bias_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            self.ffn_hidden = 4 * self.hidden
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.moe_ffn_hidden == 0:
            self.moe_ffn_hidden = self.ffn_hidden
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        for name in ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden = {self.hidden} is not divisible by "
                             f"num_heads = {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.recompute, bool):  # the older on/off flag (checkpoints keep it)
            self.recompute = "full" if self.recompute else "none"
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.ln_placement not in LN_PLACEMENTS:
            raise ValueError(f"ln_placement must be one of {LN_PLACEMENTS}, "
                             f"got {self.ln_placement!r}")
        for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS),
                              ("moe_router", ROUTERS), ("moe_group", MOE_GROUPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} is not divisible by num_kv_heads = "
                             f"{self.num_kv_heads}: each kv head serves a whole group of heads")
        if self.moe_experts and not 1 <= self.moe_topk <= self.moe_experts:
            raise ValueError(f"moe_topk = {self.moe_topk} must be between 1 and moe_experts = "
                             f"{self.moe_experts}")
        if self.moe_experts and (self.moe_experts % self.moe_groups or not 1 <= self.moe_topk_groups
                                 <= self.moe_groups or self.moe_topk > self.moe_topk_groups
                                 * self.moe_experts // self.moe_groups):
            raise ValueError(f"group-limited routing: moe_experts = {self.moe_experts} in "
                             f"moe_groups = {self.moe_groups} equal groups, of which "
                             f"moe_topk_groups = {self.moe_topk_groups} (1 … groups) hold at "
                             f"least moe_topk = {self.moe_topk} experts")
        if min(self.moe_experts, self.moe_shared_experts, self.moe_aux_loss, self.moe_z_loss,
               self.moe_bias_rate, self.moe_capacity) < 0:
            raise ValueError("moe_experts, moe_shared_experts, the balance coefficients and "
                             "moe_capacity must not be negative")

    @property
    def head_dim(self) -> int:
        """The size of one attention head, hidden / num_heads."""
        return self.hidden // self.num_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary rounded up to a multiple of 128·tp, so each tp rank gets whole
        128-row blocks (Megatron's ``make-vocab-size-divisible-by``: 50,257 → 50,304 at tp=1)."""
        unit = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / unit) * unit

    def validate(self, tp: int = 1, pp: int = 1, chunks: int = 1, cp: int = 1,
                 ep: int = 1) -> None:
        """Raise a ValueError naming the numbers if this model cannot be split tp × pp·chunks,
        the sequence over cp ranks (context parallelism: causal, two chunks per rank), its
        experts over ep ranks."""
        for name, n in (("tp", tp), ("pp", pp), ("chunks", chunks), ("cp", cp), ("ep", ep)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        # §3: attention is split by heads, the MLP by its ffn columns (tp | heads ⇒ tp | hidden)
        for name in ("num_heads", "ffn_hidden"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name} = {getattr(self, name)} is not divisible by the "
                                 f"tensor-parallel size tp = {tp}")
        if ep > 1 and self.moe_experts % ep:
            raise ValueError(f"expert parallelism gives each of ep = {ep} ranks whole experts: "
                             f"moe_experts = {self.moe_experts} is not divisible by it"
                             + ("" if self.moe_experts else " (a dense model has no experts)"))
        if self.moe_experts and self.moe_ffn_hidden % (8 * tp) + self.hidden % 8:
            raise ValueError(f"the experts' grouped GEMM wants rows of whole 16-byte blocks (8 "
                             f"bf16 values): hidden = {self.hidden} and moe_ffn_hidden / tp = "
                             f"{self.moe_ffn_hidden} / {tp} must be multiples of 8 (each expert "
                             "is split over tp as the MLP)")
        # grouped-query attention: whole kv heads per rank, or each kv head on tp/g ranks
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"num_kv_heads = {self.num_kv_heads} and tp = {tp}: each rank holds "
                             f"whole kv heads (tp divides them) or one kv head replicated on "
                             f"tp/num_kv_heads ranks (they divide tp); neither divides the other")
        if self.sequence_parallel and self.seq_len % tp:
            raise ValueError(f"sequence parallelism splits the sequence over tp: seq_len = "
                             f"{self.seq_len} is not divisible by tp = {tp}")
        if cp > 1 and not self.causal:
            raise ValueError(f"context parallelism (cp = {cp}) runs causal attention (its ring "
                             "skips the blocks the causal mask hides): got causal=False")
        pieces = 2 * cp * (tp if self.sequence_parallel else 1) if cp > 1 else 1
        if self.seq_len % pieces:  # each cp rank's two chunks, each split again over tp by SP
            raise ValueError(f"context parallelism splits the sequence into 2·cp = {2 * cp} "
                             f"chunks" + (f", each into tp = {tp} parts by sequence parallelism"
                                          if self.sequence_parallel else "")
                             + f": seq_len = {self.seq_len} is not divisible by {pieces}")
        if self.num_layers % (pp * chunks):
            raise ValueError(f"num_layers = {self.num_layers} is not divisible by pp·chunks = "
                             f"{pp}·{chunks} = {pp * chunks} (every virtual pipeline stage "
                             f"holds the same number of layers)")

    def num_parameters(self, tp: int = 1, layers: int | None = None, first: bool = True,
                       last: bool = True, ep: int = 1) -> int:
        """Parameters one tp rank holds of a stage of ``layers`` blocks (None: all), with the
        embeddings if ``first`` and, if ``last``, the final layer norm and the tied output layer
        (a copy of the word table unless also first): what ``GPT(config, grid, …)`` builds. The
        package's one exact count; ``perf.parameters_per_rank`` sums a pipeline rank's stages.

        Per block, f = ffn_hidden, k = num_kv_heads·head_dim: QKV (h + 2k rows; at tp > g kv
        heads one kv head a rank, k = tp·head_dim counting the copies) and fc (f rows, 2f for
        SwiGLU's gate and up) column-parallel, biases split too; both projections
        row-parallel, biases replicated; two replicated norms (LayerNorm 2h, RMSNorm h). GPT-2
        (k = h, f = 4h): (4h² + 3h + 2h·f + f)/tp + 6h a block; whole at tp = 1, 12·l·h² + 13·l·h
        + (V + s)·h + 2h (2104.04473 §5.1, + ln_f). An untied output layer is a second V·h.
        A mixture of experts instead of the MLP: E/ep SwiGLU experts of 3·h·f_e/tp, the router
        E·h whole, and the shared experts as an MLP of f_e·n units (+ a gate of h).
        """
        self.validate(tp, ep=ep)
        h, f, k = self.hidden, self.ffn_hidden, max(self.num_kv_heads, tp) * self.head_dim
        gates = 2 if self.mlp == "swiglu" else 1
        norm = 2 * h if self.norm == "layernorm" else h
        split = h * (h + 2 * k) + h * h + self.qkv_bias * (h + 2 * k)
        if self.moe_experts:
            shared = self.moe_ffn_hidden * self.moe_shared_experts
            split += (self.moe_experts // ep * 3 * self.moe_ffn_hidden + 3 * shared) * h \
                + self.bias * 2 * shared
            whole = self.moe_experts * h + (shared > 0) * (self.moe_shared_gate + self.bias) * h
        else:
            split += (gates + 1) * h * f + self.bias * gates * f
            whole = self.bias * h
        per_layer = split // tp + self.bias * h + whole + 2 * norm
        params = (self.num_layers if layers is None else layers) * per_layer
        table = self.padded_vocab(tp) * h // tp
        tables = (first or last) if self.tie_embeddings else first + last
        positions = self.seq_len * h if self.positions == "learned" else 0
        return params + tables * table + first * positions + last * norm

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration (see the module docstring), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _sizes(vocab: int, seq: int, layers: int, hidden: int, heads: int) -> dict[str, int]:
    return dict(vocab_size=vocab, seq_len=seq, num_layers=layers, hidden=hidden, num_heads=heads)


_gpt2 = partial(_sizes, 50257, 1024)      # each family's vocabulary and sequence length;
_megatron = partial(_sizes, 51200, 1024)  # a preset adds layers, hidden, heads
_bert = partial(_sizes, 30522, 512)

# Keyword arguments rather than configs, so that overriding ``hidden`` also rescales ffn_hidden.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=4096, seq_len=128, num_layers=4, hidden=128, num_heads=4),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "megatron-1.2b": _megatron(40, 1536, 16),
    "megatron-2.5b": _megatron(54, 1920, 20),
    "megatron-4.2b": _megatron(64, 2304, 24),
    "megatron-8.3b": _megatron(72, 3072, 32),
    "bert-base": _bert(12, 768, 12),
    "bert-large": _bert(24, 1024, 16),
    "megatron-bert-336m": _bert(24, 1024, 16),
    "megatron-bert-1.3b": _bert(24, 2048, 32),
    "megatron-bert-3.9b": _bert(48, 2560, 40),
}


@dataclass
class BertConfig(GPTConfig):
    """A BERT (Devlin et al. 2019) as 1909.08053 §5.3 trains it: the GPT's blocks with
    bidirectional attention, a token-type embedding, a masked-LM head and a sentence-order head
    (``model.bert``). The model finds the padding and the token types in the ids by ``pad_id``
    and ``sep_id``: by default the roles of the package tokenizer's control ids (``data/bert.py``).
    """

    causal: bool = False
    type_vocab_size: int = 2
    pad_id: int = 3
    sep_id: int = 2
    model: str = "bert"                  # read back from checkpoints (``config_from_dict``)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.causal:
            raise ValueError("BERT's attention is bidirectional: causal must be False")
        if self.model != "bert":
            raise ValueError(f"a BertConfig describes a BERT, got model={self.model!r}")

    def validate(self, tp: int = 1, pp: int = 1, chunks: int = 1, cp: int = 1,
                 ep: int = 1) -> None:
        """The GPT's checks, and no sequence parallelism."""
        if self.sequence_parallel:
            raise ValueError("BERT runs without sequence parallelism here: its pooler reads the "
                             "[CLS] position, which only one tp rank would hold")
        super().validate(tp, pp, chunks, cp, ep)

    def num_parameters(self, tp: int = 1, layers: int | None = None, first: bool = True,
                       last: bool = True, ep: int = 1) -> int:
        """GPT's count (the blocks, the word and position tables, the final LN) plus, on the
        first stage, the token types, and on the last the masked-LM head (dense, LN, its
        vocabulary-parallel bias) and the sentence-order head (pooler, 2-way classifier)."""
        h = self.hidden
        mlm_head = h * h + h + 2 * h + self.padded_vocab(tp) // tp
        order_head = h * h + h + 2 * h + 2
        return (super().num_parameters(tp, layers, first, last, ep)
                + first * self.type_vocab_size * h + last * (mlm_head + order_head))


@dataclass
class LlamaConfig(GPTConfig):
    """A Llama-family model (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) on the GPT's
    skeleton: RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention, no biases, no
    dropout, an output layer of its own. ``ffn_hidden`` 0 → Llama's rule, 8h/3 rounded up to a
    multiple of 256."""

    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    positions: str = "rope"
    bias: bool = False
    tie_embeddings: bool = False
    dropout: float = 0.0
    model: str = "llama"                 # read back from checkpoints (``config_from_dict``)

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            self.ffn_hidden = 256 * math.ceil(8 * self.hidden / 3 / 256)
        super().__post_init__()
        if self.model != "llama":
            raise ValueError(f"a LlamaConfig describes a Llama, got model={self.model!r}")


def _llama(vocab: int, seq: int, layers: int, hidden: int, heads: int, kv_heads: int,
           ffn: int, theta: float, **more: Any) -> dict[str, Any]:
    return dict(_sizes(vocab, seq, layers, hidden, heads), num_kv_heads=kv_heads,
                ffn_hidden=ffn, rope_theta=theta, **more)


PRESETS.update({
    "llama-tiny": _llama(4096, 128, 4, 128, 4, 2, 384, 10000.0, tie_embeddings=True),
    "smollm-135m": _llama(49152, 2048, 30, 576, 9, 3, 1536, 10000.0, tie_embeddings=True),
    "llama3-8b": _llama(128256, 8192, 32, 4096, 32, 8, 14336, 500000.0),
    "llama-moe-tiny": _llama(4096, 128, 4, 128, 4, 2, 384, 10000.0, tie_embeddings=True,
                             moe_experts=8, moe_topk=2, moe_ffn_hidden=192, moe_aux_loss=0.01),
    "mixtral-8x7b": _llama(32000, 32768, 32, 4096, 32, 8, 14336, 1e6, moe_experts=8,
                           moe_topk=2, moe_aux_loss=0.01),
    "qwen1.5-moe-a2.7b": _llama(151936, 8192, 24, 2048, 16, 16, 5632, 1e6, moe_experts=60,
                                moe_topk=4, moe_ffn_hidden=1408, moe_shared_experts=4,
                                moe_shared_gate=True, moe_norm_topk=False, qkv_bias=True,
                                moe_aux_loss=0.001),
})


def config_from_dict(fields: dict[str, Any]) -> GPTConfig:
    """The configuration a checkpoint's ``meta.json`` holds (``vars(config)``): a BertConfig if
    it says ``model: bert``, a LlamaConfig if ``llama``, else a GPTConfig."""
    return {"bert": BertConfig, "llama": LlamaConfig}.get(fields.get("model"), GPTConfig)(**fields)
