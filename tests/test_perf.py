"""The cost model against hand arithmetic, a real PyTorch model, and the papers' measurements.

- formulas: 2104.04473 §5.1 (parameters, FLOPs, training time) and Table 1;
- memory: weights, gradients, Adam states and saved activations (2205.05198 §4) of a plain
  PyTorch GPT, counted byte for byte;
- advisor: Table 1's per-GPU throughput, the divisibility and memory rules, and the takeaways of
  2104.04473 §3 and §5.4-5.8 (and 1909.08053's weak scaling, §5.1).
"""

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_edu.model import GPTConfig
from megatron_edu.perf import (
    A100_BF16_PEAK,
    DGX2H_V100,
    FP32,
    MIXED,
    MIXED_FP32_GRADS,
    SELENE_A100,
    Layout,
    ModelShape,
    activation_bytes_per_layer,
    advise,
    datasheet_bf16_peak,
    datasheet_peak_flops,
    forwards_in_flight,
    memory_per_rank,
    model_flops_utilization,
    num_parameters,
    output_layer_activation_bytes,
    parameters_per_rank,
    predict,
    rejection_reason,
    training_flops,
    training_time_seconds,
)

PAPERS = Path(__file__).resolve().parents[1] / "docs" / "papers"
DAY = 86400


def table1() -> list[dict]:
    """2104.04473 Table 1, one dict per row (vocabulary 51,200, sequence 2048)."""
    lines = (PAPERS / "2104.04473_table1.csv").read_text().splitlines()
    header = next(x for x in lines if x.startswith("# params_billion")).lstrip("# ").split(",")
    rows = csv.DictReader([x for x in lines if not x.startswith("#")], fieldnames=header)
    return [{k: float(v) for k, v in row.items()} for row in rows]


TABLE1 = table1()
ROW_IDS = [f"{r['params_billion']:g}B" for r in TABLE1]


def shape(row: dict) -> ModelShape:
    return ModelShape(int(row["layers"]), int(row["hidden"]), int(row["heads"]), 51200, 2048)


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
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA H100 80GB HBM3", 989),      # the SXM part: its name gives no form factor
    ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-32GB", None),      # no bf16 tensor cores
])
def test_datasheet_bf16_peak_by_the_name_cuda_reports(name, tflops):
    peak = datasheet_bf16_peak(name)
    assert (None if peak is None else peak / 1e12) == tflops


def test_a_cpu_has_no_datasheet_peak():
    assert datasheet_peak_flops("cpu") is None
    assert datasheet_peak_flops(torch.device("cpu")) is None


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
    def __init__(self, m: ModelShape, dropout: float = 0.0, recompute: str = "none") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(m.vocab, m.hidden), nn.Embedding(m.seq_len, m.hidden)
        self.blocks = nn.ModuleList(
            Block(m.hidden, m.heads, dropout, recompute) for _ in range(m.layers)
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


TINY = ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq_len=32)
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
    assert sum(p.numel() for p in model.parameters()) == parameters_per_rank(TINY)


def test_parameters_per_rank_is_the_papers_count_plus_the_final_layer_norm():
    l, h, v, s = TINY.layers, TINY.hidden, TINY.vocab, TINY.seq_len
    assert parameters_per_rank(TINY) == num_parameters(l, h, v, s) + 2 * h


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameters_per_rank_agree_with_gpt_config(tp):
    config = GPTConfig.preset("gpt2-medium")
    assert parameters_per_rank(ModelShape.from_config(config, tp), tp) == (
        config.num_parameters(tp)
    )


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 4), (4, 2)])
def test_shards_add_up_to_the_model_plus_replicas(tp, pp):
    m, h = ModelShape(8, 64, 8, 256, 32), 64
    held = sum(tp * parameters_per_rank(m, tp, pp, stage) for stage in range(pp))
    replicated = m.layers * 6 * h + m.seq_len * h + 2 * h  # layer norms, row biases, positions
    tied_copy = m.vocab * h if pp > 1 else 0  # the last stage's output-layer copy
    assert held == parameters_per_rank(m) + (tp - 1) * replicated + tied_copy


