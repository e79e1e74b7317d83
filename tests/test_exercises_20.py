"""The checkers of notebook 20 (zero bubble, 2401.10241): each reference solution passes, each
typical mistake gets the hint written for it (in words), a stub says "not done yet", and the marks
see an answer but not its prompt."""


import pytest
from helpers import marked, stub, verdict

from megatron_edu.pipeline.schedules import Action


@pytest.mark.parametrize("exercise", ["20.1", "20.2"])
def test_a_stub_of_20_is_not_done_yet(exercise):
    verdict(exercise, stub, "not done yet")


# --- 20.1 the B and W of one linear layer -------------------------------------------------------

def _rows(t):
    return t.reshape(-1, t.shape[-1])


def backward_split(dy, x, weight):
    return dy @ weight, _rows(dy).T @ _rows(x)


def test_20_1_the_b_and_w_of_a_linear_layer_pass():
    verdict("20.1", backward_split)


def test_20_1_einsum_passes_too():
    import torch
    verdict("20.1", lambda dy, x, w: (torch.einsum("bso,oi->bsi", dy, w),
                                      torch.einsum("bso,bsi->oi", dy, x)))


@pytest.mark.parametrize("fn, words", [
    (lambda dy, x, w: (dy @ w.T, _rows(dy).T @ _rows(x)), ["Wᵀ", "through W itself"]),
    (lambda dy, x, w: (_rows(dy).T @ _rows(x), dy @ w), ["(dW, dx)", "shaped like x"]),
    (lambda dy, x, w: (dy @ w, _rows(x).T @ _rows(dy)), ["transpose", "[h_out, h_in]"]),
    (lambda dy, x, w: (dy @ w, dy[..., :, None] * x[..., None, :]),
     ["one outer product per token", "their sum"]),
    (lambda dy, x, w: (dy @ w, _rows(dy).T @ _rows(x) / _rows(x).shape[0]), ["the mean"]),
    (lambda dy, x, w: (dy @ w, dy[0].T @ x[0]), ["first sequence only"]),
    (lambda dy, x, w: (dy @ w, _rows(dy).T @ _rows(dy @ w)), ["uses dx", "layer's input x"]),
    (lambda dy, x, w: (dy @ w, dy.mT @ x), ["one matrix per sequence"]),
    (lambda dy, x, w: (dy @ w, dy.permute(2, 1, 0) @ x), ["reshape them", "[b·s, h]"]),
    (lambda dy, x, w: (_rows(dy @ w), _rows(dy).T @ _rows(x)), ["dx has shape", "x's"]),
    (lambda dy, x, w: dy @ w, ["a pair of tensors"]),
], ids=["dx-transpose", "swapped", "dw-transposed", "per-token", "mean", "one-sequence",
        "dw-from-dx", "per-sequence", "no-reshape", "dx-flat", "not-a-pair"])
def test_20_1_mistakes_get_their_hint(fn, words):
    verdict("20.1", fn, *words)


# --- 20.2 one rank's ZB-H1 order ----------------------------------------------------------------

