"""Mixture of experts and expert parallelism (model/moe.py, expert_parallel.py): the router and its
balance losses against hand-written references, the grouped GEMM against a loop over experts,
the dispatch's round trip, the layer at every ep against serial (outputs, routing and every
gradient, each expert's by its global id), the expert gradients' reduction group, and every
factorisation of 8 ranks with expert parallelism taking the serial optimizer steps."""

import dataclasses
import itertools
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import Launches
from test_ptdp import GLOBAL_BATCH, LR, _batches, _check_equal_to_serial, _ptdp, _serial, _split

from megatron_edu import comm
from megatron_edu.data_parallel import DataParallel
from megatron_edu.expert_parallel import Dispatch, ExpertDispatcher, dispatch_bytes, gather_experts
from megatron_edu.grid import Layout, ParallelGrid, all_layouts
from megatron_edu.model import LlamaConfig
from megatron_edu.model.moe import (
    ExpertGroups,
    MoE,
    aux_loss_scale,
    group_limited,
    grouped_mm,
    keep_within_capacity,
)
from megatron_edu.model.transformer import Block
from megatron_edu.ptdp import PTDP
from megatron_edu.tensor_parallel.init import gather_full, init_parameters
from megatron_edu.tensor_parallel.layers import serial_group
from megatron_edu.tensor_parallel.sequence_parallel import STYLES

# 8 experts, 2 a token, a shared expert behind a sigmoid gate, both balance losses: the model of
# the end-to-end runs (8 layers: pp = 8 holds one each; moe_ffn_hidden / 8 = 8 at tp = 8).
MOE = LlamaConfig(vocab_size=100, seq_len=8, num_layers=8, hidden=64, num_heads=8,
                  num_kv_heads=2, ffn_hidden=96, moe_experts=8, moe_topk=2, moe_ffn_hidden=64,
                  moe_shared_experts=1, moe_shared_gate=True, moe_aux_loss=0.01,
                  moe_z_loss=1e-3, dropout=0.1)
LAYER = dataclasses.replace(MOE, num_layers=1, dropout=0.0)


# --- units -----------------------------------------------------------------------------------