def test_weights_grads_and_adam_bytes_equal_the_real_model():
    torch.manual_seed(0)
    model = PlainGPT(TINY)
    adam = torch.optim.Adam(model.parameters())
    ids = torch.randint(TINY.vocab, (B, TINY.seq_len))
    x = model.wte(ids) + model.wpe.weight
    model.head_loss(model.body(x), ids).backward()
    adam.step()
    measured = (
        sum(p.nbytes for p in model.parameters()),
        sum(p.grad.nbytes for p in model.parameters()),
        # exp_avg and exp_avg_sq; Adam's one-element `step` counter per tensor is left out
        sum(s[k].nbytes for s in adam.state.values() for k in ("exp_avg", "exp_avg_sq")),
    )
    est = memory_per_rank(TINY, Layout(recompute="none"), B, precision=FP32)
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
    per_layer = activation_bytes_per_layer(
        TINY, B, recompute=recompute, bytes_per_value=4, dropout=dropout > 0
    )
    assert saved_bytes(model, model.body, x) == TINY.layers * (per_layer + layer_norm_stats)


def test_output_layer_activations_equal_korthikanti_plus_targets():
    """Final layer-norm input, output-layer input, fp32 log-softmax: the paper's three; PyTorch
    also keeps the layer norm's statistics (8 bytes/token), the int64 targets (8 bytes/token)
    and the loss's 4-byte total weight."""
    model = PlainGPT(TINY)
    x = torch.randn(B, TINY.seq_len, TINY.hidden, requires_grad=True)
    labels = torch.randint(TINY.vocab, (B, TINY.seq_len))
    extras = 8 * B * TINY.seq_len + 8 * B * TINY.seq_len + 4
    expected = output_layer_activation_bytes(TINY, B, bytes_per_value=4) + extras
    assert saved_bytes(model, model.head_loss, x, labels) == expected


# ---- memory: the paper's closed forms (16-bit values, 1-byte masks) ----

GPT_22B = ModelShape(layers=48, hidden=6144, heads=64, vocab=51200, seq_len=2048)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel_activations_are_10_plus_24_over_t(t):
    s, b, h, a = 2048, 1, 6144, 64
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # 2205.05198 eq. 2
    assert activation_bytes_per_layer(GPT_22B, b, tp=t) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_sequence_parallel_divides_all_34_by_t(t):
    s, b, h, a = 2048, 1, 6144, 64
    expected = s * b * h / t * (34 + 5 * a * s / h)  # 2205.05198 eq. 3
    got = activation_bytes_per_layer(GPT_22B, b, tp=t, sequence_parallel=True)
    assert got == pytest.approx(expected, rel=1e-12)


def test_selective_recompute_drops_the_attention_term():
    s, b, h = 2048, 1, 6144
    got = activation_bytes_per_layer(GPT_22B, b, tp=8, sequence_parallel=True,
                                     recompute="selective")
    assert got == 34 * s * b * h // 8  # 2205.05198 eq. 4


def test_full_recompute_keeps_2sbh():
    assert activation_bytes_per_layer(GPT_22B, 1, tp=8, recompute="full") == 2 * 2048 * 6144


@pytest.mark.parametrize("precision, per_param", [(FP32, 16), (MIXED, 16), (MIXED_FP32_GRADS, 18)])
def test_bytes_per_parameter(precision, per_param):
    total = precision.weights + precision.grads + precision.master + precision.adam
    assert total == per_param


def test_zero1_shards_the_optimizer_over_dp():
    layout = Layout(tp=2, pp=2, dp=4)
    plain = memory_per_rank(GPT_22B, layout, 64)
    sharded = memory_per_rank(GPT_22B, layout, 64, zero1=True)
    assert sharded.optimizer == math.ceil(plain.optimizer / 4)


# ---- memory: microbatches in flight (2104.04473 §2.2) ----


