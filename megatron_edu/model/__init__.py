"""The models (1909.08053 §3, §5.3; 2104.04473 §2.2): configurations, GPT, BERT, pipeline stages.

config.py  GPTConfig, BertConfig: sizes, presets, checks before launching
gpt.py     GPT from tensor-parallel layers (the blocks BERT shares); stage_layers for pipelines
bert.py    BERT: the same blocks, bidirectional, with its masked-LM and sentence-order heads
hf.py      Hugging Face GPT-2 weights in and out
"""

from megatron_edu.model.bert import BERT
from megatron_edu.model.config import BertConfig, GPTConfig, config_from_dict
from megatron_edu.model.gpt import GPT, stage_layers

__all__ = ["GPTConfig", "BertConfig", "config_from_dict", "GPT", "BERT", "stage_layers"]
