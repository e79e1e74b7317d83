"""The paper's zero-shot evaluations (1909.08053 §5.2): WikiText-103 perplexity in sliding windows,
per word and per token; LAMBADA last-word accuracy, whole words only, with and without the
stop-word filter — on tiny files in the standard formats, the numbers computed by hand."""

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import poisoned_checkpoint, tiny_config

from megatron_edu import evaluate
from megatron_edu.checkpoint import export_hf, load_full_model_state, read_metadata
from megatron_edu.data import PRETRAINED_CHECKPOINT, Tokenizer
from megatron_edu.data.zeroshot import (
    LAMBADA,
    STOP_WORDS,
    count_words,
    find_data_file,
    lambada_example,
    sliding_windows,
    wikitext_detokenize,
    window_batch,
)
from megatron_edu.evaluate import lambada_correct, vocab_parallel_argmax
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, config_from_dict

WIKI = (" \n = Python = \n \n Python is a high @-@ level , general @-@ purpose language . "
        "Version 3 @.@ 0 came in 2008 ( not 2009 ) . \n \n = = Design = = \n \n It uses "
        "significant indentation , and \" readability counts \" . \n")


# --- the windows ------------------------------------------------------------------------------

def megatron_samples(tokens, seq_len: int, overlap: int, pad: int = 0):
    """Megatron-LM's ``_LMDataset`` (tasks/zeroshot_gpt/datasets.py), step by step: sample i
    holds tokens[i·overlap : i·overlap + seq_len + 1], padded to seq_len + 1, and a mask of
    the targets it scores — all in sample 0, only the last ``overlap`` later. As (input ids,
    labels with −100 where the mask is 0), one pair per sample."""
    total_targets = len(tokens) - 1
    count = max(math.ceil(max(total_targets - overlap, 0) / overlap) + 1, 1)
    samples = []
    for i in range(count):
        text = list(tokens[i * overlap : i * overlap + seq_len + 1])
        mask = [1] * len(text) + [0] * (seq_len + 1 - len(text))
        text += [pad] * (seq_len + 1 - len(text))
        mask = np.array(mask[1:])
        if overlap != seq_len and i != 0:
            mask[:-overlap] = 0
        samples.append((np.array(text[:-1]), np.where(mask == 1, text[1:], -100)))
    return samples


@pytest.mark.parametrize("n, length, stride", [(50, 16, 5), (50, 16, 16), (17, 16, 5),
                                               (10, 16, 3), (100, 8, 1), (38, 8, 3)])
def test_sliding_windows_are_megatron_lms(n, length, stride):
    tokens = np.arange(1, n + 1)                      # distinct: a label names its target
    windows = sliding_windows(n, length, stride)
    ids, labels = window_batch(tokens, windows, length)
    theirs = megatron_samples(tokens, length, stride)
    scoring = [(i, l) for i, l in theirs if (l != -100).any()]
    assert all((l == -100).all() for _, l in theirs[len(scoring):])  # only unscored ones after
    assert np.array_equal(labels, np.stack([l for _, l in scoring]))
    for row, (their_ids, their_labels) in enumerate(scoring):   # the inputs up to the last
        seen = np.nonzero(their_labels != -100)[0][-1] + 1      # target (Megatron-LM also
        assert np.array_equal(ids[row, :seen], their_ids[:seen])  # feeds the text's last token)
    assert sorted(labels[labels != -100].tolist()) == tokens[1:].tolist()   # each target once
    assert [w.start for w in windows] == [k * stride for k in range(len(windows))]
    last = windows[-1]
    assert last.end == n - 1 and (last.end - last.start < length) == ((n - 1 - length) % stride
                                                                      != 0 or n - 1 < length)


def _model_and_tokens(n=12, seed=0):
    model = GPT(tiny_config()).eval()                      # seq_len 16, vocabulary 100
    tokens = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).numpy()
    return model, tokens


def _window_loss(model, tokens, length, stride):
    ids, labels = window_batch(tokens, sliding_windows(len(tokens), length, stride), length)
    with torch.no_grad():
        return model(torch.from_numpy(ids), torch.from_numpy(labels), loss_reduction="sum").item()


