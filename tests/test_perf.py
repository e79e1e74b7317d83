"""The cost model against hand arithmetic, a real PyTorch model, and the papers' measurements.

- formulas: 2104.04473 §5.1 (parameters, FLOPs, training time) and Table 1;
- memory: weights, gradients, Adam states and saved activations (2205.05198 §4) of a plain
  PyTorch GPT, counted byte for byte;
- advisor: Table 1's per-GPU throughput, the divisibility and memory rules, and the takeaways of
  2104.04473 §3 and §5.4-5.8 (and 1909.08053's weak scaling, §5.1);
- the Llama block (SwiGLU, grouped-query attention, RMSNorm, rotary, untied output): the
  published parameter counts, FLOPs by hand, activations measured, the advisor on Llama-3-8B.
"""

import math
import time
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_edu.grid import Layout
from megatron_edu.model import BertConfig, GPTConfig, LlamaConfig, build_model
from megatron_edu.perf import (
    A100_BF16_PEAK,
    DGX2H_V100,
    DGX_H100,
    FP32,
    GIB,
    MIXED,
    MIXED_FP32_GRADS,
    SELENE_A100,
    activation_bytes_per_layer,
    activation_bytes_per_rank,
    advise,
    datasheet_bf16_peak,
    datasheet_peak_flops,
    embedding_activation_bytes,
    forwards_in_flight,
    interleaving_speedup,
    measure_matmul_flops,
    memory_per_rank,
    model_config,
    model_flops_utilization,
    num_parameters,
    output_layer_activation_bytes,
    parameters_per_rank,
    predict,
    read_paper_table,
    rejection_reason,
    table1_config,
    training_flops,
    training_flops_of,
    training_time_seconds,
)
from megatron_edu.pipeline.schedules import PipelineConfig, make_schedule
from megatron_edu.pipeline.simulate import simulate
from megatron_edu.ptdp import Parallelism

DAY = 86400
TABLE1 = read_paper_table("2104.04473_table1.csv")  # 2104.04473 Table 1 (V 51,200, s 2048)
ROW_IDS = [f"{r['params_billion']:g}B" for r in TABLE1]
shape = table1_config


def gpt(layers: int, hidden: int, heads: int, vocab: int, seq_len: int, **fields) -> GPTConfig:
    """A GPT in the papers' letters: l layers, h hidden, a heads, V vocabulary, s sequence."""
    return GPTConfig(vocab_size=vocab, seq_len=seq_len, num_layers=layers, hidden=hidden,
                     num_heads=heads, **fields)


def split(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, *, zero: int = 0,
          **pipeline) -> Parallelism:
    """A run's split in the tests' shorthand: the mesh's sizes, the pipeline's fields
    (``PipelineConfig``'s, by name), the ZeRO stage."""
    return Parallelism(Layout(tp, pp, dp, cp), PipelineConfig(**pipeline), zero)


def test_table1_models_keep_their_vocabulary_at_every_tp_the_advisor_tries():
    assert {shape(row).padded_vocab(tp) for row in TABLE1 for tp in (1, 2, 4, 8, 16)} == {51200}


# ---- formulas (2104.04473 §5.1) ----


def test_num_parameters_plus_final_layer_norm_is_gpt2_xl():
    # hand arithmetic: 12·48·1600² + 13·48·1600 + 50257·1600 + 1024·1600 = 1,557,608,000;
    # Hugging Face's gpt2-xl has 1,557,611,200 = that + the final layer norm's 2·1600
    assert num_parameters(48, 1600, 50257, 1024) + 2 * 1600 == 1_557_611_200


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_num_parameters_is_the_papers_closed_form(row):
    l, h, v, s = int(row["layers"]), int(row["hidden"]), 51200, 2048
    closed_form = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert num_parameters(l, h, v, s) == pytest.approx(closed_form, rel=1e-12)


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_parameter_counts_are_the_formula_rounded_to_a_tenth_of_a_billion(row):
    p = num_parameters(int(row["layers"]), int(row["hidden"]), 51200, 2048)
    assert round(p / 1e9, 1) == row["params_billion"]


def test_training_flops_by_hand():
    # B=1, s=2, l=1, h=6, V=8: 96·2·36 = 6912, + s/(6h) → 384, + V/(16lh) → 576
    assert training_flops(1, 2, 1, 6, 8) == 6912 + 384 + 576


def test_training_flops_without_recompute_by_hand():
    # 72·2·36 = 5184, + s/(6h) → 288, + the logits' 6·B·s·h·V = 576, unchanged
    assert training_flops(1, 2, 1, 6, 8, recompute=False) == 5184 + 288 + 576


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_training_flops_is_the_papers_closed_form(row):
    b, s, l, h, v = int(row["batch"]), 2048, int(row["layers"]), int(row["hidden"]), 51200
    closed_form = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert training_flops(b, s, l, h, v) == pytest.approx(closed_form, rel=1e-12)


def test_recompute_costs_one_more_transformer_forward():
    b, s, l, h, v = 8, 2048, 24, 2304, 51200
    forward = 24 * b * s * l * h * h + 4 * b * s * s * l * h
    assert training_flops(b, s, l, h, v) - training_flops(b, s, l, h, v, False) == forward


def test_gpt3_takes_34_days_on_1024_a100s():
    # 2104.04473 §5.1: 175B parameters, 300B tokens, 1024 GPUs at 140 TFLOP/s
    days = training_time_seconds(300e9, 175e9, 1024, 140e12) / DAY
    assert days == pytest.approx(34, abs=0.5)


def test_one_trillion_parameters_take_84_days_on_3072_a100s():
    # 2104.04473 §5.1: 450B tokens, 3072 GPUs at 163 TFLOP/s; P from Table 1
    days = training_time_seconds(450e9, TABLE1[-1]["params_billion"] * 1e9, 3072, 163e12) / DAY
    assert days == pytest.approx(84, abs=0.5)


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_percent_of_peak_is_against_312_tflops(row):
    flops = training_flops(int(row["batch"]), 2048, int(row["layers"]), int(row["hidden"]), 51200)
    step_time = flops / (row["gpus"] * row["tflops_per_gpu"] * 1e12)
    mfu = model_flops_utilization(flops, step_time, A100_BF16_PEAK, int(row["gpus"]))
    assert 100 * mfu == pytest.approx(row["percent_of_peak"], abs=0.6)


