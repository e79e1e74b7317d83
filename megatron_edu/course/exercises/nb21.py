"""Checkers for notebook 21 (mixed precision and fused operations).

21.1 ★★  one step of dynamic loss scaling on several ranks: unscale the gradients, agree on an
         overflow, halve or grow the scale (``optim.DynamicLossScale``, with Megatron-LM's floor)
21.2 ★   bias + GeLU as one fused kernel computes it: GPT-2's tanh GeLU written out, the bias
         added in the activation's dtype, computed in fp32 and rounded once (2104.04473 §4.2)

21.1 runs the learner's function first in this process, on a group of one rank (``comm``'s
collectives are then the identity), through seven steps that take every branch of the rule,
against ``DynamicLossScale`` with the floor ``min_scale``; then in one launch of 4 gloo ranks, an
inf on one rank only, then a NaN on another. Named: a NaN or an inf that does not skip the step
(``isinf`` misses NaN), the scale grown every step or never, grown after an overflow, halved below
the floor, a skipped step counted as good, the count not restarted after a change, the gradients
not unscaled or unscaled by the new scale, each rank deciding alone (its replicas then drift), the
gradients summed over the ranks.

21.2 runs in this process against ``fused.PLAIN.bias_gelu``, in fp32 (within 1e-5) and in bf16
(within one unit in the last place, beyond 1e-5), with ``F.gelu`` unavailable. Named: the exact
(erf) GeLU, the bias missing or added in fp32, an fp32 result for bf16 activations, a formula
computed op by op in bf16 (a rounding at every operation), ``y`` changed in place, the output
detached from autograd.
"""

from __future__ import annotations

import math
from unittest import mock

import torch
import torch.nn.functional as F

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.model import fused
from megatron_edu.optim import DynamicLossScale

__all__ = ["GROWTH_INTERVAL", "MIN_SCALE", "RANKS", "STEPS", "RANK_STEPS"]

# --- 21.1 ★★ one step of dynamic loss scaling ----------------------------------------------------

GROWTH_INTERVAL, MIN_SCALE, RANKS, TIMEOUT = 3, 1.0, 4, 30.0
SHAPES = ((3, 4), (5,))                 # a rank's two gradient tensors
STEPS = [                               # (what the gradients hold, S, good steps so far)
    ("finite", 1024.0, 0),
    ("finite", 1024.0, 1),
    ("finite", 1024.0, 2),              # the third good step in a row: S doubles
    ("inf", 1024.0, 2),                 # an overflow where a good step would have grown S
    ("nan", 1024.0, 0),
    ("inf", 1.0, 1),                    # at the floor
    ("inf", 2.0, 0),                    # down to the floor
]
RANK_STEPS = [                          # (what, the one rank that holds it, S, good steps)
    ("inf", 2, 1024.0, 1),
    ("finite", None, 512.0, 0),
    ("nan", 3, 512.0, 2),
]


def _grads(kind: str, rank: int, scale: float) -> list[torch.Tensor]:
    """A rank's gradients after backward from the loss times ``scale``: fp32, still scaled; an
    inf (overflow) or a NaN in the first or second tensor if ``kind`` says so."""
    gen = torch.Generator().manual_seed(2100 + rank)
    grads = [1e-3 * torch.randn(shape, generator=gen) * scale for shape in SHAPES]
    if kind == "inf":
        grads[0][1, 2] = math.inf
    if kind == "nan":
        grads[1][3] = math.nan
    return grads


def _rule(kind: str, scale: float, good: int) -> tuple[bool, float, int]:
    """The package's answer: DynamicLossScale's update, with Megatron-LM's floor min_scale."""
    overflow = kind != "finite"
    state = DynamicLossScale(scale=scale, growth_interval=GROWTH_INTERVAL, clean_steps=good)
    state.update(overflow)
    return not overflow, max(state.scale, MIN_SCALE), state.clean_steps


def _normalise(result) -> tuple[bool, float, int]:
    """The learner's (step, scale, good steps) as Python values (0-d tensors allowed)."""
    if not isinstance(result, tuple | list) or len(result) != 3:
        shown = type(result).__name__ if not isinstance(result, tuple | list) else len(result)
        raise Hint(f"return the triple (step, new_scale, new_good_steps), got {shown}")
    step, scale, good = result
    return bool(step), float(scale), int(good)


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(g.shape == w.shape and torch.allclose(g, w, rtol=1e-6, atol=0)
               for g, w in zip(got, want, strict=True))


