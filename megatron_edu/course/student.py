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
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

__all__ = ["student_source", "student_notebook", "write_student_notebooks"]

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_CHECK = re.compile(r"""check\(\s*["'](\d\d\.\d+)["']""")


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


def student_notebook(notebook: dict) -> dict:
    """The student version of a notebook (as loaded JSON): stubs, and no outputs."""
    cells = []
    for cell in notebook["cells"]:
        cell = dict(cell)
        if cell["cell_type"] == "code":
            cell.update(source=_lines(student_source("".join(cell["source"]))), outputs=[],
                        execution_count=None)
            cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items()
                                if k != "execution"}
        cells.append(cell)
    return {**notebook, "cells": cells}


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def write_student_notebooks(source: Path, out: Path) -> list[Path]:
    """Every ``NN_*.ipynb`` of ``source`` as its student version in ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        notebook = student_notebook(json.loads(path.read_text()))
        target = out / path.name
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_edu.course.student [NOTEBOOKS] [OUT]``: write the student notebooks."""
    args = sys.argv[1:] if argv is None else argv
    source = Path(args[0]) if args else Path("notebooks")
    out = Path(args[1]) if len(args) > 1 else source / "student"
    for path in write_student_notebooks(source, out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