def test_hardware_flops_of_a_recomputing_run_are_a_third_more_than_the_model_flops():
    # the transformer layers run 4 forwards instead of 3; the logit layer is not recomputed,
    # which holds GPT-2 medium's ratio (a large V/(12lh) = 0.17) down to 1.29
    b, s, l, h, v = 8, 1024, 24, 1024, 50257
    ratio = training_flops(b, s, l, h, v, recompute=True) / training_flops(b, s, l, h, v, False)
    assert 1.28 < ratio < 4 / 3


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA GB200", 2500),
    ("NVIDIA B200", 2250),               # not the GB200's: "B200" inside "GB200" is no match
    ("NVIDIA H100 80GB HBM3", 989),      # the SXM part: its name gives no form factor
    ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835),
    ("NVIDIA GH200 480GB", 989),
    ("NVIDIA H800", 989),
    ("NVIDIA H800 PCIe", 756),
    ("NVIDIA H20", 148),                 # not the H200's
    ("NVIDIA L40S", 362),
    ("NVIDIA L40", 181),
    ("NVIDIA L4", 121),                  # not the L40's
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA A800-SXM4-80GB", 312),
    ("NVIDIA A40", 149.7),
    ("NVIDIA A30", 165),
    ("NVIDIA A10", 125),                 # not the A100's, nor the A10G's below
    ("NVIDIA RTX A6000", 154.8),
    ("Tesla V100-SXM2-32GB", 125),       # fp16: no bf16 tensor cores
    ("Tesla V100-PCIE-16GB", 112),
    ("Tesla V100S-PCIE-32GB", 130),
    # not in the table: their MFU is against a measured peak (``measure_matmul_flops``)
    ("NVIDIA A10G", None),
    ("NVIDIA RTX 6000 Ada Generation", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_datasheet_bf16_peak_by_the_name_cuda_reports(name, tflops):
    peak = datasheet_bf16_peak(name)
    assert (None if peak is None else peak / 1e12) == tflops


def test_a_cpu_has_no_datasheet_peak():
    assert datasheet_peak_flops("cpu") is None
    assert datasheet_peak_flops(torch.device("cpu")) is None


def test_a_measured_peak_is_a_positive_rate_within_its_time():
    """Small matmuls for a short while: a finite positive FLOP/s, in about the time asked for;
    and it leaves the global random generator alone (a run's draws do not depend on it)."""
    state = torch.random.get_rng_state()
    start = time.perf_counter()
    rate = measure_matmul_flops("cpu", torch.float32, size=64, seconds=0.02)
    assert 0 < rate < math.inf and time.perf_counter() - start < 2
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_measured_peak_times_the_matmuls_queued_not_one_at_a_time(monkeypatch):
    """The matmuls timed are counted whole: with every span of ``count`` matmuls taking
    ``count`` ms, the rate is exactly 2n³ per ms, however many fill ``seconds``."""
    from megatron_edu.perf import flops

    spans = []

    def one_ms_each(run, count, device):
        run(count)
        spans.append(count)
        return count * 1e-3

    monkeypatch.setattr(flops, "_seconds", one_ms_each)
    assert measure_matmul_flops("cpu", size=32, seconds=0.1) == pytest.approx(2 * 32**3 * 1e3)
    # allocation, a first estimate, warm-up for ¼ of the time, the timed ¾ as one span
    assert spans[:2] == [2, 3] and spans[2:] == pytest.approx([25, 75], abs=1)


# ---- memory: a plain PyTorch GPT (pre-LN, fp32, no fused kernels), counted byte for byte ----


class Block(nn.Module):
    """A GPT-2 block written with plain PyTorch ops, in the order Megatron computes them."""

    def __init__(self, h: int, a: int, dropout: float, recompute: str) -> None:
        super().__init__()
        self.a, self.p, self.recompute = a, dropout, recompute
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def dropout(self, x):
        # the fused kernel F.dropout uses on GPUs: it keeps a 1-byte mask, as 2205.05198 counts
        # (on CPU F.dropout keeps a mask of the input's dtype instead)
        return torch.native_dropout(x, self.p, True)[0] if self.p else x

    def attention_core(self, q, k, v, causal):  # [b, a, s, d] -> [b, a, s, d]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return self.dropout(scores.masked_fill(causal, float("-inf")).softmax(-1)) @ v

    def layer(self, x, causal):
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.a, h // self.a)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if self.recompute == "selective":  # 2205.05198 §5: recompute only softmax(QKᵀ)·V
            ctx = checkpoint(self.attention_core, q, k, v, causal, use_reentrant=True)
        else:
            ctx = self.attention_core(q, k, v, causal)
        x = x + self.dropout(self.proj(ctx.transpose(1, 2).reshape(b, s, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def forward(self, x, causal):
        if self.recompute == "full":  # 2104.04473 §3.5: keep only the layer's input
            return checkpoint(self.layer, x, causal, use_reentrant=True)
        return self.layer(x, causal)


class PlainGPT(nn.Module):
    def __init__(self, m: GPTConfig, dropout: float = 0.0, recompute: str = "none") -> None:
        super().__init__()
        self.wte = nn.Embedding(m.vocab_size, m.hidden)
        self.wpe = nn.Embedding(m.seq_len, m.hidden)
        self.blocks = nn.ModuleList(
            Block(m.hidden, m.num_heads, dropout, recompute) for _ in range(m.num_layers)
        )
        self.ln_f = nn.LayerNorm(m.hidden)
        self.register_buffer("causal", torch.ones(m.seq_len, m.seq_len, dtype=torch.bool).triu(1))

    def body(self, x):
        for block in self.blocks:
            x = block(x, self.causal)
        return x

    def head_loss(self, x, labels):  # the output layer is tied to the word embedding
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


TINY = gpt(layers=2, hidden=64, heads=4, vocab=128, seq_len=32)  # 128 = its padded vocabulary
B = 3


def saved_bytes(model: nn.Module, fn, *args) -> int:
    """Bytes of the storages autograd keeps alive for backward (weights and buffers excluded)."""
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in fixed:
            storages[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def test_parameters_per_rank_count_the_plain_model():
    model = PlainGPT(TINY)
    assert sum(p.numel() for p in model.parameters()) == parameters_per_rank(TINY, Parallelism())


def test_parameters_per_rank_is_the_papers_count_plus_the_final_layer_norm():
    l, h, v, s = TINY.num_layers, TINY.hidden, TINY.vocab_size, TINY.seq_len
    assert parameters_per_rank(TINY, Parallelism()) == num_parameters(l, h, v, s) + 2 * h


STAGED = dict(vocab_size=100, seq_len=16, num_layers=8, hidden=32, num_heads=4, ffn_hidden=48)


@pytest.mark.parametrize("parallelism", [
    split(pp=4), split(pp=2, schedule="interleaved", chunks=2, num_microbatches=2),
    split(pp=2, schedule="zb-v")], ids=["1f1b", "interleaved", "zb-v"])
@pytest.mark.parametrize("kind", [GPTConfig, BertConfig, partial(LlamaConfig, num_kv_heads=2),
                                  LlamaConfig], ids=["gpt", "bert", "llama-gqa", "llama-mha"])
def test_parameters_per_rank_are_what_the_models_stages_hold(parallelism, kind):
    """Each pipeline rank's chunks, built as the model's stages (ZB-V: rank 0 holds the first
    and the last stage, each chunk its own copy of the word embedding; a Llama's untied output
    layer on the last stage, no copy; grouped-query attention's QKV of (a + 2g)·d rows), any
    ffn width."""
    config, stages = kind(**STAGED), parallelism.stages
    for rank in range(parallelism.pp):
        held = 0
        for chunk in range(stages.v):
            stage = stages.stage(rank, chunk)
            model = build_model(config, layers=stages.layers(stage, config.num_layers),
                                first=stage == 0, last=stage == stages.num_stages - 1)
            held += sum(p.numel() for p in model.parameters())
        assert parameters_per_rank(config, parallelism, rank) == held, rank


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 4), (4, 2)])
def test_shards_add_up_to_the_model_plus_replicas(tp, pp):
    m, h = gpt(8, 64, 8, 512, 32), 64  # 512: no padding at tp ≤ 4
    held = sum(tp * parameters_per_rank(m, split(tp, pp), stage) for stage in range(pp))
    replicated = m.num_layers * 6 * h + m.seq_len * h + 2 * h  # layer norms, row biases, wpe
    tied_copy = m.vocab_size * h if pp > 1 else 0  # the last stage's output-layer copy
    assert held == parameters_per_rank(m, Parallelism()) + (tp - 1) * replicated + tied_copy


def test_a_layout_that_cannot_split_the_model_is_refused_with_the_models_rule():
    with pytest.raises(ValueError, match="num_heads = 4 is not divisible by the tensor-parallel"):
        parameters_per_rank(TINY, split(tp=3))


def test_weights_grads_and_adam_bytes_equal_the_real_model():
    torch.manual_seed(0)
    model = PlainGPT(TINY)
    adam = torch.optim.Adam(model.parameters())
    ids = torch.randint(TINY.vocab_size, (B, TINY.seq_len))
    x = model.wte(ids) + model.wpe.weight
    model.head_loss(model.body(x), ids).backward()
    adam.step()
    measured = (
        sum(p.nbytes for p in model.parameters()),
        sum(p.grad.nbytes for p in model.parameters()),
        # exp_avg and exp_avg_sq; Adam's one-element `step` counter per tensor is left out
        sum(s[k].nbytes for s in adam.state.values() for k in ("exp_avg", "exp_avg_sq")),
    )
    est = memory_per_rank(TINY, split(num_microbatches=B), precision=FP32)
    assert measured == (est.weights, est.grads, est.optimizer)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_activations_equal_korthikanti_byte_for_byte(recompute, dropout):
    """fp32 values take 4 bytes (Korthikanti counts 2) and masks 1: `bytes_per_value=4` is the
    factor-2 scaling. What PyTorch keeps beyond the paper's count: each LayerNorm's per-token
    mean and 1/std (2 fp32 per token), where Megatron's fused kernel keeps the same and the paper
    rounds them away; under full recomputation the layer keeps only its input."""
    torch.manual_seed(0)
    model = PlainGPT(TINY, dropout, recompute)
    x = torch.randn(B, TINY.seq_len, TINY.hidden, requires_grad=True)
    layer_norm_stats = 0 if recompute == "full" else 2 * 2 * B * TINY.seq_len * 4
    config = replace(TINY, recompute=recompute, dropout=dropout)  # the masks: if it has dropout
    per_layer = activation_bytes_per_layer(config, B, bytes_per_value=4)
    assert saved_bytes(model, model.body, x) == TINY.num_layers * (per_layer + layer_norm_stats)


def test_output_layer_activations_equal_korthikanti_plus_targets():
    """Final layer-norm input, output-layer input, fp32 log-softmax: the paper's three; PyTorch
    also keeps the layer norm's statistics (8 bytes/token), the int64 targets (8 bytes/token)
    and the loss's 4-byte total weight."""
    model = PlainGPT(TINY)
    x = torch.randn(B, TINY.seq_len, TINY.hidden, requires_grad=True)
    labels = torch.randint(TINY.vocab_size, (B, TINY.seq_len))
    extras = 8 * B * TINY.seq_len + 8 * B * TINY.seq_len + 4
    expected = output_layer_activation_bytes(TINY, B, bytes_per_value=4) + extras
    assert saved_bytes(model, model.head_loss, x, labels) == expected


# ---- memory: the paper's closed forms (16-bit values, 1-byte masks) ----

GPT_22B = gpt(layers=48, hidden=6144, heads=64, vocab=51200, seq_len=2048)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel_activations_are_10_plus_24_over_t(t):
    s, b, h, a = 2048, 1, 6144, 64
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # 2205.05198 eq. 2
    assert activation_bytes_per_layer(GPT_22B, b, tp=t) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_sequence_parallel_divides_all_34_by_t(t):
    s, b, h, a = 2048, 1, 6144, 64
    expected = s * b * h / t * (34 + 5 * a * s / h)  # 2205.05198 eq. 3
    got = activation_bytes_per_layer(replace(GPT_22B, sequence_parallel=True), b, tp=t)
    assert got == pytest.approx(expected, rel=1e-12)


def test_selective_recompute_drops_the_attention_term():
    s, b, h = 2048, 1, 6144
    config = replace(GPT_22B, sequence_parallel=True, recompute="selective")
    assert activation_bytes_per_layer(config, b, tp=8) == 34 * s * b * h // 8  # 2205.05198 eq. 4


def test_full_recompute_keeps_2sbh():
    config = replace(GPT_22B, recompute="full")
    assert activation_bytes_per_layer(config, 1, tp=8) == 2 * 2048 * 6144


@pytest.mark.parametrize("precision, per_param", [(FP32, 16), (MIXED, 16), (MIXED_FP32_GRADS, 18)])
def test_bytes_per_parameter(precision, per_param):
    total = precision.weights + precision.grads + precision.master + precision.adam
    assert total == per_param


@pytest.mark.parametrize("cp", [1, 2])
def test_zero_stages_shard_over_the_dp_cp_ranks_that_hold_the_same_weights(cp):
    """1910.02054 Figure 1: stage 1 the optimizer, 2 the gradients too, 3 the weights too —
    over the dp·cp ranks that hold the same weights; activations untouched."""
    layout = Layout(tp=2, pp=1 if cp == 1 else 2, dp=4, cp=cp)
    pipeline = PipelineConfig(num_microbatches=16)
    stages = range(4) if layout.pp == 1 else range(2)   # ZeRO-2 and 3 run without a pipeline
    plain, *sharded = (memory_per_rank(GPT_22B, Parallelism(layout, pipeline, z)) for z in stages)
    for zero, estimate in enumerate(sharded, start=1):
        for part, from_stage in (("optimizer", 1), ("grads", 2), ("weights", 3)):
            whole = getattr(plain, part)
            assert getattr(estimate, part) == (math.ceil(whole / (4 * cp)) if zero >= from_stage
                                               else whole), (zero, part)
        assert estimate.activations == plain.activations


def test_zero_stages_cost_the_bytes_of_the_zero_paper_per_step():
    """ZeRO-1 moves an all-reduce's bytes; ZeRO-2 reduce-scatters each of m microbatches and
    gathers once ((m + 1)/2 of it); ZeRO-3 gathers twice and reduce-scatters per microbatch
    (3m/2: 1.5× at m = 1, the paper's §7)."""
    model = replace(GPT_22B, num_layers=8)

    def dp_time(zero, m):
        return predict(model, split(tp=8, dp=8, zero=zero, num_microbatches=m),
                       DGX_H100).time.data_parallel

    for m in (1, 4):
        assert dp_time(1, m) == pytest.approx(dp_time(0, m))
        assert dp_time(2, m) == pytest.approx((m + 1) / 2 * dp_time(0, m))
        assert dp_time(3, m) == pytest.approx(3 * m / 2 * dp_time(0, m))


# ---- memory: context parallelism (2310.01889; megatron-core's CP) ----


@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_activations_are_a_cp_th_without_the_scores_plus_the_ring(cp, t):
    """s/cp tokens per rank: every s·b·h term divides by cp; the 5·a·s²·b/t of the softmax, its
    dropout mask and output are gone, and the ring keeps its output (1 sbh/t, 16-bit) and its
    log-sum-exp (a·s·b/t fp32) instead — selective recomputation has nothing left to drop."""
    s, b, h, a = 2048, 1, 6144, 64
    config = replace(GPT_22B, dropout=0.1)
    scores = 5 * a * s * s * b // t
    ring = 2 * s * b * h // t + 4 * a * s * b // t
    serial = activation_bytes_per_layer(config, b, tp=t)
    expected = (serial - scores + ring) // cp
    assert expected * cp == serial - scores + ring           # exact: no rounding anywhere
    assert expected == s * b * h // cp * (10 + 24 // t) + ring // cp
    for recompute in ("none", "selective"):
        got = activation_bytes_per_layer(replace(config, recompute=recompute), b, tp=t, cp=cp)
        assert got == expected, recompute
    full = activation_bytes_per_layer(replace(config, recompute="full"), b, tp=t, cp=cp)
    assert full == 2 * s * b * h // cp


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_pipeline_ranks_activations_fall_as_one_over_cp(recompute):
    config = replace(GPT_22B, recompute=recompute, dropout=0.1)
    pipeline = PipelineConfig("interleaved", 2, num_microbatches=8)
    by_cp = {cp: Parallelism(Layout(tp=2, pp=4, dp=2, cp=cp), pipeline) for cp in (2, 4)}
    for stage in (0, 3):   # the embedding's rank and the output layer's
        half, quarter = (activation_bytes_per_rank(config, by_cp[cp], stage) for cp in (2, 4))
        assert half == 2 * quarter, stage
        assert embedding_activation_bytes(config, 1, tp=2, cp=4) * 4 == \
            embedding_activation_bytes(config, 1, tp=2)
        assert output_layer_activation_bytes(config, 1, tp=2, cp=4) * 4 == \
            output_layer_activation_bytes(config, 1, tp=2)


# ---- memory: microbatches in flight, read off the schedule (2104.04473 §2.2, 2401.10241) ----


def test_gpipe_holds_every_microbatch():
    assert forwards_in_flight(PipelineConfig("gpipe", num_microbatches=16), p=4) == [16]


def test_1f1b_first_stage_holds_p_and_last_holds_one():
    pipeline = PipelineConfig(num_microbatches=16)
    assert [forwards_in_flight(pipeline, 4, stage) for stage in range(4)] == [[4], [3], [2], [1]]


def test_1f1b_with_fewer_microbatches_than_stages_holds_them_all():
    assert forwards_in_flight(PipelineConfig(num_microbatches=3), p=8) == [3]


def test_interleaved_first_stage_holds_p_plus_p_minus_1_over_v_stages():
    p, m, v = 4, 16, 2
    held = forwards_in_flight(PipelineConfig("interleaved", v, num_microbatches=m), p)
    assert sum(held) / v == p + (p - 1) / v


@pytest.mark.parametrize("name, k", [("zb-h1", 1), ("zb-h2", 2)])
def test_zero_bubble_ranks_hold_k_times_p_minus_1_plus_1_everywhere(name, k):
    """2401.10241 §2: ZB-H1 holds p microbatches on every rank (1F1B's rank-0 peak), ZB-H2
    2p − 1, between each forward and its weight-gradient pass W."""
    p = 4
    pipeline = PipelineConfig(name, num_microbatches=16)
    assert [forwards_in_flight(pipeline, p, stage) for stage in range(p)] == [[k * (p - 1) + 1]] * p


SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("interleaved", 3),
             ("zb-h1", None), ("zb-h2", None), ("zb-v", None)]


@pytest.mark.parametrize("name, v, p, m", [
    (name, v, p, m) for name, v in SCHEDULES for p, m in [(4, 8), (3, 12), (2, 1)]
    if name != "interleaved" or m % p == 0])
def test_forwards_in_flight_add_up_to_the_simulators_peak(name, v, p, m):
    pipeline = PipelineConfig(name, v, num_microbatches=m)
    peaks = simulate(make_schedule(name, p, m, v)).peak_activations
    assert [sum(forwards_in_flight(pipeline, p, stage)) for stage in range(p)] == peaks


TINY_DEEP = gpt(layers=8, hidden=64, heads=4, vocab=128, seq_len=32)


def test_activation_memory_grows_with_the_schedules_in_flight_count():
    splits = [split(pp=4, schedule=s, num_microbatches=16) for s in ("1f1b", "gpipe")]
    one_f_one_b, gpipe = (memory_per_rank(TINY_DEEP, x).activations for x in splits)
    assert gpipe > 3 * one_f_one_b  # GPipe keeps m = 16 microbatches, 1F1B keeps p = 4


def test_a_middle_zb_h2_rank_holds_2p_minus_1_microbatches_of_its_layers():
    p, b = 4, 2
    per_layer = activation_bytes_per_layer(TINY_DEEP, b)
    zb_h2 = split(pp=p, schedule="zb-h2", microbatch=b, num_microbatches=16)
    assert activation_bytes_per_rank(TINY_DEEP, zb_h2, 1) == (2 * p - 1) * 2 * per_layer


def test_zb_v_rank_0_holds_the_embedding_and_the_output_layer():
    """ZB-V's V puts the first and the last stage on rank 0: both ends' activations are there,
    each on its own chunk (half a stage's layers), none on the other ranks."""
    b, p = 2, 2
    zb_v = split(pp=p, schedule="zb-v", microbatch=b, num_microbatches=8)
    first, middle = (activation_bytes_per_rank(TINY_DEEP, zb_v, rank) for rank in (0, 1))
    held0, held1 = (forwards_in_flight(zb_v.pipeline, p, rank) for rank in (0, 1))
    layers = TINY_DEEP.num_layers // (2 * p) * activation_bytes_per_layer(TINY_DEEP, b)
    ends = (held0[0] * embedding_activation_bytes(TINY_DEEP, b)
            + held0[1] * output_layer_activation_bytes(TINY_DEEP, b))
    assert first >= sum(held0) * layers + ends  # the heaviest moment weighs at least the peak
    assert middle == sum(held1) * layers


# ---- the performance model and the advisor on Selene (2104.04473 §5.1, Table 1) ----


@pytest.mark.parametrize("recompute, with_recompute", [("full", True), ("none", False)])
def test_predicted_flops_are_the_papers_formula(recompute, with_recompute):
    row = TABLE1[4]
    parallelism = split(8, 2, 32, num_microbatches=int(row["batch"]) // 32)
    pred = predict(replace(shape(row), recompute=recompute), parallelism)
    expected = training_flops(int(row["batch"]), 2048, int(row["layers"]), int(row["hidden"]),
                              51200, recompute=with_recompute)
    assert pred.flops_per_iteration == pytest.approx(expected, rel=1e-12)


def test_throughput_is_flops_over_gpus_and_iteration_time():
    parallelism = split(8, 4, 32, schedule="interleaved", chunks=5, microbatch=2,
                        num_microbatches=28)
    pred = predict(shape(TABLE1[5]), parallelism)
    assert pred.time.total == pytest.approx(pred.flops_per_iteration
                                            / (1024 * pred.tflops_per_gpu * 1e12))


def test_the_fused_core_moves_no_scores_through_hbm_and_recomputes_them_in_backward():
    """Flash attention (``attention="fused"``) on GPT-2 medium, one H100: less time than the
    eager core, whose softmax and dropout pass its b·a·s² scores through HBM, and one more
    forward of the core (4·B·s²·h per layer, Q·Kᵀ and ·V) executed: its backward recomputes."""
    eager = GPTConfig.preset("gpt2-medium")
    one_gpu, parallelism = replace(DGX_H100, gpus_per_node=1), split(microbatch=4,
                                                                    num_microbatches=4)
    plain, flash = (predict(c, parallelism, one_gpu)
                    for c in (eager, replace(eager, attention="fused")))
    assert flash.time.compute < 0.85 * plain.time.compute
    assert flash.flops_per_iteration - plain.flops_per_iteration == 4 * 16 * 1024**3 * 24


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_rows_own_layout_within_15_percent(row):
    """The row's tp and pp; microbatch and schedule (not in Table 1) chosen by the model."""
    ranked = advise(shape(row), int(row["batch"]), int(row["gpus"]), SELENE_A100,
                    tp=int(row["tensor_parallel"]), pp=int(row["pipeline_parallel"]))
    assert ranked[0][1].tflops_per_gpu == pytest.approx(row["tflops_per_gpu"], rel=0.15)


@pytest.mark.parametrize("row", TABLE1, ids=ROW_IDS)
def test_table1_advisors_choice_within_15_percent(row):
    ranked = advise(shape(row), int(row["batch"]), int(row["gpus"]), SELENE_A100)
    assert ranked[0][1].tflops_per_gpu == pytest.approx(row["tflops_per_gpu"], rel=0.15)


@pytest.mark.parametrize("row", TABLE1[::3], ids=ROW_IDS[::3])
def test_advisor_proposes_only_layouts_that_divide_and_fit(row):
    m, batch, n = shape(row), int(row["batch"]), int(row["gpus"])
    for proposed, pred in advise(m, batch, n):
        assert (proposed.world_size, proposed.global_batch) == (n, batch)
        assert m.num_heads % proposed.tp == 0 and SELENE_A100.gpus_per_node % proposed.tp == 0
        assert m.num_layers % (proposed.pp * proposed.chunks) == 0
        assert proposed.schedule != "interleaved" or proposed.num_microbatches % proposed.pp == 0
        assert pred.memory.total <= SELENE_A100.memory_bytes
        assert (pred.parallelism, pred.config) == (proposed, m)


MODEL_24 = gpt(layers=24, hidden=5120, heads=40, vocab=51200, seq_len=2048, recompute="full")


@pytest.mark.parametrize("parallelism, recompute, reason", [
    (split(tp=3, dp=8), "full", "num_heads = 40 is not divisible by the tensor-parallel size"),
    (split(tp=5, dp=8), "full", "tp 5 does not divide the 8 GPUs of a node"),
    (split(pp=5, dp=6), "full", "num_layers = 24 is not divisible by pp·chunks = 5·1"),
    (split(pp=2, dp=7), "full", "but the world has 16"),
    (split(tp=2, dp=30, num_microbatches=16), "none", "GiB > 80 GiB"),
])
def test_rejection_names_the_reason(parallelism, recompute, reason):
    gpus = 16 if "world" in reason else parallelism.world_size
    assert reason in rejection_reason(replace(MODEL_24, recompute=recompute), parallelism, gpus)


def test_the_advisor_sweeps_recomputation_and_sequence_parallelism_as_config_variants():
    model = replace(MODEL_24, recompute="none")
    ranked = advise(model, 64, 16, recompute=("none", "selective", "full"),
                    sequence_parallel=(False, True))
    variants = {(p.config.recompute, p.config.sequence_parallel) for _, p in ranked}
    assert {("selective", True), ("full", False)} <= variants
    assert all(replace(p.config, recompute="none", sequence_parallel=False) == model
               for _, p in ranked)


# ---- context parallelism (2310.01889; megatron-core's CP) ----

LONG_7B = gpt(layers=32, hidden=4096, heads=32, vocab=32000, seq_len=32768, recompute="selective")
CPS = (1, 2, 4, 8)


def _fastest_by_cp(config, batch, gpus, hw=DGX_H100) -> dict[int, float]:
    best: dict[int, float] = {}
    for parallelism, pred in advise(config, batch, gpus, hw, cp=CPS):  # fastest first
        best.setdefault(parallelism.cp, pred.time.total)
    return best


def test_at_32k_tokens_the_advisor_proposes_context_parallelism():
    """A 7B model at 32,768 tokens on 64 H100s: cp = 1 fits only at tp = 8 with its [s, s]
    scores recomputed; splitting the tokens over a ring instead is faster (> 10 %). Under
    60 GiB cp = 1 fits nowhere, cp > 1 does."""
    best = _fastest_by_cp(LONG_7B, 64, 64)
    assert min(best, key=best.get) > 1 and min(best.values()) < best[1] / 1.1
    tight = replace(DGX_H100, memory_bytes=60 * GIB)
    assert advise(LONG_7B, 64, 64, tight) == []
    proposed = advise(LONG_7B, 64, 64, tight, cp=CPS)
    assert proposed and all(parallelism.cp > 1 and p.memory.total <= tight.memory_bytes
                            for parallelism, p in proposed)


def test_at_2048_tokens_context_parallelism_gains_little():
    """The same model at 2048 tokens, batch 512: every cp fits, and cp = 1 is fastest — the
    ring's launches and bytes buy nothing when one sequence's activations fit anyway."""
    best = _fastest_by_cp(replace(LONG_7B, seq_len=2048), 512, 64)
    assert set(best) == set(CPS) and best[1] == min(best.values())


def test_the_ring_shows_only_where_it_outlasts_the_attention_core():
    """tp = 8 × cp = 8 on 64 H100s: the ring crosses nodes (each rank 1/8 of a node's adapters).
    At 32k tokens the core hides it, at 2048 too (and over NVLink, tp = 1); on slower adapters
    it shows, and beyond the core it costs exactly its bytes: cp − 1 hops of the
    2·b·s·h/(t·cp) 16-bit K, V values forward, twice that backward, every layer and
    microbatch."""
    t, cp, b, m = 8, 8, 8, 2
    pipeline, short = PipelineConfig(microbatch=b, num_microbatches=m), replace(LONG_7B,
                                                                                seq_len=2048)
    ring = Parallelism(Layout(tp=t, cp=cp), pipeline)
    assert predict(LONG_7B, ring, DGX_H100).time.context_parallel == 0.0
    assert predict(short, Parallelism(Layout(dp=8, cp=cp), pipeline),
                   DGX_H100).time.context_parallel == 0.0
    pred = predict(short, ring, DGX_H100)
    parts = ("compute", "bubble", "tensor_parallel", "context_parallel", "pipeline_p2p",
             "data_parallel", "optimizer")
    assert pred.time.context_parallel == 0.0
    assert pred.time.total == pytest.approx(sum(getattr(pred.time, x) for x in parts))
    assert str(pred).startswith("tp=8 cp=8 pp=1 dp=1") and "cp=" not in str(
        predict(short, Parallelism(Layout(tp=t, dp=cp), pipeline), DGX_H100))
    bandwidths = (8e9, 4e9)   # a node's adapters; both slow enough to expose every pass
    slow = [predict(short, ring, replace(DGX_H100, inter_node_bandwidth=bw)).time
            for bw in bandwidths]
    block = 2 * b * 2048 * 4096 // (t * cp) * 2        # bytes of a rank's K, V block
    hops = 3 * (cp - 1) * short.num_layers * m         # forward + backward, every layer and mb
    per_rank = [bw / DGX_H100.gpus_per_node for bw in bandwidths]
    grown = hops * block * (1 / per_rank[1] - 1 / per_rank[0])
    assert 0 < slow[0].context_parallel
    assert slow[1].context_parallel - slow[0].context_parallel == pytest.approx(grown)


# ---- zero-bubble schedules (2401.10241) ----


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v"])
def test_a_split_backward_bubble_does_not_grow_beyond_2p_microbatches(name):
    """What the time model relies on to simulate only min(m, 2p) microbatches: beyond, a steady
    state adds one microbatch's work per microbatch and no idle time (unequal costs)."""
    p = 4
    idle = [max(simulate(make_schedule(name, p, m), 1.0, 1.4, weight_time=0.6).idle)
            for m in (2 * p, 3 * p, 5 * p + 1)]
    assert idle == pytest.approx([idle[0]] * 3)


def test_zero_bubble_schedules_shrink_the_bubble_and_hold_more():
    """2401.10241 Table 2: ZB-H1's bubble is (t_F + t_B − t_W)/(t_F + t_B + t_W) of 1F1B's;
    with t_F ≈ t_W and B carrying the recomputed forward (t_B ≈ 2t_F), a little over half."""
    model, gpus = GPT3, 96
    plain, h1, h2 = (predict(model, split(8, 12, schedule=name, num_microbatches=48))
                     for name in ("1f1b", "zb-h1", "zb-h2"))
    assert 0.5 < h1.time.bubble / plain.time.bubble < 2 / 3
    assert h2.time.bubble <= h1.time.bubble
    assert plain.memory.activations <= h1.memory.activations < h2.memory.activations
    assert plain.parallelism.world_size == gpus


def test_the_advisor_weighs_zero_bubble_schedules_too():
    model = shape(TABLE1[4])  # 39.1B on 512 GPUs, batch 1536
    ranked = advise(model, 1536, 512, tp=8, pp=2, schedules=("1f1b", "zb-h1"))
    assert ranked[0][0].schedule == "zb-h1"
    assert all(p.memory.total <= SELENE_A100.memory_bytes for _, p in ranked)


# ---- the takeaways ----


def test_takeaway_1_tensor_parallel_peaks_at_the_gpus_of_a_node():
    """2104.04473 §5.4.1, Fig. 13: 162B model, 64 GPUs, no data parallelism, (t, p) from
    (2, 32) to (32, 2): throughput peaks at t = 8 = GPUs per DGX A100."""
    m = gpt(layers=32, hidden=20480, heads=128, vocab=51200, seq_len=2048, recompute="full")
    for batch in (32, 128):
        by_tp = {t: predict(m, split(t, 64 // t, num_microbatches=batch)).tflops_per_gpu
                 for t in (2, 4, 8, 16, 32)}
        assert max(by_tp, key=by_tp.get) == 8


def test_takeaway_2_data_parallel_when_the_model_fits():
    """§5.4.2: with a model that fits on one GPU, the advisor uses data parallelism only."""
    row = TABLE1[0]
    best, _ = advise(shape(row), int(row["batch"]), int(row["gpus"]))[0]
    assert (best.tp, best.pp) == (1, 1)


GPT3 = gpt(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048, recompute="full")


def test_interleaving_pays_at_small_batch():
    """§5.3, Fig. 12: GPT-3 175B on 96 GPUs, (t, p) = (8, 12), microbatch 1."""
    assert interleaving_speedup(GPT3, 8, 12, 2, 12) > 1.15


def test_interleaving_gain_shrinks_as_the_batch_grows():
    assert interleaving_speedup(GPT3, 8, 12, 2, 12) > interleaving_speedup(GPT3, 8, 12, 2, 60) > 1


def test_scatter_gather_speeds_up_interleaving():
    """§5.7, Fig. 17: the p2p message split over the t adapters of a node, gathered on NVLink."""
    interleaved = split(8, 12, schedule="interleaved", chunks=2, num_microbatches=60)
    times = [predict(GPT3, interleaved, scatter_gather=sg).time.total for sg in (True, False)]
    assert times[0] < times[1]


MICROBATCHES = (1, 2, 4, 8)


def _gpt3_by_microbatch() -> list:
    """GPT-3 on t = 8, p = 12, B = 96: b·m = B, so the microbatch size sets m."""
    return [predict(GPT3, split(8, 12, microbatch=b, num_microbatches=96 // b))
            for b in MICROBATCHES]


def test_larger_microbatches_grow_the_bubble():
    """§3.4: with B fixed, b·m = B/dp, so the bubble (p-1)/m grows with b."""
    fractions = [p.time.bubble / p.time.total for p in _gpt3_by_microbatch()]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]


def test_larger_microbatches_grow_the_activation_memory():
    activations = [p.memory.activations for p in _gpt3_by_microbatch()]
    assert activations == sorted(activations) and activations[0] < activations[-1]


def test_larger_microbatches_raise_efficiency_outside_the_bubble():
    """Fewer, larger messages and kernels: time outside the bubble falls as b grows."""
    busy = [p.time.total - p.time.bubble for p in _gpt3_by_microbatch()]
    assert busy == sorted(busy, reverse=True) and busy[0] > busy[-1]


def test_without_a_pipeline_memory_caps_the_microbatch():
    """No bubble to pay: the advisor takes the largest microbatch that fits in memory."""
    m, batch, n = shape(TABLE1[0]), 4096, 32
    best, _ = advise(m, batch, n, tp=1, pp=1)[0]
    b = 2 * best.microbatch
    bigger = split(dp=n, microbatch=b, num_microbatches=batch // (n * b))
    assert "GiB >" in rejection_reason(m, bigger, n)


def test_1909_tensor_parallel_weak_scaling_efficiency_is_77_percent():
    """1909.08053 §5.1, Fig. 5: 1.2B on 1 V100 to 8.3B on 8 (DGX-2H), batch 8: 77% of linear."""
    one = predict(GPTConfig.preset("megatron-1.2b", recompute="full"), split(microbatch=8),
                  DGX2H_V100)
    eight = predict(GPTConfig.preset("megatron-8.3b", recompute="full"),
                    split(tp=8, microbatch=8), DGX2H_V100)
    assert eight.tflops_per_gpu / one.tflops_per_gpu == pytest.approx(0.77, abs=0.05)


# ---- the Llama block: SwiGLU, grouped-query attention, RMSNorm, rotary, untied output ----

LLAMA3_8B = LlamaConfig.preset("llama3-8b")   # l 32, h 4096, 32 heads, 8 kv heads, f 14336
LLAMA2_7B = LlamaConfig(vocab_size=32000, seq_len=4096, num_layers=32, hidden=4096,
                        num_heads=32, num_kv_heads=32, ffn_hidden=11008)  # 2307.09288 Table 1


@pytest.mark.parametrize("config, published, billions", [(LLAMA2_7B, 6_738_415_616, 6.74),
                                                         (LLAMA3_8B, 8_030_261_248, 8.03)],
                         ids=["llama-2-7b", "llama-3-8b"])
def test_llama_parameter_counts_are_the_published_ones(config, published, billions):
    """Hugging Face's counts of meta-llama/Llama-2-7b-hf and Meta-Llama-3-8B (6.74 B, 8.03 B):
    the model's exact count and the memory model's both give them."""
    assert config.num_parameters() == published
    assert parameters_per_rank(config, Parallelism()) == published
    assert round(published / 1e9, 2) == billions


def test_the_models_count_is_the_papers_for_gpt2():
    """GPT-2 small on its true vocabulary: 2104.04473 §5.1's P plus the final layer norm,
    Hugging Face's 124,439,808."""
    config = GPTConfig.preset("gpt2-small", make_vocab_size_divisible_by=1)
    assert config.num_parameters() == num_parameters(12, 768, 50257, 1024) + 2 * 768
    assert config.num_parameters() == 124_439_808


def test_llama3_8b_training_flops_by_hand():
    """Without recomputation: 6 FLOPs per token and matmul weight (2001.08361 §2.1) — every
    parameter but the input embedding (a lookup) and the norms' weights (elementwise) — plus
    the attention core's 12·B·s²·l·h, whatever the kv heads."""
    b, s, l, h, v = 2, 8192, 32, 4096, 128256
    matmul_weights = 8_030_261_248 - v * h - (2 * l + 1) * h
    assert matmul_weights == l * (h * (h + 2 * 1024) + h * h + 3 * h * 14336) + v * h
    expected = 6 * matmul_weights * b * s + 12 * b * s * s * l * h
    assert training_flops_of(LLAMA3_8B, b) == expected
    # recomputation: one more forward of the layers, 2·B·s per matmul weight + 4·B·s²·h
    forward = 2 * b * s * (matmul_weights - v * h) + 4 * b * s * s * l * h
    assert training_flops_of(LLAMA3_8B, b, "full") - training_flops_of(LLAMA3_8B, b) == forward


def test_grouped_query_attention_saves_the_kv_columns_flops():
    """8 kv heads instead of 32: 2·(h − k) fewer QKV columns, 6·B·s·l·h·2(h − k) FLOPs."""
    b, s, l, h, k = 1, 8192, 32, 4096, 1024
    multi_head = replace(LLAMA3_8B, num_kv_heads=32)
    saved = training_flops_of(multi_head, b) - training_flops_of(LLAMA3_8B, b)
    assert saved == 6 * b * s * l * h * 2 * (h - k)


@pytest.mark.parametrize("recompute", [False, "selective", True])
def test_the_gpt2_block_gives_the_papers_flops_from_its_config(recompute):
    config, b = GPTConfig.preset("gpt2-medium"), 8
    shape = (b, 1024, 24, 1024, 50257)
    assert training_flops_of(config, b, recompute) == training_flops(*shape, recompute)
    assert training_flops(*shape, recompute, ffn_hidden=4096, kv_hidden=1024) == \
        training_flops(*shape, recompute)
    s, l, h, v = shape[1:]
    if recompute is False:
        closed_form = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        assert training_flops_of(config, b) == pytest.approx(closed_form, rel=1e-12)


def test_the_predicted_flops_of_a_llama_are_its_formulas():
    parallelism = split(tp=8, microbatch=1, num_microbatches=4)
    for recompute in ("none", "selective", "full"):
        config = replace(LLAMA3_8B, recompute=recompute)
        pred = predict(config, parallelism, DGX_H100)
        expected = training_flops_of(config, 4, recompute, vocab=config.padded_vocab(8))
        assert pred.flops_per_iteration == pytest.approx(expected, rel=1e-12), recompute


@pytest.mark.parametrize("tp, pp", [(2, 1), (8, 2)])
def test_llama_shards_add_up_to_the_model_plus_replicated_norms(tp, pp):
    """Whatever the split, the tp ranks of all stages hold the model once, plus the RMSNorms'
    weights on every tp rank (no biases, no positions) and both tables' padding rows (128·tp:
    128,256 → 129,024 at tp = 8) — and no third table: the output layer is the last stage's
    own, not a copy of the word table."""
    config, h, l = LLAMA3_8B, 4096, 32
    held = sum(tp * parameters_per_rank(config, split(tp, pp), stage) for stage in range(pp))
    padding = 2 * (config.padded_vocab(tp) - config.vocab_size) * h
    assert held == 8_030_261_248 + (tp - 1) * (2 * l + 1) * h + padding


@pytest.mark.parametrize("t", [1, 2, 8, 16])
def test_llama_activations_per_layer_in_closed_form(t):
    """16-bit, no dropout: 8·sbh whole (two norms' inputs, QKV and MLP inputs), 8·sb(h + f)/t
    split (Q, K, V, the projection's input; SwiGLU's gate and up, silu(gate), their product) and
    the 2·a·s²·b/t softmax output; sequence parallelism splits the 8·sbh; selective
    recomputation drops the scores but keeps the core's inputs: the whole QKV output (V is a
    view of it, its g kv heads only: k = g·d columns each for K and V), the turned Q and the
    turned K (k columns); Llama-2-7B's one kv head per query head is k = h. Grouped-query
    attention keeps its QKV weight put together, (h + 2k)·h/t values; at t = 16 > g each rank
    holds one kv head, which counts as k = t·d."""
    s, b, h, f, a, k = 8192, 1, 4096, 14336, 32, max(8, t) * 128  # t = 16: 2 copies a kv head
    whole, split_ = 8 * s * b * h, 8 * s * b * (h + f) // t
    scores, weight = 2 * a * s * s * b // t, 2 * (h + 2 * k) * h // t
    assert activation_bytes_per_layer(LLAMA3_8B, b, tp=t) == whole + split_ + scores + weight
    sp = replace(LLAMA3_8B, sequence_parallel=True)
    assert activation_bytes_per_layer(sp, b, tp=t) == (whole + 8 * s * b * (h + f)) // t \
        + scores + weight
    selective = replace(LLAMA3_8B, recompute="selective")
    assert activation_bytes_per_layer(selective, b, tp=t) == whole + (6 * h + 6 * k + 8 * f) \
        * s * b // t + weight
    llama2 = replace(selective, num_kv_heads=32, ffn_hidden=11008, seq_len=s)
    assert activation_bytes_per_layer(llama2, b, tp=t) == whole + (12 * h + 8 * 11008) * s * b // t
    full = replace(LLAMA3_8B, recompute="full")
    assert activation_bytes_per_layer(full, b, tp=t) == 2 * s * b * h


LLAMA_SMALL = dict(vocab_size=128, seq_len=32, num_layers=2, hidden=64, num_heads=4,
                   ffn_hidden=160)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_a_llama_layer_saves_what_the_formula_says(kv_heads, recompute):
    """A real Llama block measured on this CPU (``perf.measure``, fp32) is the formula to the
    byte plus what it rounds away or what a GPU's fused kernels would not keep: PyTorch's
    composite RMSNorm keeps x/rms(x) beside its input (its CUDA kernel, ``_fused_rms_norm``,
    does not) and 1/rms per token, rotary positions their cos and sin [s, d], the eager core
    its [s, s] causal mask. Full recomputation keeps the layer's input alone."""
    from megatron_edu.perf.measure import layer_activation_bytes
    from megatron_edu.tensor_parallel.layers import serial_group

    config = LlamaConfig(**LLAMA_SMALL, num_kv_heads=kv_heads, recompute=recompute)
    b, s, h, d = 2, config.seq_len, config.hidden, config.head_dim
    measured = layer_activation_bytes(config, serial_group(), b)
    formula = activation_bytes_per_layer(config, b, bytes_per_value=4)
    cpu_rms_norm, statistics, cos_sin = 2 * s * b * h * 4, 2 * s * b * 4, 2 * s * d * 4
    causal_mask = s * s if recompute == "none" else 0
    extras = 0 if recompute == "full" else cpu_rms_norm + statistics + cos_sin + causal_mask
    assert measured == formula + extras


@pytest.mark.parametrize(("name", "kind"), [("llama3-8b", LlamaConfig),
                                            ("smollm-135m", LlamaConfig),
                                            ("gpt2-small", GPTConfig), ("bert-large", BertConfig)])
def test_the_advisor_reads_a_preset_name_as_the_model_it_names(name, kind):
    config = model_config(name)
    assert type(config) is kind and config == kind.preset(name)
    assert model_config(config) is config
    assert model_config(name, recompute="full").recompute == "full"


def test_the_advisor_fits_llama3_8b_on_8_h100s():
    """Llama-3-8B at 8192 tokens, batch 16, on one DGX H100: 8 B × 18 bytes of weights and
    optimizer fit no single GPU, so every proposal splits the model (tp·pp ≥ 2) by whole kv
    groups (tp | 8) and fits in 80 GiB; the name and the configuration get the same advice."""
    ranked = advise("llama3-8b", 16, 8, DGX_H100, recompute=("selective", "full"))
    assert ranked and ranked == advise(LLAMA3_8B, 16, 8, DGX_H100,
                                       recompute=("selective", "full"))
    for parallelism, pred in ranked:
        assert LLAMA3_8B.num_kv_heads % parallelism.tp == 0
        assert parallelism.tp * parallelism.pp >= 2
        assert pred.memory.total <= DGX_H100.memory_bytes
        assert isinstance(pred.config, LlamaConfig)
    best = ranked[0][1]
    assert 0.2 < best.percent_of_peak / 100 < 0.6   # an 8 B model on H100s: tens of percent
