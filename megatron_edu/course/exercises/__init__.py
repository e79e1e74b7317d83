"""Exercises for the notebooks, each with a checker that answers in words.

    from megatron_edu.course.exercises import check
    check("00.1", ring_all_reduce)      # ✓ 00.1 …: passed …   or   ✗ 00.1 …: a hint

``EXERCISES`` maps each id ("NN.k": notebook NN, exercise k) to its title. The checkers live in
``nbNN.py``, one module per notebook, and run the learner's function — on several ranks where
the exercise is about communication — against the package's own implementation. Solutions are
in the notebooks between ``# BEGIN SOLUTION`` and ``# END SOLUTION``; ``make student-notebooks``
(``python -m megatron_edu.course.student``) writes ``notebooks/student/`` with each solution
replaced by a ``raise NotImplementedError``, which the checker answers with "not done yet".
"""

import importlib
import pkgutil

from megatron_edu.course.exercises.checking import (
    EXERCISES,
    MARKS,
    REFERENCES,
    TAUGHT,
    CheckResult,
    Hint,
    check,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("nb")):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["EXERCISES", "MARKS", "REFERENCES", "TAUGHT", "CheckResult", "Hint", "check"]