def test_sliding_window_loss_equals_the_whole_text_at_once_when_the_window_covers_it():
    model, tokens = _model_and_tokens(n=12)
    whole = torch.from_numpy(tokens)[None]
    with torch.no_grad():
        by_hand = F.cross_entropy(model(whole[:, :-1])[0, :, :100], whole[0, 1:],
                                  reduction="sum").item()
    for stride in (1, 4, 16):
        assert _window_loss(model, tokens, 16, stride) == pytest.approx(by_hand, abs=1e-4)


def test_stride_equal_to_the_window_is_non_overlapping_chunks_and_overlap_helps():
    model, tokens = _model_and_tokens(n=49)
    chunks = torch.from_numpy(tokens)
    with torch.no_grad():
        by_hand = sum(F.cross_entropy(model(c[None, :-1])[0, :, :100], c[1:], reduction="sum")
                      for c in (chunks[0:17], chunks[16:33], chunks[32:49])).item()
    assert _window_loss(model, tokens, 16, 16) == pytest.approx(by_hand, abs=1e-4)
    assert _window_loss(model, tokens, 16, 4) != pytest.approx(by_hand, abs=1e-2)


def test_wikitext_detokenizer_undoes_the_word_level_tokenization():
    assert wikitext_detokenize(WIKI) == (
        "\n= Python =\n\nPython is a high-level, general-purpose language. Version 3.0 came in "
        "2008 (not 2009).\n\n== Design ==\n\nIt uses significant indentation, and "
        "\"readability counts\".\n")


def test_words_are_the_test_files_space_separated_tokens():
    assert count_words(" \n = A = \n the cat @-@ like , sat . \n") == 11


# --- LAMBADA scoring --------------------------------------------------------------------------

def test_a_multi_token_word_is_right_only_when_all_its_tokens_are():
    labels = torch.tensor([[-100, -100, 7, 8], [-100, -100, 7, 8], [-100, -100, -100, 9]])
    predicted = torch.tensor([[1, 2, 7, 8], [1, 2, 7, 5], [1, 2, 3, 9]])
    right, _ = lambada_correct(predicted, predicted, labels)
    assert right.tolist() == [True, False, True]


def test_the_stop_word_filter_takes_the_best_non_stop_word_at_the_first_token_always():
    """GPT-2's filter: stop words are not candidates for the word's first token — a stop-word
    first choice gives way to the best other token, and a stop-word target is never right."""
    labels = torch.tensor([[-100, 7, 8], [-100, 3, -100], [-100, 7, 8], [-100, 7, 8]])
    predicted = torch.tensor([[0, 3, 8],       # " the" (3, a stop word), then the next choice 7
                              [0, 3, 0],       # the target is " the" itself, predicted
                              [0, 3, 5],       # the filter helps the first token, not the second
                              [0, 7, 8]])      # no stop word: the filter changes nothing
    filtered = torch.tensor([[0, 7, 8], [0, 6, 0], [0, 7, 5], [0, 7, 8]])   # best non-stop
    right, right_filtered = lambada_correct(predicted, filtered, labels)
    assert right.tolist() == [False, True, False, True]
    assert right_filtered.tolist() == [True, False, False, True]


def test_the_last_word_is_split_off_and_encoded_with_its_space():
    context, word = lambada_example("He opened the door . Then he saw the cat", str.split)
    assert (context, word) == (["He", "opened", "the", "door", ".", "Then", "he", "saw", "the"],
                               ["cat"])


def _argmax_at_tp():
    grid = ParallelGrid(tp=dist.get_world_size())
    logits = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(0))
    logits[0, 0, [10, 200]] = 50.0                         # a tie across ranks: the lowest id
    mine = logits.chunk(grid.tp, dim=-1)[grid.tp_rank]
    return torch.equal(vocab_parallel_argmax(mine, grid.tp_group), logits.argmax(-1))


