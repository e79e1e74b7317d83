"""Write the student notebooks: every solution replaced by a stub, every output cleared.

    python -m megatron_edu.course.student [NOTEBOOKS] [OUT]     # make student-notebooks

In the notebooks (which hold the solutions) each solution sits between two comment lines::

    def ring_all_reduce(x):
        \"\"\"...the task...\"\"\"
        # BEGIN SOLUTION
        ...
        # END SOLUTION

    check("00.1", ring_all_reduce)

and the student version keeps everything but what lies between them, which becomes
``raise NotImplementedError("exercise 00.1: your code here")`` at the same indentation — so the
student notebook runs, and the checker answers each exercise with "not done yet" until it is done.

A cell that shows what an exercise asks the learner to write carries the tag ``answers-NN.k``:
the student version comments a code cell out behind a pointer to run it once exercise NN.k
passes, and replaces a markdown cell by a pointer to the solution notebook
(``tests/test_student_notebooks.py`` finds every "read the code" cell that needs the tag by its
output; ``reveals.py`` finds every other answer met before its exercise).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

__all__ = ["student_source", "answer_pointer", "prose_pointer", "answers_of"]

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_CHECK = re.compile(r"""check\(\s*["'](\d\d\.\d+)["']""")
ANSWERS = "answers-"  # a cell tag: "answers-04.2" — the cell shows what exercise 04.2 asks for


def student_source(source: str) -> str:
    """A code cell's source with each solution block replaced by its stub."""
    ids = _CHECK.findall(source)
    lines, out, inside = source.split("\n"), [], False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"line {number}: {BEGIN} inside another solution")
            if not ids:
                raise ValueError(f"line {number}: a solution in a cell with no check(\"NN.k\", …)")
            indent = line[:len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("exercise {ids[0]}: your code here")')
            inside = True
        elif stripped == END:
            if not inside:
                raise ValueError(f"line {number}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    return "\n".join(out)


def answers_of(cell: dict) -> list[str]:
    """The exercises whose answer a cell shows, from its ``answers-NN.k`` tags."""
    tags = cell.get("metadata", {}).get("tags", [])
    return [tag.removeprefix(ANSWERS) for tag in tags if tag.startswith(ANSWERS)]


def answer_pointer(source: str, exercises: list[str]) -> str:
    """A cell that would show an answer, commented out behind a pointer to run it afterwards."""
    which = " and ".join(exercises)
    pointer = [f"# Exercise {which} asks you to write what this cell shows: the package's own",
               "# code. Once your answer passes, uncomment the lines below and run them."]
    return "\n".join(pointer + [f"# {line}" if line else "#" for line in source.split("\n")])


def prose_pointer(exercises: list[str]) -> str:
    """A markdown cell that would give an answer away, as the student version has it."""
    which = " and ".join(exercises)
    return (f"*This cell explains the answer to exercise {which}. Once your answer passes, read "
            "it in the solution notebook beside this one (`notebooks/`, same name).*")


def student_notebook(notebook: dict) -> dict:
    """The student version of a notebook (as loaded JSON): stubs, no answer shown before its
    exercise, and no outputs."""
    cells = []
    for cell in notebook["cells"]:
        cell = dict(cell)
        if cell["cell_type"] == "code":
            source = student_source("".join(cell["source"]))
            if answers_of(cell):
                source = answer_pointer(source, answers_of(cell))
            cell.update(source=_lines(source), outputs=[], execution_count=None)
            cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items()
                                if k != "execution"}
        elif answers_of(cell):
            cell["source"] = _lines(prose_pointer(answers_of(cell)))
        cells.append(cell)
    return {**notebook, "cells": cells}


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def write_student_notebooks(source: Path, out: Path) -> tuple[list[Path], list[Path]]:
    """Every ``NN_*.ipynb`` of ``source`` as its student version in ``out``: the paths written,
    and those kept — a student notebook already there holds the learner's work and is never
    overwritten (delete it to start that notebook afresh)."""
    out.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        target = out / path.name
        if target.exists():
            kept.append(target)
            continue
        notebook = student_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written, kept


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_edu.course.student [NOTEBOOKS] [OUT]``: write the student notebooks."""
    args = sys.argv[1:] if argv is None else argv
    source = Path(args[0]) if args else Path("notebooks")
    out = Path(args[1]) if len(args) > 1 else source / "student"
    written, kept = write_student_notebooks(source, out)
    for path in written:
        print(f"wrote {path}")
    if kept:
        print(f"kept {len(kept)} student notebooks already in {out} (your work; delete one to "
              "start it afresh)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
