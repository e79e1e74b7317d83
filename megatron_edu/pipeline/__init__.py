"""Pipeline parallelism (2104.04473 §2.2; zero bubble, 2401.10241).

stages.py     StageMap: which rank and chunk hold each virtual stage; the messages between them
schedules.py  schedules as data (GPipe, 1F1B, interleaved, ZB-H1/H2/V), checked by one walk
simulate.py   a schedule played with fixed costs: its timeline, bubble and memory in flight
reference.py  1F1B (and GPipe) as one readable loop over real sends and receives
engine.py     any schedule executed for real, over the transports of p2p.py
backward.py   a stage's backward pass, whole or split into B and W
"""

from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    check_schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
    zero_bubble_v,
)
from megatron_edu.pipeline.simulate import simulate
from megatron_edu.pipeline.stages import StageMap

__all__ = ["Action", "Schedule", "StageMap", "check_schedule", "gpipe", "interleaved_one_f_one_b",
           "make_schedule", "one_f_one_b", "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v",
           "simulate"]
