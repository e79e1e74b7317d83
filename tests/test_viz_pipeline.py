"""The pipeline diagrams of notebooks 20 and 05 say what they claim: one linear layer's F, B and W
and who waits for what; each link's share of the activation with and without scatter/gather
(drawing only)."""

from megatron_edu.course.viz.pipeline import draw_backward_split, draw_scatter_gather
from tests.test_viz_dp import _agg_backend  # noqa: F401  (autouse: draw only, no window)


def _texts(ax) -> list[str]:
    return [text.get_text() for text in ax.texts]


def test_the_backward_split_names_the_three_passes_and_who_waits():
    texts = _texts(draw_backward_split())
    assert {"stage i − 1", "stage i + 1"} <= set(texts)
    assert any(t.startswith("F") and "Y = X·W" in t for t in texts)
    assert any(t.startswith("B") and "∂L/∂X = ∂L/∂Y·Wᵀ" in t for t in texts)
    assert any(t.startswith("W") and "∂L/∂W = Xᵀ·∂L/∂Y" in t for t in texts)
    assert any("waits for it" in t for t in texts)


def test_scatter_gather_sends_a_tth_of_the_message_on_each_link():
    without, with_split = draw_scatter_gather(4, message_bytes=65_536).axes
    for ax in (without, with_split):
        texts = _texts(ax)
        assert {"stage i (one node)", "stage i + 1 (another node)"} <= set(texts)
        assert {f"tp rank {r}" for r in range(4)} <= set(texts)
    assert _texts(without).count("65,536 B") == 4
    assert _texts(with_split).count("16,384 B") == 4
    received = [p for p in with_split.patches if str(p.get_gid()).startswith("with stage i + 1")]
    assert sum(p.get_alpha() == 1 for p in received) == 4  # rank r receives slice r only


def test_scatter_gather_writes_the_sizes_without_numbers():
    texts = _texts(draw_scatter_gather(2).axes[1])
    assert texts.count("b·s·h/t") == 2 and "between nodes (InfiniBand): 2 × b·s·h/t" in texts
