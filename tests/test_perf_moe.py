"""The cost model of a mixture of experts and of expert parallelism, against hand arithmetic:
total and active parameters (the published Mixtral-8x7B and Qwen1.5-MoE-A2.7B figures), FLOPs of
the active weights, the parameters and activations a GPU holds at any ep, ZeRO over the
expert-data-parallel ranks, the all-to-alls' bytes and time, and the advisor choosing ep for
Mixtral-8x7B on 64 H100s. Pure arithmetic: no model is built."""

from dataclasses import replace

import pytest

from megatron_edu.comm import CommEvent, CommLog
from megatron_edu.grid import Layout
from megatron_edu.model import LlamaConfig
from megatron_edu.perf import (
    DGX_H100,
    MIXED,
    activation_bytes_per_layer,
    activation_bytes_per_rank,
    active_parameters,
    advise,
    all_to_all_bytes,
    candidates,
    expert_parallel_bytes,
    expert_parameters_per_rank,
    explain,
    memory_per_rank,
    parameters_per_rank,
    predict,
    rejection_reason,
    training_flops_of,
    wire_bytes_by_group,
)
from megatron_edu.pipeline.schedules import PipelineConfig
from megatron_edu.ptdp import Parallelism

MIXTRAL = LlamaConfig.preset("mixtral-8x7b")        # l 32, h 4096, 8 kv heads, 8 experts of 14336
QWEN = LlamaConfig.preset("qwen1.5-moe-a2.7b")      # l 24, h 2048, 60 of 1408, 4 a token, shared
LLAMA3_8B = LlamaConfig.preset("llama3-8b")


def split(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, *, zero: int = 0,
          **pipeline) -> Parallelism:
    return Parallelism(Layout(tp, pp, dp, cp, ep), PipelineConfig(**pipeline), zero)


# ---- parameters: total and active ----


def test_mixtral_has_46_7_billion_parameters_12_9_billion_active():
    """Per layer attention h·(h + 2k) + h² (k = 8 kv heads · 128), 8 experts of 3·h·f, the
    router 8·h, two RMSNorms; an input table and an output layer, the final norm. A token uses
    2 of the 8 experts and all the rest: Mistral AI's 46.7 B and 12.9 B."""
    l, h, k, f, v = 32, 4096, 1024, 14336, 32000
    dense = h * (h + 2 * k) + h * h + 8 * h + 2 * h
    total = l * (dense + 8 * 3 * h * f) + 2 * v * h + h
    active = l * (dense + 2 * 3 * h * f) + 2 * v * h + h
    assert MIXTRAL.num_parameters() == total == 46_702_792_704
    assert active_parameters(MIXTRAL) == active == 12_879_925_248
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (46.7, 12.9)
    assert parameters_per_rank(MIXTRAL, Parallelism()) == total


def test_qwen_moe_has_14_3_billion_parameters_2_7_billion_active():
    """Multi-head attention with q, k, v biases, 60 experts of 1408 units (4 a token), shared
    experts of 4·1408 units behind a sigmoid gate (h): Qwen's 14.3 B total and 2.7 B activated;
    its "2.0 B non-embedding" activated ones leave out both tables (2.07 B here)."""
    l, h, f, v = 24, 2048, 1408, 151936
    dense = 4 * h * h + 3 * h + 60 * h + 3 * h * 4 * f + h + 2 * h
    total = l * (dense + 60 * 3 * h * f) + 2 * v * h + h
    active = l * (dense + 4 * 3 * h * f) + 2 * v * h + h
    assert QWEN.num_parameters() == total == 14_315_784_192
    assert active_parameters(QWEN) == active == 2_689_173_504
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == (14.3, 2.7)
    assert 2.0 < (active - 2 * v * h) / 1e9 < 2.1


def test_a_dense_models_parameters_are_all_active():
    assert active_parameters(LLAMA3_8B) == LLAMA3_8B.num_parameters() == 8_030_261_248


@pytest.mark.parametrize("tp, pp, dp, ep", [(1, 1, 8, 8), (2, 4, 8, 4), (8, 2, 4, 2)])
def test_a_gpu_holds_e_over_ep_experts_of_its_layers(tp, pp, dp, ep):
    """The model's own count at ep (``GPTConfig.num_parameters``), stage by stage; the experts
    of all tp·ep·pp positions are the model's 32·8 experts once."""
    parallelism, layers = split(tp, pp, dp, ep=ep), 32 // pp
    for stage in range(pp):
        assert parameters_per_rank(MIXTRAL, parallelism, stage) == MIXTRAL.num_parameters(
            tp, layers, first=stage == 0, last=stage == pp - 1, ep=ep)
    held = expert_parameters_per_rank(MIXTRAL, parallelism)
    assert tp * ep * pp * held == 32 * 8 * 3 * 4096 * 14336
    assert expert_parameters_per_rank(LLAMA3_8B, split(tp, pp, dp)) == 0