def test_grouped_mm_equals_a_loop_over_experts_with_an_empty_one_and_any_gradient():
    """int32 offsets from counts, an expert with no rows, and ``y.sum().backward()``, whose
    stride-0 gradient F.grouped_mm's own backward refuses."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16, generator=gen, requires_grad=True)
    w = torch.randn(3, 24, 16, generator=gen, requires_grad=True)    # [E, out, in]
    y = grouped_mm(x, w, rows)
    loop = torch.cat([part @ w[e].T for e, part in enumerate(x.split(rows.tolist()))])
    torch.testing.assert_close(y, loop)
    y.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    loop.sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    assert gw[1].abs().max() == 0                                      # no rows, no gradient


def test_a_layout_the_grouped_gemm_cannot_take_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"moe_ffn_hidden / tp = 64 / 16 must be multiples of 8"):
        dataclasses.replace(LAYER, num_heads=16, num_kv_heads=16).validate(tp=16)
    with pytest.raises(ValueError, match="ep = 3.*moe_experts = 8 is not divisible"):
        LAYER.validate(ep=3)
    with pytest.raises(ValueError, match=r"ep = 4 must divide dp·cp = 2·1 = 2"):
        Layout(dp=2, ep=4)


def _router_inputs(seed=0, b=2, s=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, LAYER.hidden, generator=gen)


def _router(config=LAYER):
    block = Block(config, serial_group())
    init_parameters(block, config.seed, serial_group())
    return block.mlp.router


@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "softmax-raw"])
def test_the_router_picks_the_top_k_and_weighs_them_as_mixtral_and_deepseek(kind):
    config = dataclasses.replace(LAYER, moe_router=kind.split("-")[0],
                                 moe_norm_topk=kind != "softmax-raw")
    router, x = _router(config), _router_inputs()
    ids, weights = router(x)
    logits = x @ router.weight.T
    scores = logits.softmax(-1) if config.moe_router == "softmax" else logits.sigmoid()
    top = scores.topk(2, dim=-1)
    expected = top.values / top.values.sum(-1, keepdim=True) if config.moe_norm_topk \
        else top.values
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(weights, expected)


def test_the_balance_loss_is_switch_s_and_1_under_uniform_routing():
    """Per sequence: E · Σ_i f_i · P_i with f_i the share of the sequence's k·s choices, P_i
    the mean probability; 1 when the probabilities are uniform, whatever is chosen; the
    z-loss Σ_t logsumexp². Recorded per token: summed here over 2 sequences of 6 tokens."""
    router, x = _router(), _router_inputs()
    ids, _ = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    f = F.one_hot(ids, 8).sum(2).float().sum(1) / (2 * 6)           # [b, E]
    expected = (8 * (f * probs.mean(1)).sum(-1)).sum() * 6            # per token, summed
    torch.testing.assert_close(router.aux, expected)
    torch.testing.assert_close(router.z, (x @ router.weight.T).logsumexp(-1).square().sum())
    router.reset_stats()
    with torch.no_grad():
        router.weight.zero_()                                          # every expert alike
    router(x)
    torch.testing.assert_close(router.aux / 12, torch.tensor(1.0))


def test_the_balance_losses_gradient_enters_at_the_router_output_at_the_given_scale():
    """The layer's output alone gives the router a gradient through the weights; inside
    ``aux_loss_scale(c)`` the balance losses add c · ∂(α·aux + β·z)/∂w exactly."""
    router, x = _router(), _router_inputs()
    grads = []
    for scale in (None, 0.25):
        router.weight.grad = None
        with aux_loss_scale(scale):
            _, weights = router(x)
        (weights * torch.arange(24.0).view(2, 6, 2)).sum().backward()
        grads.append(router.weight.grad.clone())
    router.weight.grad = None
    logits = F.linear(x, router.weight)
    router._balance(logits, logits.softmax(-1), router(x)[0]).mul(0.25).backward()
    torch.testing.assert_close(grads[1] - grads[0], router.weight.grad)


def _reference_layer(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer by hand: each token through each of its k experts, one at a time."""
    tokens, (ids, weights) = x.flatten(0, 1), layer.router(x)
    ids, weights = ids.flatten(0, 1), weights.flatten(0, 1)
    fc, proj = layer.experts.fc, layer.experts.proj
    out = []
    for t, token in enumerate(tokens):
        y = 0
        for j in range(ids.shape[1]):
            gate, up = (fc[ids[t, j]] @ token).view(-1, 2).unbind(-1)
            y = y + weights[t, j] * (proj[ids[t, j]] @ (F.silu(gate) * up))
        out.append(y)
    shared = layer.shared(x) * torch.sigmoid(x @ layer.shared_gate.T)
    return torch.stack(out).view_as(x) + shared


def test_the_layer_equals_a_token_by_token_loop_over_its_experts():
    x = _router_inputs()
    block = Block(LAYER, serial_group())
    init_parameters(block, LAYER.seed, serial_group())
    torch.testing.assert_close(block.mlp(x), _reference_layer(block.mlp, x))


# --- on several ranks ------------------------------------------------------------------------

