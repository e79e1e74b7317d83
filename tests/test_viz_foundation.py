"""The pictures of notebook 00 draw what they claim: one cell per element coloured by its origin,
the ring's cost per rank, one box per rank of the grid, nodes and groups (drawing only)."""

import matplotlib.pyplot as plt
import pytest
import torch

from megatron_edu.course.viz.collectives import (
    MIXED,
    draw_collective,
    draw_ring_cost,
    element_origins,
)
from megatron_edu.course.viz.grid import draw_grid, draw_grid_groups, groups_across_nodes
from megatron_edu.grid import Layout

T = 4
BEFORE = [torch.arange(2.0) + 10 * r for r in range(T)]  # rank r holds [10r, 10r + 1]
TOTAL = sum(BEFORE)
LAYOUT = Layout(tp=2, pp=4, dp=2)


@pytest.fixture(autouse=True)
def _agg_backend():
    plt.switch_backend("agg")  # draw only, no window
    yield
    plt.close("all")


def _cells(fig):
    return [p for p in fig.axes[0].patches if p.get_gid() == "cell"]


def _rank_box(fig, rank, axes_index=0):
    return next(p for p in fig.axes[axes_index].patches if p.get_gid() == f"rank {rank}")


# --- collectives ---------------------------------------------------------------------------------

def test_all_gather_draws_one_cell_per_element_before_and_after():
    fig = draw_collective("all_gather", BEFORE, [torch.cat(BEFORE)] * T)
    assert len(_cells(fig)) == T * 2 + T * 2 * T


def test_all_gather_keeps_each_chunk_in_the_colour_of_its_rank():
    _, after = element_origins("all_gather", BEFORE, [torch.cat(BEFORE)] * T)
    assert after == [[0, 0, 1, 1, 2, 2, 3, 3]] * T


def test_a_sum_is_a_mix_of_every_rank():
    _, after = element_origins("all_reduce", BEFORE, [TOTAL] * T)
    assert after == [[MIXED, MIXED]] * T


def test_a_mixed_cell_is_drawn_with_one_stripe_per_rank():
    fig = draw_collective("reduce_scatter", BEFORE, list(torch.cat(BEFORE).view(T, 2)))
    stripes = [p for p in fig.axes[0].patches if p.get_gid() != "cell"]
    assert len(stripes) == T * 2 + T * 2 * T  # before: one colour a cell; after: T stripes a cell


def test_broadcast_copies_come_from_the_source():
    _, after = element_origins("broadcast", BEFORE, [BEFORE[1]] * T, sources=[1] * T)
    assert after == [[1, 1]] * T


def test_send_recv_defaults_to_a_pipeline_where_rank_r_receives_from_r_minus_1():
    _, after = element_origins("send_recv", BEFORE, [BEFORE[0], *BEFORE[:-1]])
    assert after == [[0, 0], [0, 0], [1, 1], [2, 2]]


def test_an_unknown_collective_is_rejected():
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        draw_collective("all_to_all", BEFORE, BEFORE)


def test_ring_cost_bars_follow_the_ring_formulas():
    fig = draw_ring_cost(range(2, 17))
    all_reduce, all_gather = (
        [bar.get_height() for bar in bars] for bars in fig.axes[0].containers)
    assert all_reduce == pytest.approx([2 * (t - 1) / t for t in range(2, 17)])
    assert all_gather == pytest.approx([(t - 1) / t for t in range(2, 17)])


# --- grid ----------------------------------------------------------------------------------------

def test_the_grid_draws_one_box_per_rank():
    fig = draw_grid(LAYOUT)
    assert sum(p.get_gid().startswith("rank") for p in fig.axes[0].patches) == 16


def test_two_nodes_of_8_cover_two_pipeline_stages_each():
    fig = draw_grid(LAYOUT, gpus_per_node=8)
    assert sum(p.get_gid() == "node" for p in fig.axes[0].patches) == 4  # (node, stage) pairs


def test_a_highlighted_tp_group_shares_one_colour():
    fig = draw_grid(LAYOUT, highlight="tp")
    assert _rank_box(fig, 0).get_facecolor() == _rank_box(fig, 1).get_facecolor()
    assert _rank_box(fig, 0).get_facecolor() != _rank_box(fig, 2).get_facecolor()


def test_ranks_outside_the_embedding_groups_stay_white():
    fig = draw_grid(LAYOUT, highlight="embedding")
    assert _rank_box(fig, 4).get_facecolor() == (1.0, 1.0, 1.0, 1.0)


def test_a_bad_highlight_is_rejected():
    with pytest.raises(ValueError, match="highlight must be one of"):
        draw_grid(LAYOUT, highlight="ep")


def test_the_group_panels_are_one_axes_per_kind():
    assert len(draw_grid_groups(LAYOUT, 8, kinds=("tp", "dp", "pp")).axes) == 3


@pytest.mark.parametrize(("kind", "crossing"), [("tp", 0), ("dp", 0), ("pp", 4)])
def test_with_8_gpus_per_node_only_pipeline_groups_cross_nodes(kind, crossing):
    assert groups_across_nodes(getattr(LAYOUT, f"{kind}_groups")(), 8) == crossing
