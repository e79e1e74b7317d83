"""The GPT model (1909.08053 §3; 2104.04473 §2.2): configuration, model and pipeline stages.

config.py  GPTConfig: sizes, presets, checks before launching
gpt.py     GPT built from tensor-parallel layers; stage_layers for the pipeline
hf.py      Hugging Face GPT-2 weights in and out
"""

from megatron_edu.model.config import GPTConfig
from megatron_edu.model.gpt import GPT, stage_layers

__all__ = ["GPTConfig", "GPT", "stage_layers"]
