"""Exercises of notebook 20: zero bubble, the backward pass split into B and W (2401.10241).

20.1 ★   the B and W of one linear layer y = x·Wᵀ: the input's gradient from ∂L/∂y and W, the
         weight's from ∂L/∂y and x, summed over every token — compared with autograd on square
         and non-square layers, naming a transpose missing or one too many, B and W returned
         swapped, a weight gradient kept per token, averaged or summed over one sequence only,
         and one computed from dx instead of x.
20.2 ★★  one rank's ZB-H1 order (§2.1, Figure 3 top): F, B and W of every microbatch such that
         the ranks' lists together pass ``check_schedule``, no rank holds more microbatches than
         1F1B's rank 0 does, and the bubble size is no larger than ZB-H1's — judged by
         ``simulate`` at three costs with t_W ≤ t_F (§2.3), naming a W before its B, W's missing,
         GPipe's order, every W left to the end, ZB-H2's longer warm-up, a W held back one
         backward too long, and W's run at once (which leaves the bubble unfilled).

Both are decided in this process, no ranks started.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    _warmup_then_1f1b,
    _weights_after_backwards,
    _zero_bubble,
    check_schedule,
    make_schedule,
)
from megatron_edu.pipeline.simulate import Timeline, simulate
from megatron_edu.pipeline.stages import StageMap

__all__ = ["LINEAR_CASES", "ORDER_CASES", "COSTS"]  # the checkers register themselves

# --- 20.1 ★ the B and W of one linear layer -----------------------------------------------------

# (b, s, h_in, h_out): the square layer first, where a transpose too many still runs
LINEAR_CASES = ((2, 3, 5, 5), (2, 3, 4, 6), (3, 1, 6, 2), (1, 4, 3, 7))


def _tensors(b: int, s: int, h_in: int, h_out: int) -> tuple[torch.Tensor, ...]:
    """(dy, x, weight) in float64, and autograd's (dx, dW) of y = x·Wᵀ given dy."""
    gen = torch.Generator().manual_seed(b * 1000 + s * 100 + h_in * 10 + h_out)
    x = torch.randn(b, s, h_in, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(h_out, h_in, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(b, s, h_out, dtype=torch.float64, generator=gen)
    F.linear(x, weight).backward(dy)
    return dy, x.detach(), weight.detach(), x.grad, weight.grad


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# Wrong answers, each as a function of (dy, x, weight, dx) → the tensor it gives
DX_MISTAKES: dict[str, tuple[Callable, str]] = {
    "transpose": (lambda dy, x, w, dx: dy @ w.T,
                  "your dx multiplies dy by Wᵀ: the forward already used Wᵀ (y = x·Wᵀ), so the "
                  "input's gradient goes back through W itself — W is [h_out, h_in], dy "
                  "[b, s, h_out], and dx must come out [b, s, h_in]"),
}
DW_MISTAKES: dict[str, tuple[Callable, str]] = {
    "transposed": (lambda dy, x, w, dx: _rows(x).T @ _rows(dy),
                   "your dW is the transpose of the weight's gradient: it must have W's shape "
                   "[h_out, h_in], the tokens' dy (as columns) times their x (as rows). The "
                   "paper writes Y = X·W, with W stored the other way round"),
    "per token": (lambda dy, x, w, dx: dy[..., :, None] * x[..., None, :],
                  "your dW holds one outer product per token: the layer uses the same W for "
                  "every token of every sequence, so its gradient is their sum, one [h_out, h_in] "
                  "matrix"),
    "per sequence": (lambda dy, x, w, dx: dy.mT @ x,
                     "your dW holds one matrix per sequence: the layer uses the same W for every "
                     "sequence of the batch too, so sum over b as well as s"),
    "mean": (lambda dy, x, w, dx: _rows(dy).T @ _rows(x) / _rows(x).shape[0],
             "your dW is the mean over the tokens: the weight's gradient is their sum (dy already "
             "carries whatever 1/N the loss divides by)"),
    "first sequence": (lambda dy, x, w, dx: dy[0].T @ x[0],
                       "your dW sums over the first sequence only: sum over every token, of "
                       "every sequence of the batch (flatten b and s into one dimension)"),
    "last sequence": (lambda dy, x, w, dx: dy[-1].T @ x[-1],
                      "your dW sums over the last sequence only: sum over every token, of every "
                      "sequence of the batch (flatten b and s into one dimension)"),
    "from dx": (lambda dy, x, w, dx: _rows(dy).T @ _rows(dx),
                "your dW uses dx: the weight's gradient needs the layer's input x (kept from the "
                "forward) and dy; dx is B's result, sent to the previous stage"),
    "dx from dx": (lambda dy, x, w, dx: _rows(dx).T @ _rows(x),
                   "your dW uses dx: the weight's gradient needs the layer's input x (kept from "
                   "the forward) and dy; dx is B's result, sent to the previous stage"),
}


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got.double(), want, atol=1e-8))


