"""Checkers of notebook 08, the performance model: counting parameters and FLOPs against real
models, and describing a cluster to the advisor.

08.1  the parameters of this package's GPT from its shape (2104.04473 §5.1, plus what the paper
      leaves out), against ``sum(p.numel())`` of real models built here;
08.2  the training FLOPs of a layer with a gated (SwiGLU) MLP and grouped-query attention,
      against ``FlopCounterMode`` on a real forward + backward and the paper's 72·B·s·h² +
      12·B·s²·h at the vanilla setting;
08.3  a DGX H200 cluster as a ``Hardware``, and the split (a ``Parallelism``) the advisor picks
      on it for the 1T model of Table 1.

All arithmetic or one process: no ranks are started.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.perf import (
    SELENE_A100,
    Hardware,
    advise,
    num_parameters,
    training_flops,
)
from megatron_edu.ptdp import Parallelism

__all__ = ["GatedGQALayer", "DGX_H200_DATASHEET", "TRILLION"]


def _as_int(value: object, what: str) -> int:
    """The learner's count as an int; a Hint if it is not a whole number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Hint(f"{what} should be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value != round(value):
        raise Hint(f"{what} should be a whole number, got {value!r}")
    return int(round(value))


# --- 08.1 the parameters of a GPT --------------------------------------------------------------

_GPT_SHAPES = (  # (layers, hidden, vocab, seq_len, ffn_hidden): vocab a multiple of 128, no padding
    (2, 64, 256, 32, 256),
    (3, 32, 384, 16, 80),
    (1, 48, 128, 64, 160),
)


def _real_gpt_parameters(layers: int, hidden: int, vocab: int, seq_len: int, ffn: int) -> int:
    config = GPTConfig(vocab_size=vocab, seq_len=seq_len, num_layers=layers, hidden=hidden,
                       num_heads=4, ffn_hidden=ffn, dropout=0.0)
    return sum(p.numel() for p in GPT(config).parameters())


def _parameter_mistakes(l: int, h: int, v: int, s: int, f: int) -> dict[str, int]:
    """What each typical mistake adds to the count (learner's minus the model's)."""
    return {
        "the final layer norm (2h: its weight and bias) is missing — the paper leaves it out, "
        "the model has it": -2 * h,
        "the position embeddings (s·h) are missing": -s * h,
        "the output layer is counted apart from the word embedding: GPT-2 ties them, one V×h "
        "matrix": v * h,
        "the layer norms are missing: two per layer, a weight and a bias of h each (4h)":
            -4 * l * h,
        "the biases are missing: per layer 3h (QKV), h (projection), ffn and h (the MLP)":
            -l * (5 * h + f),
        "the MLP is counted as h → 4h → h: it is h → ffn → h (2·h·ffn weights, ffn + h biases)":
            l * (8 * h * h + 4 * h - 2 * h * f - f),
    }


def _explain(diffs: list[int], mistakes: list[dict[str, int]]) -> str | None:
    """The one, two or three mistakes whose effects add up to the differences at every shape."""
    names = list(mistakes[0])
    for size in (1, 2, 3):
        for combo in combinations(names, size):
            if all(sum(m[name] for name in combo) == d for m, d in zip(mistakes, diffs,
                                                                         strict=True)):
                return "; ".join(combo)
    return None


@exercise("08.1", "the parameters of a GPT from its shape", reference=(num_parameters,),
          marks=(r"4h(²|\^2|\*\*2)\+2(·|\*)?h(·|\*)?f", r"9(·|\*)?h\+f"))