def _rule_hint(kind: str, scale: float, good: int, got: tuple[bool, float, int],
               where: str) -> None:
    """Raise the hint naming what is wrong with (step, scale, good steps), if anything."""
    want = _rule(kind, scale, good)
    if got == want:
        return
    step, new_scale, new_good = got
    state = f"{where}, S = {scale:g}, {good} good step{'s' if good != 1 else ''} so far"
    if step != want[0]:
        if kind == "nan":
            raise Hint(f"{state}, a NaN gradient did not skip the step: isinf misses NaN (0·inf "
                       "or inf − inf in fp16 makes one). Test with isfinite")
        if kind == "inf":
            raise Hint(f"{state}, an inf gradient did not skip the step: an overflow updates "
                       "nothing")
        raise Hint(f"{state}, every gradient finite, yet the step was skipped")
    growth = good + 1 == GROWTH_INTERVAL
    if not want[0]:                                   # an overflow
        if new_scale > scale or (new_scale == scale and growth):
            raise Hint(f"{state}, an overflow left S at {new_scale:g}: it grew, then halved (or "
                       "only grew). An overflow halves S and restarts the count: look at the "
                       "overflow before counting the step as good")
        if new_scale == scale:
            raise Hint(f"{state}, an overflow left S at {new_scale:g}: it halves S")
        if new_scale < MIN_SCALE:
            raise Hint(f"{state}, an overflow took S to {new_scale:g}, below min_scale = "
                       f"{MIN_SCALE:g}: halve, but never below the floor (Megatron-LM's "
                       "min_scale), or a model that always overflows drives S to 0")
        if new_scale != want[1]:
            raise Hint(f"{state}, an overflow took S to {new_scale:g}; it halves S: {want[1]:g}")
        if new_good == good + 1:
            raise Hint(f"{state}, the skipped step was counted as good ({new_good}): an overflow "
                       "restarts the count at 0")
        raise Hint(f"{state}, after an overflow the count is {new_good}: it restarts at 0")
    if new_scale == 2 * scale and not growth:
        raise Hint(f"{state}, S doubled after {good + 1} good step{'s' if good else ''}: double "
                   f"it only after growth_interval = {GROWTH_INTERVAL} good steps in a row (a "
                   "scale grown every step soon overflows again)")
    if new_scale != want[1]:
        raise Hint(f"{state}, a good step took S to {new_scale:g}; expected {want[1]:g} ("
                   f"{'the count reached growth_interval: double S' if growth else 'unchanged'})")
    if growth and new_good == GROWTH_INTERVAL:
        raise Hint(f"{state}, S doubled but the count stayed at {new_good}: restart it at 0, so "
                   f"that S grows again only after {GROWTH_INTERVAL} more good steps")
    raise Hint(f"{state}, a good step left the count at {new_good}; expected {want[2]}")


def _unscale_hint(got: list[torch.Tensor], scaled: list[torch.Tensor], scale: float,
                  new_scale: float, where: str) -> None:
    """The step was taken: the gradients must be the scaled ones divided by this step's S."""
    if not all(isinstance(g, torch.Tensor) for g in got):
        raise Hint(f"{where}: grads must stay a list of tensors, unscaled in place")
    if _same(got, [g / scale for g in scaled]):
        return
    if _same(got, scaled):
        raise Hint(f"{where}: the step was taken but the gradients are still multiplied by S = "
                   f"{scale:g}: divide them by S in place (g.div_(scale)) before the update, or "
                   "the optimizer steps S times too far")
    if new_scale != scale and _same(got, [g / new_scale for g in scaled]):
        raise Hint(f"{where}: the gradients were divided by the new scale ({new_scale:g}); "
                   f"backward used this step's S = {scale:g}: unscale with it")
    raise Hint(f"{where}: after the step the gradients are not g/S (S = {scale:g}), in place")


def _call_alone(fn, kind: str, scale: float, good: int):
    """fn on a group of this process alone: comm's collectives are the identity there."""
    grads = _grads(kind, 0, scale)
    scaled = [g.clone() for g in grads]
    try:
        result = fn(grads, scale, good, comm.CommGroup("dp", (0,)), GROWTH_INTERVAL, MIN_SCALE)
    except (RuntimeError, ValueError) as err:
        if "process group" in str(err).lower():
            raise Hint("the checker first runs your function on a group of one rank, without "
                       "torch.distributed: communicate through comm (comm.all_reduce(x, group)), "
                       "whose collectives are the identity on one rank") from None
        raise
    return _normalise(result), grads, scaled


def _on_rank(fn) -> list[dict]:
    """RANK_STEPS on this rank of the world: each step's answer, gradients and collectives."""
    group = comm.world()
    out = []
    for kind, holder, scale, good in RANK_STEPS:
        grads = _grads(kind if group.rank == holder else "finite", group.rank, scale)
        scaled = [g.clone() for g in grads]
        with comm.record() as log:
            result = fn(grads, scale, good, group, GROWTH_INTERVAL, MIN_SCALE)
        out.append(dict(result=_normalise(result), grads=grads, scaled=scaled,
                        calls=len(log.events)))
    return out


