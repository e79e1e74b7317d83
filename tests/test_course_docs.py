"""docs/course.md and the README count and list the exercises the checkers register: the table
of what each checker catches has a row per exercise, and the counts in the prose are theirs."""

import re
from pathlib import Path

from megatron_edu.course.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[1]


def test_the_course_guide_has_a_row_per_exercise_and_says_how_many():
    text = (ROOT / "docs" / "course.md").read_text()
    assert re.findall(r"^\| (\d\d\.\d+) \|", text, re.M) == sorted(EXERCISES)
    assert f"{len(EXERCISES)} exercises, " in text


def test_every_count_of_the_exercises_is_the_checkers():
    assert f"{len(EXERCISES)} in all" in (ROOT / "README.md").read_text()
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("megatron_edu/**/*.py")]
    counts = [(path.name, n) for path in texts
              for n in re.findall(r"\b(\d+) exercises\b", path.read_text())]
    assert counts and {n for _, n in counts} == {str(len(EXERCISES))}, counts