# ---- FLOPs: the active weights ----


@pytest.mark.parametrize("config", [MIXTRAL, QWEN], ids=["mixtral", "qwen"])
def test_an_moe_step_costs_6_flops_per_token_and_active_matmul_weight(config):
    """2001.08361's 6 per token and weight, over the weights a token uses: every active
    parameter but the input table (a lookup), the norms, the biases and the shared experts'
    gate (elementwise) — the router's E·h included, 2·h·E FLOPs a token forward — plus the
    attention core's 12·B·s²·l·h. MFU's numerator for an MoE run."""
    b, s, l, h, v = 1, 4096, config.num_layers, config.hidden, config.vocab_size
    config = replace(config, seq_len=s)
    biases = 3 * h * config.qkv_bias + h * config.moe_shared_gate
    matmul = active_parameters(config) - v * h - (2 * l + 1) * h - l * biases
    assert training_flops_of(config, b) == 6 * b * s * matmul + 12 * b * s * s * l * h


def test_k_experts_cost_an_mlp_of_k_times_their_width_plus_the_router():
    """Mixtral's 2 experts of 14336 against Llama's block with one SwiGLU of 28672: the same
    FLOPs but the router's, 3 passes × 2·h·E per token and layer."""
    b, s, l, h = 2, 4096, 32, 4096
    moe = replace(MIXTRAL, seq_len=s)
    dense = replace(moe, moe_experts=0, ffn_hidden=2 * 14336)
    for recompute, passes in (("none", 3), ("full", 4)):
        extra = training_flops_of(moe, b, recompute) - training_flops_of(dense, b, recompute)
        assert extra == passes * 2 * b * s * h * 8 * l


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (4, False)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_predicted_flops_of_an_moe_are_its_formula(tp, sp, recompute):
    """The performance model executes the active FLOPs (its throughput, percent of peak and
    MFU are of those), whatever ep; without sequence parallelism every tp rank scores all its
    tokens, the router's FLOPs t times (its passes × 2·B·s·h·E a layer)."""
    config = replace(QWEN, seq_len=4096, recompute=recompute, sequence_parallel=sp)
    expected = training_flops_of(config, 32, recompute, vocab=config.padded_vocab(tp))
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]
    replicated = 0 if sp else (tp - 1) * passes * 2 * 32 * 4096 * 2048 * 60 * 24
    for ep in (1, 4):
        parallelism = split(tp, 2, 4, ep=ep, microbatch=2, num_microbatches=4)
        predicted = predict(config, parallelism, DGX_H100).flops_per_iteration
        assert predicted == pytest.approx(expected + replicated, rel=1e-12)


# ---- memory: activations, and ZeRO over the expert-data-parallel ranks ----


@pytest.mark.parametrize("t", [1, 2, 8])
def test_mixtral_activations_per_layer_in_closed_form(t):
    """Llama's block with the MLP's 2·sbh input and 8·sbf/t SwiGLU replaced by the router's fp32
    input (4·sbh) and scores and logits (8·sbE), the k·sb rows dispatched and returned (2·k·sbh
    each, whole on every tp rank) and the experts' SwiGLU over them (8·k·sb·f_e/t). Sequence
    parallelism splits the replicated terms but the rows; full recomputation keeps the input."""
    s, b, h, f, a, e, k = 4096, 1, 4096, 14336, 32, 8, 2
    kv = max(8, t) * 128
    config = replace(MIXTRAL, seq_len=s)
    replicated, rows = s * b * (10 * h + 8 * e), 4 * k * s * b * h
    split_ = (8 * h + 8 * k * f) * s * b // t + 2 * a * s * s * b // t + 2 * (h + 2 * kv) * h // t
    assert activation_bytes_per_layer(config, b, tp=t) == replicated + rows + split_
    sp = replace(config, sequence_parallel=True)
    assert activation_bytes_per_layer(sp, b, tp=t) == replicated // t + rows + split_
    full = replace(config, recompute="full")
    assert activation_bytes_per_layer(full, b, tp=t) == 2 * s * b * h


