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


def _notebook_minutes() -> dict[str, int]:
    """Each notebook's own estimate of its reading time, from its "**Time** — about N minutes"."""
    import json

    minutes = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"][:4])
        minutes[path.name[:2]] = int(re.search(r"\*\*Time\*\* — about (\d+) minutes", text)[1])
    return minutes


def test_the_syllabus_gives_each_notebook_its_own_time():
    """The guide's minutes beside a notebook, "05 pipeline execution (20)" or "12 (…, ~20
    minutes", are the notebook's own "**Time**" line: one estimate, not two that drift."""
    text = (ROOT / "docs" / "course.md").read_text()
    table = r"(?:\| \d+ \| |; )(\d\d) [^|;(\n]+\((\d+)(?: min)?\)"   # "| 3 | 04 pipel… (15)"
    stated = {n: int(m) for n, m in re.findall(table, text)}
    stated |= {n: int(m) for n, m in re.findall(
        r"Notebook (\d\d)\b[^~.]*?(?:~|about )(\d+)\s+minutes", text)}
    own = _notebook_minutes()
    assert set(stated) == set(own) and {n: own[n] for n in stated} == stated


def test_code_the_docs_quote_is_the_package_code_as_it_is():
    """A docs page's block headed "# megatron_edu/….py: name" quotes that object's source whole:
    the quote cannot drift from the code."""
    import importlib
    import inspect
    import textwrap

    quoted = 0
    for path in (ROOT / "docs").glob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            header = re.match(r"# megatron_edu/(\S+)\.py: (\S+)\n", block)
            if header is None:
                continue
            obj = importlib.import_module("megatron_edu." + header[1].replace("/", "."))
            for name in header[2].split("."):
                obj = getattr(obj, name)
            source = textwrap.dedent(inspect.getsource(obj)).strip()
            assert textwrap.dedent(block[header.end():]).strip() == source, (path.name, header[0])
            quoted += 1
    assert quoted >= 3
