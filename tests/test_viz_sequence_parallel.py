"""The sequence-parallel layer's picture (2205.05198 Figure 5) draws what it claims: six
operations, the layer norms and dropouts cut along the sequence and attention and the MLP along
the hidden size into t stripes, and g and ḡ, each twice, with the collectives they run."""

import pytest

from megatron_edu.course.viz.sequence_parallel import draw_sequence_parallel_layer
from tests.test_viz_dp import _agg_backend  # noqa: F401  (autouse: draw only, no window)


def _with_gid(ax, suffix):
    return [p for p in ax.patches if (p.get_gid() or "").endswith(suffix)]


@pytest.mark.parametrize("tp", [2, 4])
def test_each_operation_is_cut_into_t_stripes_along_its_split(tp):
    ax = draw_sequence_parallel_layer(tp).axes[0]
    ops = _with_gid(ax, " op")
    assert [op.get_gid().split()[1] for op in ops] == ["sp", "tp", "sp", "sp", "tp", "sp"]
    for op in ops:
        index, kind = op.get_gid().split()[:2]
        stripes = [p for p in ax.patches if p.get_gid() == f"{index} {kind} stripe"]
        assert len(stripes) == tp
        if kind == "sp":   # split along the sequence: full width, 1/t of the height each
            assert all(s.get_width() == pytest.approx(op.get_width()) for s in stripes)
            assert all(s.get_height() == pytest.approx(op.get_height() / tp) for s in stripes)
        else:              # split along the hidden size: full height, 1/t of the width each
            assert all(s.get_height() == pytest.approx(op.get_height()) for s in stripes)
            assert all(s.get_width() == pytest.approx(op.get_width() / tp) for s in stripes)


def test_g_and_g_bar_each_sit_twice_between_the_regions_with_their_collectives():
    ax = draw_sequence_parallel_layer().axes[0]
    assert len(_with_gid(ax, " g")) == 2 and len(_with_gid(ax, " ḡ")) == 2
    assert len(_with_gid(ax, "region")) == 5          # sp | tp | sp | tp | sp
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("all-gather fwd\nreduce-scatter bwd") == 2
    assert texts.count("reduce-scatter fwd\nall-gather bwd") == 2