def zb_h1_rank(p, m, rank):
    warmup = min(p - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            order.append(Action("F", warmup + i))
        order.append(Action("B", i))
        if i >= rank:
            order.append(Action("W", i - rank))
    return order + [Action("W", i) for i in range(max(m - rank, 0), m)]


def _with_delay(warmup, delay):
    """1F1B's order with ``warmup(p, m, rank)`` forwards first and each W ``delay`` B's late."""
    def rank_order(p, m, rank):
        w, d = warmup(p, m, rank), delay(p, m, rank)
        order = [Action("F", i) for i in range(w)]
        done = []
        for i in range(m):
            if w + i < m:
                order.append(Action("F", w + i))
            order.append(Action("B", i))
            done.append(i)
            if len(done) > d:
                order.append(Action("W", done[-1 - d]))
        return order + [Action("W", i) for i in done[max(len(done) - d, 0):]]
    return rank_order


def _warm(p, m, r):
    return min(p - r - 1, m)


def test_20_2_the_zb_h1_order_passes():
    verdict("20.2", zb_h1_rank)


def test_20_2_the_packages_own_rows_pass():
    from megatron_edu.pipeline.schedules import make_schedule
    verdict("20.2", lambda p, m, rank: make_schedule("zb-h1", p, m)[rank])


def _w_first(p, m, rank):
    row = zb_h1_rank(p, m, rank)
    w0 = row.index(Action("W", 0))
    return [row[w0]] + row[:w0] + row[w0 + 1:]


@pytest.mark.parametrize("fn, words", [
    (_w_first, ["dependency violation", "a W needs its own B"]),
    (lambda p, m, r: [a for a in zb_h1_rank(p, m, r) if a.kind != "W"], ["no W"]),
    (lambda p, m, r: [a for a in zb_h1_rank(p, m, r) if a != Action("W", 0)],
     ["check_schedule rejects", "missing W0"]),
    (_with_delay(lambda p, m, r: m, lambda p, m, r: 0), ["GPipe's order", "holds 8"]),
    (_with_delay(_warm, lambda p, m, r: m), ["every W is left to the end", "fill nothing"]),
    (_with_delay(lambda p, m, r: min(2 * (p - r - 1), m), lambda p, m, r: 2 * r),
     ["too many forwards in flight", "ZB-H2"]),
    (_with_delay(lambda p, m, r: min(p - r, m), lambda p, m, r: r),
     ["one forward too many"]),
    (_with_delay(_warm, lambda p, m, r: r + 1), ["one backward too long"]),
    (_with_delay(_warm, lambda p, m, r: 0), ["right after its B", "bubble size is 6, ZB-H1's 3"]),
    (_with_delay(_warm, lambda p, m, r: p - r - 1), ["over 1F1B's rank 0", "hold fewer W's"]),
    (_with_delay(_warm, lambda p, m, r: min(r, 1)), ["still waits where a W could run"]),
    (lambda p, m, r: [Action(a.kind, a.microbatch, 1) for a in zb_h1_rank(p, m, r)],
     ["one chunk per rank"]),
    (lambda p, m, r: tuple(map(str, zb_h1_rank(p, m, r))), ["return a list of Action"]),
], ids=["w-before-b", "no-w", "a-w-missing", "gpipe", "w-last", "zb-h2", "warmup-p-r",
        "w-one-too-late", "w-at-once", "reversed-delay", "delay-one", "chunk-1", "strings"])
def test_20_2_mistakes_get_their_hint(fn, words):
    verdict("20.2", fn, *words)


# --- the marks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("exercise, answers, harmless", [
    ("20.1", [r"B:\ \frac{\partial L}{\partial X} = \frac{\partial L}{\partial Y}\,W^\top",
              r"W:\ \frac{\partial L}{\partial W} = X^\top\,\frac{\partial L}{\partial Y}",
              "a linear layer Y = X·W computes ∂L/∂Y·Wᵀ and skips Xᵀ·∂L/∂Y"],
     ["dX = dY·A → dW = dYᵀ·X → copy of dY·A → start all-reduce",   # notebook 02's async TP
      "grad·W_r is only this rank's share of dx; dW_r = gradᵀ·X needs every position",
      "gather W again for dx = dy · W", "this rank's rows of dW = dyᵀ · x",   # notebook 13
      "computes y = x · Wᵀ", "the input's gradient, which the previous stage waits for"]),
    ("20.2", ["rank 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
              "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
              "ZB-H1's rank r runs each W r backwards late, into the tail where 1F1B idles",
              "ZB-H2 doubles both moves: 2(p − r − 1) warm-up forwards, W's 2r late",
              "ZB-H1 holds p microbatches on every rank (its delayed W's add r to 1F1B's)"],
     ["rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",       # 1F1B's
      "1f1b            peak activations per rank: [4, 3, 2, 1]",
      "Write `zb_h1_rank(p, m, rank)`: rank `rank`'s list of F, B and W",
      "W needs only its own B; no rank may hold more than 1F1B's rank 0"]),
])
def test_the_marks_of_20_see_an_answer_not_its_prompt(exercise, answers, harmless):
    """The reveal detector's marks (megatron_edu/course/reveals.py) on text without spaces."""
    assert [text for text in answers if not marked(exercise, text)] == []
    assert [text for text in harmless if marked(exercise, text)] == []
