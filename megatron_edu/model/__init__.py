"""The models (1909.08053 §3, §5.3; 2104.04473 §2.2): GPT-2 (``gpt.py``), BERT (``bert.py``) and
Llama (``llama.py``) on the tensor-parallel blocks they share and their pipeline stages
(``transformer.py``), with the attention cores (``attention.py``), fused chains (``fused.py``) and
configurations (``config.py``).
"""

from megatron_edu.grid import ParallelGrid
from megatron_edu.model.bert import BERT
from megatron_edu.model.config import BertConfig, GPTConfig, LlamaConfig, config_from_dict
from megatron_edu.model.gpt import GPT
from megatron_edu.model.llama import Llama
from megatron_edu.model.transformer import compile_blocks

__all__ = ["GPTConfig", "BertConfig", "LlamaConfig", "config_from_dict", "GPT", "BERT", "Llama",
           "build_model", "compile_blocks"]

# the model each configuration describes
MODELS = {GPTConfig: GPT, BertConfig: BERT, LlamaConfig: Llama}


def build_model(config: GPTConfig, grid: ParallelGrid | None = None, *,
                layers: range | None = None, first: bool = True, last: bool = True) -> GPT | BERT:
    """This rank's stage of the model ``config`` describes (``MODELS``), built and initialised,
    as the pipeline engine and checkpoints build theirs; the arguments as for ``GPT``."""
    if type(config) not in MODELS:
        raise TypeError(f"no model is built from a {type(config).__name__}")
    return MODELS[type(config)](config, grid, layers=layers, first=first, last=last)
