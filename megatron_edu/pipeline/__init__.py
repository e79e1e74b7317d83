"""Pipeline parallelism (2104.04473 §2.2; zero bubble, 2401.10241): schedules as data, and their
simulator."""

from .schedules import (
    Action,
    check_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
    zero_bubble_v,
)
from .simulate import simulate

__all__ = ["Action", "check_schedule", "gpipe", "interleaved_one_f_one_b", "one_f_one_b",
           "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v", "simulate"]
