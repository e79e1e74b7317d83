"""Pipeline parallelism (2104.04473 §2.2): schedules as data, and their simulator."""

from .schedules import Action, check_schedule, gpipe, interleaved_one_f_one_b, one_f_one_b
from .simulate import simulate

__all__ = ["Action", "check_schedule", "gpipe", "interleaved_one_f_one_b", "one_f_one_b",
           "simulate"]