def _gpt_parameters(fn: Callable[..., object]) -> str:
    got, real = [], []
    for shape in _GPT_SHAPES:
        got.append(_as_int(fn(*shape), "the count"))
        real.append(_real_gpt_parameters(*shape))
    diffs = [g - r for g, r in zip(got, real, strict=True)]
    if any(diffs):
        explained = _explain(diffs, [_parameter_mistakes(*shape) for shape in _GPT_SHAPES])
        shape, g, r = next((s, g, r) for s, g, r in zip(_GPT_SHAPES, got, real, strict=True)
                           if g != r)
        where = (f"for l={shape[0]}, h={shape[1]}, V={shape[2]}, s={shape[3]}, "
                 f"ffn={shape[4]} you count {g:,}, the model holds {r:,}")
        raise Hint(f"{where}: {explained}" if explained else
                   f"{where} (off by {g - r:+,}). Count each tensor of "
                   f"GPT(config).named_parameters()")
    l, h, v, s = 96, 12288, 51200, 2048
    gpt3 = _as_int(fn(l, h, v, s, 4 * h), "the count")
    paper = num_parameters(l, h, v, s)
    if gpt3 != paper + 2 * h:
        raise Hint(f"right on the small models, but for GPT-3 (l=96, h=12288, ffn=4h) you count "
                   f"{gpt3:,}, expected the paper's {paper:,} + 2h = {paper + 2 * h:,}: is "
                   f"anything rounded, or held in a 32-bit integer?")
    return (f"equal to sum(p.numel()) of {len(_GPT_SHAPES)} real GPTs, and for GPT-3 to the "
            f"paper's 12lh² + 13lh + (V + s)h = {paper:,} plus the final layer norm's 2h")


# --- 08.2 the FLOPs of a SwiGLU + grouped-query-attention layer --------------------------------

class GatedGQALayer(nn.Module):
    """A transformer layer with grouped-query attention (``kv_heads`` key/value heads shared by
    ``heads`` query heads) and an MLP that is either GPT's (h → ffn, GeLU, ffn → h) or gated,
    SwiGLU (Shazeer 2020, arXiv 2002.05202): silu(x·W₁) ⊙ (x·W₃), then · W₂. Plain matmuls
    only, so that ``FlopCounterMode`` counts every FLOP the formula should."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, gated: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * ffn if gated else ffn)   # [W₁ W₃] side by side if gated
        self.down = nn.Linear(ffn, hidden)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # x: [b, s, h]
        """The layer's output [b, s, h]: attention (GQA), then the MLP, each residual."""
        b, s, h = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)     # [b, a, s, d]
        k, v = self.kv(y).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        group = self.heads // self.kv_heads                  # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)          # [b, a, s, s]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v        # [b, a, s, d]
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        up = self.up(self.ln2(x))
        if self.gated:
            gate, value = up.chunk(2, dim=-1)
            up = F.silu(gate) * value
        else:
            up = F.gelu(up)
        return x + self.down(up)


def measured_layer_flops(batch: int, seq_len: int, hidden: int, heads: int, kv_heads: int,
                         ffn: int, gated: bool) -> int:
    """FLOPs of a real forward and backward of ``GatedGQALayer``, counted by PyTorch."""
    torch.manual_seed(0)
    layer = GatedGQALayer(hidden, heads, kv_heads, ffn, gated)
    x = torch.randn(batch, seq_len, hidden, requires_grad=True)  # its input gradient too
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    return counter.get_total_flops()