def test_shared_experts_keep_an_mlps_activations_and_their_gates_output():
    """Qwen's 4 shared experts of 1408 units: the MLP's input (2·sbh) and SwiGLU
    (8·sb·f_e·n/t), and their gate's input, the shared output (2·sbh), beside the routed rows."""
    s, b, h, f, a, e, k, t = 4096, 2, 2048, 1408, 16, 60, 4, 2
    config = replace(QWEN, seq_len=s)
    routed = s * b * (10 * h + 8 * e) + 4 * k * s * b * h + 8 * k * s * b * f // t
    attention = 8 * s * b * h // t + 2 * a * s * s * b // t
    shared = 4 * s * b * h + 8 * s * b * f * 4 // t
    assert activation_bytes_per_layer(config, b, tp=t) == routed + attention + shared


def test_expert_parallelism_moves_the_rows_but_keeps_their_count():
    """Routing uniform: as many rows arrive at a rank as leave it, whatever ep."""
    config = replace(MIXTRAL, seq_len=4096)
    held = {activation_bytes_per_rank(config, split(2, 4, 8, ep=ep, num_microbatches=8))
            for ep in (1, 2, 4, 8)}
    assert len(held) == 1


def test_zero_shards_the_experts_over_the_ranks_that_hold_them():
    """tp = 1, pp = 4, dp = 16, ep = 4: a GPU's 8 layers hold 2 of the 8 experts each; ZeRO-1
    shards their master weights and Adam moments (12 bytes) over the dp/ep = 4 ranks that hold
    the same experts, everything else's over the 16 data-parallel ranks; 16-bit weights and
    gradients stay whole."""
    experts = 8 * 2 * 3 * 4096 * 14336
    for stage in (0, 3):
        parallelism = split(1, 4, 16, ep=4, zero=1)
        dense = parameters_per_rank(MIXTRAL, parallelism, stage) - experts
        zero1 = memory_per_rank(MIXTRAL, parallelism, precision=MIXED, stage=stage)
        assert zero1.optimizer == -(-dense * 12 // 16) + experts * 12 // 4
        assert zero1.weights == zero1.grads == 2 * (dense + experts)
        plain = memory_per_rank(MIXTRAL, replace(parallelism, zero=0), precision=MIXED,
                                stage=stage)
        assert plain.optimizer == 12 * (dense + experts)


# ---- traffic: the all-to-alls ----


@pytest.mark.parametrize("tp, pp, dp, cp, ep", [(1, 1, 8, 1, 8), (2, 4, 8, 1, 4),
                                                (2, 2, 4, 2, 8)])
@pytest.mark.parametrize("recompute, passes", [("selective", 4), ("full", 6)])
def test_a_steps_all_to_alls_send_n_l_b_s_k_h_t_ep_minus_1_over_ep_values(tp, pp, dp, cp, ep,
                                                                           recompute, passes):
    """Dispatch and combine, forward and backward (and the forward again under full
    recomputation), each rank its tokens' k rows, (ep − 1)/ep of them away; over all ranks
    n·l·B·s·k·h·t·(ep − 1)/ep 16-bit values a step, at any cp and pp."""
    config = replace(MIXTRAL, seq_len=4096, recompute=recompute)
    parallelism = split(tp, pp, dp, cp, ep, microbatch=2, num_microbatches=4)
    l, batch, s, k, h = 32, dp * 8, 4096, 2, 4096
    assert expert_parallel_bytes(config, parallelism) == \
        passes * l * batch * s * k * h * tp * 2 * (ep - 1) // ep
    assert all_to_all_bytes(config, 2, cp, ep) == 2 * s // cp * k * h * 2 * (ep - 1) / ep
    assert expert_parallel_bytes(config, replace(parallelism, layout=Layout(tp, pp, dp, cp))) == 0
    assert expert_parallel_bytes(LLAMA3_8B, split(tp, pp, dp, cp)) == 0


def test_the_logs_experts_traffic_has_a_purpose_of_its_own():
    """The ep group's all-to-alls (wire bytes: their whole buffers), the experts' gradients
    over the expert-data-parallel group among the gradients, the routing statistics among the
    scalars; a log without expert parallelism keeps the five purposes alone."""
    logs = [CommLog([CommEvent("all_to_all", "ep", 4, 1000, "dispatch forward"),
                     CommEvent("all_to_all", "ep", 4, 32, "expert counts"),
                     CommEvent("all_reduce", "edp", 2, 100, "dp grads"),
                     CommEvent("all_reduce", "dp", 4, 80, "dp grads"),
                     CommEvent("all_reduce", "tp_cp", 2, 64, "moe counts"),
                     CommEvent("all_reduce", "dp", 2, 4, "moe stats")])]
    assert wire_bytes_by_group(logs) == {"tp": 0, "pp": 0, "dp": 220, "embedding": 0,
                                         "scalars": 68, "ep": 1032}
    assert "ep" not in wire_bytes_by_group([CommLog(logs[0].events[3:4])])


def test_an_all_to_all_within_a_node_runs_at_nvlink_and_across_nodes_at_its_adapters():
    """tp = 2: ep = 4 spans 8 GPUs, one node; ep = 8 spans two, and 4/7 of each rank's rows
    cross at 1/8 of the node's adapters (50 GB/s a GPU where NVLink gives 450)."""
    config = replace(MIXTRAL, seq_len=4096, attention="fused", recompute="selective")
    m, layers = 4, 16
    times = {}
    for ep in (4, 8):
        parallelism = split(2, 2, 16, ep=ep, microbatch=1, num_microbatches=m)
        times[ep] = predict(config, parallelism, DGX_H100).time.expert_parallel
    sent = all_to_all_bytes(config, 1, 1, 4)
    one = 3 * DGX_H100.latency + sent / DGX_H100.intra_node_bandwidth
    assert times[4] == pytest.approx(m * layers * 4 * one, rel=1e-12)
    sent = all_to_all_bytes(config, 1, 1, 8)
    one = 7 * DGX_H100.latency + sent * 4 / 7 * 8 / DGX_H100.inter_node_bandwidth
    assert times[8] == pytest.approx(m * layers * 4 * one, rel=1e-12)


# ---- the advisor ----


def test_the_advisor_searches_ep_for_mixtures_of_experts_only():
    """Every ep dividing dp·cp and E for Mixtral; ep = 1 alone for a dense model."""
    moe = {(p.dp, p.ep) for _, p in candidates(MIXTRAL, 32, 16, DGX_H100)}
    assert {(16, 1), (16, 2), (16, 4), (16, 8), (2, 2), (4, 4), (8, 8), (1, 1)} <= moe
    assert all(dp % ep == 0 and 8 % ep == 0 for dp, ep in moe)
    assert {p.ep for _, p in candidates(LLAMA3_8B, 32, 16, DGX_H100)} == {1}


def test_the_advisor_splits_mixtrals_experts_over_a_node():
    """Mixtral-8x7B at 4096 tokens, 512 sequences a step (2 M tokens), on 64 H100s (8 DGX
    nodes), with flash attention, selective recomputation and the distributed optimizer: the
    advisor splits the experts (ep > 1) within a node (ep·tp ≤ 8: the all-to-alls ride NVLink),
    because the same layout at ep = 1 does not fit in 80 GiB; its explanation says so."""
    config = replace(MIXTRAL, seq_len=4096, attention="fused", recompute="selective")
    ranked = advise(config, 512, 64, DGX_H100, zero=1)
    best, prediction = ranked[0]
    assert best.ep > 1 and best.ep * best.tp <= DGX_H100.gpus_per_node
    assert prediction.memory.total <= DGX_H100.memory_bytes
    alone = replace(best, layout=replace(best.layout, ep=1))
    assert "GiB > 80 GiB" in rejection_reason(config, alone, 64, DGX_H100)
    assert f"ep={best.ep}" in str(prediction)
    words = explain(ranked, DGX_H100)
    assert f"Experts split over ep = {best.ep}" in words
    assert "more than the GPU has" in words and "stay inside a node" in words
    dense = next(p for split_, p in ranked if split_.ep == 1)
    assert dense.time.total > prediction.time.total and "slower" in words


def test_the_advisor_tries_the_ep_it_is_given_and_says_when_the_experts_stay_whole():
    """``ep`` pins the sizes searched; a layout of ep = 1 keeps every expert on every GPU."""
    assert {p.ep for p, _ in advise("llama-moe-tiny", 16, 8, DGX_H100, ep=(2, 4))} == {2, 4}
    ranked = advise("llama-moe-tiny", 16, 8, DGX_H100, ep=(1,))
    assert "Experts not split: each GPU holds all 8 experts" in explain(ranked, DGX_H100)


def test_a_dense_models_explanation_has_no_experts():
    ranked = advise(replace(LLAMA3_8B, seq_len=2048), 16, 8, DGX_H100)
    words = explain(ranked, DGX_H100)
    assert words.startswith(f"Proposed: {ranked[0][1]}.") and "Experts" not in words
    assert explain([], DGX_H100) == "No layout fits."
