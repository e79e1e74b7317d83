"""The data pipeline: corpus, tokenizer, token dataset, deterministic data-parallel sampler."""

import json
import math
import pickle
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_edu.checkpoint import load_full_model_state, read_metadata
from megatron_edu.data import (
    PRETRAINED_CHECKPOINT,
    BatchSampler,
    TokenDataset,
    Tokenizer,
    default_corpus,
    encode_documents,
    load_corpus,
    load_text_files,
    load_wikitext103,
    prepare_data,
    split_point,
    train_tokenizer,
    unigram_entropy,
)
from megatron_edu.data import corpus as corpus_module
from megatron_edu.data import dataset as dataset_module
from megatron_edu.data import tokenizer as tokenizer_module
from megatron_edu.data.corpus import documents_sha256, stdlib_docstrings
from megatron_edu.data.dataset import token_dtype
from megatron_edu.data.prepare import main as prepare_main
from megatron_edu.perf import num_parameters

VOCAB = 512


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def corpus(corpus_cache):
    return default_corpus(corpus_cache)


@pytest.fixture(scope="module")
def small_corpus(corpus):
    return corpus[:40]  # ~100 KB: enough for a 512-token vocabulary, trained in a blink


@pytest.fixture(scope="module", params=["bpe", "byte-bpe"])
def kind(request):
    """sentencepiece's BPE (the default), and a byte-level BPE of the tokenizers library."""
    return request.param


@pytest.fixture(scope="module")
def tokenizer(small_corpus, corpus_cache, kind):
    return train_tokenizer(small_corpus, VOCAB, corpus_cache, model_type=kind)


# ---------------------------------------------------------------------------------------------
# The default corpus
# ---------------------------------------------------------------------------------------------


def test_default_corpus_is_a_few_megabytes(corpus):
    size = sum(len(document.encode("utf-8")) for document in corpus)
    assert 1_000_000 < size < 20_000_000


def test_default_corpus_holds_stdlib_docstrings(corpus):
    assert any("Serialize ``obj`` to a JSON formatted ``str``." in doc for doc in corpus)


def test_default_corpus_ends_with_python_reference_topics(corpus):
    assert corpus[-1].startswith('The "yield" statement\n*****')  # the last topic, by key


# The fingerprint of the shipped corpus, written out here too: a changed corpus (which changes
# the tokenizer and notebook 09's outputs) must change this line, not pass unnoticed.
SHIPPED_SHA256 = "e832f7179fad494a30cb5cc15a7b938212f1b0575bffae601eb708fd82166162"


def test_shipped_corpus_has_its_pinned_fingerprint(corpus):
    assert documents_sha256(corpus) == corpus_module.DEFAULT_CORPUS_SHA256 == SHIPPED_SHA256


def test_default_corpus_never_reads_the_running_python(corpus, monkeypatch):
    def no_extraction(*args):
        raise AssertionError("the shipped corpus should have been read")

    monkeypatch.setattr(corpus_module, "stdlib_docstrings", no_extraction)
    monkeypatch.setattr(corpus_module, "pydoc_topics", no_extraction)
    assert default_corpus() == corpus
    assert load_corpus("default") == corpus


@pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info[:3] != (3, 11, 7),
                    reason="the corpus was extracted from CPython 3.11.7")
def test_shipped_corpus_is_what_cpython_3_11_7_extracts(corpus, tmp_path):
    rebuilt = tmp_path / "corpus.txt.gz"
    assert corpus_module.write_default_corpus(rebuilt) == corpus
    assert rebuilt.read_bytes() == corpus_module.DEFAULT_CORPUS_PATH.read_bytes()


def test_rebuilt_corpus_round_trips_through_its_file(tmp_path, monkeypatch):
    documents = ["first\n\nwith a blank line", "", "third: naïve café"]
    monkeypatch.setattr(corpus_module, "stdlib_docstrings", lambda: documents[:2])
    monkeypatch.setattr(corpus_module, "pydoc_topics", lambda: documents[2:])
    monkeypatch.setattr(corpus_module, "DEFAULT_CORPUS_PATH", tmp_path / "corpus.txt.gz")
    assert corpus_module.write_default_corpus(tmp_path / "corpus.txt.gz") == documents
    assert default_corpus() == documents