def _named(ranks: list[int]) -> str:
    """"rank 2", "ranks 0, 1 and 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _drift_hint(results: list[list[dict]], index: int) -> None:
    """The ranks answered step ``index`` differently: name who stepped and who skipped."""
    kind, holder, scale, good = RANK_STEPS[index]
    answers = [r[index]["result"] for r in results]
    if len(set(answers)) == 1:
        return
    stepped = [r for r, a in enumerate(answers) if a[0]]
    skipped = [r for r, a in enumerate(answers) if not a[0]]
    if stepped and skipped:
        raise Hint(f"on {RANKS} ranks with an {kind} on rank {holder} only, {_named(skipped)} "
                   f"skipped the step and {_named(stepped)} took it: each rank decided alone, so "
                   "the replicas now hold different weights and drift apart. Every rank must "
                   "learn whether any rank overflowed: all-reduce this rank's count of "
                   "non-finite values over group (through comm) and decide on the sum")
    raise Hint(f"on {RANKS} ranks with an {kind} on rank {holder} only, the ranks returned "
               f"different scales or counts: {answers}")


@exercise("21.1", "one step of dynamic loss scaling on several ranks",
          reference=(DynamicLossScale.update,),
          marks=(r"skips?(the)?step(\d+)?oneveryrank",          # the shared decision, in words
                 r"everyrankskipped",
                 r"(stepping|stepped|steps)alone",
                 r"all-?reduc\w*(an?|the|one)?(overflow|inf|nan|non-?finite|bad)?flag"))
def check_loss_scaling(fn) -> str:
    """fn(grads, scale, good_steps, group, growth_interval, min_scale) alone through STEPS,
    then on 4 ranks through RANK_STEPS, against DynamicLossScale with the floor."""
    for kind, scale, good in STEPS:
        got, grads, scaled = _call_alone(fn, kind, scale, good)
        where = f"alone, {'finite gradients' if kind == 'finite' else 'an ' + kind}"
        _rule_hint(kind, scale, good, got, where)
        if got[0]:
            _unscale_hint(grads, scaled, scale, got[1], where)
    results = on_ranks(RANKS, _on_rank, fn, timeout=TIMEOUT, may_deadlock=True)
    for index, (kind, holder, scale, good) in enumerate(RANK_STEPS):
        _drift_hint(results, index)
        where = (f"on {RANKS} ranks, " + (f"an {kind} on rank {holder} only" if holder is not None
                                         else "every gradient finite"))
        _rule_hint("finite" if holder is None else kind, scale, good,
                   results[0][index]["result"], where)
        for rank, got in enumerate(r[index] for r in results):
            if got["result"][0]:
                total = [sum(r[index]["scaled"][i] for r in results) for i in range(len(SHAPES))]
                if _same(got["grads"], [g / scale for g in total]):
                    raise Hint(f"{where}: rank {rank}'s gradients were summed over the group: "
                               "the ranks hold different parts of the model, and only the "
                               "overflow flag needs to travel")
                _unscale_hint(got["grads"], got["scaled"], scale, got["result"][1],
                              f"{where}, rank {rank}")
    calls = max(r[0]["calls"] for r in results)
    return (f"the rule holds through {len(STEPS)} steps alone (S doubled after "
            f"{GROWTH_INTERVAL} good steps, halved on an inf or a NaN, never below "
            f"{MIN_SCALE:g}; gradients unscaled by this step's S), and on {RANKS} ranks an "
            f"overflow on one rank skipped the step on all, with {calls} collective"
            f"{'s' if calls != 1 else ''} a step")


# --- 21.2 ★ bias + GeLU as one fused kernel ------------------------------------------------------

GELU_ATOL = 1e-5


def _gelu_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A column layer's output y [64, 96] in ``dtype`` and its fp32 master bias [96]."""
    gen = torch.Generator().manual_seed(212)
    return (2 * torch.randn(64, 96, generator=gen)).to(dtype), 0.5 * torch.randn(96, generator=gen)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got − want| beyond GELU_ATOL, in units of the last place of want's dtype at want (the
    gap between neighbours in [2^k, 2^(k+1)) is 2^k · eps)."""
    magnitude = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    ulp = 2.0 ** torch.floor(torch.log2(magnitude)) * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() - GELU_ATOL).clamp_min(0) / ulp


def _refuse_gelu(*args, **kwargs):
    raise Hint("write GeLU out of torch's elementwise operations (tanh, products, sums): "
               "F.gelu is a kernel of its own, and the exercise is to write the fused one")


def _call(fn, y: torch.Tensor, bias: torch.Tensor):
    with mock.patch.object(F, "gelu", _refuse_gelu):
        return fn(y, bias)


def _fp32_hint(got: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> None:
    """In fp32 the values are not the package's: name the GeLU or the bias, if that is it."""
    x = y + bias
    for other, message in [
        (0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
         "this is the exact GeLU, 0.5·x·(1 + erf(x/√2)); GPT-2's is the tanh approximation "
         "(gelu_new), 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): it differs by up to 5e-4"),
        (_tanh_gelu(y), "the bias is missing: GeLU(y + bias)"),
    ]:
        if (got - other).abs().max().item() <= GELU_ATOL:
            raise Hint(f"in fp32, {message}")
    raise Hint("in fp32 the result differs from fused.PLAIN.bias_gelu's by up to "
               f"{(got - fused.PLAIN.bias_gelu(y, bias)).abs().max().item():.3g}: "
               "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) with x = y + bias")


