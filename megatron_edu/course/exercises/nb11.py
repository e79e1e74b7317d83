"""Checkers for notebook 11 (BERT and the layer-norm placement: 1909.08053 §5.3, Figure 7).

11.1 ★    BERT's masking: choose 15 % of the non-special tokens; of those 80 % → [MASK], 10 % → a
          random token, 10 % kept (Devlin et al. 2019, arXiv 1810.04805 §3.1)
11.2 ★★   the rearranged block (Figure 7b, pre-LN) from the package block's pieces

Both are checked in this process. 11.1 runs the learner's masking on 3,000 seeded samples and
measures the proportions against Devlin's within a statistical tolerance (the package's
``data.bert.mask_tokens`` draws the same shares); 11.2 compares outputs and every gradient with
the package's ``Block`` at ``ln_placement="rearranged"``. Typical wrong answers — every chosen
token masked, 80 % of *all* tokens masked, random tokens drawn among the special ids, labels at
positions not chosen, the layer norm after the add (Figure 7a), the residual taken after the
layer norm, one layer norm for both sublayers, GPT-J's parallel branches — are named.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.data.bert import (
    CLS_ID,
    IGNORE_INDEX,
    MASK_FRACTION,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    TO_MASK,
    TO_RANDOM,
    mask_tokens,
)
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.model.transformer import Block, PreLN

__all__ = ["VOCAB", "WRONG"]  # the checkers register themselves (``@exercise``)

# --- 11.1 ★ BERT's masking -----------------------------------------------------------------------

SAMPLES, SEQ, VOCAB = 3000, 64, 60      # ~27,000 chosen tokens: a share's std is ~0.25 %
CHOSEN_TOL, SHARE_TOL = 0.01, 0.02      # ±1 and ±2 percentage points: > 6 std


def _sample(i: int) -> np.ndarray:
    """[CLS] a [SEP] b [SEP], every third sample ending in [PAD]s; ids ≥ 4 elsewhere."""
    ids = np.random.default_rng([11, i]).integers(len(SPECIAL_IDS), VOCAB, size=SEQ)
    end = SEQ - 1 - (10 if i % 3 == 0 else 0)
    ids[0], ids[SEQ // 2], ids[end], ids[end + 1:] = CLS_ID, SEP_ID, SEP_ID, PAD_ID
    return ids


def _masked(fn, ids: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
    given = ids.copy()
    got = fn(given, VOCAB, np.random.default_rng([11, i, 1]))
    if not (isinstance(got, tuple) and len(got) == 2):
        raise Hint("return a tuple (masked ids, labels), each an array of the sample's length")
    masked, labels = (np.asarray(g) for g in got)
    if masked.shape != ids.shape or labels.shape != ids.shape:
        raise Hint(f"masked ids and labels should each have the sample's shape {ids.shape}, got "
                   f"{masked.shape} and {labels.shape}")
    if not np.array_equal(given, ids):
        raise Hint("your function changed the ids it was given, in place: the corpus's sample "
                   "would be masked for good. Work on a copy (ids.copy())")
    return masked.astype(np.int64), labels.astype(np.int64)


def _tally(fn) -> dict[str, int]:
    """The counts over every sample, after checking each sample's labels and special tokens."""
    n = dict(candidates=0, chosen=0, mask=0, random=0, kept=0)
    for i in range(SAMPLES):
        ids = _sample(i)
        masked, labels = _masked(fn, ids, i)
        special = np.isin(ids, SPECIAL_IDS)
        chosen = labels != IGNORE_INDEX
        if chosen.all() or chosen[~special].all():
            raise Hint(f"sample {i}: every position has a label. Labels are −100 except at the "
                       "chosen positions, where they hold the original token: the masked-LM "
                       "loss is on the chosen 15 % only")
        changed = int(((masked != ids) & ~chosen & ~special).sum())
        if changed:
            raise Hint(f"sample {i}: {changed} tokens that are not chosen (label −100) were "
                       "changed — e.g. 80 % of *all* tokens masked. The 80 / 10 / 10 split "
                       "applies to the chosen 15 % only; every other token stays as it was")
        if (chosen & special).any() or (masked[special] != ids[special]).any():
            where = int(np.flatnonzero((chosen | (masked != ids)) & special)[0])
            raise Hint(f"sample {i}: the special token at position {where} (id {ids[where]}: "
                       "[CLS], [SEP] or [PAD]) was chosen or changed. Only tokens not in "
                       "SPECIAL_IDS are candidates — np.isin(ids, SPECIAL_IDS) finds the others")
        if (labels[chosen] != ids[chosen]).any():
            same_as_input = np.array_equal(labels[chosen], masked[chosen])
            raise Hint(f"sample {i}: the labels at the chosen positions are "
                       + ("the masked input ([MASK] or the random token)" if same_as_input else
                          "not the original tokens")
                       + ": they must hold what was there before masking — ids[chosen]")
        n["candidates"] += int((~special).sum())
        n["chosen"] += int(chosen.sum())
        fate = masked[chosen]
        drawn = (fate != ids[chosen]) & (fate != MASK_ID)
        if np.isin(fate[drawn], SPECIAL_IDS).any() or (fate[drawn] >= VOCAB).any():
            bad = int(fate[drawn][np.isin(fate[drawn], SPECIAL_IDS) | (fate[drawn] >= VOCAB)][0])
            raise Hint(f"sample {i}: a random replacement is id {bad}, "
                       + ("a special id" if bad < VOCAB else "outside the vocabulary")
                       + f": draw the random tokens from {len(SPECIAL_IDS)} … vocab_size − 1 "
                         "(rng.integers(len(SPECIAL_IDS), vocab_size)), never [CLS], [SEP], "
                         "[PAD] or [MASK]")
        n["mask"] += int((fate == MASK_ID).sum())
        n["random"] += int(drawn.sum())
        n["kept"] += int((fate == ids[chosen]).sum())
    return n


