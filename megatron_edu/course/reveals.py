"""Does a learner meet an exercise before its answer? A search of the student notebooks.

    python -m megatron_edu.course.reveals [NOTEBOOKS]     # every answer found before its exercise

A learner reads the notebooks in their numbered order, so what they have seen before exercise
NN.k is every earlier notebook and the cells of notebook NN above the exercise's heading, as the
student version has them: prose, the code they can run, and what that code prints when run (the
solution notebook's outputs of the cells the student version keeps live). The answer is
recognised there by three kinds of fingerprint:

* the lines of the solution (between ``# BEGIN SOLUTION`` and ``# END SOLUTION``);
* the lines of the package code the exercise rewrites (``@exercise(..., reference=)``);
* the exercise's own marks (``@exercise(..., marks=)``): the constants the answer prints and the
  formula the checker compares with, as regular expressions over text with its spaces removed.

A line of the answer that an earlier notebook teaches as it stands (``@exercise(..., taught=)``)
is a piece the exercise asks the learner to put together, not a fingerprint.

Code is compared with its spaces removed, so a copy reformatted still matches. A line of code
met in ``COMMON`` or more cells of the course (``optimizer.step()``, ``ctx.group = group``) is the
package's vocabulary, not an answer, and is not a fingerprint; marks always are. The exercise's
own prompt and stub are searched too: a prompt that states the formula gives the answer away. A
cell tagged ``answers-NN.k`` is commented out in the student version (``student.py``) and shows
nothing.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from megatron_edu.course.exercises import EXERCISES, MARKS, REFERENCES, TAUGHT
from megatron_edu.course.student import BEGIN, END, answers_of, student_notebook

__all__ = ["Reveal", "fingerprints", "reveals"]

_MIN_LINE = 16          # characters, spaces removed: shorter lines ("returnx") say nothing
COMMON = 3              # cells: a line of code met this often is vocabulary
_CHECK = re.compile(r"""\bcheck\(\s*["'](\d\d\.\d+)["']""")


@dataclass(frozen=True)
class Reveal:
    """Exercise ``exercise``'s answer, found in ``notebook``'s cell ``cell`` by ``fingerprint``."""

    exercise: str
    notebook: str
    cell: int
    fingerprint: str

    def __str__(self) -> str:
        return f"{self.exercise}: {self.notebook} [{self.cell}] shows {self.fingerprint!r}"


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _code_lines(source: str) -> list[str]:
    """The lines of code that say something: no comments, docstrings or short lines."""
    body = source.split('"""')[2] if source.lstrip().startswith(("def ", "class ", "@")) \
        and source.count('"""') >= 2 else source
    lines = []
    for line in body.splitlines():
        line = _squeeze(re.sub(r"\s+#.*$", "", line))
        line = line.removeprefix("return")
        if len(line) >= _MIN_LINE and not line.startswith(("#", "def", "class", "@", '"""')):
            lines.append(line)
    return lines


def _solutions(folder: Path) -> dict[str, list[str]]:
    """Each exercise's solution lines, from the cell that checks it."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and BEGIN in source:
                solution = re.findall(rf"{re.escape(BEGIN)}\n(.*?){re.escape(END)}", source, re.S)
                for exercise in _CHECK.findall(source):
                    found.setdefault(exercise, []).extend(
                        line for block in solution for line in _code_lines(block))
    return found


def fingerprints(folder: Path, cells: list[tuple[str, int, str]] | None = None
                 ) -> dict[str, list[re.Pattern]]:
    """Each exercise's fingerprints: its solution's lines and its reference's, less the course's
    common vocabulary (counted over ``cells``, by default the folder's), and its marks."""
    solutions = _solutions(folder)
    texts = [text for _, _, text in (cells if cells is not None else _cells(folder))]
    prints = {}
    for exercise in EXERCISES:
        lines = solutions.get(exercise, []) + [
            line for obj in REFERENCES[exercise]
            for line in _code_lines(textwrap.dedent(inspect.getsource(inspect.unwrap(obj))))]
        taught = {_squeeze(line) for line in TAUGHT.get(exercise, ())}
        lines = [line for line in dict.fromkeys(lines)
                 if sum(line in text for text in texts) < COMMON and line not in taught]
        prints[exercise] = ([re.compile(re.escape(line)) for line in lines]
                            + [re.compile(mark) for mark in MARKS.get(exercise, ())])
    return prints


def _visible(cell: dict, solution: dict) -> str:
    """What the learner sees of one student cell, spaces removed: its prose, or its live code
    and what that code prints when run (a check's output is the learner's own, not shown)."""
    source = "".join(cell["source"])
    if cell["cell_type"] == "markdown":
        return _squeeze(source)
    live = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    if answers_of(solution) or _CHECK.search(source):
        return _squeeze(live)
    printed = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                      for o in solution.get("outputs", []))
    return _squeeze(live + "\n" + printed)


def _cells(folder: Path) -> list[tuple[str, int, str]]:
    """Every (notebook, cell index, what the learner sees of it), in reading order."""
    cells = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        solution = json.loads(path.read_text())
        student = student_notebook(solution)
        cells += [(path.name, index, _visible(cell, original)) for index, (cell, original)
                  in enumerate(zip(student["cells"], solution["cells"], strict=True))]
    return cells


def _seen_before(cells: list[tuple[str, int, str]]) -> dict[str, list[tuple[str, int, str]]]:
    """For each exercise: the cells a learner has met up to its check, the exercise's prompt
    and stub included."""
    seen: dict[str, list[tuple[str, int, str]]] = {}
    for position, (_, _, text) in enumerate(cells):
        for exercise in _CHECK.findall(text):
            seen.setdefault(exercise, cells[:position + 1])
    return seen


def reveals(folder: Path) -> list[Reveal]:
    """Every fingerprint of an exercise's answer found before the exercise."""
    cells = _cells(folder)
    prints, seen = fingerprints(folder, cells), _seen_before(cells)
    found = []
    for exercise, patterns in prints.items():
        for notebook, index, text in seen.get(exercise, []):
            hits = [p.pattern for p in patterns if p.search(text)]
            found += [Reveal(exercise, notebook, index, hit) for hit in hits]
    return found


if __name__ == "__main__":
    hits = reveals(Path(sys.argv[1] if len(sys.argv) > 1 else "notebooks"))
    print("\n".join(map(str, hits)) or "no answer shown before its exercise")