def _bf16_hint(got: torch.Tensor, y: torch.Tensor, bias: torch.Tensor, off: torch.Tensor) -> None:
    """Right in fp32, wrong in bf16: the bias in fp32, or a rounding at every operation."""
    fp32_bias = _tanh_gelu(y.float() + bias).to(y.dtype)
    if _ulps(got, fp32_bias).max().item() <= 1 < _ulps(fp32_bias, fused.PLAIN.bias_gelu(
            y, bias)).max().item():
        raise Hint("in bf16 the bias was added in fp32: the package adds it in the "
                   "activation's dtype (bias.to(y.dtype)), and the fused kernel must give the "
                   "unfused chain's numbers")
    raise Hint(f"in bf16, {int((off > 1).sum())} of {off.numel()} values are off by more than "
               f"one unit in the last place (up to {off.max().item():.0f}): each bf16 operation "
               "of your formula rounds its result. A fused kernel loads y once, computes in "
               "fp32 and rounds once, when it stores the output")


@exercise("21.2", "bias + GeLU as one fused kernel computes it",
          reference=(fused._bias_gelu,),
          marks=(r"round(s|ed|ing)?(it|them|the\w+)?once",      # what the kernel does, in words
                 r"(fp32|float32)registers"))
def check_bias_gelu(fn) -> str:
    """fn(y, bias) against fused.PLAIN.bias_gelu in fp32 and bf16, F.gelu unavailable; then
    its gradients in fp32."""
    for dtype in (torch.float32, torch.bfloat16):
        y, bias = _gelu_data(dtype)
        got = _call(fn, y.clone(), bias.clone())
        name = str(dtype).removeprefix("torch.")
        if not isinstance(got, torch.Tensor) or got.shape != y.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise Hint(f"return GeLU(y + bias), a tensor of y's shape {tuple(y.shape)}; got "
                       f"{shape}")
        if got.dtype != dtype:
            raise Hint(f"for {name} y the result is {str(got.dtype).removeprefix('torch.')}: "
                       "return y's dtype. An fp32 activation is twice the bytes to write, and "
                       "to read again in the next matmul: the traffic fusion exists to save")
        if not torch.isfinite(got).all():
            raise Hint(f"for {name} y the result holds infs or NaNs: GeLU(y + bias) is finite "
                       "for every finite input")
        off = _ulps(got, fused.PLAIN.bias_gelu(y, bias))
        if off.max().item() > (0 if dtype == torch.float32 else 1):
            if dtype == torch.float32:
                _fp32_hint(got, y, bias)
            _bf16_hint(got, y, bias, off)
    y, bias = _gelu_data(torch.float32)
    before = y.clone()
    _call(fn, y, bias.clone())
    if not torch.equal(y, before):
        raise Hint("your function changed y in place: the caller's tensor (and autograd's copy "
                   "of it) must stay as it was; write the result into a new tensor")
    ours = (y.clone().requires_grad_(), bias.clone().requires_grad_())
    theirs = (y.clone().requires_grad_(), bias.clone().requires_grad_())
    got = _call(fn, *ours)
    if not got.requires_grad:
        raise Hint("the output has no gradient: it was computed under torch.no_grad or "
                   "detached, and a fused kernel in training needs its backward")
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(213))
    got.backward(upstream)
    fused.PLAIN.bias_gelu(*theirs).backward(upstream)
    for mine, want, what in zip(ours, theirs, ("y", "the bias"), strict=True):
        if mine.grad is None or (mine.grad - want.grad).abs().max().item() > 1e-4:
            raise Hint(f"the gradient of {what} differs from fused.PLAIN.bias_gelu's")
    return ("equal to fused.PLAIN.bias_gelu within 1e-5 in fp32 and within one unit in the last "
            "place in bf16 (computed in fp32, rounded once), y's dtype kept, its gradients "
            "equal too")