def test_pretrained_checkpoint_holds_weights_of_notebook_09s_model(corpus):
    meta = read_metadata(PRETRAINED_CHECKPOINT)
    config = meta["config"]
    assert (config["num_layers"], config["hidden"], config["num_heads"]) == (4, 64, 4)
    assert (config["vocab_size"], config["seq_len"]) == (500, 64)
    assert meta["adam_step"] == 0 and meta["layout"]["tp"] == meta["layout"]["pp"] == 1
    state = load_full_model_state(PRETRAINED_CHECKPOINT)
    assert sum(t.numel() for t in state.values()) == num_parameters(4, 64, 500, 64) + 2 * 64
    assert sum(f.stat().st_size for f in PRETRAINED_CHECKPOINT.iterdir()) < 2_000_000


def test_pretrained_checkpoint_tokenizer_is_the_one_the_shipped_corpus_trains(corpus, tmp_path):
    tokenizer = train_tokenizer(corpus, 500, tmp_path)
    shipped = read_metadata(PRETRAINED_CHECKPOINT)["tokenizer"]
    assert Path(shipped).read_bytes() == tokenizer.path.read_bytes()


@pytest.fixture
def fake_stdlib(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""Module doc."""\nclass A:\n    """Class doc."""\n    def f(self):\n'
        '        """Method\n        doc,   indented."""\n'
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text('"""Skipped: a test module."""\n')
    (tmp_path / "broken.py").write_text('"""Skipped: does not parse."""\ndef (:\n')
    return tmp_path


def test_stdlib_docstrings_reads_module_class_and_function_docs(fake_stdlib):
    expected = "Module doc.\n\nClass doc.\n\nMethod\ndoc,   indented."
    assert stdlib_docstrings(fake_stdlib) == [expected]


# ---------------------------------------------------------------------------------------------
# Local text files and WikiText-103
# ---------------------------------------------------------------------------------------------


def test_text_files_load_one_document_per_file_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "notes.md").write_text("not text data")
    assert load_text_files([tmp_path]) == ["first", "second"]


def test_a_jsonl_file_holds_one_document_a_line_in_its_text_field(tmp_path):
    """The way corpora are kept on disk (The Pile, OpenWebText dumps, Megatron-LM's
    preprocess_data.py input): one JSON object a line; a folder mixes them with .txt files."""
    lines = [{"text": "first doc", "id": 1}, {"text": "second\ndoc", "id": 2}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    (tmp_path / "b.txt").write_text("third")
    assert load_text_files([tmp_path]) == ["first doc", "second\ndoc", "third"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "fourth"}) + "\n")
    assert load_corpus(str(tmp_path / "c.jsonl"), text_field="body") == ["fourth"]


@pytest.mark.parametrize(("line", "message"), [
    ('{"body": "x"}', r"c.jsonl:2 has no text in field 'text' \(its fields: \['body'\]\)"),
    ('{"text": "  "}', r"c.jsonl:2 has no text in field 'text'"),
    ('{"text": 3}', r"c.jsonl:2 has no text in field 'text'"),
    ("not json", r"c.jsonl:2 is not JSON"),
])
def test_a_jsonl_line_without_text_is_named_by_file_and_line(tmp_path, line, message):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_text_files([tmp_path / "c.jsonl"])


def test_a_hugging_face_dataset_saved_to_disk_is_its_text_column(tmp_path, monkeypatch):
    """A Dataset or a DatasetDict (its train split) that ``save_to_disk`` wrote, beside text
    files; a missing column, an empty row, no train split and no ``datasets`` package each one
    line naming it."""
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"body": ["first doc", "second\ndoc"], "id": [1, 2]})
    rows.save_to_disk(tmp_path / "rows")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
                                   "test": datasets.Dataset.from_dict({"text": ["c"]})})
    splits.save_to_disk(tmp_path / "splits")
    (tmp_path / "c.txt").write_text("third")
    assert load_corpus([tmp_path / "rows", tmp_path / "c.txt"], text_field="body") == [
        "first doc", "second\ndoc", "third"]
    assert load_corpus([tmp_path / "splits"]) == ["a", "b"]
    datasets.Dataset.from_dict({"text": ["a", " "]}).save_to_disk(tmp_path / "blank")
    datasets.DatasetDict({"valid": rows}).save_to_disk(tmp_path / "no_train")
    for folder, message in [("rows", r"rows has no column 'text' \(its columns: body, id\)"),
                            ("blank", r"blank: row 1's 'text' is empty"),
                            ("no_train", r"no_train holds the splits \['valid'\], none called")]:
        with pytest.raises(ValueError, match=message):
            load_corpus([tmp_path / folder])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="needs the optional datasets package"):
        load_corpus([tmp_path / "splits"])


def test_load_corpus_accepts_a_single_path(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    assert load_corpus(str(tmp_path / "a.txt")) == ["hello"]


def test_missing_text_file_error_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        load_text_files([tmp_path / "nowhere.txt"])


def test_folder_without_txt_files_error_names_the_folder(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match=r"data is a folder with no \.txt or \.jsonl"):
        load_text_files([tmp_path / "data"])


def test_empty_text_file_error_names_the_file(tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\n")
    with pytest.raises(ValueError, match="blank.txt is empty"):
        load_text_files([tmp_path / "blank.txt"])


def test_wikitext_without_datasets_package_says_how_to_use_local_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(RuntimeError, match=r"pip install datasets.*--data PATH"):
        load_wikitext103()


def fake_datasets(load_dataset):
    return types.SimpleNamespace(load_dataset=load_dataset)


def test_wikitext_offline_is_one_clear_error_without_the_inner_traceback(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(offline))
    with pytest.raises(RuntimeError, match=r"ConnectionError.*--data PATH") as caught:
        load_wikitext103("train", tmp_path)
    assert caught.value.__suppress_context__


def test_wikitext_lines_are_grouped_into_articles(monkeypatch, tmp_path):
    lines = ["", " = Alpha = \n", " a\n", " = = Part = = \n", " more\n", " = Beta = \n", " b\n"]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(lambda *a, **k: {"text": lines}))
    expected = ["= Alpha = \n a\n = = Part = = \n more", "= Beta = \n b"]
    assert load_wikitext103("train", tmp_path) == expected


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["naïve café — ∑", "def f(x):\n\treturn  x  \n\n", " 日本語 "])
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_has_the_requested_vocabulary_size(tokenizer):
    assert tokenizer.vocab_size == VOCAB


def test_tokenizer_special_ids_are_fixed(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (3, 1, 2)


def test_training_twice_gives_identical_models(tokenizer, small_corpus, tmp_path, kind):
    retrained = train_tokenizer(small_corpus, VOCAB, tmp_path, model_type=kind)
    assert retrained.path.read_bytes() == tokenizer.path.read_bytes()


def test_tokenizer_is_reused_from_cache(tokenizer, small_corpus, corpus_cache, monkeypatch, kind):
    def no_training(*args):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokenizer_module, "_train_sentencepiece", no_training)
    monkeypatch.setattr(tokenizer_module, "_train_byte_bpe", no_training)
    assert train_tokenizer(small_corpus, VOCAB, corpus_cache, model_type=kind).path == \
        tokenizer.path


def test_tokenizer_cache_key_depends_on_the_text(tokenizer, small_corpus, corpus_cache, kind):
    other = train_tokenizer(small_corpus[1:], VOCAB, corpus_cache, model_type=kind)
    assert other.path != tokenizer.path


def test_a_sentencepiece_tokenizer_saved_as_tokenizer_json_gives_its_ids(small_corpus,
                                                                          corpus_cache, tmp_path):
    """``Tokenizer.save_hf``'s tokenizer.json, read back by the tokenizers library."""
    ours = train_tokenizer(small_corpus, VOCAB, corpus_cache)
    ours.save_hf(tmp_path, 128)
    theirs = Tokenizer.load(tmp_path / "tokenizer.json")
    text = "\n".join(small_corpus[:20]) + " a  b\t✓ 日本"
    assert theirs.encode(text) == ours.encode(text)
    assert (theirs.bos_id, theirs.eos_id, theirs.pad_id) == (1, 2, 3)
    assert type(Tokenizer.load(tmp_path)) is Tokenizer     # a folder: its tokenizer.model first


def test_a_hugging_face_tokenizer_json_finds_its_special_tokens(tmp_path):
    """GPT-2's kind: <|endoftext|> ends (and begins) a text, no padding token; without an end
    of text, which separates documents, it is refused by name."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["some text " * 50], vocab_size=300, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.load(tmp_path)                     # a folder holding tokenizer.json
    assert (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id) == (0, 0, -1)
    assert tokenizer.decode(tokenizer.encode("some text")) == "some text"
    bare = tokenizers.ByteLevelBPETokenizer()
    bare.train_from_iterator(["some text " * 50], vocab_size=300, show_progress=False)
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="bare.json names no end-of-text token"):
        Tokenizer.load(tmp_path / "bare.json")


def test_tokenizer_survives_pickling_for_spawned_ranks(tokenizer):
    assert pickle.loads(pickle.dumps(tokenizer)).encode("café") == tokenizer.encode("café")


def test_corrupt_model_file_error_names_the_file(tmp_path):
    (tmp_path / "broken.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="broken.model is not a valid sentencepiece"):
        Tokenizer.load(tmp_path / "broken.model")


def test_missing_model_file_error_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.model"):
        Tokenizer.load(tmp_path / "absent.model")


def test_vocabulary_too_large_for_the_text_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not train a 5000-token bpe tokenizer"):
        train_tokenizer("a tiny corpus", 5000, tmp_path)


# ---------------------------------------------------------------------------------------------
# Tokens, sequences, split
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(512, np.uint16), (65536, np.uint16), (65537, np.uint32)]
)
def test_token_dtype_is_the_smallest_that_fits(vocab, dtype):
    assert token_dtype(vocab) == dtype


def test_documents_are_followed_by_eos(tokenizer):
    expected = tokenizer.encode("one") + [2] + tokenizer.encode("two") + [2]
    assert encode_documents(["one", "two"], tokenizer).tolist() == expected


def test_long_documents_encode_in_pieces_to_the_same_tokens(tokenizer, small_corpus, monkeypatch):
    monkeypatch.setattr(dataset_module, "_PIECE_CHARS", 300)
    document = small_corpus[0][:5000]
    expected = tokenizer.encode(document) + [tokenizer.eos_id]
    assert encode_documents([document], tokenizer).tolist() == expected


@pytest.fixture
def counting_tokens(tmp_path):
    np.save(tmp_path / "tokens.npy", np.arange(100, dtype=np.uint16))
    return tmp_path / "tokens.npy"


def test_labels_are_inputs_shifted_by_one(counting_tokens):
    input_ids, labels = TokenDataset(counting_tokens, seq_len=8)[2]
    assert torch.equal(labels, input_ids + 1)


def test_sequences_tile_the_tokens_without_overlap(counting_tokens):
    input_ids, _ = TokenDataset(counting_tokens, seq_len=8)[2]
    assert input_ids.tolist() == list(range(16, 24))


def test_sequences_are_int64_tensors(counting_tokens):
    input_ids, labels = TokenDataset(counting_tokens, seq_len=8).batch([0, 3])
    assert (input_ids.dtype, labels.dtype, labels.shape) == (torch.int64, torch.int64, (2, 8))


def test_dataset_counts_only_sequences_with_a_full_label(counting_tokens):
    assert len(TokenDataset(counting_tokens, seq_len=9)) == 11  # 11 * 9 + 1 = 100 tokens


def test_dataset_range_starts_at_its_first_token(counting_tokens):
    input_ids, _ = TokenDataset(counting_tokens, seq_len=4, start=90)[0]
    assert input_ids.tolist() == [90, 91, 92, 93]


def test_dataset_survives_pickling_for_spawned_ranks(counting_tokens):
    dataset = TokenDataset(counting_tokens, seq_len=4, start=10)
    assert torch.equal(pickle.loads(pickle.dumps(dataset))[1][0], dataset[1][0])


def test_split_holds_out_the_last_fraction():
    assert split_point(100_000, seq_len=16, val_fraction=0.05) == 95_000


def test_split_holds_out_at_least_a_few_sequences():
    assert split_point(1_000, seq_len=64, val_fraction=0.05) == 1_000 - (4 * 64 + 1)


def test_split_of_a_too_small_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="300 tokens are too few for seq_len=64"):
        split_point(300, seq_len=64)


def test_prepare_data_splits_local_text_into_train_then_validation(small_corpus, tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(small_corpus), encoding="utf-8")
    _, train, val = prepare_data([tmp_path / "corpus.txt"], VOCAB, 32, tmp_path / "cache")
    assert (train.start, train.end, val.start) == (0, val.start, train.end)


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------


def take(sampler, steps):
    return [next(sampler) for _ in range(steps)]


def test_sampler_order_is_fixed_by_the_seed():
    assert take(BatchSampler(40, 8, seed=3), 10) == take(BatchSampler(40, 8, seed=3), 10)


def test_sampler_order_changes_with_the_seed():
    assert take(BatchSampler(40, 8, seed=3), 5) != take(BatchSampler(40, 8, seed=4), 5)


def test_each_epoch_visits_every_sequence_once():
    batches = take(BatchSampler(40, 8, seed=0), 5)
    assert sorted(i for batch in batches for i in batch) == list(range(40))


def test_epochs_are_shuffled_differently():
    batches = take(BatchSampler(40, 8, seed=0), 10)
    assert batches[:5] != batches[5:]


def test_dp_slices_are_disjoint_and_make_up_the_global_batch():
    whole = take(BatchSampler(40, 8, seed=1), 7)
    replicas = [take(BatchSampler(40, 8, dp_rank=r, dp_size=4, seed=1), 7) for r in range(4)]
    assert [sum((replica[step] for replica in replicas), []) for step in range(7)] == whole


def test_resumed_sampler_continues_like_an_uninterrupted_one():
    uninterrupted = take(BatchSampler(40, 8, seed=5), 12)
    first = BatchSampler(40, 8, seed=5)
    take(first, 7)  # stops in the second epoch
    resumed = BatchSampler(40, 8, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 5) == uninterrupted[7:]


def test_global_batch_not_divisible_by_dp_is_a_clear_error():
    with pytest.raises(ValueError, match="global batch 10 is not divisible by dp=4"):
        BatchSampler(40, 10, dp_size=4)


# ---------------------------------------------------------------------------------------------
# The baseline
# ---------------------------------------------------------------------------------------------


def test_unigram_entropy_of_two_equally_likely_tokens_is_ln_2():
    assert unigram_entropy([0, 1, 1, 0]) == pytest.approx(math.log(2))


def test_unigram_entropy_of_skewed_tokens_by_hand():
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # 0.5623 nats
    assert unigram_entropy(torch.tensor([5, 5, 7, 5])) == pytest.approx(expected)


def test_unigram_entropy_of_a_single_repeated_token_is_zero():
    assert unigram_entropy(np.full(10, 42, dtype=np.uint16)) == 0.0


# ---------------------------------------------------------------------------------------------
# A corpus tokenized once (python -m megatron_edu.data.prepare)
# ---------------------------------------------------------------------------------------------

def test_a_prepared_folder_gives_the_batches_of_the_text_it_was_prepared_from(
        tmp_path, small_corpus, tokenizer, corpus_cache):
    """Encoded in 2 processes, part by part: the same ids as the text's token file, every
    document's end in the index, and training reads the folder instead of the text."""
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                   for d in small_corpus[:20]))
    (tmp_path / "more.txt").write_text(small_corpus[20])
    assert prepare_main(["--data", str(tmp_path / "corpus.jsonl"), str(tmp_path / "more.txt"),
                         "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "ids"),
                         "--workers", "2"]) == 0
    _, train, val = prepare_data(str(tmp_path / "ids"), VOCAB, 64)
    _, text_train, text_val = prepare_data([tmp_path / "corpus.jsonl", tmp_path / "more.txt"],
                                           VOCAB, 64, corpus_cache, tokenizer_path=tokenizer.path)
    assert np.array_equal(train.tokens, text_train.tokens)
    assert np.array_equal(val.tokens, text_val.tokens)
    ends = np.load(tmp_path / "ids" / "documents.npy")
    assert len(ends) == 21 and ends[-1] == len(train.tokens) + len(val.tokens)
    with pytest.raises(ValueError, match=f"prepared with a vocabulary of {VOCAB}: the model "
                                         f"has 100 \\(pass --vocab-size {VOCAB}\\)"):
        prepare_data(str(tmp_path / "ids"), 100, 64)


def _rss() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS:")).split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_a_gigabyte_of_prepared_tokens_opens_without_being_read(tmp_path, tokenizer):
    """A 1 GB token file (5·10⁸ uint16 ids): opening it, splitting off validation and reading
    a batch touch a few pages, not the file (a memory map; nothing tokenized, nothing hashed)."""
    folder = tmp_path / "big"
    folder.mkdir()
    np.lib.format.open_memmap(folder / "tokens.npy", "w+", np.uint16, (500_000_000,)).flush()
    shutil.copyfile(tokenizer.path, folder / ("tokenizer" + tokenizer.path.suffix))
    (folder / "prepared.json").write_text("{}")
    before = _rss()
    _, train, val = prepare_data(str(folder), VOCAB, 1024)
    inputs, labels = train.batch([0, len(train) // 2, len(train) - 1])
    assert inputs.shape == (3, 1024) and len(train) + len(val) > 480_000
    assert _rss() - before < 64 * 2**20
