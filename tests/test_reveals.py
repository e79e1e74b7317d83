"""Every exercise before its answer (``megatron_edu/course/reveals.py``): no student notebook lets
a learner meet an exercise's answer before the exercise, and the search sees each answer that
the second edition showed early, quoted here from its notebooks."""

import json
import shutil
from pathlib import Path

import pytest

from megatron_edu.course.exercises import EXERCISES
from megatron_edu.course.reveals import fingerprints, reveals

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_no_learner_meets_an_answer_before_its_exercise():
    found = reveals(NOTEBOOKS)
    assert found == [], "answers shown before their exercise:\n" + "\n".join(map(str, found))


def test_every_exercise_has_fingerprints():
    prints = fingerprints(NOTEBOOKS)
    assert sorted(prints) == sorted(EXERCISES)
    assert [e for e, patterns in prints.items() if not patterns] == []


# What gave each answer away in the second edition (issue 36 §2), as its cells said it: kind,
# source, printed output. Each is put back before its exercise, and must be found there.
SECOND_EDITION = {
    "12.1": ("code", "lse = torch.logaddexp(l1, l2)\n"
                     "merged = (l1 - lse).exp() * o1 + (l2 - lse).exp() * o2", ""),
    "12.2": ("markdown", "megatron-core and torchtitan split the sequence into 2·cp chunks\n"
                         "instead and give rank i chunks i and 2·cp − 1 − i — one early, one late",
             ""),
    "12.2 printed": ("code", 'for r in range(4):\n    print(f"rank {r} holds positions '
                             '{split(x, r, 4)[0].tolist()}")',
                     "rank 0 holds positions [0, 1, 14, 15]\n"),
    "12.3": ("code", "    r, n = group.rank, group.size\n"
                     "    for work in comm.batch_isend_irecv([comm.P2POp(\"send\", block, "
                     "group.ranks[(r + 1) % n]),\n"
                     "                                        comm.P2POp(\"recv\", received, "
                     "group.ranks[(r - 1) % n])],\n                                       group):",
             ""),
    "06.2": ("code", "for i, (x, y) in enumerate(pieces):\n"
                     "    loss = model(x, y) / microbatches\n"
                     "    with ddp.sync(i == microbatches - 1):\n        loss.backward()\n"
                     "ddp.finish_grad_sync()", ""),
    "05.1": ("code", 'deadlock = Schedule([[Action("F", 0), Action("B", 0), Action("F", 1), '
                     'Action("B", 1)],\n'
                     '                     [Action("F", 1), Action("F", 0), Action("B", 0), '
                     'Action("B", 1)]], two_stages)', ""),
    "13.1": ("markdown", "| 1, P_os | the optimizer state | 2Ψ + 2Ψ + KΨ/d |\n"
                         "| 2, P_os+g | and the gradients | 2Ψ + (2 + K)Ψ/d |", ""),
    "13.3": ("markdown", "the lines read: plain DP and ZeRO-1 **2** at every m; ZeRO-2 **m + 1**; "
                         "ZeRO-3 **3m**", ""),
    "04.1": ("markdown", "1F1B starts backwards early and holds at most **p − r** on rank r — "
                         "independent of m", ""),
    "04.1 printed": ("code", 'print(f"{name:<15} peak activations per rank: '
                             '{run.peak_activations}")',
                     "1f1b            peak activations per rank: [4, 3, 2, 1]\n"),
    "10.1": ("markdown", "the bytes one layer keeps for backward in fp16 (2205.05198 Table 2): "
                         "s·b·h·(34 + 5·a·s/h) alone; s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor "
                         "parallelism", ""),
    "14.1": ("markdown", "Return the pair (Megatron-LM's code, 1909.08053's text):\n"
                         "exp(L / (W − 1)) and exp(L / W), L the summed loss.", ""),
    "11.2": ("markdown", "* **(b) rearranged, pre-LN** (GPT-2's, and Megatron-BERT's): "
                         "x ← x + f(LN(x)), and one last\n  LN before the output.", ""),
    "17.1": ("markdown", "| data parallelism | `DataParallel(chunks, grid.dp_group, …, "
                         "average=False)` | gradients in buckets, summed over the replicas |", ""),
    "17.2": ("markdown", "2. **the pipeline**: `run_schedule(…, RunSettings(scatter_gather=True, "
                         "grad_sync=lambda chunk, last: parts.ddp.sync(last)))`", ""),
    "16.3": ("code", 'for m in (4, 8):\n    print(f"m={m}: interleaving wins: '
                     '{nb16.interleaving_wins(m)}")', "m=4: interleaving wins: True\n"),
}


def _cell(kind: str, source: str, printed: str) -> dict:
    if kind == "markdown":
        return {"cell_type": "markdown", "metadata": {}, "source": [source]}
    outputs = [{"output_type": "stream", "name": "stdout", "text": [printed]}] if printed else []
    return {"cell_type": "code", "metadata": {}, "source": [source], "outputs": outputs,
            "execution_count": None}


def test_the_answers_the_second_edition_showed_early_are_found(tmp_path):
    """Each quote, put back as the second cell of its exercise's notebook (before the exercise
    in any form), is reported there: the search sees every reveal issue 36 §2 lists."""
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder, ignore=shutil.ignore_patterns("student", ".*"))
    planted = {}
    for case, cell in SECOND_EDITION.items():
        exercise = case.split()[0]
        path = next(folder.glob(f"{exercise[:2]}_*.ipynb"))
        notebook = json.loads(path.read_text())
        index = 1 + sum(1 for other in planted.values() if other[0] == path.name)  # in order
        notebook["cells"].insert(index, _cell(*cell))
        path.write_text(json.dumps(notebook))
        planted[case] = (path.name, index)
    seen = {(r.exercise, r.notebook, r.cell) for r in reveals(folder)}
    missed = [case for case, (name, index) in planted.items()
              if (case.split()[0], name, index) not in seen]
    assert missed == []


@pytest.mark.parametrize("exercise", ["12.1", "13.3", "17.2"])
def test_an_answer_shown_after_its_exercise_is_no_reveal(tmp_path, exercise):
    """The same quote after the exercise's check is what the exercise-first form allows."""
    folder = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, folder, ignore=shutil.ignore_patterns("student", ".*"))
    path = next(folder.glob(f"{exercise[:2]}_*.ipynb"))
    notebook = json.loads(path.read_text())
    check = max(i for i, c in enumerate(notebook["cells"])
                if f'check("{exercise}"' in "".join(c["source"]))
    notebook["cells"].insert(check + 1, _cell(*SECOND_EDITION[exercise]))
    path.write_text(json.dumps(notebook))
    assert [r for r in reveals(folder) if r.exercise == exercise] == []
