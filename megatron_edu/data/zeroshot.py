"""The data of 1909.08053's zero-shot evaluations (§5.2): WikiText-103 and LAMBADA, as read and
cut up for scoring. The scoring itself is ``megatron_edu/evaluate.py``.

**WikiText-103** (Merity et al. 2016): the test file ``wiki.test.tokens`` is word-level
tokenized text (" @-@ " for a hyphen, spaces around punctuation). The paper, like GPT-2,
*detokenizes* it (``wikitext_detokenize``) before its own BPE encodes it, and scores the result
with **overlapping sliding windows** (``sliding_windows``, Megatron-LM's ``_LMDataset``): each
window holds s tokens and starts ``stride`` tokens after the previous one (the last one, if the
text ends inside it, padded); the first scores all its targets, each later one only its last
``stride`` — so every token is scored exactly once, with at least s − stride tokens of context
(Megatron-LM's ``--overlapping-eval``, 32 by default). The summed loss is then divided by the
number of *original word-level tokens* (``count_words``: the test file's space-separated tokens,
as Megatron-LM counts them) — less one in Megatron-LM's code, not in 1909.08053's text
(``evaluate.wikitext_result`` gives both) — not by the number of BPE tokens: the paper's 10.8 is
a per-word perplexity, comparable across tokenizers; the per-subword one is reported beside.

**LAMBADA** (Paperno et al. 2016): passages whose last word a human can guess only from the whole
passage. Either standard form: OpenAI's detokenized ``lambada_test.jsonl`` (one
``{"text": ...}`` per line; GPT-2's and Megatron-LM's) or the original
``lambada_test_plain_text.txt`` (one passage per line). A passage is split into its context and
its last word (``lambada_example``, Megatron-LM's "strict" form): the word counts as predicted
only if *all* its subword tokens are (``evaluate.py`` scores it).

Users fetch the files themselves (``find_data_file`` says from where, if one is missing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["WIKITEXT103", "LAMBADA", "find_data_file", "read_wikitext", "wikitext_detokenize",
           "count_words", "sliding_windows", "window_batch", "read_lambada", "lambada_example",
           "STOP_WORDS"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TaskFiles:
    """Where a task's test set comes from and what its files are called."""

    name: str
    names: tuple[str, ...]          # file names accepted inside a --data folder
    where: str                      # how to get them


WIKITEXT103 = TaskFiles(
    "WikiText-103", ("wiki.test.tokens", "wikitext-103/wiki.test.tokens"),
    "download wikitext-103-v1.zip (https://wikitext.smerity.com/wikitext-103-v1.zip, or "
    "Salesforce/wikitext 'wikitext-103-v1' on the Hugging Face hub), unzip it and pass "
    "--data path/to/wikitext-103/wiki.test.tokens (or the folder holding it)")
LAMBADA = TaskFiles(
    "LAMBADA", ("lambada_test.jsonl", "lambada_test_plain_text.txt"),
    "download OpenAI's detokenized test set, lambada_test.jsonl "
    "(https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl), or the "
    "original lambada_test_plain_text.txt (https://zenodo.org/record/2630551), and pass "
    "--data path/to/lambada_test.jsonl (or the folder holding it)")


def find_data_file(path: str | Path, task: TaskFiles) -> Path:
    """The test file at ``path`` (a file, or a folder holding one of the task's file names);
    missing, a FileNotFoundError that says where to get it and where to put it."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for name in task.names:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"no {task.name} test file ({' or '.join(task.names)}) in "
                                f"{path}: {task.where}")
    raise FileNotFoundError(f"{task.name} test set not found at {path}: {task.where}")


# ---------------------------------------------------------------------------------------------
# WikiText-103
# ---------------------------------------------------------------------------------------------


def read_wikitext(path: str | Path) -> str:
    """The raw text of ``wiki.test.tokens`` (found as ``find_data_file`` finds it)."""
    return find_data_file(path, WIKITEXT103).read_text(encoding="utf-8")


def count_words(raw: str) -> int:
    """The original word-level tokens: the raw file's space-separated items (Megatron-LM's
    count, the paper's normaliser)."""
    return len(raw.strip().split(" "))