def _formula(b: int, s: int, h: int, a: int, kv: int, f: int, gated: bool,
             passes: int = 3) -> int:
    """The reference: forward GEMMs of the layer, times forward + backward (3)."""
    kv_width = kv * (h // a)
    forward = (2 * b * s * h * h              # Q
               + 2 * 2 * b * s * h * kv_width   # K and V: [b·s, h]·[h, kv·d] each
               + 2 * 2 * b * s * s * h          # Q·Kᵀ and scores·V, per query head
               + 2 * b * s * h * h              # output projection
               + (3 if gated else 2) * 2 * b * s * h * f)  # MLP: 3 matrices if gated, else 2
    return passes * forward


_BASE = dict(batch=2, seq_len=16, hidden=64, heads=8, kv_heads=8, ffn=256, gated=False)


def _call(fn: Callable[..., object], **changes: object) -> int:
    args = {**_BASE, **changes}
    return _as_int(fn(args["batch"], args["seq_len"], args["hidden"], args["heads"],
                      args["kv_heads"], args["ffn"], args["gated"]), "the FLOP count")


def _expected(**changes: object) -> int:
    a = {**_BASE, **changes}
    return _formula(a["batch"], a["seq_len"], a["hidden"], a["heads"], a["kv_heads"], a["ffn"],
                    a["gated"])


def _check_vanilla(fn: Callable[..., object]) -> None:
    """GPT's layer (kv_heads = heads, ffn = 4h, not gated): the paper's 72·B·s·h² + 12·B·s²·h."""
    b, s, h = 4, 128, 256
    got = _call(fn, batch=b, seq_len=s, hidden=h, heads=8, kv_heads=8, ffn=4 * h, gated=False)
    paper = int(training_flops(b, s, 1, h, 0, recompute=False))  # one layer, no logits (V = 0)
    if got == paper:
        return
    forward = paper // 3
    known = {forward: "you counted the forward pass only: the backward costs two more "
                      "(the input and the weight gradients, each a GEMM as large): ×3",
             4 * forward: "you counted a recomputed forward too (the 96): this layer runs "
                          "without recomputation, forward + backward = 3 forwards (72)",
             2 * forward: "you counted forward and backward as one each: the backward is "
                          "two GEMMs per forward GEMM, so 3 forwards in all",
             paper - 12 * b * s * s * h: "the attention scores are missing: Q·Kᵀ and "
                                         "scores·V, 2·B·s²·h each in the forward (12·B·s²·h "
                                         "in training)",
             paper - 6 * b * s * s * h: "the attention scores are counted once: Q·Kᵀ and "
                                        "scores·V are two GEMMs, 2·B·s²·h each"}
    raise Hint(f"at GPT's setting (B={b}, s={s}, h={h}, kv_heads = heads, ffn = 4h, not gated) "
               f"you count {got:,} FLOPs where the paper's 72·B·s·h² + 12·B·s²·h gives "
               f"{paper:,}" + (f": {known[got]}" if got in known else
                               f" ({got / paper:.3f}×)"))


def _check_slope(fn: Callable[..., object], name: str, low: object, high: object,
                 wrong: dict[int, str], what: str, **fixed: object) -> None:
    """The learner's change of FLOPs when one argument goes from low to high."""
    got = _call(fn, **fixed, **{name: high}) - _call(fn, **fixed, **{name: low})
    expected = _expected(**fixed, **{name: high}) - _expected(**fixed, **{name: low})
    if got != expected:
        settings = ", ".join(f"{k}={v}" for k, v in {**_BASE, **fixed}.items() if k != name)
        raise Hint(f"from {name}={low} to {name}={high} ({settings}) your count changes by "
                   f"{got:+,}, a real layer's by {expected:+,}: "
                   + wrong.get(got, what))


@exercise("08.2", "the FLOPs of a SwiGLU + grouped-query-attention layer",
          marks=(r"6(·|\*)?[bB](·|\*)?s(·|\*)?h(·|\*)?f", r"18(·|\*)?[bB](·|\*)?s(·|\*)?h(·|\*)?f",
                 r"kvheadsinsteadof64save"))
def _gated_gqa_flops(fn: Callable[..., object]) -> str:
    _check_vanilla(fn)
    b, s, h, a = (_BASE[k] for k in ("batch", "seq_len", "hidden", "heads"))
    d = h // a
    _check_slope(fn, "ffn", 128, 256, {
        0: "your count does not change with ffn: the MLP is h → ffn → h, whatever ffn is "
           "(4h in GPT-2, not here)",
        3 * 2 * b * s * h * 128: "only one of the MLP's two matrices grows with ffn in your "
                                 "count: h×ffn and ffn×h, 2·B·s·h·ffn forward each"},
        "the MLP's two matrices are h×ffn and ffn×h: 2·B·s·h·ffn forward each")
    _check_slope(fn, "gated", False, True, {
        0: "gated=True must add SwiGLU's third h×ffn matrix (the gate): +2·B·s·h·ffn forward"},
        "a gated MLP has three h×ffn matrices (gate, value, out): 3·2·B·s·h·ffn forward "
        "where GPT's has two", ffn=192)
    kv_wrong = {
        0: "the K and V projections shrink with kv_heads: [B·s, h]·[h, kv_heads·h/heads] each",
        3 * 2 * 2 * b * s * h * d * 6 + 3 * 2 * 2 * b * s * s * d * 6:
            "the scores Q·Kᵀ and scores·V shrink with kv_heads in your count: they are "
            "computed per query head (GQA shares K and V, every query head still makes its own "
            "s×s scores) — only the K and V projections shrink",
        3 * 2 * b * s * h * d * 6: "only one of the K and V projections shrinks in your count: "
                                   "both are [B·s, h]·[h, kv_heads·h/heads]",
        3 * 3 * 2 * b * s * h * d * 6: "Q shrinks with kv_heads in your count: only K and V "
                                       "are shared, every query head keeps its own Q",
    }
    _check_slope(fn, "kv_heads", 2, 8, kv_wrong,
                 "the K and V projections are [B·s, h]·[h, kv_heads·h/heads] each: "
                 "4·B·s·h·kv_heads·(h/heads) forward together")
    measured = []
    for shape in ((2, 16, 64, 8, 2, 192, True), (1, 24, 96, 6, 3, 160, True),
                  (3, 8, 32, 4, 1, 64, False)):
        got = _as_int(fn(*shape), "the FLOP count")
        real = measured_layer_flops(*shape)
        if got != real:
            raise Hint(f"for (batch, seq_len, hidden, heads, kv_heads, ffn, gated) = {shape} you "
                       f"count {got:,}, a real forward + backward measured with FlopCounterMode "
                       f"{real:,}: is the head dimension h/heads? Is anything rounded?")
        measured.append(real)
    llama = dict(batch=1, seq_len=4096, hidden=8192, heads=64, ffn=28672, gated=True)
    saving = 1 - _call(fn, **llama, kv_heads=8) / _call(fn, **llama, kv_heads=64)
    return (f"equal to FlopCounterMode on real forward + backward passes ({len(measured)} "
            f"shapes) and to the paper's 72·B·s·h² + 12·B·s²·h at GPT's setting. For a "
            f"Llama-2-70B layer (h = 8192, 64 query heads, SwiGLU ffn = 28,672, s = 4096), 8 "
            f"kv heads instead of 64 save {100 * saving:.0f}% of the FLOPs: K and V are small "
            f"next to the MLP and the scores — GQA's gain is the 8× smaller KV cache")


# --- 08.3 a DGX H200 cluster for the advisor ---------------------------------------------------

GB = 10**9
DGX_H200_DATASHEET = Hardware(
    "DGX H200", gpus_per_node=8, memory_bytes=141 * GB, peak_flops=989e12,
    memory_bandwidth=4.8e12, intra_node_bandwidth=450 * GB, inter_node_bandwidth=8 * 50 * GB)
TRILLION = GPTConfig(vocab_size=51200, seq_len=2048, num_layers=128, hidden=25600,
                     num_heads=160, recompute="full")  # Table 1's 1T model, as it trained


def _field_hints(hw: Hardware) -> list[str]:
    """Each field of the learner's cluster that differs from the datasheet, with why."""
    ref, hints = DGX_H200_DATASHEET, []
    if hw.gpus_per_node != ref.gpus_per_node:
        hints.append(f"gpus_per_node is {hw.gpus_per_node}: a DGX H200 holds 8")
    if hw.memory_bytes != ref.memory_bytes:
        why = {141: "in GB, not bytes", 141 * 2**30: "141 GiB; the datasheet's 141 GB are "
               "decimal, 141·10⁹ bytes", 80 * 2**30: "an A100's or H100's 80 GiB"}
        hints.append(f"memory_bytes is {hw.memory_bytes:,}: "
                     + why.get(hw.memory_bytes, "141 GB are 141·10⁹ bytes"))
    if hw.peak_flops != ref.peak_flops:
        why = {1979e12: "that is the 2:4-sparsity figure; the dense bf16 peak is 989 TFLOP/s",
               989.0: "in TFLOP/s; the field is in FLOP/s (989e12)",
               312e12: "the A100's peak"}
        hints.append(f"peak_flops is {hw.peak_flops:g}: "
                     + why.get(hw.peak_flops, "the dense bf16 peak is 989e12 FLOP/s"))
    if hw.memory_bandwidth != ref.memory_bandwidth:
        hints.append(f"memory_bandwidth is {hw.memory_bandwidth:g}: HBM3e's 4.8 TB/s are "
                     f"4.8e12 bytes/s")
    if hw.intra_node_bandwidth != ref.intra_node_bandwidth:
        why = {900 * GB: "NVLink's 900 GB/s count both directions; the field takes one (450 GB/s), "
               "as SELENE_A100's 300e9 is half the A100's 600 GB/s",
               450.0: "in GB/s; the field is in bytes/s"}
        hints.append(f"intra_node_bandwidth is {hw.intra_node_bandwidth:g}: "
                     + why.get(hw.intra_node_bandwidth, "NVLink 4 moves 450e9 bytes/s each way"))
    if hw.inter_node_bandwidth != ref.inter_node_bandwidth:
        why = {50 * GB: "one adapter's; the field is per node, all 8 adapters together",
               8 * 400 * GB: "400 Gb/s are gigabits: 50 GB/s per adapter"}
        hints.append(f"inter_node_bandwidth is {hw.inter_node_bandwidth:g}: "
                     + why.get(hw.inter_node_bandwidth, "8 adapters × 400 Gb/s = 8 × 50e9 "
                               "bytes/s per node"))
    return hints


@exercise("08.3", "the advisor on a DGX H200 cluster",
          marks=(r"461TFLOP/s", r"pp=32wheretheA100s", r"memory_bytes=141\*",
                 r"intra_node_bandwidth=900\*GB/2", r"inter_node_bandwidth=8\*400e9/8"))
def _h200_advisor(fn: Callable[[], object]) -> str:
    answer = fn()
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise Hint(f"return a pair (hardware, parallelism), got {type(answer).__name__}")
    hw, parallelism = answer
    if not isinstance(hw, Hardware):
        raise Hint(f"the first item should be a megatron_edu.perf.Hardware, got "
                   f"{type(hw).__name__}")
    wrong = _field_hints(hw)
    if wrong:
        raise Hint("; ".join(wrong))
    best, prediction = advise(TRILLION, 3072, 3072, DGX_H200_DATASHEET)[0]
    selene, selene_prediction = advise(TRILLION, 3072, 3072, SELENE_A100)[0]
    if not isinstance(parallelism, Parallelism):
        raise Hint(f"the second item should be the advisor's Parallelism (advise(...)[0][0]), "
                   f"got {type(parallelism).__name__}")
    if parallelism == selene:
        raise Hint(f"{_short(parallelism)} is the advisor's pick on Selene's A100s: pass your "
                   f"cluster to advise(..., hw)")
    if parallelism != best:
        raise Hint(f"the advisor picks {_short(best)} for the 1T model (B = 3072 on 3072 GPUs) on "
                   f"your cluster; you return {_short(parallelism)}: the first of advise(...)'s "
                   f"ranked list")
    return (f"on H200s the 1T model fits with pp={best.pp} where the A100s needed "
            f"pp={selene.pp}: {prediction.tflops_per_gpu:.0f} TFLOP/s per GPU "
            f"({prediction.percent_of_peak:.0f}% of peak), {prediction.time.total:.0f} s per "
            f"iteration against {selene_prediction.time.total:.0f} s")


def _short(parallelism: Parallelism) -> str:
    chunks = f" v={parallelism.chunks}" if parallelism.chunks > 1 else ""
    return (f"tp={parallelism.tp} pp={parallelism.pp} dp={parallelism.dp} "
            f"b={parallelism.microbatch} {parallelism.schedule}{chunks}")
