"""Checkers for notebook 14 (evaluating GPT-2 as 1909.08053 §5.2 does).

14.1 ★    WikiText-103's per-word perplexity from the per-token losses, both normalisations
          (Megatron-LM's code: W − 1; 1909.08053's text: W)
14.2 ★★   LAMBADA's last-word accuracy: a passage counts only if every token of its last word is
          the greedy prediction (teacher-forced)

Both are checked in this process against the package's own ``evaluate.wikitext_result`` and
``evaluate.lambada_correct``. Typical wrong answers — the per-token perplexity (the mean over the
tokens), a loss not exponentiated, the token count or the normalisations swapped, 2 as the base;
only the word's first token checked, the context's tokens checked too, logits and targets not
shifted against each other — are named.
"""

from __future__ import annotations

import math

import torch

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.evaluate import lambada_correct, wikitext_result
from megatron_edu.model.transformer import IGNORE_INDEX

__all__ = []  # the checkers register themselves (``@exercise``)

# --- 14.1 ★ per-word perplexity ------------------------------------------------------------------

NOTEBOOK_TEXT = (223.02, 105, 56)       # notebook 14's file: L (nats), N BPE tokens, W words
TEXTS = [NOTEBOOK_TEXT, (410.0, 300, 140), (583_000.0, 280_000, 245_000)]  # ~WikiText-103


