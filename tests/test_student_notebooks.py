"""The student notebooks: every solution becomes a stub, and the stubs run to the checkers, which
answer each exercise with "not done yet" (the solutions themselves pass under nbval); no student
notebook shows, before an exercise, the package source that the exercise asks the learner to
write."""

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from megatron_edu.course.exercises import EXERCISES, REFERENCES
from megatron_edu.course.student import (
    answer_pointer,
    answers_of,
    main,
    student_notebook,
    student_source,
)

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
    """The first code cell (the imports) and the code of the '## Exercises' section, up to the
    next heading of its level (an appendix after it is the solution notebook's, which nbval
    runs, and no exercise needs it)."""
    cells = notebook.cells
    start = next(i for i, c in enumerate(cells)
                 if c.cell_type == "markdown" and c.source.startswith("## Exercises"))
    end = next((i for i, c in enumerate(cells[start + 1:], start + 1)
                if c.cell_type == "markdown" and c.source.startswith("## ")), len(cells))
    first = next(c for c in cells if c.cell_type == "code")
    return [first] + [c for c in cells[start:end] if c.cell_type == "code"]


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
                   resources={"metadata": {"path": str(students)}}).execute()  # as opened
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


def _normalised(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def _shown_sources(cell: dict) -> list[str]:
    """What a "read the code" cell printed (its committed output): one text per object shown,
    each under ``show_source``'s header line ``# megatron_edu/…: name``."""
    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")
    blocks = re.split(r"^# megatron_edu/\S+: \S+$", text, flags=re.M)[1:]
    return [_normalised(block) for block in blocks]


def _reference_sources() -> dict[str, list[str]]:
    return {exercise: [_normalised(textwrap.dedent(inspect.getsource(inspect.unwrap(obj))))
                       for obj in objects] for exercise, objects in REFERENCES.items()}


def _reveals(shown: str, reference: str) -> bool:
    """The shown source contains the reference, or is a piece of it (a method of its class)."""
    return reference in shown or (shown in reference and shown.count("\n") >= 3)


def _answers_shown_early() -> dict[tuple[str, int], set[str]]:
    """(notebook, cell index) -> the exercises whose reference the cell's committed output shows
    before the exercise: in an earlier notebook, or in its own before its ``## Exercises``."""
    references, found = _reference_sources(), {}
    for path in NOTEBOOKS:
        number, before_exercises = path.name[:2], True
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith(
                    "## Exercises"):
                before_exercises = False
            later = {e for e in references
                     if e[:2] > number or (e[:2] == number and before_exercises)}
            shown = {e for e in later for block in _shown_sources(cell)
                     for ref in references[e] if _reveals(block, ref)}
            if shown:
                found[(path.name, index)] = shown
    return found


def test_every_cell_showing_an_answer_before_its_exercise_is_tagged_and_hidden(students):
    """Found by what the solution notebooks print, not by their tags: a new "read the code" cell
    that prints an exercise's reference before the exercise fails here until it is tagged."""
    early = _answers_shown_early()
    assert {"04.2", "03.3", "17.2"} <= set().union(*early.values())  # the test can see
    tagged = {}
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and answers_of(cell):
                tagged[(path.name, index)] = set(answers_of(cell))
    assert tagged == early, "tag each cell answers-NN.k for exactly the exercises it shows"
    for name, index in tagged:
        cell = json.loads((students / name).read_text())["cells"][index]
        live = [line for line in "".join(cell["source"]).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
        assert live == [], f"{name} cell {index} still runs {live}"


def test_a_hidden_cell_is_the_original_commented_out_behind_its_pointer():
    source = "import inspect\n\nshow_source(one_f_one_b)"
    hidden = answer_pointer(source, ["04.2"])
    assert hidden.startswith("# Exercise 04.2 asks you to write what this cell shows")
    ast.parse(hidden)
    restored = [line[2:] if line.startswith("# ") else "" for line in hidden.splitlines()[2:]]
    assert "\n".join(restored) == source


def test_prose_tagged_as_an_answer_is_a_pointer_in_the_student_version():
    revealing = {"cell_type": "markdown", "metadata": {"tags": ["answers-13.3"]},
                 "source": ["ZeRO-2 sends m + 1 halves."]}
    plain = {"cell_type": "markdown", "metadata": {}, "source": ["ZeRO shards the state."]}
    cells = student_notebook({"cells": [revealing, plain]})["cells"]
    assert "m + 1" not in "".join(cells[0]["source"])
    assert "exercise 13.3" in "".join(cells[0]["source"]) and cells[1] == plain


def test_writing_the_student_notebooks_again_keeps_the_learners_work(tmp_path):
    source = tmp_path / "notebooks"
    source.mkdir()
    (source / "00_a.ipynb").write_text((ROOT / "notebooks" / NOTEBOOKS[0].name).read_text())
    assert main([str(source), str(tmp_path / "student")]) == 0
    mine = tmp_path / "student" / "00_a.ipynb"
    mine.write_text("my answers")
    assert main([str(source), str(tmp_path / "student")]) == 0
    assert mine.read_text() == "my answers"


def _stub(block, group):
    """A student's placeholder."""
    raise NotImplementedError("exercise 12.3: your code here")


def _unfinished(rank, cp):
    if cp > 4:
        raise NotImplementedError("only this branch is left")
    return (rank, 2 * cp - 1 - rank)


def test_a_stub_is_answered_at_once_and_anything_else_is_run():
    """The placeholder is answered "not done yet" without starting the checker's ranks; a
    function that only sometimes raises is checked for real (and is told what is wrong)."""
    from megatron_edu.course.exercises import check
    from megatron_edu.course.exercises.checking import _stub_message

    assert _stub_message(_stub) == "exercise 12.3: your code here"
    assert _stub_message(_unfinished) is None and _stub_message(len) is None
    assert "not done yet" in check("12.3", _stub).message
    assert "not done yet" in check("12.2", _unfinished).message  # raised at cp = 8, for real
    assert "cp = 8" not in check("12.3", _stub).message
