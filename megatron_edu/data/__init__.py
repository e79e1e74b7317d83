"""Data for the end-to-end GPT: corpus, sentencepiece tokenizer, token dataset and sampler."""

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
    build_token_file,
    encode_documents,
    prepare_data,
    split_point,
    unigram_entropy,
)
from megatron_edu.data.tokenizer import Tokenizer, train_tokenizer

__all__ = [
    "DEFAULT_CACHE_DIR",
    "BatchSampler",
    "TokenDataset",
    "Tokenizer",
    "build_token_file",
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
