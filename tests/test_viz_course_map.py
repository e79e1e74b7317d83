"""The course map is read from the notebooks' "Before this" lines: the parsing, the shipped
notebooks' order, the arrows kept and the picture."""

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from megatron_edu.course.viz.course_map import (
    depths,
    direct,
    draw_course_map,
    imported_from,
    needs,
    prerequisites,
    reachable,
    titles,
)

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize(("line", "want"), [
    ("notebooks 01–03 (tensor parallelism, `f` and `g`), 04–05 (pipeline schedules), 06 (data "
     "parallelism, buckets, ZeRO-1).", {1, 2, 3, 4, 5, 6}),
    ("notebooks 01–03 (…) and 08 §3 (the memory model); autograd's saved tensors.", {1, 2, 3, 8}),
    ("notebook 02 (…); autograd Functions (notebook 01, exercise 01.2).", {1, 2}),
    ("no other notebook (schedules here are pure data; notebooks 01–03 show what a stage "
     "computes); the idea of cutting a model's layers", set()),
])
def test_a_before_this_line_names_its_notebooks_not_sections_or_exercises(line, want):
    assert needs(line) == want


def test_every_notebook_needs_only_earlier_ones_so_the_numbers_are_a_reading_order():
    prereqs = prerequisites(NOTEBOOKS)
    assert sorted(prereqs) == list(range(len(prereqs)))
    assert all(m < n for n, before in prereqs.items() for m in before)
    assert {n for n, before in prereqs.items() if not before} == {0, 4}
    assert prereqs[17] >= {6, 7}
    assert titles(NOTEBOOKS)[7] == "3D parallelism"


def test_every_before_this_line_reaches_the_notebooks_that_taught_what_it_imports():
    """Derived from the imports: a notebook importing GPT builds on the notebook that first
    imported it, through its "Before this" line or a chain of them."""
    prereqs, used = prerequisites(NOTEBOOKS), imported_from(NOTEBOOKS)
    assert used[1] == {0} and 1 in used[3]          # the derivation sees what it should
    reach = {n: reachable(prereqs, n) for n in prereqs}
    missing = {n: sorted(used[n] - reach[n]) for n in prereqs if used[n] - reach[n]}
    assert missing == {}, "a 'Before this' line misses the notebooks its imports come from"


def test_only_the_arrows_no_longer_chain_implies_are_drawn():
    prereqs = {0: set(), 1: {0}, 2: {0, 1}, 3: {2}, 4: {0, 3}}
    assert direct(prereqs) == {(0, 1), (1, 2), (2, 3), (3, 4)}
    assert depths(prereqs) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    with pytest.raises(ValueError, match="circle"):
        depths({0: {1}, 1: {0}})


def test_the_map_draws_a_box_per_notebook_and_an_arrow_per_direct_prerequisite():
    prereqs = prerequisites(NOTEBOOKS)
    fig = draw_course_map(prereqs, titles(NOTEBOOKS))
    ax = fig.axes[0]
    assert len(ax.patches) == len(prereqs)
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == len(direct(prereqs))
    labels = {t.get_text().split()[0] for t in ax.texts if t.get_text()}
    assert labels == {f"{n:02d}" for n in prereqs}
    plt.close(fig)