def _losses(loss_sum: float, tokens: int, seed: int) -> torch.Tensor:
    """N − 1 per-token losses (the first token is never predicted) summing to ``loss_sum``."""
    raw = torch.rand(tokens - 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (raw * loss_sum / raw.sum()).float()


def _number(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        return None


def _pair(got) -> tuple[float, float]:
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise Hint("return a pair: (Megatron-LM's per-word perplexity, 1909.08053's)")
    values = [_number(g) for g in got]
    if None in values:
        raise Hint("each of the pair should be a number (a float, or a tensor of one value)")
    return values[0], values[1]


def _is(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-4)


@exercise("14.1", "per-word perplexity from per-token losses", reference=(wikitext_result,),
          marks=(r"L/\(W[−-]1\)",       # exp(L / (W − 1)): Megatron-LM's code
                 r"exp\(L/W\)"))         # exp(L / W): 1909.08053's text
def check_word_perplexity(fn) -> str:
    """fn(losses [N − 1], words W) → (exp(L/(W−1)), exp(L/W)) against ``wikitext_result``."""
    for seed, (loss_sum, n, w) in enumerate(TEXTS):
        losses = _losses(loss_sum, n, seed)
        L = float(losses.double().sum())
        want = wikitext_result(L, n, w)
        code, paper = want["word_perplexity"], want["word_perplexity_paper"]
        got = _pair(fn(losses.clone(), w))
        if _is(got[0], code) and _is(got[1], paper):
            continue
        where = f"(L = {L:.6g} nats over N − 1 = {n - 1:,} tokens, W = {w:,} words)"
        token = want["token_perplexity"]
        if any(_is(g, token) for g in got):
            raise Hint(f"{token:.4g} is the per-token perplexity {where}: exp of the mean over "
                       "the tokens. Per word, the same summed loss L is divided by the words: "
                       "W − 1 (Megatron-LM) and W (the paper)")
        if any(_is(g, math.exp(L / n)) for g in got):
            raise Hint(f"divided by the BPE tokens {where}: per word, divide by the "
                       "original word-level tokens W (less one, in Megatron-LM's code)")
        if _is(got[0], L / (w - 1)) or _is(got[1], L / w):
            raise Hint(f"{got[0]:.4g} is a loss per word in nats {where}, not a perplexity: "
                       "a perplexity is its exponential, exp(L / (W − 1))")
        if not all(math.isfinite(g) for g in got):
            raise Hint(f"{got[0]:.4g} and {got[1]:.4g} {where}: e^L overflows for a summed "
                       "loss — divide L by the count first, then exponentiate")
        if _is(got[0], paper) and _is(got[1], code):
            raise Hint(f"the two are swapped {where}: Megatron-LM's code divides by W − 1 (its "
                       "'adjusted ppl', first), 1909.08053's text by W (second)")
        if _is(got[0], got[1]):
            raise Hint(f"both numbers are {got[0]:.4g} {where}: the two normalisations differ — "
                       "W − 1 in Megatron-LM's code, W in the paper's text")
        if _is(got[0], 2 ** (L / (w - 1))):
            raise Hint("the losses are in nats (natural log): the perplexity is e^(L / (W − 1)), "
                       "not 2^(…)")
        raise Hint(f"{where} the per-word perplexities are {code:.4g} (exp(L / (W − 1))) and "
                   f"{paper:.4g} (exp(L / W)), not {got[0]:.4g} and {got[1]:.4g}")
    L, n, w = NOTEBOOK_TEXT
    code, paper = _pair(fn(_losses(L, n, 0), w))
    return (f"both normalisations, on three texts up to WikiText-103's size — on the notebook's "
            f"file {code:.2f} (÷ (W − 1), Megatron-LM's code) and {paper:.2f} (÷ W, 1909.08053's "
            f"text) per word, against {math.exp(L / (n - 1)):.2f} per token; at WikiText-103's "
            "W ≈ 245,000 the two differ by 1e-5 relative")


# --- 14.2 ★★ LAMBADA's last word -----------------------------------------------------------------

ROWS, SEQ, VOCAB = 64, 10, 12
S = SEQ
# The kinds of passage the checker builds: the positions j (and the shift) at which the greedy
# choice argmax(logits[j]) is ids[j + shift] — right for the word of k tokens ending the passage
# at "the word", one of the typical slips at the others (an answer that checks just those
# positions says such a passage is right).
RIGHT_AT = {
    "the word": (lambda k: range(S - 1 - k, S - 1), 1),
    "the word and the context": (lambda k: range(0, S - 1), 1),
    "the word's first token only": (lambda k: range(S - 1 - k, S - k), 1),
    "the tokens at the same positions": (lambda k: range(S - k, S), 0),
    "one position early": (lambda k: range(S - 2 - k, S - 2), 1),
    "all but the word's first token": (lambda k: range(S - k, S - 1), 1),
    "all but the word's last token": (lambda k: range(S - 1 - k, S - 2), 1),
    "nothing": (lambda k: range(0), 1),
}
KINDS = tuple(RIGHT_AT)
SLIPS = {   # an answer that checks the positions of this kind, and what is wrong with it
    "the word's first token only": "only the word's first token is checked: a word of k tokens "
    "counts only if all k are the greedy choice (the paper's strict LAMBADA)",
    "the word and the context": "the context's tokens are checked too: the model is given the "
    "context, only the last word is asked for — check the k positions whose next token is one "
    "of the word's",
    "the tokens at the same positions": "logits and targets are not shifted: the logits at "
    "position j predict token j + 1 — compare logits[:, j].argmax(-1) with ids[:, j + 1]",
    "one position early": "the window is one position early: it checks the context's last "
    "token and misses the word's last. The k targets ids[s − k:] are predicted at positions "
    "s − 1 − k … s − 2",
    "all but the word's first token": "the word's first token is not checked (the window starts "
    "one late): it is predicted at position s − 1 − k, from the context's last token",
    "all but the word's last token": "the word's last token is not checked: its k targets are "
    "predicted at positions s − 1 − k … s − 2, range(s − 1 − k, s − 1)",
}


def _passages(seed: int = 14) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [b, s] (no two neighbours equal), word lengths [b] (2 … 4), and logits [b, s, V]
    whose argmax is right, at the positions of the row's kind, and wrong elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(ROWS, S, dtype=torch.long)
    ids[:, 0] = torch.randint(VOCAB, (ROWS,), generator=gen)
    for j in range(1, S):                        # a neighbour never equal: shifts are visible
        ids[:, j] = (ids[:, j - 1] + torch.randint(1, VOCAB, (ROWS,), generator=gen)) % VOCAB
    lengths = torch.randint(2, 5, (ROWS,), generator=gen)
    best = torch.zeros(ROWS, S, dtype=torch.long)
    for row in range(ROWS):
        positions, shift = RIGHT_AT[KINDS[row % len(KINDS)]]
        right = set(positions(int(lengths[row])))
        for j in range(S):
            avoid = {int(ids[row, j]), int(ids[row, j + 1]) if j + 1 < S else -1}
            wrong = next(t for t in torch.randperm(VOCAB, generator=gen).tolist()
                         if t not in avoid)
            best[row, j] = ids[row, j + shift] if j in right else wrong
    logits = torch.randn(ROWS, S, VOCAB, generator=gen)
    logits.scatter_add_(-1, best.unsqueeze(-1), torch.full((ROWS, S, 1), 10.0))
    return ids, lengths, logits


def _labels(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The package's LAMBADA labels: at position j the target ids[j + 1], the word's only."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, k in enumerate(lengths.tolist()):
        labels[row, S - 1 - k : S - 1] = ids[row, S - k :]
    return labels


def _judged(kind: str, ids: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor
            ) -> torch.Tensor:
    """[b] bool: what an answer checking the positions of ``kind`` says of each passage."""
    (positions, shift), predicted = RIGHT_AT[kind], logits.argmax(-1)
    return torch.tensor([all(predicted[row, j] == ids[row, j + shift] for j in positions(k))
                         for row, k in enumerate(lengths.tolist())])


@exercise("14.2", "LAMBADA: the whole last word, greedy", reference=(lambada_correct,),
          marks=(r"s[−-]1[−-]k",))        # the position whose logits predict the word's first token
def check_lambada(fn) -> str:
    """fn(logits [b, s, V], ids [b, s], word_lengths [b]) → [b] bool against
    ``lambada_correct`` (without the stop-word filter)."""
    ids, lengths, logits = _passages()
    predicted = logits.argmax(-1)
    want = lambada_correct(predicted, predicted, _labels(ids, lengths))[0]
    got = fn(logits.clone(), ids.clone(), lengths.clone())
    try:
        got = torch.as_tensor(got).bool()
    except (TypeError, ValueError, RuntimeError):
        raise Hint(f"return one True/False per passage, a tensor of shape ({ROWS},)") from None
    if got.shape != want.shape:
        raise Hint(f"return one True/False per passage, shape ({ROWS},), not {tuple(got.shape)}")
    if torch.equal(got, want):
        return (f"on {ROWS} passages, the {int(want.sum())} right are those lambada_correct "
                "counts: a word counts only if argmax(logits[j]) = ids[j + 1] at every one of "
                "its tokens — not its first alone, not the context's")
    for kind, hint in SLIPS.items():
        if torch.equal(got, _judged(kind, ids, logits, lengths)):
            raise Hint(hint)
    rows = (got != want).nonzero().flatten().tolist()
    kinds = sorted({KINDS[r % len(KINDS)] for r in rows})
    raise Hint(f"{len(rows)} of {ROWS} passages judged wrongly, among them passages where the "
               f"greedy choice gets {'; '.join(kinds)} right: a passage counts if and only if "
               "argmax(logits[j]) = ids[j + 1] for each of the last word's k tokens")
