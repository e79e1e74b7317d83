"""Pipeline parallelism (2104.04473 §2.2; zero bubble, 2401.10241): read ``reference.py`` (1F1B
as a loop) first, then ``stages.py``, ``schedules.py``, ``simulate.py``, ``engine.py``."""

from megatron_edu.pipeline.schedules import (
    Action,
    PipelineConfig,
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

__all__ = ["Action", "PipelineConfig", "Schedule", "StageMap", "check_schedule", "gpipe",
           "interleaved_one_f_one_b", "make_schedule", "one_f_one_b", "zero_bubble_h1",
           "zero_bubble_h2", "zero_bubble_v", "simulate"]