def test_gpipe_holds_every_microbatch():
    assert forwards_in_flight("gpipe", 4, 16) == [16]


def test_1f1b_first_stage_holds_p_and_last_holds_one():
    held = [forwards_in_flight("1f1b", 4, 16, stage) for stage in range(4)]
    assert held == [[4], [3], [2], [1]]


def test_interleaved_first_stage_holds_p_plus_p_minus_1_over_v_stages():
    p, m, v = 4, 16, 2
    held = forwards_in_flight("interleaved", p, m, 0, v)
    assert sum(held) / v == p + (p - 1) / v


TINY_DEEP = ModelShape(layers=8, hidden=64, heads=4, vocab=128, seq_len=32)


def test_activation_memory_grows_with_the_schedules_in_flight_count():
    layouts = [Layout(pp=4, schedule=s, recompute="none") for s in ("1f1b", "gpipe")]
    one_f_one_b, gpipe = (memory_per_rank(TINY_DEEP, x, 16).activations for x in layouts)
    assert gpipe > 3 * one_f_one_b  # GPipe keeps m = 16 microbatches, 1F1B keeps p = 4


# ---- the performance model and the advisor on Selene (2104.04473 §5.1, Table 1) ----


@pytest.mark.parametrize("recompute, with_recompute", [("full", True), ("none", False)])
def test_predicted_flops_are_the_papers_formula(recompute, with_recompute):
    row = TABLE1[4]
    layout = Layout(8, 2, 32, 1, recompute=recompute)
    pred = predict(shape(row), layout, int(row["batch"]))
    expected = training_flops(int(row["batch"]), 2048, int(row["layers"]), int(row["hidden"]),
                              51200, recompute=with_recompute)
    assert pred.flops_per_iteration == pytest.approx(expected, rel=1e-12)


def test_throughput_is_flops_over_gpus_and_iteration_time():
    pred = predict(shape(TABLE1[5]), Layout(8, 4, 32, 2, "interleaved", 5), 1792)
    assert pred.time.total == pytest.approx(pred.flops_per_iteration
                                            / (1024 * pred.tflops_per_gpu * 1e12))


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
    for layout, pred in advise(m, batch, n):
        microbatches = layout.num_microbatches(batch)
        assert layout.gpus == n
        assert m.heads % layout.tp == 0 and SELENE_A100.gpus_per_node % layout.tp == 0
        assert m.layers % (layout.pp * layout.chunks) == 0
        assert batch % (layout.dp * layout.microbatch) == 0
        assert layout.schedule != "interleaved" or microbatches % layout.pp == 0
        assert pred.memory.total <= SELENE_A100.memory_bytes


@pytest.mark.parametrize("layout, reason", [
    (Layout(dp=0), "sizes must be positive"),
    (Layout(tp=3, dp=8), "tp 3 does not divide heads 40"),
    (Layout(tp=5, dp=8), "tp 5 does not divide the 8 GPUs of a node"),
    (Layout(pp=5, dp=6), "pp·v = 5·1 does not divide 24 layers"),
    (Layout(pp=2, dp=7), "dp·b = 7·1 does not divide B"),
    (Layout(pp=2, dp=15, chunks=2), "chunks v > 1 iff interleaved"),
    (Layout(pp=2, dp=15, microbatch=32, schedule="interleaved", chunks=2), "m=1 % p=2"),
    (Layout(tp=2, dp=30, recompute="none"), "GiB > 80 GiB"),
])
def test_rejection_names_the_reason(layout, reason):
    m = ModelShape(layers=24, hidden=5120, heads=40, vocab=51200, seq_len=2048)
    assert reason in rejection_reason(m, layout, 480, layout.gpus)


# ---- the takeaways ----


