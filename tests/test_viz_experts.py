"""The pictures of notebook 19 draw what they claim: the balance loss is the router's, a capacity
drops the choices above it, the load heatmap holds each step's shares, and the dispatch and
capacity pictures draw a box per row (drawing only, from made-up routings)."""

import math

import pytest
import torch

from megatron_edu.course.viz.experts import (
    Strip,
    balance,
    draw_balance,
    draw_dispatch,
    draw_kept,
    draw_load,
    skewed_logits,
)
from megatron_edu.model import GPTConfig
from megatron_edu.model.moe import ExpertGroups, Router
from megatron_edu.tensor_parallel import init_parameters, serial_group
from tests.test_viz_dp import (
    _agg_backend,  # noqa: F401  (autouse: draw only, no window)
    _bars,
)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_balance_loss_is_1_under_uniform_probabilities_whatever_is_chosen(k):
    f, p, loss = balance(torch.zeros(10, 8), k)
    assert f.sum().item() == pytest.approx(1.0)
    assert p.tolist() == pytest.approx([1 / 8] * 8)
    assert loss == pytest.approx(1.0)


def test_the_balance_loss_is_the_one_the_package_s_router_records():
    """One sequence of 16 tokens: the router's recorded sum over tokens, per token."""
    config = GPTConfig(vocab_size=16, seq_len=16, num_layers=1, hidden=8, num_heads=1,
                       ffn_hidden=8, moe_experts=8, moe_topk=2)
    router = Router(config, ExpertGroups.serial())
    init_parameters(router, 0, serial_group())
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
    logits = skewed_logits(1.5, tokens=16)
    router(logits.unsqueeze(0))
    assert balance(logits, 2)[2] == pytest.approx(router.aux.item() / 16, rel=1e-5)


def test_a_stronger_skew_sends_more_choices_to_the_first_expert_and_raises_the_loss():
    shares = [balance(skewed_logits(skew), 2)[0][0].item() for skew in (0.0, 1.0, 3.0)]
    losses = [balance(skewed_logits(skew), 2)[2] for skew in (0.0, 1.0, 3.0)]
    assert shares == sorted(shares) and shares[-1] > 0.45   # 0.5: in every token's top 2
    assert losses == sorted(losses)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, 1.25])
def test_the_choices_above_the_capacity_are_drawn_dropped(capacity_factor):
    logits = skewed_logits(2.0)
    fig = draw_balance(logits, 2, capacity_factor)
    counts = (balance(logits, 2)[0] * 2 * 64).round().long().tolist()
    capacity = math.ceil(capacity_factor * 2 * 64 / 8) if capacity_factor else max(counts)
    ax = fig.axes[0]
    for e, n in enumerate(counts):
        dropped = _bars(ax, f"dropped {e}")
        assert _bars(ax, f"kept {e}")[0].get_height() == min(n, capacity)
        assert sum(b.get_height() for b in dropped) == max(0, n - capacity)


def _records(loads):
    return [{"step": i + 1, "moe_load": [load], "moe_aux": 1.0 + i} for i, load in
            enumerate(loads)] + [{"step": len(loads), "val_loss": 3.0}]


def test_the_load_heatmap_holds_each_step_s_shares_of_the_choices():
    runs = {"a": _records([[2, 2, 0, 0], [4, 0, 0, 0]]), "b": _records([[1, 1, 1, 1]] * 2)}
    fig = draw_load(runs, layer=0)
    shares = fig.axes[0].images[0].get_array()               # [experts, steps]
    assert shares.tolist() == [[0.5, 1.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert [line.get_ydata().tolist() for line in fig.axes[2].lines[:2]] == [[1.0, 2.0]] * 2


def test_the_dispatch_draws_a_box_per_row_of_each_rank_in_each_strip():
    strips = [Strip("choices", [[(0, 1), (0, 0)], [(2, 1)]], [[("t0", 2)], [("t2", 1)]]),
              Strip("sorted", [[(0, 0), (0, 1)], [(2, 1)]], [[("→ 0", 1), ("→ 1", 1)],
                                                             [("→ 1", 1)]])]
    fig = draw_dispatch(strips, tokens_per_rank=2)
    assert len([p for p in fig.axes[0].patches if p.get_gid() == "row"]) == 6
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"choices", "sorted", "rank 0", "rank 1", "→ 0", "t0\ne1"} <= texts


def test_the_kept_choices_are_outlined_where_a_rule_differs_from_the_first():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    whole = torch.tensor([[True, True], [True, True], [False, True]])
    halves = torch.tensor([[True, True], [False, True], [True, True]])
    fig = draw_kept(ids, {"whole": whole, "halves": halves})
    assert len([p for p in fig.axes[0].patches if p.get_gid() == "differs"]) == 2
    assert sorted(t.get_text() for t in fig.axes[0].texts if "×" in t.get_text()) == ["×0", "×0"]