# WikiText's tokenization, undone (GPT-2 §3.1's invertible detokenizers; Megatron-LM's rules)
_PLAIN = [("s '", "s'"), (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
          (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]
_BRACKETS = [(r"\(\s*([^\)]*?)\s*\)", r"(\1)"), (r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
             (r"{\s*([^}]*?)\s*}", r"{\1}"), (r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
             (r"'\s*([^']*?)\s*'", r"'\1'")]
_TAIL = [("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
         (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")]


def wikitext_detokenize(text: str) -> str:
    """WikiText's word-level tokenization undone: hyphens and number separators joined,
    spaces before punctuation and inside brackets and quotes removed, headings closed up."""
    for old, new in _PLAIN:
        text = text.replace(old, new)
    for pattern, new in _BRACKETS:
        text = re.sub(pattern, new, text)
    for old, new in _TAIL:
        text = text.replace(old, new)
    return text


@dataclass(frozen=True)
class Window:
    """Inputs tokens[start:end], targets tokens[start + 1:end + 1]; the targets with index
    > ``scored_after`` are scored (those before were scored by an earlier window)."""

    start: int
    end: int
    scored_after: int


def sliding_windows(num_tokens: int, length: int, stride: int) -> list[Window]:
    """Megatron-LM's windows (``tasks/zeroshot_gpt/datasets.py``, ``_LMDataset``): window k
    starts at k · ``stride`` and holds ``length`` inputs — the last one fewer, padded by
    ``window_batch``; the first scores all its targets, each later one only its last ``stride``
    (those after start + length − stride), so targets 1 … num_tokens − 1 are scored exactly once,
    each with at least length − stride tokens of context outside the first window.

    As many windows as reach the last target: 1 + ⌈(T − length) / stride⌉ for T = num_tokens − 1
    targets (at least 1). Megatron-LM builds max(1, 1 + ⌈(T − stride) / stride⌉), the same windows
    followed, when length > stride, by windows that score nothing (every target masked): the
    summed loss is the same, their forward passes are left out here."""
    if not 1 <= stride <= length:
        raise ValueError(f"the stride must be in 1 … the window length {length}, got {stride}")
    if num_tokens < 2:
        raise ValueError(f"{num_tokens} tokens: nothing to predict")
    targets = num_tokens - 1
    count = 1 + max(0, -(-(targets - length) // stride))              # 1 + ceil(…)
    return [Window(k * stride, min(k * stride + length, targets),
                   0 if k == 0 else k * stride + length - stride) for k in range(count)]


def window_batch(tokens: np.ndarray, windows: Sequence[Window], length: int,
                 pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input ids and labels [len(windows), length]: labels −100 except at the targets each
    window scores; short windows padded with ``pad_id`` (unscored)."""
    ids = np.full((len(windows), length), pad_id, dtype=np.int64)
    labels = np.full((len(windows), length), IGNORE_INDEX, dtype=np.int64)
    for row, w in enumerate(windows):
        n = w.end - w.start
        ids[row, :n] = tokens[w.start : w.end]
        targets = np.arange(w.start + 1, w.end + 1)                   # target indices
        scored = targets > w.scored_after
        labels[row, :n][scored] = tokens[targets[scored]]
    return ids, labels


# ---------------------------------------------------------------------------------------------
# LAMBADA
# ---------------------------------------------------------------------------------------------


def read_lambada(path: str | Path) -> list[str]:
    """The passages of a LAMBADA test file: ``.jsonl`` (one {"text": ...} per line) or plain
    text (one passage per line); blank lines are skipped. Refused, naming the file and the
    line: a file without passages, a passage that is not text, or one of fewer than two words
    (a passage is a context and its last word)."""
    file = find_data_file(path, LAMBADA)
    passages = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        text = _lambada_line(line, file, number) if file.suffix == ".jsonl" else line
        words = len(text.split()) if isinstance(text, str) else None
        if words is None or words < 2:
            what = f"{type(text).__name__} {text!r}" if words is None else f"{text!r}"
            raise ValueError(f"{file}, line {number}: the passage {what} is not a context and "
                             f"a last word (text of at least two words)")
        passages.append(text)
    if not passages:
        raise ValueError(f"{file} holds no LAMBADA passages (one {{\"text\": ...}} per line, or "
                         f"one passage per line)")
    return passages


def _lambada_line(line: str, file: Path, number: int):
    try:
        return json.loads(line)["text"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{file}, line {number}: not LAMBADA jsonl (one {{\"text\": ...}} "
                         f"object per line): {error}") from None


def lambada_example(text: str, encode: Callable[[str], list[int]]
                    ) -> tuple[list[int], list[int]]:
    """(context ids, last-word ids): the passage up to its last word, and " " + that word,
    encoded apart (Megatron-LM's strict LAMBADA), so the word's tokens are whole."""
    word = text.split()[-1]
    context = text[: text.rfind(word)].strip()
    return encode(context), encode(" " + word)


# Function words a stop-word filter removes from the candidates for LAMBADA's last word
# (Radford et al. 2019 §3.3 filter GPT-2's predictions so: 63.24 % with it, 52.66 % without;
# 1909.08053's 66.5 % and Megatron-LM's --strict-lambada have no filter). evaluate.py applies it.
STOP_WORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further
had has have having he her here hers herself him himself his how i if in into is it its itself
just me more most my myself no nor not now of off on once only or other our ours ourselves out
over own same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves
""".split())
