"""Kept for its callers: Hugging Face GPT-2 interop lives in ``megatron_edu.hf``, beside the
checkpoints — a conversion of files, not part of the model."""

from megatron_edu.hf import config_from_hf, load_hf_gpt2, read_hf_gpt2, save_hf_gpt2

__all__ = ["load_hf_gpt2", "save_hf_gpt2", "config_from_hf", "read_hf_gpt2"]
