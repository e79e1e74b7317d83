"""The student notebooks: every solution becomes a stub, and the stubs run to the checkers, which
answer each exercise with "not done yet" (the solutions themselves pass under nbval)."""

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from megatron_edu.course.exercises import EXERCISES
from megatron_edu.course.student import main, student_source

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTION = '''def f(x):
    """Double x."""
    # BEGIN SOLUTION
    return 2 * x
    # END SOLUTION


check("00.1", f)'''


def test_a_solution_becomes_a_stub_naming_its_exercise():
    assert student_source(SOLUTION) == '''def f(x):
    """Double x."""
    raise NotImplementedError("exercise 00.1: your code here")


check("00.1", f)'''


@pytest.mark.parametrize("broken", [
    SOLUTION.replace("    # END SOLUTION\n", ""),
    SOLUTION.replace('check("00.1", f)', "f(1)"),
], ids=["unclosed", "no-check"])
def test_a_malformed_solution_is_refused(broken):
    with pytest.raises(ValueError):
        student_source(broken)


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    assert main([str(ROOT / "notebooks"), str(out)]) == 0
    return out


def _code(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                     if c["cell_type"] == "code")


def test_every_exercise_is_checked_in_a_notebook_and_every_solution_is_stubbed(students):
    checked = {}
    for path in NOTEBOOKS:
        for exercise in re.findall(r"""check\(\s*["'](\d\d\.\d+)["']""", _code(path)):
            checked[exercise] = path.name
        student = _code(students / path.name)
        assert "BEGIN SOLUTION" not in student and "END SOLUTION" not in student
        assert student.count("raise NotImplementedError(") >= _code(path).count("BEGIN SOLUTION")
    assert sorted(checked) == sorted(EXERCISES)


def _exercise_cells(notebook):
    """The first code cell (the imports) and everything from the '## Exercises' heading on."""
    cells = notebook.cells
    start = next(i for i, c in enumerate(cells)
                 if c.cell_type == "markdown" and c.source.startswith("## Exercises"))
    first = next(c for c in cells if c.cell_type == "code")
    return [first] + [c for c in cells[start:] if c.cell_type == "code"]


def test_the_student_exercises_run_and_each_check_says_not_done_yet(students):
    """Every notebook's exercise section, one after another in one kernel (a kernel start per
    notebook would cost more than its checks): no error, and each check is "not done yet"."""
    combined, owner = nbformat.v4.new_notebook(), []
    for path in NOTEBOOKS:
        if "check(" in _code(path):
            cells = _exercise_cells(nbformat.read(students / path.name, as_version=4))
            combined.cells += cells
            owner += [path.name] * len(cells)
    NotebookClient(combined, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    verdicts: dict[str, list[str]] = {name: [] for name in owner}
    for name, cell in zip(owner, combined.cells, strict=True):
        for output in cell.outputs:
            assert output.output_type != "error", f"{name}: " + "".join(output.get("traceback", []))
            if output.output_type == "execute_result":
                verdicts[name].append(output.data["text/plain"])
    for name, lines in verdicts.items():
        expected = re.findall(r"""check\(\s*["'](\d\d\.\d+)["']""", _code(students / name))
        assert [v.split()[1] for v in lines if v.startswith("✗")] == expected, name
        assert all("not done yet" in v for v in lines), name
