"""The layout and its process grid: Megatron's rank order (tp fastest, then dp, then pp), its
groups, and every impossible split — of the mesh, of the pipeline, of the model — refused with
its numbers before any process starts."""

import functools

import pytest
import torch.distributed as dist
from helpers import Launches

from megatron_edu.grid import Layout, ParallelGrid, all_layouts
from megatron_edu.launch import RankError, run
from megatron_edu.model import GPTConfig
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import Parallelism


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    layout = Layout(tp=2, pp=4, dp=2)
    assert layout.coords(0) == (0, 0, 0)
    assert layout.coords(1) == (1, 0, 0)   # next tp rank
    assert layout.coords(2) == (0, 0, 1)   # next dp replica
    assert layout.coords(4) == (0, 1, 0)   # next pipeline stage
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(16))


def test_groups_of_16_ranks_as_tp2_pp4_dp2():
    layout = Layout(tp=2, pp=4, dp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                  [14, 15]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                  [13, 15]]
    assert layout.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_cp_sits_next_to_tp_and_its_gradients_reduce_over_dp_x_cp():
    """megatron-core's order, tp then cp then dp then pp: 16 ranks as tp 2 × cp 2 × pp 2 × dp 2."""
    layout = Layout(tp=2, pp=2, dp=2, cp=2)
    assert layout.world_size == 16
    assert [layout.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.coords(2) == (0, 0, 0) and layout.coords(4) == (0, 0, 1)   # cp, then dp
    assert layout.coords(8) == (0, 1, 0)                                       # then pp
    assert all(layout.rank_of(*layout.coords(r), layout.cp_rank(r)) == r for r in range(16))
    assert layout.cp_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert layout.dp_groups()[:3] == [[0, 4], [1, 5], [2, 6]]
    assert layout.dp_cp_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.pp_groups()[0] == [0, 8] and layout.tp_groups()[1] == [2, 3]
    assert layout.model_parallel_groups()[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    for groups in (layout.cp_groups(), layout.dp_cp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(16))
    with pytest.raises(ValueError, match="tp·cp·pp·dp = 2·2·2·2 = 16 ranks, but the world has 8"):
        layout.check_world(8)
    split = Parallelism(layout)
    split.check(GPTConfig(num_layers=2, hidden=32, num_heads=4, seq_len=16))
    with pytest.raises(ValueError, match="2·cp = 4 chunks: seq_len = 6 is not divisible by 4"):
        split.check(GPTConfig(num_layers=2, hidden=32, num_heads=4, seq_len=6))
    with pytest.raises(ValueError, match="each into tp = 2 parts by sequence parallelism: "
                                         "seq_len = 12 is not divisible by 8"):
        split.check(GPTConfig(num_layers=2, hidden=32, num_heads=4, seq_len=12,
                              sequence_parallel=True))
    with pytest.raises(ValueError, match=r"cp = 2\) runs causal attention .* causal=False"):
        split.check(GPTConfig(num_layers=2, hidden=32, num_heads=4, causal=False))
    with pytest.raises(ValueError, match="cp must be a positive integer, got 0"):
        Layout(cp=0)


def _cp_grid():
    grid = ParallelGrid(Layout(tp=2, dp=1, cp=2))
    return grid.cp_rank, grid.cp_group.ranks, grid.dp_cp_group.ranks, grid.tp_group.ranks


def test_a_grid_builds_its_cp_groups():
    assert LAUNCHES["cp-groups"] == [(0, (0, 2), (0, 2), (0, 1)), (0, (1, 3), (1, 3), (0, 1)),
                                     (1, (0, 2), (0, 2), (2, 3)), (1, (1, 3), (1, 3), (2, 3))]


def test_the_embedding_groups_follow_the_stage_map():
    """Under ZB-V's V the first and the last stage are both on pipeline rank 0: each tied
    embedding's two copies are on one rank, whose embedding group is itself."""
    layout = Layout(tp=2, pp=4, dp=2)
    zb_v = PipelineConfig("zb-v", num_microbatches=8)
    assert zb_v.chunks == 2 and zb_v.stages(4).kind == "v" and zb_v.stages(4).ends == (0, 0)
    assert layout.embedding_groups(zb_v.stages(4).ends) == [[0], [1], [2], [3]]
    assert layout.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]
    interleaved = PipelineConfig("interleaved", 2, num_microbatches=8).stages(4)
    assert Layout(pp=4).embedding_groups(interleaved.ends) == [[0, 3]]


@pytest.mark.parametrize("layout", all_layouts(8), ids=str)
def test_every_rank_is_in_exactly_one_group_of_each_kind(layout):
    for groups in (layout.tp_groups(), layout.dp_groups(), layout.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_all_layouts_of_8_are_the_ten_factorisations():
    assert len(all_layouts(8)) == 10


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Layout(2, 2, 2).check_world(4), r"tp·pp·dp = 2·2·2 = 8 ranks, but the world has 4"),
    (lambda: Layout(tp=0), "tp must be a positive integer, got 0"),
    (lambda: Layout(pp=1.5), "pp must be a positive integer"),
    (lambda: PipelineConfig(microbatch=0), "microbatch must be a positive integer, got 0"),
    (lambda: PipelineConfig(num_microbatches=0), "num_microbatches must be at least 1, got 0"),
    (lambda: PipelineConfig("zigzag"), "unknown schedule 'zigzag'"),
    (lambda: PipelineConfig("interleaved", num_microbatches=4), "needs its number of"),
    (lambda: PipelineConfig("interleaved", 2, num_microbatches=6).check(4),
     "num_microbatches=6, num_stages=4"),
    (lambda: PipelineConfig(chunks=2), "the 1f1b schedule has one model chunk per rank; got v=2"),
    (lambda: Parallelism(Layout(pp=2), PipelineConfig("interleaved", 2, num_microbatches=3)),
     "num_microbatches=3, num_stages=2"),
    (lambda: Parallelism(pipeline=PipelineConfig("zb-v")),
     "2 model chunks per rank need a pipeline"),
    (lambda: Parallelism(zero=4), "zero is a ZeRO stage 0, 1, 2 or 3, got 4"),
    (lambda: Parallelism(Layout(tp=3)).check(GPTConfig(num_heads=4, hidden=64)),
     "num_heads = 4 is not divisible by the tensor-parallel size tp = 3"),
    (lambda: Parallelism(Layout(pp=4), PipelineConfig("zb-v", num_microbatches=8)).check(
        GPTConfig(num_layers=4)), "num_layers = 4 is not divisible by pp·chunks = 4·2"),
])
def test_bad_splits_name_the_numbers(build, message):
    with pytest.raises(ValueError, match=message):
        build()


FACTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1)]  # layouts of 4 ranks


def _grid_facts(tp, pp, dp):
    grid = ParallelGrid(tp=tp, pp=pp, dp=dp)
    return (grid.tp_rank, grid.pp_rank, grid.dp_rank, grid.tp_group.ranks, grid.pp_group.ranks,
            grid.dp_group.ranks, grid.embedding_group.ranks)


@pytest.mark.parametrize(("tp", "pp", "dp"), FACTS)
def test_each_rank_sees_its_coordinates_and_groups(tp, pp, dp):
    layout = Layout(tp, pp, dp)
    for rank, facts in enumerate(LAUNCHES[f"facts-tp{tp}-pp{pp}-dp{dp}"]):
        t, p, d = layout.coords(rank)
        assert facts[:3] == (t, p, d)
        assert rank in facts[3] and rank in facts[4] and rank in facts[5]
        # a rank that holds no embedding (a middle stage) is a group of itself: a no-op
        assert list(facts[6]) == next((g for g in layout.embedding_groups() if rank in g), [rank])


def _sum_over_each_group(tp, pp, dp):
    import torch

    from megatron_edu import comm
    grid = ParallelGrid(tp=tp, pp=pp, dp=dp)
    one = torch.ones(1)
    return [comm.all_reduce(one, group).item()
            for group in (grid.tp_group, grid.pp_group, grid.dp_group, grid.mp_group)]


def test_groups_really_communicate_among_their_members():
    assert LAUNCHES["sums-tp2-pp2-dp2"] == [[2.0, 2.0, 2.0, 4.0]] * 8


def _mismatched_grid():
    ParallelGrid(tp=2, pp=2, dp=2)
    dist.barrier()  # never reached: the grid raises before any collective


def test_a_mismatched_grid_raises_before_any_collective():
    with pytest.raises(RankError, match=r"tp·pp·dp = 2·2·2 = 8 ranks, but the world has 2"):
        run(_mismatched_grid, 2, timeout=30)


def _sizes_of(*args, **kwargs):
    grid = ParallelGrid(*args, **kwargs)
    return grid.tp, grid.pp, grid.dp, grid.embedding_group.ranks


def test_a_grid_is_made_from_sizes_or_from_a_layout():
    assert LAUNCHES["sizes-by-position"][0] == (2, 2, 1, (0, 2))
    assert LAUNCHES["sizes-by-name"][0] == (2, 1, 2, (0,))
    assert LAUNCHES["layout"][3] == (1, 4, 1, (0, 3))


def test_a_grid_puts_the_embedding_group_on_the_stage_maps_ends():
    """ZB-V's V: the first and the last stage on pipeline rank 0, each rank a group of itself."""
    embedding = [facts[3] for facts in LAUNCHES["layout-zb-v"]]
    assert embedding == [(0,), (1,), (2,), (3,)]


# --- the runs above: one launch per world size --------------------------------------------------

LAUNCHES = Launches({  # name -> (world size, function, arguments)
    "cp-groups": (4, _cp_grid, ()),
    **{f"facts-tp{tp}-pp{pp}-dp{dp}": (4, _grid_facts, (tp, pp, dp)) for tp, pp, dp in FACTS},
    "sums-tp2-pp2-dp2": (8, _sum_over_each_group, (2, 2, 2)),
    "sizes-by-position": (4, _sizes_of, (2, 2, 1)),
    "sizes-by-name": (4, functools.partial(_sizes_of, tp=2, dp=2), ()),
    "layout": (4, _sizes_of, (Layout(pp=4),)),
    "layout-zb-v": (4, functools.partial(   # ZB-V's stage map: the ends on pipeline rank 0
        _sizes_of, embedding_ranks=PipelineConfig("zb-v", num_microbatches=8).stages(4).ends),
        (Layout(pp=4),)),
})
