"""The checkers of notebook 14: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import math
import sys

import cloudpickle
import pytest
import torch
from helpers import failed, stub

from megatron_edu.course.exercises import check

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 14.1 per-word perplexity ---------------------------------------------------------------------

def word_perplexities(losses, words):
    total = losses.double().sum().item()
    return math.exp(total / (words - 1)), math.exp(total / words)


@pytest.mark.parametrize(("answer", "fragments"), [
    (word_perplexities, ()),
    (lambda losses, w: (losses.mean().exp(), losses.mean().exp()), ("per-token perplexity",)),
    (lambda losses, w: (losses.sum() / (w - 1), losses.sum() / w), ("not", "exponential")),
    (lambda losses, w: word_perplexities(losses, w)[::-1], ("swapped",)),
    (lambda losses, w: (word_perplexities(losses, w)[1],) * 2, ("two normalisations differ",)),
    (lambda losses, w: (2 ** (losses.sum() / (w - 1)), 2 ** (losses.sum() / w)), ("nats",)),
    (lambda losses, w: (math.exp(losses.sum() / (len(losses) + 1)),) * 2, ("BPE tokens",)),
    (lambda losses, w: (losses.sum().exp() / w, losses.sum().exp() / w), ("overflows",)),
    (lambda losses, w: word_perplexities(losses, w)[0], ("return a pair",)),
    (stub, ("not done yet",)),
])
def test_14_1_word_perplexity(answer, fragments):
    result = check("14.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def test_14_1_reports_the_notebooks_numbers():
    assert "57.68 (÷ (W − 1)" in check("14.1", word_perplexities).message
    assert "53.65 (÷ W" in check("14.1", word_perplexities).message


# --- 14.2 LAMBADA's last word ---------------------------------------------------------------------

def last_word_correct(logits, ids, word_lengths, first=None, stop=None, shift=1):
    """Greedy, teacher-forced: the word's k targets ids[s − k:] predicted at s − 1 − k … s − 2;
    ``first``/``stop`` (functions of k and s) and ``shift`` switch on the typical slips."""
    s = ids.shape[1]
    predicted = logits.argmax(-1)
    out = []
    for row, k in enumerate(word_lengths.tolist()):
        lo = s - 1 - k if first is None else first(k, s)
        hi = s - 1 if stop is None else stop(k, s)
        out.append(bool((predicted[row, lo:hi] == ids[row, lo + shift : hi + shift]).all()))
    return torch.tensor(out)


def vectorised(logits, ids, word_lengths):
    s = ids.shape[1]
    hit = logits[:, :-1].argmax(-1) == ids[:, 1:]                 # [b, s − 1]
    in_word = torch.arange(s - 1) >= (s - 1 - word_lengths)[:, None]
    return (hit | ~in_word).all(1)


@pytest.mark.parametrize(("answer", "fragments"), [
    (last_word_correct, ()),
    (vectorised, ()),
    (lambda lg, i, k: last_word_correct(lg, i, k, stop=lambda k, s: s - k),
     ("only the word's first token",)),
    (lambda lg, i, k: last_word_correct(lg, i, k, first=lambda k, s: 0), ("context's tokens",)),
    (lambda lg, i, k: last_word_correct(lg, i, k, lambda k, s: s - k, lambda k, s: s, shift=0),
     ("not shifted",)),
    (lambda lg, i, k: last_word_correct(lg, i, k, lambda k, s: s - 2 - k, lambda k, s: s - 2),
     ("one position early",)),
    (lambda lg, i, k: last_word_correct(lg, i, k, first=lambda k, s: s - k), ("starts one late",)),
    (lambda lg, i, k: last_word_correct(lg, i, k, stop=lambda k, s: s - 2),
     ("last token is not checked",)),
    (lambda lg, i, k: ~vectorised(lg, i, k), ("judged wrongly",)),
    (lambda lg, i, k: vectorised(lg, i, k)[:-1], ("shape",)),
    (stub, ("not done yet",)),
])
def test_14_2_lambada(answer, fragments):
    result = check("14.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