def test_the_vocabulary_parallel_argmax_is_the_argmax_of_the_whole_row():
    assert all(run(_argmax_at_tp, 2))


# --- the command line, on tiny files ----------------------------------------------------------

@pytest.fixture(scope="module")
def pretrained():
    """Notebook 09's small GPT (V = 500), whole, and its tokenizer."""
    meta = read_metadata(PRETRAINED_CHECKPOINT)
    model = GPT(config_from_dict(meta["config"])).eval()
    model.load_full_state_dict(load_full_model_state(PRETRAINED_CHECKPOINT))
    return model, Tokenizer.load(meta["tokenizer"])


def _cli(capsys, *argv):
    assert evaluate.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_wikitext_perplexities_are_megatron_lms_in_windows_whose_last_is_padded(
        tmp_path, pretrained, capsys):
    (tmp_path / "wiki.test.tokens").write_text(WIKI)
    model, tokenizer = pretrained
    tokens = tokenizer.encode(wikitext_detokenize(WIKI))
    assert (len(tokens) - 1 - 32) % 10                    # the last window is short: padded
    loss = 0.0
    with torch.no_grad():
        for ids, labels in megatron_samples(tokens, 32, 10):
            loss += F.cross_entropy(model(torch.from_numpy(ids)[None])[0, :, :500],
                                    torch.from_numpy(labels), reduction="sum").item()
    n, w = len(tokens), len(WIKI.strip().split(" "))
    result = _cli(capsys, "--task", "wikitext103", "--data", str(tmp_path), "--seq-len", "32",
                  "--stride", "10", "--checkpoint", str(PRETRAINED_CHECKPOINT))
    assert (result["tokens"], result["words"]) == (n, w)
    assert result["loss_sum"] == pytest.approx(loss, rel=1e-5)
    assert result["word_perplexity"] == pytest.approx(math.exp(loss / (w - 1)), rel=1e-5)
    assert result["word_perplexity_paper"] == pytest.approx(math.exp(loss / w), rel=1e-5)
    assert result["token_perplexity"] == pytest.approx(math.exp(loss / (n - 1)), rel=1e-5)
    bf16 = _cli(capsys, "--task", "wikitext103", "--data", str(tmp_path), "--seq-len", "32",
                "--stride", "10", "--checkpoint", str(PRETRAINED_CHECKPOINT), "--dtype", "bf16")
    assert bf16["loss_sum"] != result["loss_sum"]             # autocast did run, in bf16,
    assert bf16["loss_sum"] == pytest.approx(loss, rel=2e-2)  # to bf16's precision


def _greedy_passages(model, tokenizer):
    """Passages whose last word the model produces itself (every token its argmax), and the
    same passages with the last word's final token changed, which it then gets wrong."""
    right, wrong = [], []
    for context in ("If the key is not", "Return True if the object is", "This is a subclass of",
                    "Return a list of all the", "Set the value of the"):
        ids = tokenizer.encode(context)
        word = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([ids + word]))[0, -1, :500].argmax())
                if word and tokenizer.decode([nxt])[:1].isspace():
                    break
                word.append(nxt)
        text = tokenizer.decode(word)
        if not text[:1] == " " or tokenizer.encode(text) != word or len(text.split()) != 1:
            continue
        right.append(context + text)
        wrong.append(context + text + "zq")                    # one more token: not predicted
    return right, wrong


def _right_with_the_filter(model, tokenizer, passage) -> bool:
    """GPT-2's stop-word filter by hand: the word's first token the best that is not a stop
    word on its own, the others the argmax."""
    context, word = lambada_example(passage, tokenizer.encode)
    with torch.no_grad():
        logits = model(torch.tensor([context + word[:-1]]))[0, len(context) - 1:, :500]
    stop = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i])[:1].isspace()
            and tokenizer.decode([i]).strip().lower() in STOP_WORDS]
    choices = logits.argmax(-1)
    choices[0] = logits[0].index_fill(0, torch.tensor(stop, dtype=torch.long),
                                      -math.inf).argmax()
    return choices.tolist() == word


