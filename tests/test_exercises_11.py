"""The checkers of notebook 11: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet"."""

import sys

import cloudpickle
import numpy as np
import pytest
from helpers import failed, stub

from megatron_edu.course.exercises import check, nb11
from megatron_edu.data.bert import MASK_ID, SPECIAL_IDS

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 11.1 BERT's masking --------------------------------------------------------------------------

def masking(ids, vocab_size, rng, to_mask=0.8, to_random=0.1, every_token=False,
            from_specials=False, labels_everywhere=False, specials=False, of_all=False,
            label_masked=False, in_place=False):
    """1810.04805 §3.1, with one of the typical mistakes switched on."""
    candidates = np.arange(len(ids)) if specials else np.flatnonzero(~np.isin(ids, SPECIAL_IDS))
    n = max(1, round(0.15 * (len(ids) if of_all else len(candidates))))
    chosen = rng.choice(candidates, size=n, replace=False)
    masked = ids if in_place else ids.copy()
    original = ids.copy()
    fate = rng.random(len(ids) if every_token else n)
    where = np.arange(len(ids)) if every_token else chosen
    masked[where[fate < to_mask]] = MASK_ID
    drawn = where[(fate >= to_mask) & (fate < to_mask + to_random)]
    low = 0 if from_specials else len(SPECIAL_IDS)
    masked[drawn] = rng.integers(low, vocab_size, size=len(drawn))
    labels = original.copy() if labels_everywhere else np.full(len(ids), -100)
    labels[chosen] = masked[chosen] if label_masked else original[chosen]
    return masked, labels


@pytest.mark.parametrize(("answer", "fragments"), [
    (masking, ()),
    (lambda i, v, r: masking(i, v, r, to_mask=1.0), ("every chosen token became [MASK]",)),
    (lambda i, v, r: masking(i, v, r, every_token=True), ("not chosen", "80 % of *all*")),
    (lambda i, v, r: masking(i, v, r, from_specials=True), ("random replacement", "special id")),
    (lambda i, v, r: masking(i, v, r, labels_everywhere=True), ("every position has a label",)),
    (lambda i, v, r: masking(i, v, r, specials=True), ("special token", "SPECIAL_IDS")),
    (lambda i, v, r: masking(i, v, r, of_all=True), ("of the candidates",)),
    (lambda i, v, r: masking(i, v, r, label_masked=True), ("the masked input",)),
    (lambda i, v, r: masking(i, v, r, to_mask=0.1, to_random=0.8), ("Devlin's are 80 %",)),
    (lambda i, v, r: masking(i, v, r, in_place=True), ("in place",)),
    (lambda i, v, r: masking(i, v, r)[0], ("return a tuple",)),
    (stub, ("not done yet",)),
])
def test_11_1_masking(answer, fragments):
    result = check("11.1", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message


def test_11_1_the_package_masking_passes_with_its_proportions():
    from megatron_edu.data.bert import mask_tokens

    result = check("11.1", mask_tokens)
    assert result.passed and "15.0% of the" in result.message, result.message


# --- 11.2 the rearranged block --------------------------------------------------------------------

def pre_ln(block, x):
    x = x + block.attn(block.ln1(x))
    return x + block.mlp(block.ln2(x))


def residual_after_ln(block, x):
    u = block.ln1(x)
    x = u + block.attn(u)
    u = block.ln2(x)
    return u + block.mlp(u)


def detached_attention(block, x):
    x = x + block.attn(block.ln1(x)).detach()
    return x + block.mlp(block.ln2(x))


def no_grad(block, x):
    import torch

    with torch.no_grad():
        return pre_ln(block, x)


@pytest.mark.parametrize(("answer", "fragments"), [
    (pre_ln, ()),
    (residual_after_ln, ("residual is taken after the layer norm", "'original'")),
    *[(wrong, (hint[:40],)) for wrong, hint in nb11.WRONG],  # LN after the add, one LN, …
    (detached_attention, ("gradient of", "detached")),
    (no_grad, ("does not require grad",)),
    (lambda block, x: (pre_ln(block, x),), ("return the block's output",)),
    (lambda block, x: x, ("differs from the rearranged Block's",)),
    (stub, ("not done yet",)),
])
def test_11_2_pre_ln_block(answer, fragments):
    result = check("11.2", answer)
    assert result.passed if not fragments else failed(result, *fragments), result.message