@exercise("11.1", "BERT's masking: 15 % chosen, then 80 / 10 / 10", reference=(mask_tokens,))
def check_masking(fn) -> str:
    """fn(ids, vocab_size, rng) on 3,000 seeded samples: Devlin's proportions, the labels."""
    n = _tally(fn)
    chosen = n["chosen"] / n["candidates"]
    if not abs(chosen - MASK_FRACTION) <= CHOSEN_TOL:
        raise Hint(f"you chose {chosen:.1%} of the non-special tokens; BERT chooses 15 % of "
                   "them (of the candidates, not of the whole sample with its [CLS], [SEP] and "
                   "[PAD]) — round(0.15 · candidates) positions, drawn without replacement")
    shares = {k: n[k] / n["chosen"] for k in ("mask", "random", "kept")}
    if shares["mask"] > 0.99:
        raise Hint("every chosen token became [MASK]. Only 80 % do; 10 % become a random token "
                   "and 10 % stay unchanged — so the model must predict every token it sees, not "
                   "only [MASK] positions, which fine-tuning never shows it (1810.04805 §3.1)")
    want = {"mask": TO_MASK, "random": TO_RANDOM, "kept": 1 - TO_MASK - TO_RANDOM}
    if any(not abs(shares[k] - want[k]) <= SHARE_TOL for k in want):
        raise Hint("of the chosen tokens you made " + ", ".join(
            f"{shares[k]:.1%} {k if k != 'mask' else '[MASK]'}" for k in want)
            + "; Devlin's are 80 % [MASK], 10 % random, 10 % kept: one uniform draw per chosen "
              "token, < 0.8 → [MASK], < 0.9 → random, else keep")
    return (f"on {SAMPLES:,} samples: {chosen:.1%} of the {n['candidates']:,} non-special tokens "
            f"chosen, of those {shares['mask']:.1%} [MASK], {shares['random']:.1%} random, "
            f"{shares['kept']:.1%} unchanged (a random draw can equal the original); special "
            "tokens never chosen, labels the original ids at the chosen positions and −100 "
            "elsewhere")


# --- 11.2 ★★ the rearranged block ----------------------------------------------------------------

def _block(ln_placement: str) -> Block:
    """Block 0 of a small GPT at ``ln_placement``, its weights redrawn at std 0.2 (layer norms
    included, so ln1 ≠ ln2) — the same weights for either placement."""
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=1, hidden=32, num_heads=4,
                       dropout=0.0, seed=11, ln_placement=ln_placement)
    block = GPT(config).blocks["0"]
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in block.named_parameters():
            scale = 1.0 if name.startswith("ln") and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + scale)
    return block