def test_lambada_accuracy_by_hand_and_the_same_on_every_layout(tmp_path, pretrained, capsys):
    right, wrong = _greedy_passages(*pretrained)
    assert len(right) >= 3
    passages = right + wrong
    (tmp_path / "lambada_test.jsonl").write_text("".join(json.dumps({"text": p}) + "\n"
                                                         for p in passages))
    base = ["--task", "lambada", "--data", str(tmp_path / "lambada_test.jsonl"),
            "--checkpoint", str(PRETRAINED_CHECKPOINT), "--batch", "4", "--micro-batch", "1"]
    results = [_cli(capsys, *base), _cli(capsys, *base, "--nproc", "4", "--tp", "2",
                                         "--pp", "2")]
    filtered = sum(_right_with_the_filter(*pretrained, p) for p in passages)
    for result in results:
        assert result["n"] == len(passages)
        assert result["accuracy_without_filter"] == pytest.approx(len(right) / len(passages))
        assert result["accuracy_with_filter"] == pytest.approx(filtered / len(passages))


def test_wikitext_through_the_hugging_face_directory_equals_the_checkpoint(tmp_path, capsys):
    (tmp_path / "wiki.test.tokens").write_text(WIKI)
    export_hf(PRETRAINED_CHECKPOINT, tmp_path / "hf")       # weights + the sentencepiece model
    args = ["--task", "wikitext103", "--data", str(tmp_path), "--stride", "8", "--seq-len", "32"]
    ours = _cli(capsys, *args, "--checkpoint", str(PRETRAINED_CHECKPOINT))
    theirs = _cli(capsys, *args, "--hf", str(tmp_path / "hf"), "--nproc", "2")
    assert theirs["word_perplexity"] == pytest.approx(ours["word_perplexity"], rel=1e-4)


def test_a_hugging_face_tokenizer_is_used_when_the_directory_has_one(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    export_hf(PRETRAINED_CHECKPOINT, tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([WIKI] * 5, vocab_size=300, min_frequency=1, show_progress=False)
    transformers.GPT2TokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "wiki.test.tokens").write_text(WIKI)
    result = _cli(capsys, "--task", "wikitext103", "--data", str(tmp_path / "data"),
                  "--hf", str(tmp_path))
    hf_tokens = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert result["tokens"] == len(hf_tokens.encode(wikitext_detokenize(WIKI)))


@pytest.mark.parametrize("task, names", [("lambada", "lambada_test.jsonl"),
                                         ("wikitext103", "wiki.test.tokens")])
def test_missing_data_says_where_to_get_it_and_where_to_put_it(task, names, tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--task", task, "--data", str(tmp_path / "nothing"),
                       "--checkpoint", str(PRETRAINED_CHECKPOINT)])
    err = capsys.readouterr().err
    assert names in err and "https://" in err and "--data" in err


def test_a_folder_without_the_test_file_is_named():
    with pytest.raises(FileNotFoundError, match="no LAMBADA test file"):
        find_data_file(PRETRAINED_CHECKPOINT, LAMBADA)


# --- refused: a broken model, bad arguments, files that are not the task's ----------------------

@pytest.mark.parametrize("task, name, text, where", [
    ("wikitext103", "wiki.test.tokens", WIKI, r"position 0 of window 1 \(token 0 of the text\)"),
    ("lambada", "lambada_test.jsonl", '{"text": "Return a list of all the headers."}\n',
     "position 7 of passage 1")])           # the first scored: the context's 8 tokens − 1