def test_takeaway_1_tensor_parallel_peaks_at_the_gpus_of_a_node():
    """2104.04473 §5.4.1, Fig. 13: 162B model, 64 GPUs, no data parallelism, (t, p) from
    (2, 32) to (32, 2): throughput peaks at t = 8 = GPUs per DGX A100."""
    m = ModelShape(layers=32, hidden=20480, heads=128, vocab=51200, seq_len=2048)
    for batch in (32, 128):
        by_tp = {t: predict(m, Layout(t, 64 // t), batch).tflops_per_gpu for t in (2, 4, 8, 16, 32)}
        assert max(by_tp, key=by_tp.get) == 8


def test_takeaway_2_data_parallel_when_the_model_fits():
    """§5.4.2: with a model that fits on one GPU, the advisor uses data parallelism only."""
    row = TABLE1[0]
    layout, _ = advise(shape(row), int(row["batch"]), int(row["gpus"]))[0]
    assert (layout.tp, layout.pp) == (1, 1)


GPT3 = ModelShape(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)


def interleaving_speedup(batch: int) -> float:
    """§5.3, Fig. 12: GPT-3 175B on 96 GPUs, (t, p) = (8, 12), microbatch 1."""
    plain = predict(GPT3, Layout(8, 12, 1, 1, "1f1b"), batch)
    interleaved = predict(GPT3, Layout(8, 12, 1, 1, "interleaved", 2), batch)
    return plain.time.total / interleaved.time.total


def test_interleaving_pays_at_small_batch():
    assert interleaving_speedup(12) > 1.15


def test_interleaving_gain_shrinks_as_the_batch_grows():
    assert interleaving_speedup(12) > interleaving_speedup(60) > 1


def test_scatter_gather_speeds_up_interleaving():
    """§5.7, Fig. 17: the p2p message split over the t adapters of a node, gathered on NVLink."""
    layout = Layout(8, 12, 1, 1, "interleaved", 2)
    times = [predict(GPT3, layout, 60, scatter_gather=sg).time.total for sg in (True, False)]
    assert times[0] < times[1]


MICROBATCHES = (1, 2, 4, 8)


def test_larger_microbatches_grow_the_bubble():
    """§3.4: with B fixed, b·m = B/dp, so the bubble (p-1)/m grows with b."""
    preds = [predict(GPT3, Layout(8, 12, 1, b), 96) for b in MICROBATCHES]
    fractions = [p.time.bubble / p.time.total for p in preds]
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]


def test_larger_microbatches_grow_the_activation_memory():
    preds = [predict(GPT3, Layout(8, 12, 1, b), 96) for b in MICROBATCHES]
    activations = [p.memory.activations for p in preds]
    assert activations == sorted(activations) and activations[0] < activations[-1]


def test_larger_microbatches_raise_efficiency_outside_the_bubble():
    """Fewer, larger messages and kernels: time outside the bubble falls as b grows."""
    preds = [predict(GPT3, Layout(8, 12, 1, b), 96) for b in MICROBATCHES]
    busy = [p.time.total - p.time.bubble for p in preds]
    assert busy == sorted(busy, reverse=True) and busy[0] > busy[-1]


def test_without_a_pipeline_memory_caps_the_microbatch():
    """No bubble to pay: the advisor takes the largest microbatch that fits in memory."""
    m, batch, n = shape(TABLE1[0]), 4096, 32
    layout, _ = advise(m, batch, n, tp=1, pp=1)[0]
    bigger = Layout(1, 1, n, 2 * layout.microbatch)
    assert "GiB >" in rejection_reason(m, bigger, batch, n)


def test_1909_tensor_parallel_weak_scaling_efficiency_is_77_percent():
    """1909.08053 §5.1, Fig. 5: 1.2B on 1 V100 to 8.3B on 8 (DGX-2H), batch 8: 77% of linear."""
    one = predict(ModelShape(40, 1536, 16, 51200, 1024), Layout(1, 1, 1, 8), 8, DGX2H_V100)
    eight = predict(ModelShape(72, 3072, 32, 51200, 1024), Layout(8, 1, 1, 8), 8, DGX2H_V100)
    assert eight.tflops_per_gpu / one.tflops_per_gpu == pytest.approx(0.77, abs=0.05)
