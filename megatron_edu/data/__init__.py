"""Data for the end-to-end GPT: corpus, sentencepiece tokenizer, token dataset and sampler.

``PRETRAINED_CHECKPOINT``: notebook 09's small GPT (4 layers, hidden 64, V = 500) trained longer
on the built-in corpus, weights only, so the notebook can show what more steps buy without
spending them (its ``meta.json`` says how it was trained).
"""

from pathlib import Path

from megatron_edu.data.corpus import (
    DEFAULT_CACHE_DIR,
    default_corpus,
    load_corpus,
    load_text_files,
    load_wikitext103,
)
from megatron_edu.data.dataset import (
    BatchSampler,
    TokenDataset,
    encode_documents,
    prepare_data,
    split_point,
    unigram_entropy,
)
from megatron_edu.data.tokenizer import Tokenizer, train_tokenizer

PRETRAINED_CHECKPOINT = Path(__file__).with_name("pretrained_gpt")

__all__ = [
    "DEFAULT_CACHE_DIR",
    "PRETRAINED_CHECKPOINT",
    "BatchSampler",
    "TokenDataset",
    "Tokenizer",
    "default_corpus",
    "encode_documents",
    "load_corpus",
    "load_text_files",
    "load_wikitext103",
    "prepare_data",
    "split_point",
    "train_tokenizer",
    "unigram_entropy",
]