def test_non_finite_logits_are_refused_with_where_they_are(tmp_path, capsys, task, name, text,
                                                           where):
    poisoned = poisoned_checkpoint(PRETRAINED_CHECKPOINT, tmp_path / "poisoned")
    (tmp_path / name).write_text(text)
    assert evaluate.main(["--task", task, "--data", str(tmp_path / name), "--checkpoint",
                          str(poisoned)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: the model's logits are not finite \(NaN\) at {where}: the "
                        r"checkpoint holds non-finite weights\?\n", err), err


WORDS = {"wiki.test.tokens": WIKI, "one.tokens": " Python \n", "none.tokens": " \n \n",
         "lambada_test.jsonl": '{"text": "He opened the door"}\n',
         "empty.jsonl": "", "blank.jsonl": '{"text": "He opened the door"}\n{"text": " "}\n',
         "word.txt": "He opened the door\nalone\n"}
TASK = {".tokens": "wikitext103", ".jsonl": "lambada", ".txt": "lambada"}


@pytest.mark.parametrize("data, flags, message", [
    ("lambada_test.jsonl", ["--micro-batch", "0"], "--micro-batch must be a positive integer, "
                                                   "got 0"),
    ("lambada_test.jsonl", ["--batch", "-8"], "--batch must be a positive integer, got -8"),
    ("lambada_test.jsonl", ["--nproc", "two"], "--nproc must be an integer, got 'two'"),
    ("lambada_test.jsonl", ["--tp", "0"], "--tp must be a positive integer, got 0"),
    ("wiki.test.tokens", ["--stride", "0"], "--stride must be a positive integer, got 0"),
    ("wiki.test.tokens", ["--seq-len", "1"], "--seq-len must be an integer ≥ 2, got 1"),
    ("wiki.test.tokens", ["--seq-len", "65"], r"--seq-len must be in 2 … 64 \(the model's "
                                              r"seq_len\), got 65"),
    ("wiki.test.tokens", ["--seq-len", "16", "--stride", "32"], r"--stride must be in 1 … the "
                                                                r"window length 16"),
    ("lambada_test.jsonl", ["--stride", "8"], "--stride applies to --task wikitext103"),
    ("wiki.test.tokens", ["--stop-word-filter"], "--stop-word-filter applies to --task lambada"),
    ("lambada_test.jsonl", ["--batches", "3"], "--batches applies to the validation loss"),
    ("lambada_test.jsonl", ["--batch", "8", "--micro-batch", "3"],
     "--batch 8 must be divisible by dp·micro-batch = 1·3"),
    ("lambada_test.jsonl", ["--nproc", "3", "--tp", "2"], "--nproc 3 ranks do not divide into "
                                                          "tp·pp = 2·1"),
    ("lambada_test.jsonl", ["--nproc", "3", "--tp", "3"], "--tp 3 --pp 1: num_heads = 4 is not "
                                                          "divisible"),
    ("lambada_test.jsonl", ["--task", "squad"],
     r"--task must be one of wikitext103, lambada, got 'squad'"),
    ("none.tokens", [], r"none.tokens holds 0 word-level tokens and \d+ BPE tokens: a "
                        r"perplexity needs at least 2"),
    ("one.tokens", [], r"one.tokens holds 1 word-level tokens"),
    ("empty.jsonl", [], r"--data .*empty.jsonl holds no LAMBADA passages"),
    ("blank.jsonl", [], r"--data .*blank.jsonl, line 2: the passage ' ' is not a context and a "
                        r"last word"),
    ("word.txt", [], r"--data .*word.txt, line 2: the passage 'alone' is not a context"),
    ("lambada_test.jsonl", ["BERT"], r"--task lambada scores a left-to-right language model; "
                                     r"this checkpoint holds a BertConfig"),
])
def test_the_command_refuses_in_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch,
                                                                 data, flags, message):
    monkeypatch.setattr(evaluate, "run", lambda *a, **k: pytest.fail("ranks were launched"))
    (tmp_path / data).write_text(WORDS[data])
    checkpoint = PRETRAINED_CHECKPOINT
    if flags == ["BERT"]:                        # a checkpoint whose meta.json says BERT
        flags, checkpoint = [], shutil.copytree(checkpoint, tmp_path / "bert")
        meta = json.loads((checkpoint / "meta.json").read_text())
        meta["config"]["model"] = "bert"
        (checkpoint / "meta.json").write_text(json.dumps(meta))
    argv = ["--task", TASK[Path(data).suffix], "--data", str(tmp_path / data), "--checkpoint",
            str(checkpoint), *flags]
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