def _run(forward, block: Block) -> dict[str, torch.Tensor]:
    """Output, the input's gradient and every parameter's for one seeded x and upstream grad."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 8, 32, generator=gen).requires_grad_()
    upstream = torch.randn(2, 8, 32, generator=gen)
    block.zero_grad()
    y = forward(block, x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise Hint(f"return the block's output, a tensor of x's shape (2, 8, 32); got {shape}")
    if not y.requires_grad:
        raise Hint("the output does not require grad: the forward was run under torch.no_grad() "
                   "or detached — the block must be trainable")
    y.backward(upstream)
    grads = {"x": x.grad}
    grads.update({name: p.grad if p.grad is not None else torch.zeros_like(p)
                  for name, p in block.named_parameters()})
    return {"y": y.detach(), **grads}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], key: str = "y") -> bool:
    return torch.allclose(a[key], b[key], atol=1e-5)


def _post_ln_literal(block, x):            # Figure 7a drawn literally: LN after the add
    x = block.ln1(x + block.attn(x))
    return block.ln2(x + block.mlp(x))


def _one_norm(block, x):
    x = x + block.attn(block.ln1(x))
    return x + block.mlp(block.ln1(x))


def _no_mlp_residual(block, x):
    x = x + block.attn(block.ln1(x))
    return block.mlp(block.ln2(x))


def _parallel(block, x):                  # GPT-J: both sublayers read the block's input
    return x + block.attn(block.ln1(x)) + block.mlp(block.ln2(x))


WRONG = [
    (_post_ln_literal, "the layer norm comes after each add, LN(x + f(x)): that is Figure 7a, "
     "the original BERT. The rearranged block normalises the sublayer's *input* and adds the "
     "result to the un-normalised stream: x + attn(ln1(x))"),
    (_one_norm, "both sublayers read ln1: each has its own layer norm — ln1 before attention, "
     "ln2 before the MLP"),
    (_no_mlp_residual, "the MLP's output replaces the stream instead of being added to it: the "
     "second residual, x + mlp(ln2(x)), is missing"),
    (_parallel, "the MLP reads the block's input, not the stream after attention's add: that "
     "is GPT-J's parallel block. Add attention first, then feed the sum to ln2 and the MLP"),
]


# The reference is PreLN, the placement the answer writes out, not Block.forward: that one's
# check_initialised(self) is every layer's first line (shown with other layers' sources).
@exercise("11.2", "the rearranged (pre-LN) block from its pieces", reference=(PreLN,),
          marks=(r"(?i)\+f\(ln\(x\)\)",                             # x ← x + f(LN(x))
                 r"\+(block\.)?attn\((block\.)?ln1\(x\)\)",           # x + attn(ln1(x))
                 r"\+(block\.)?mlp\((block\.)?ln2\(x\)\)",            # x + mlp(ln2(x))
                 r"normed:torch\.Tensor\)->torch\.Tensor:returnx(?![\w.])"))  # PreLN.residual
def check_pre_ln_block(fn) -> str:
    """fn(block, x) against ``Block`` at "rearranged": outputs and every gradient."""
    want = _run(lambda b, x: b(x), _block("rearranged"))
    got = _run(fn, _block("rearranged"))
    if not _same(got, want):
        original = _run(lambda b, x: b(x), _block("original"))
        if _same(got, original):
            raise Hint("the residual is taken after the layer norm, u + f(u) with u = ln1(x): "
                       "that is the 'original' placement (post-LN, as Megatron-LM chains it). "
                       "In the rearranged block the residual is x itself: x + attn(ln1(x))")
        for wrong, hint in WRONG:
            if _same(got, _run(wrong, _block("rearranged"))):
                raise Hint(hint)
        diff = (got["y"] - want["y"]).abs().max().item()
        raise Hint(f"the output differs from the rearranged Block's by up to {diff:.3g}: "
                   "x ← x + attn(ln1(x)), then x ← x + mlp(ln2(x)), and return x")
    for name in want:
        if not torch.allclose(got[name], want[name], atol=1e-5):
            raise Hint(f"the output is right but the gradient of {name} is not: something "
                       "is detached or computed outside autograd (call the block's own "
                       "ln1, attn, ln2 and mlp on tensors that require grad)")
    params = len(want) - 2                                               # less y and x
    return (f"the output and the gradients of x and of all {params} parameters equal "
            "the package's rearranged Block (Figure 7b): the residual stream is never "
            "normalised, and the gradient reaches x through the adds unchanged")