def _round_trip(ep):
    """Dispatch random routings (experts 2 and 5 chosen by no token) and return them untouched:
    combine(dispatch(x)) is x's slots, bit for bit; and the bytes each all-to-all recorded."""
    group = ParallelGrid(Layout(dp=ep, ep=ep)).ep_group
    gen = torch.Generator().manual_seed(10 + group.rank)
    x = torch.randn(5 + 3 * group.rank, 16, generator=gen)
    allowed = torch.tensor([0, 1, 3, 4, 6, 7])
    ids = allowed[torch.randint(0, 6, (x.shape[0], 2), generator=gen)]
    dispatcher = ExpertDispatcher(8, group)
    with comm.record() as log:
        route = Dispatch(ids, group, 8)
        back = dispatcher.combine(dispatcher.dispatch(x, route), route)
    identical = torch.equal(back, x[route.order // 2][route.order.argsort()]) and \
        torch.equal(back.view(-1, 2, 16), x.unsqueeze(1).expand(-1, 2, -1))
    rows = log.total_bytes("all_to_all", label="dispatch forward") + \
        log.total_bytes("all_to_all", label="combine forward")
    return identical, route.per_expert.tolist(), rows, dispatch_bytes(route, 16, 4)


def _grad_reduction(dp, ep):
    """Rank-encoded gradients through DataParallel (average=True): a dense weight's is the mean
    of every rank's; an expert's the sum over the ranks holding it, / the dense dp."""
    grid = ParallelGrid(Layout(dp=dp, ep=ep))
    dense = torch.nn.Linear(1, 1, bias=False)
    dense.weight.expert_ids = None
    experts = torch.nn.Parameter(torch.zeros(2, 1))
    experts.expert_ids = range(2 * grid.ep_group.rank, 2 * grid.ep_group.rank + 2)
    module = torch.nn.Module()
    module.dense, module.experts = dense, torch.nn.ParameterList([experts])
    ddp = DataParallel(module, grid.dp_cp_group, experts=(grid.ep_group, grid.edp_group))
    with ddp.sync(True):
        (dense.weight.sum() * (grid.rank + 1) + experts.sum() * (grid.rank + 1)).backward()
    ddp.finish_grad_sync()
    return dense.weight.grad.item(), experts.grad.flatten().tolist(), grid.edp_group.ranks


def _layer_at(layout, sequence_parallel):
    """The MoE layer of LAYER on ``layout`` (dp splits the 4 sequences, ep the experts, tp each
    expert): its output and input gradient for this rank's tokens, the routing ids, and the
    router's, shared expert's and (by global id) experts' gradients summed as PTD-P sums them."""
    config = dataclasses.replace(LAYER, sequence_parallel=sequence_parallel)
    grid = ParallelGrid(layout)
    style = STYLES[sequence_parallel, False](grid.tp_group)
    groups = ExpertGroups(grid.ep_group, style.token_group(grid.cp_group, grid.tp_cp_group))
    block = Block(config, grid.tp_group, 0, grid.cp_group, groups)
    init_parameters(block, config.seed, grid.tp_group)
    x, w = _layer_inputs()
    b = 4 // layout.dp
    x, w = (t[grid.dp_rank * b:(grid.dp_rank + 1) * b] for t in (x, w))
    if sequence_parallel:                     # this tp rank's part of the sequence
        x, w = (t.chunk(grid.tp, dim=1)[grid.tp_rank] for t in (x, w))
    y, ids = _forward_backward(block.mlp, x, w)
    grads = {}
    for name, p in block.mlp.named_parameters():         # summed as PTD-P sums them, whole
        grad = comm.all_reduce(p.grad, grid.edp_group if p.expert_ids is not None
                               else grid.dp_cp_group)
        if p.tp_dim is None and sequence_parallel:       # replicated, each rank's part
            grad = comm.all_reduce(grad, grid.tp_group)
        grad = gather_full(grad, p.tp_dim, grid.tp_group, p.tp_replicas)
        grads[name] = gather_experts(grad, p, grid.ep_group)
    return y, x.grad, ids, grads


def _forward_backward(layer: MoE, x: torch.Tensor, w: torch.Tensor):
    """The layer's output for x (its gradient kept) and its routing ids, after backward from
    Σ y·w with the balance losses at 1/32 a token."""
    x.requires_grad_(True)
    ids = []
    layer.router.register_forward_hook(lambda m, i, out: ids.append(out[0]))
    with aux_loss_scale(1.0 / 32):
        y = layer(x)
    (y * w).sum().backward()
    return y.detach(), ids[0]


def _layer_inputs():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, LAYER.hidden, generator=gen), torch.randn(4, 8, LAYER.hidden,
                                                                       generator=gen)


EP_LAYOUTS = {"ep1-dp4": (Layout(dp=4), False), "ep2-dp4": (Layout(dp=4, ep=2), False),
              "ep4-dp4": (Layout(dp=4, ep=4), False), "ep2-tp2": (Layout(tp=2, dp=2, ep=2), False),
              "ep2-tp2-sp": (Layout(tp=2, dp=2, ep=2), True)}
# each ep > 1 a layout of 8 allows, and ep = 1 where dp = 1 (ep = 1 at dp > 1, the experts
# reduced over all of dp: the layer tests and the CLI run below)
LEGAL = [(g, ep) for g in all_layouts(8) for ep in range(1, g.dp + 1)
         if g.dp % ep == 0 and (ep > 1 or g.dp == 1)]


def _every_layout_and_ep_of_8():
    return [_ptdp(*_moe_split(Layout(g.tp, g.pp, g.dp, ep=ep))) for g, ep in LEGAL]


def _moe_split(layout, zero=0, config=MOE, **pipeline):
    _, options, split = _split(layout.tp, layout.pp, layout.dp, layout.cp, zero, **pipeline)
    return layout, options, split, config


# DeepSeek-V3's router (sigmoid scores, the loss-free expert bias, a token's 2 experts from its
# best 2 of 4 groups) with a capacity of 1: choices dropped, the same ones at every layout.
DEEPSEEK = dataclasses.replace(MOE, moe_router="sigmoid", moe_bias_rate=0.01, moe_capacity=1.0,
                               moe_groups=4, moe_topk_groups=2)
DEEPSEEK_SP = dataclasses.replace(DEEPSEEK, sequence_parallel=True)


def _step_stats(layout, sequence_parallel):
    """One PTD-P step's routing record and its collectives."""
    config = dataclasses.replace(MOE, sequence_parallel=sequence_parallel)
    _, options, split = _split(layout.tp, layout.pp, layout.dp)
    trainer = PTDP(config, ParallelGrid(layout), options, **split)
    ids, labels = _batches()[0]
    b = GLOBAL_BATCH // layout.dp
    mine = slice(trainer.grid.dp_rank * b, (trainer.grid.dp_rank + 1) * b)
    with comm.record() as log:
        result = trainer.train_step(ids[mine], labels[mine], LR)
    return result.moe, log


CASES = {
    "serial": (1, partial(_serial, MOE), ()),
    **{f"round-trip-ep{ep}": (ep, _round_trip, (ep,)) for ep in (1, 2, 4, 8)},
    "grads-dp4-ep2": (4, _grad_reduction, (4, 2)),
    "grads-dp4-ep4": (4, _grad_reduction, (4, 4)),     # an edp group of one
    **{name: (4, _layer_at, args) for name, args in EP_LAYOUTS.items()},
    "every-layout-and-ep-of-8": (8, _every_layout_and_ep_of_8, ()),
    "ep2-tp2-sp-zero3": (4, _ptdp, _moe_split(Layout(tp=2, dp=2, ep=2), zero=3)),
    "stats-serial": (1, _step_stats, (Layout(), False)),
    "deepseek-serial": (1, partial(_serial, DEEPSEEK), ()),
    "deepseek-tp2-sp-ep2": (4, _ptdp, _moe_split(Layout(tp=2, dp=2, ep=2), config=DEEPSEEK_SP)),
    "deepseek-cp2-ep4-zero1": (4, _ptdp, _moe_split(Layout(cp=2, dp=2, ep=4), zero=1,
                                                    config=DEEPSEEK)),
    "deepseek-pp2-ep2-zb": (4, _ptdp, _moe_split(Layout(pp=2, dp=2, ep=2), config=DEEPSEEK,
                                                 schedule="zb-h1", num_microbatches=4)),
    "stats-tp2-sp-ep2": (4, _step_stats, (Layout(tp=2, dp=2, ep=2), True)),
}
LAUNCHES = Launches(CASES)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_the_dispatch_round_trip_is_the_identity_bit_for_bit(ep):
    """Uneven splits, ranks of different token counts, two experts that receive nothing; the
    recorded all-to-all bytes are the formula's, from the actual counts."""
    received = 0
    for identical, per_expert, recorded, formula in LAUNCHES[f"round-trip-ep{ep}"]:
        assert identical
        assert recorded == (formula if ep > 1 else 0)   # ep = 1: nothing is sent
        received += sum(per_expert)
    assert received == sum(2 * (5 + 3 * r) for r in range(ep))   # every slot, once


@pytest.mark.parametrize("name, dp, ep", [("grads-dp4-ep2", 4, 2), ("grads-dp4-ep4", 4, 4)])
def test_expert_gradients_are_summed_over_their_holders_and_divided_by_the_dense_dp(name, dp, ep):
    """Rank r's gradient is r + 1. Dense: the mean over the 4 ranks, 2.5. An expert held by the
    edp ranks R: Σ_{r ∈ R} (r + 1) / 4 — not / |R|, which is ep× too large (pytorch#160285)."""
    for dense, experts, holders in LAUNCHES[name]:
        assert dense == pytest.approx(2.5)
        assert experts == pytest.approx([sum(r + 1 for r in holders) / dp] * 2)


@pytest.fixture(scope="module")
def serial_layer():
    block = Block(LAYER, serial_group())
    init_parameters(block, LAYER.seed, serial_group())
    x, w = _layer_inputs()
    y, ids = _forward_backward(block.mlp, x, w)
    scores = (x.detach() @ block.mlp.router.weight.T).softmax(-1).sort(-1, descending=True).values
    margin = (scores[..., 1] - scores[..., 2]).min().item()
    grads = {n: p.grad for n, p in block.mlp.named_parameters()}
    return y, x.grad, ids, grads, margin


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_the_layer_at_every_ep_equals_serial(serial_layer, name):
    """Output, input gradient, the same routing, and the gradient of the router, the shared
    expert and every expert by its global id. The smallest top-k margin of the serial routing
    is asserted well above rounding, so that a near-tie cannot pass for agreement."""
    y, x_grad, ids, grads, margin = serial_layer
    layout, sequence_parallel = EP_LAYOUTS[name]
    print(f"smallest top-2 margin: {margin:.2e}")
    assert margin > 1e-4
    b = 4 // layout.dp
    for rank, (y_r, xg_r, ids_r, grads_r) in enumerate(LAUNCHES[name]):
        d, t = rank // layout.tp, rank % layout.tp
        part = [slice(d * b, (d + 1) * b)]
        if sequence_parallel:
            part.append(slice(t * 8 // layout.tp, (t + 1) * 8 // layout.tp))
        assert torch.equal(ids_r, ids[tuple(part)]), rank
        torch.testing.assert_close(y_r, y[tuple(part)], atol=1e-5, rtol=0)
        torch.testing.assert_close(xg_r, x_grad[tuple(part)], atol=1e-5, rtol=0)
        assert grads_r.keys() == grads.keys()
        for key, value in grads.items():
            torch.testing.assert_close(grads_r[key], value, atol=1e-6, rtol=1e-5, msg=key)


@pytest.fixture(scope="module")
def serial():
    return LAUNCHES["serial"][0]


@pytest.mark.parametrize("index", range(len(LEGAL)),
                         ids=[f"tp{g.tp}-pp{g.pp}-dp{g.dp}-ep{ep}" for g, ep in LEGAL])
def test_every_layout_of_8_with_expert_parallelism_takes_the_serial_steps(serial, index):
    """The Llama block with experts (grouped-query attention whose kv heads tp = 4 and 8
    replicate, RMSNorm, rotary positions, an untied output layer), dropout on, both balance
    losses and a gated SwiGLU shared expert: losses, norms and every weight after 2 steps equal
    serial's."""
    _check_equal_to_serial(serial, [rank[index] for rank in LAUNCHES["every-layout-and-ep-of-8"]])


def test_ep_with_sequence_parallelism_under_zero3_takes_the_serial_steps(serial):
    """ep × tp + SP under ZeRO-3: each block's expert bucket gathered over edp, its dense one
    over dp (ep × cp, ZeRO-1 and ZB-H1: the capacity runs below)."""
    _check_equal_to_serial(serial, LAUNCHES["ep2-tp2-sp-zero3"])


def test_a_step_records_the_routing_and_its_all_to_alls_move_the_counted_rows_both_ways():
    """The step's record (log.jsonl's ``moe_load``, ``moe_aux``, ``moe_z``) is the serial one:
    every token's k choices per layer and expert, the balance per token. Backward's all-to-alls
    send what forward's received: dispatch back the combine's rows, and the reverse."""
    (serial, _), = LAUNCHES["stats-serial"]
    for moe, log in LAUNCHES["stats-tp2-sp-ep2"]:
        assert moe["moe_load"] == serial["moe_load"]
        assert [sum(layer) for layer in moe["moe_load"]] == [GLOBAL_BATCH * 8 * 2] * 8
        assert moe["moe_rank_load"] == [[sum(layer[:4]), sum(layer[4:])]
                                        for layer in moe["moe_load"]]
        assert moe["moe_aux"] == pytest.approx(serial["moe_aux"], abs=1e-6)
        assert moe["moe_z"] == pytest.approx(serial["moe_z"], rel=1e-6)
        sent = {label: log.total_bytes("all_to_all", label=label) for label in (
            "dispatch forward", "combine forward", "dispatch backward", "combine backward")}
        assert sent["dispatch backward"] == sent["combine forward"] > 0
        assert sent["combine backward"] == sent["dispatch forward"] > 0
        assert log.count("all_to_all", label="dispatch forward") == 8 * 2   # layers × microbatches


# --- capacity and the loss-free expert bias ---------------------------------------------------

def _brute_force_keep(ids, scores, index, capacity):
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(ids.shape[0]):
        for e in ids[row].unique().tolist():
            mine = [j for j in range(ids.shape[1]) if ids[row, j] == e]
            mine.sort(key=lambda j: (-scores[row, j].item(), index[row, j].item()))
            keep[row, mine[:capacity]] = True
    return keep


def test_capacity_keeps_each_expert_s_best_choices_by_score_then_token_index():
    """Ties in score (a quarter of the choices) are broken by the lower token index."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 4, (3, 40), generator=gen)
    scores = torch.randint(0, 4, (3, 40), generator=gen).float() / 4     # many ties
    index = torch.randperm(40, generator=gen).expand(3, 40)
    for capacity in (1, 3, 7, 40):
        torch.testing.assert_close(keep_within_capacity(ids, scores, index, 4, capacity),
                                   _brute_force_keep(ids, scores, index, capacity))


def test_a_capacity_counted_per_rank_drops_other_tokens_than_the_sequence_s_at_tp2_sp():
    """The trap: under tp = 2 + SP each rank routes half the sequence; a capacity counted on
    its own tokens, ceil(cf·k·(s/2)/E) per half, keeps other choices than the sequence's
    ceil(cf·k·s/E): the run's result would change with the layout. Ours is the sequence's."""
    router, x = _router(dataclasses.replace(LAYER, moe_capacity=1.0)), _router_inputs(s=8)
    logits = x @ router.weight.T
    scores, ids = logits.softmax(-1).topk(2, dim=-1)
    index = torch.arange(8).view(1, 8, 1).expand(2, 8, 2)
    whole = keep_within_capacity(ids.flatten(1), scores.flatten(1), index.flatten(1), 8,
                                 math.ceil(2 * 8 / 8))
    halves = torch.cat([keep_within_capacity(*(t[:, h].flatten(1) for t in (ids, scores, index)),
                                             8, math.ceil(2 * 4 / 8))
                        for h in (slice(0, 4), slice(4, 8))], dim=1)
    assert not torch.equal(whole, halves)
    kept, weights = router(x)
    assert torch.equal(kept == ids, whole.view(2, 8, 2))
    assert torch.equal(weights == 0, ~whole.view(2, 8, 2))


def test_the_expert_bias_changes_which_experts_are_chosen_never_their_weights():
    config = dataclasses.replace(LAYER, moe_router="sigmoid", moe_bias_rate=0.1)
    router, x = _router(config), _router_inputs()
    ids, weights = router(x)
    scores = (x @ router.weight.T).sigmoid()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0]))
    biased, biased_weights = router(x)
    assert (biased.sort(-1).values == torch.tensor([0, 1])).all()      # the bias chose
    picked = scores.gather(-1, biased)
    torch.testing.assert_close(biased_weights, picked / picked.sum(-1, keepdim=True))
    router.update_bias(torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1]))       # expert 0 overloaded
    torch.testing.assert_close(router.expert_bias,
                               torch.tensor([0.9, 1.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]))


@pytest.mark.parametrize("name", ["tp2-sp-ep2", "cp2-ep4-zero1", "pp2-ep2-zb"])
def test_capacity_and_the_expert_bias_take_the_serial_steps(name):
    """Sigmoid scores, group-limited routing, the expert bias moved each step from the whole
    batch's counts (a parameter, compared as every weight), and choices dropped by a capacity of
    1 counted over each whole sequence (gathered over tp under SP and over cp): the same drops
    as serial; ep 4 × cp 2 with ZeRO-1 sharding experts over an edp of one; ep × pp under ZB-H1
    (the balance losses' gradient through B and W)."""
    _check_equal_to_serial(LAUNCHES["deepseek-serial"][0], LAUNCHES[f"deepseek-{name}"])


def test_group_limited_top_k_equals_a_brute_force_over_every_choice_of_groups():
    """DeepSeek-V3 §2.1.2: 16 experts in 4 groups, a token's 4 from its best 2 groups (a group
    scoring its two best experts): against trying every pair of groups."""
    scores = torch.rand(50, 16, generator=torch.Generator().manual_seed(2))
    ids = group_limited(scores, 4, 2).topk(4, dim=-1).indices.sort(-1).values
    for token, row in zip(ids, scores, strict=True):
        per_group = row.view(4, 4).sort(-1, descending=True).values[:, :2].sum(-1)
        best = max(itertools.combinations(range(4), 2), key=lambda g: per_group[list(g)].sum())
        allowed = torch.cat([torch.arange(4 * g, 4 * g + 4) for g in best])
        expected = allowed[row[allowed].topk(4).indices].sort().values
        assert torch.equal(token, expected)
    assert torch.equal(group_limited(scores, 1, 1), scores)
    with pytest.raises(ValueError, match="moe_topk_groups = 1 .* hold at least moe_topk = 2"):
        dataclasses.replace(LAYER, moe_groups=8, moe_topk_groups=1)
