"""``from megatron_edu.exercises import check``: the exercises live in ``megatron_edu.course``."""

from megatron_edu.course.exercises import EXERCISES, CheckResult, Hint, check

__all__ = ["EXERCISES", "CheckResult", "Hint", "check"]