def _name_mistake(got: torch.Tensor, mistakes: dict, tensors: tuple, shapes: str) -> None:
    """Raise the hint of the first catalogued mistake that ``got`` equals, if any (a mistake
    whose shapes do not even multiply is not the one made)."""
    for wrong, advice in mistakes.values():
        try:
            candidate = wrong(*tensors)
        except RuntimeError:
            continue
        if _same(got, candidate):
            raise Hint(f"with {shapes}: {advice}")


def _split(fn, case: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    dy, x, weight, dx, dw = _tensors(*case)
    b, s, h_in, h_out = case
    shapes = f"x [{b}, {s}, {h_in}], W [{h_out}, {h_in}], dy [{b}, {s}, {h_out}]"
    try:
        got = fn(dy.clone(), x.clone(), weight.clone())
    except RuntimeError as error:
        raise Hint(f"with {shapes} your function raised: {str(error).splitlines()[0]} — x and "
                   "dy have a batch and a sequence dimension, every token a row: reshape them "
                   "to [b·s, h] before a matrix product (W is [h_out, h_in])") from None
    if not (isinstance(got, tuple | list) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise Hint(f"return a pair of tensors (dx, dW); got {type(got).__name__}")
    return dy, x, weight, dx, dw, shapes, *got


@exercise("20.1", "the B and W of one linear layer",
          # 2401.10241's B and W, in words and as display math; not dx = dy·W and dW = dyᵀ·x,
          # which notebooks 02 and 13 teach: this exercise puts them to a new use
          marks=(r"∂L/∂Y·?Wᵀ", r"Xᵀ·?∂L/∂Y", r"\\frac\{\\partialL\}\{\\partial[XW]\}="))
def _linear(fn) -> str:
    for case in LINEAR_CASES:
        dy, x, weight, dx, dw, shapes, got_dx, got_dw = _split(fn, case)
        if _same(got_dx, dx) and _same(got_dw, dw):
            continue
        if _same(got_dx, dw) and _same(got_dw, dx) or (
                got_dx.shape == dw.shape and got_dw.shape == dx.shape != dw.shape):
            raise Hint(f"with {shapes} you returned (dW, dx): B is the input's gradient, shaped "
                       "like x, which the previous stage waits for; W the weight's, shaped like "
                       "W — return (dx, dW)")
        if not _same(got_dx, dx):
            _name_mistake(got_dx, DX_MISTAKES, (dy, x, weight, dx), shapes)
            if got_dx.shape != dx.shape:
                raise Hint(f"with {shapes} your dx has shape {tuple(got_dx.shape)}: it must "
                           f"have x's, {tuple(dx.shape)} — one gradient per input number")
            raise Hint(f"with {shapes} your dx differs from autograd's by up to "
                       f"{(got_dx.double() - dx).abs().max().item():.3g}: dx needs dy and W "
                       "only (y = x·Wᵀ)")
        _name_mistake(got_dw, DW_MISTAKES, (dy, x, weight, dx), shapes)
        if got_dw.shape != dw.shape:
            raise Hint(f"with {shapes} your dW has shape {tuple(got_dw.shape)}: it must have "
                       f"W's, {tuple(dw.shape)}")
        raise Hint(f"with {shapes} your dW differs from autograd's by up to "
                   f"{(got_dw.double() - dw).abs().max().item():.3g}: dW needs dy and x only, "
                   "summed over every token")
    return (f"equal to autograd's x.grad and W.grad on {len(LINEAR_CASES)} layers, square and "
            "not: B is dy·W, the input's gradient, which needs W but not x; W is dyᵀ·x over "
            "every token, which needs x but not W — so W can run later, if x and dy are kept")


# --- 20.2 ★★ one rank's ZB-H1 order ------------------------------------------------------------

ORDER_CASES = ((4, 8), (2, 2), (2, 4), (3, 3), (3, 7), (4, 2), (4, 4), (5, 10), (6, 9), (8, 16))
COSTS = ((1, 1, 1), (1, 2, 1), (2, 3, 1))   # (t_F, t_B, t_W) with t_W ≤ t_F (2401.10241 §2.3)


def _one_f_one_b_split(p: int, m: int, rank: int, warmup: int, delay: int) -> list[Action]:
    """1F1B's streams with ``warmup`` forwards first, each W ``delay`` backwards after its B."""
    forwards = [Action("F", i) for i in range(m)]
    backwards = [Action("B", i) for i in range(m)]
    return _weights_after_backwards(_warmup_then_1f1b(forwards, backwards, warmup), delay)


def _gpipe_split(p: int, m: int, rank: int) -> list[Action]:
    return _one_f_one_b_split(p, m, rank, m, 0)


def _w_last(p: int, m: int, rank: int) -> list[Action]:
    return [a for a in _one_f_one_b_split(p, m, rank, min(p - rank - 1, m), m) if a.kind != "W"
            ] + [Action("W", i) for i in range(m)]


# Recognised orders: (the rows, what to say). Checked in this order on the lists that fail.
ORDER_MISTAKES: dict[str, tuple[Callable[[int, int, int], list[Action]], str]] = {
    "gpipe": (_gpipe_split,
              "that is GPipe's order (every forward first): each rank holds all m microbatches. "
              "Start from 1F1B's order (exercise 04.2)"),
    "W last": (_w_last,
               "every W is left to the end: a microbatch's activations live until its W, so each "
               "rank holds all m; and the W's fill nothing, since they run after the last "
               "backward, where no rank waits any more"),
    "zb-h2": (lambda p, m, r: _one_f_one_b_split(p, m, r, min(2 * (p - r - 1), m), 2 * r),
              "too many forwards in flight: a warm-up of 2(p − r − 1) forwards is ZB-H2's "
              "(2p − 1 microbatches held); keep 1F1B's warm-up, min(p − r − 1, m)"),
    "warm-up p - r": (lambda p, m, r: _one_f_one_b_split(p, m, r, min(p - r, m), r),
                      "one forward too many in the warm-up: 1F1B's is min(p − r − 1, m), and the "
                      "steady state's first forward follows it"),
    "one W too late": (lambda p, m, r: _one_f_one_b_split(p, m, r, min(p - r - 1, m), r + 1),
                       "each W is held back one backward too long: a microbatch's activations "
                       "live from its F to its W, so every rank holds one microbatch too many"),
    "W at once": (lambda p, m, r: _one_f_one_b_split(p, m, r, min(p - r - 1, m), 0),
                  "each W runs right after its B: the gradient now leaves after B alone, which "
                  "saves (p − 1)·t_W, but each rank still idles where 1F1B does. Rank r holds "
                  "only p − r microbatches under 1F1B: it has room to hold some W's back and run "
                  "them where it would wait"),
}


def _order_rows(fn, p: int, m: int) -> list[list[Action]]:
    rows = []
    for rank in range(p):
        row = fn(p, m, rank)
        if not isinstance(row, list | tuple) or not all(isinstance(a, Action) for a in row):
            raise Hint(f"your function returned {type(row).__name__} for p={p}, m={m}, rank "
                       f"{rank}; return a list of Action(kind, microbatch), kind 'F', 'B' or 'W'")
        if bad := [a for a in row if a.chunk != 0]:
            raise Hint(f"p={p}, m={m}, rank {rank} runs {bad[0]} on chunk {bad[0].chunk}: ZB-H1 "
                       "has one chunk per rank (leave chunk at 0)")
        rows.append(list(row))
    return rows


def _known(rows: list[list[Action]], p: int, m: int) -> str | None:
    for wrong, advice in ORDER_MISTAKES.values():
        if rows == [wrong(p, m, r) for r in range(p)]:
            return advice
    return None


def _peaks(rows: list[list[Action]], p: int) -> list[int]:
    return Timeline([[(a, 0, 0) for a in row] for row in rows], StageMap.plain(p)).peak_activations


@exercise("20.2", "one rank's ZB-H1 order: the W's where 1F1B waits",
          reference=(_zero_bubble, _weights_after_backwards),
          marks=(r"F3B1W0F4B2W1", r"B2W0F4B3W1F5", r"B3W0F4B4W1F5",   # ZB-H1's rows at p=4, m=8
                 r"eachWr(backward|late)", r"W'?s?byrbackward",         # the rule, in words
                 r"W's2rlate", r"addrto1F1B"))
def _zb_h1_rank(fn) -> str:
    for p, m in ORDER_CASES:
        rows = _order_rows(fn, p, m)
        where = f"p={p}, m={m}"
        schedule = Schedule(rows, StageMap.plain(p))
        if not schedule.splits_backward:
            raise Hint(f"{where}: your lists have no W: each B is now the input's gradient only, "
                       "and every microbatch also needs its W, Action('W', i), somewhere after "
                       "its B")
        try:
            check_schedule(schedule)
        except ValueError as error:
            text = str(error)
            if "dependency violation" in text and " runs W" in text:
                raise Hint(f"{where}: {text} — a W needs its own B: it computes the weight's "
                           "gradient from the dy that B received") from None
            raise Hint(f"{where}: check_schedule rejects your lists: {text}") from None
        reference = make_schedule("zb-h1", p, m)
        peaks, limit = _peaks(rows, p), min(p, m)
        advice = _known(rows, p, m)
        if max(peaks) > limit:
            rank = peaks.index(max(peaks))
            raise Hint(f"{where}: rank {rank} holds {max(peaks)} microbatches at its peak, over "
                       f"1F1B's rank 0, {limit} (activations live from a microbatch's F to its "
                       "W) — " + (advice or "hold fewer W's back, or start fewer forwards"))
        for costs in COSTS:
            size = simulate(schedule, *costs[:2], weight_time=costs[2]).bubble_size
            target = simulate(reference, *costs[:2], weight_time=costs[2]).bubble_size
            if size > target:
                t_f, t_b, t_w = costs
                raise Hint(f"{where}, t_F={t_f}, t_B={t_b}, t_W={t_w}: your bubble size is "
                           f"{size}, ZB-H1's {target} — " + (advice or (
                               "some rank still waits where a W could run: which of rank r's "
                               "backwards wait for a gradient, and how many W's may it hold "
                               "back within the memory limit?")))
    return (f"on all {len(ORDER_CASES)} (p, m), m < p included: your lists pass check_schedule, "
            "no rank holds more than 1F1B's rank 0 (min(p, m)), and the bubble size is "
            f"ZB-H1's at {len(COSTS)} costs with t_W ≤ t_F — a third of 1F1B's at equal costs")
