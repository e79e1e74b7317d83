"""Checkers for notebook 10 (activation memory, recomputation, sequence parallelism).

10.1 ★    the activation bytes of one transformer layer (2205.05198 Table 2)
10.2 ★★   selective recomputation: the attention core under a checkpoint (2205.05198 §5)
10.3 ★★   the sequence-parallel layer norm's weight gradients, summed over tp (§4.2.2)
10.4 ★★★  sequence parallelism's column layer as an autograd Function: all-gather the sequence
          forward; gather the input again and reduce-scatter its gradient backward (§4.2.2)

10.1 is checked in this process against ``megatron_edu.perf.activation_bytes_per_layer`` over a
grid of shapes, tensor-parallel sizes and modes. Typical wrong answers — the 10·s·b·h not divided
by t under sequence parallelism, selective recomputation dropping the 34 term instead of the
5·a·s/h one, elements instead of bytes, t missing from the attention term — are named.

10.2 is checked in this process against the package's ``Attention`` (dropout off, then on): the
output and every gradient equal to the plain sublayer's, and the bytes autograd saves for
backward (``perf.measure.saved_bytes``) those of the package's selective recomputation. Named:
no checkpoint (the s×s tensors it keeps, listed), a dropout mask recomputation cannot repeat (not
the keyed one, or another key in the recomputation), the whole sublayer checkpointed (full
recomputation: too few bytes kept), the 1/√h_d scale or the causal mask missing.

10.3 runs on 4 gloo ranks (tp = 2 × dp = 2, each replica its own batch) against the serial layer
norm's gradients. Named: each rank's partial gradient not reduced, averaged instead of summed,
summed over the wrong group (dp, or every rank), the sequence split along another dimension, the
whole sequence on every rank.

10.4 runs on 2 gloo ranks against the serial layer x·Wᵀ on the whole sequence (each rank its
out/t columns), comparing y, dx and dW, and records the collectives of each pass and the shapes
saved for backward. Named: the own part of the sequence only (no gather), the batch or the hidden
size gathered or scattered instead of the sequence, the partial gradients not summed, all-reduced
(the whole sequence's gradient, or twice the bytes), gathered in backward, summed twice, another
rank's part kept, dW of the rank's own positions only or all-reduced, and the gathered input kept
for backward instead of gathered again (t× its memory).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPTConfig
from megatron_edu.model.transformer import Attention
from megatron_edu.perf import activation_bytes_per_layer
from megatron_edu.perf.measure import saved_bytes
from megatron_edu.tensor_parallel.init import init_parameters
from megatron_edu.tensor_parallel.layers import serial_group
from megatron_edu.tensor_parallel.random import DropoutKey, checkpoint
from megatron_edu.tensor_parallel.sequence_parallel import (
    _SequenceParallelLinear,
    sum_replicated_grads_,
)

__all__ = ["CASES", "ATTENTION", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

CASES = [(s, b, h, a, t) for s, b, h, a in [(128, 2, 128, 8), (2048, 1, 12288, 96)]
         for t in (1, 2, 4, 8)]


def _reference(s: int, b: int, h: int, a: int, t: int, sp: bool, selective: bool) -> int:
    """The package's per-layer activation bytes (fp16) for that shape and mode."""
    config = GPTConfig(vocab_size=512, seq_len=s, num_layers=1, hidden=h, num_heads=a,
                       recompute="selective" if selective else "none", sequence_parallel=sp)
    return activation_bytes_per_layer(config, b, tp=t, bytes_per_value=2)


def _hint(s, b, h, a, t, sp, selective, got) -> None:
    """Raise the hint naming the mistake that gives ``got``, if it is a known one."""
    sbh, core = s * b * h, 5 * a * s * s * b
    want = _reference(s, b, h, a, t, sp, selective)
    if abs(got - want / 2) < 1:
        raise Hint("the answer is half the bytes: you counted elements; Table 2 is in bytes "
                   "(fp16 activations: 2 bytes each, the dropout masks 1)")
    if sp and abs(got - (10 * sbh + 24 * sbh / t + (0 if selective else core / t))) < 1:
        raise Hint("with sequence parallelism the 10·s·b·h (layer norms, dropouts, their inputs) "
                   "is split t ways too: sbh·34/t")
    if selective and abs(got - (want + core / t - (10 + 24 / t if not sp else 34 / t) * sbh)) < 1:
        raise Hint("selective recomputation drops the attention core's 5·a·s/h term, not the 34: "
                   "it keeps 34·s·b·h (÷ t as the mode splits it)")
    if not selective and t > 1 and abs(got - (want - core / t + core)) < 1:
        raise Hint("the 5·a·s/h term is not divided by t: tensor parallelism splits the heads, so "
                   "each rank keeps 5·a·s²·b/t")


@exercise("10.1", "the activation bytes of one transformer layer",
          reference=(activation_bytes_per_layer,),
          marks=(r"34[·*]?s[·*]?b[·*]?h",                # the 34·s·b·h (34·sbh, 34*sbh)
                 r"34\+5[·*]?a[·*]?s/h",                 # s·b·h·(34 + 5·a·s/h)
                 r"10\+24/t",                            # tensor parallelism's 10 + 24/t
                 r"34/t\+5",                             # with sequence parallelism, 34/t + …
                 r"5[·*]?a[·*]?s(²|\*\*2|\^2)[·*]?b",     # attention's 5·a·s²·b
                 r"5[·*]?a[·*]?s/\(?h"))                  # its 5·a·s/h, 5·a·s/(h·t)
def check_layer_bytes(fn) -> str:
    """fn(s, b, h, a, t, sequence_parallel, selective) against perf.memory over a grid."""
    for (s, b, h, a, t), sp, selective in itertools.product(CASES, (False, True), (False, True)):
        got = fn(s, b, h, a, t, sp, selective)
        want = _reference(s, b, h, a, t, sp, selective)
        if abs(got - want) > 1e-6 * want:
            _hint(s, b, h, a, t, sp, selective, got)
            raise Hint(f"s={s}, b={b}, h={h}, a={a}, t={t}, sequence_parallel={sp}, "
                       f"selective={selective}: {got:,.0f} bytes, expected {want:,} — see "
                       "2205.05198 Table 2")
    return (f"Table 2's bytes match perf.memory for {len(CASES) * 4} cases "
            "(t = 1…8, with and without sequence parallelism and selective recomputation).")


# --- 10.2 ★★ selective recomputation of the attention core ---------------------------------------

ATTENTION = GPTConfig(vocab_size=64, seq_len=16, num_layers=1, hidden=32, num_heads=4)  # s ≠ h
BATCH = 2


def _attention(dropout: float, recompute: str = "none", causal: bool = True) -> Attention:
    """A serial attention sublayer of ATTENTION (in training mode), its weights from the seed."""
    attn = Attention(replace(ATTENTION, dropout=dropout, recompute=recompute, causal=causal),
                     serial_group())
    init_parameters(attn, ATTENTION.seed, serial_group())
    return attn


def _unscaled(attn: Attention) -> Attention:
    """``attn`` with each head's q rows √h_d larger: its scores are q·kᵀ, without the 1/√h_d."""
    d = attn.head_dim
    with torch.no_grad():
        for rows in range(0, 3 * ATTENTION.hidden, 3 * d):        # per head: q | k | v rows
            attn.qkv.weight[rows:rows + d] *= math.sqrt(d)
            attn.qkv.bias[rows:rows + d] *= math.sqrt(d)
    return attn


def _run_attention(fn, attn: Attention) -> tuple[object, dict, int]:
    """fn(attn, x, key) on the fixed input: its output, the gradients of x and of every weight
    after a backward from a fixed dL/dy, and the bytes saved for backward (weights excluded)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(BATCH, ATTENTION.seq_len, ATTENTION.hidden, generator=gen).requires_grad_()
    upstream = torch.randn(x.shape, generator=gen)
    out: list = []
    kept = saved_bytes(lambda: out.append(fn(attn, x, DropoutKey.first(BATCH))),
                       attn.parameters())
    y = out[0]
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise Hint(f"return the sublayer's output, a tensor [b, s, h] of shape {tuple(x.shape)} "
                   f"(got {tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}) "
                   "— after attn.proj, as Attention.forward returns it")
    if not y.requires_grad:
        raise Hint("the output has no gradient: it was computed under torch.no_grad or detached")
    y.backward(upstream)
    grads = {"x": x.grad, **{name: p.grad for name, p in attn.named_parameters()}}
    return y.detach(), grads, kept


def _square_tensors(fn) -> list[str]:
    """The tensors of s×s scores per head that fn saves for backward, as 'dtype [shape]'."""
    attn, s, found = _attention(0.1), ATTENTION.seq_len, {}
    x = torch.zeros(BATCH, s, ATTENTION.hidden, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in attn.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (t.dim() >= 2 and tuple(t.shape[-2:]) == (s, s)
                and t.untyped_storage().data_ptr() not in weights):
            found[t.untyped_storage().data_ptr()] = (f"{str(t.dtype).removeprefix('torch.')} "
                                                      f"{list(t.shape)}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(attn, x, DropoutKey.first(BATCH))
    return list(found.values())


def _differs(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> bool:
    return not (got.shape == want.shape and (got - want).abs().max().item() <= atol)


def _package(attn: Attention, x: torch.Tensor, key: DropoutKey) -> torch.Tensor:
    """The package's sublayer, as the model calls it."""
    return attn(x, None, key)


def _output_hint(y: torch.Tensor, want: torch.Tensor) -> None:
    """Dropout off, the output wrong: the scale or the causal mask missing, or something else."""
    if not _differs(y, _run_attention(_package, _unscaled(_attention(0.0)))[0], 1e-5):
        raise Hint("the scores are not scaled: softmax(q·kᵀ/√h_d), with h_d = attn.head_dim "
                   f"= {ATTENTION.head_dim}")
    if not _differs(y, _run_attention(_package, _attention(0.0, causal=False))[0], 1e-5):
        raise Hint("each position sees every key: GPT's attention is causal — mask the scores "
                   "above the diagonal with −inf before the softmax")
    raise Hint(f"with dropout off the output differs from Attention.forward's by up to "
               f"{(y - want).abs().max().item():.3g}: the core is softmax(q·kᵀ/√h_d, causal)·v, "
               "per head, the heads split from qkv as Attention.forward splits them")


def _bytes_hint(fn, kept: int, selective: int) -> None:
    """Right values, the wrong bytes kept for backward: name what was kept, or what recomputed."""
    if kept > selective:
        squares = _square_tensors(fn)
        if squares:
            raise Hint(f"your sublayer keeps {kept:,} bytes for backward, {kept - selective:,} "
                       f"more than selective recomputation ({selective:,}): the s×s tensors "
                       f"{', '.join(squares)} — the softmax's output, the dropout's mask and "
                       "output (5·a·s²·b bytes in fp16) and the causal mask. Run the core under "
                       "a checkpoint "
                       "(torch.utils.checkpoint.checkpoint(core, q, k, v, use_reentrant=False))")
        raise Hint(f"your sublayer keeps {kept:,} bytes for backward, {kept - selective:,} more "
                   f"than selective recomputation ({selective:,}), though no s×s tensor: a copy "
                   "of q, k or v made outside the checkpoint is kept beside qkv's output — make "
                   "it inside the checkpointed function")
    raise Hint(f"your sublayer keeps only {kept:,} bytes for backward, selective recomputation "
               f"{selective:,}: the checkpoint covers more than the core, and the qkv and output "
               "projections run again in backward (checkpointing the whole sublayer is full "
               "recomputation, 2104.04473 §3.5). Keep q, k, v and the projection's input; "
               "recompute only softmax(q·kᵀ/√h_d)·v")


@exercise("10.2", "selective recomputation of the attention core", reference=(checkpoint,))
def check_selective_attention(fn) -> str:
    """fn(attn, x, key) against Attention.forward, with dropout off and on: the output and the
    gradients; then the bytes kept for backward against the package's selective recomputation."""
    for p in (0.0, 0.1):
        y, grads, kept = _run_attention(fn, _attention(p))
        want_y, want_grads, plain = _run_attention(_package, _attention(p))
        if _differs(y, want_y):
            if p == 0.0:
                _output_hint(y, want_y)
            raise Hint("with dropout on (p = 0.1) the output is not the package's: the mask must "
                       "be the keyed one, attn.core.dropout(probs, key) — a function of the key, "
                       "so the recomputation draws the same mask again (torch's F.dropout draws "
                       "from the global generator: another mask at every call)")
        missing = [name for name, g in grads.items() if g is None]
        if missing:
            raise Hint(f"no gradient reached {', '.join(missing)}: something was detached")
        wrong = [name for name in want_grads if _differs(grads[name], want_grads[name], 1e-5)]
        if wrong and p > 0:
            raise Hint(f"the output is right but the gradients of {', '.join(wrong)} are not: "
                       "the recomputation in backward drew another dropout mask. It must use "
                       "the same key as the forward (pass it in, or close over it)")
        if wrong:
            raise Hint(f"the gradients of {', '.join(wrong)} differ from Attention.forward's")
    selective = _run_attention(_package, _attention(0.1, "selective"))[2]
    if kept != selective:
        _bytes_hint(fn, kept, selective)
    return (f"output and gradients equal Attention.forward's (dropout 0.1: the keyed masks, "
            f"recomputed exactly), and it keeps {kept:,} bytes for backward, as the package's "
            f"selective recomputation does: {plain - kept:,} fewer than without it, the s×s "
            "tensors of the core")


# --- 10.3 ★★ the sequence-parallel layer norm's gradients -----------------------------------------

TP, DP, TIMEOUT = 2, 2, 30.0
LN_SHAPE = (2, 8, 16)             # b, s, h of each data-parallel replica's batch


def _ln_data(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch x [b, s, h] of one data-parallel replica and its dL/dy."""
    gen = torch.Generator().manual_seed(300 + replica)
    return torch.randn(LN_SHAPE, generator=gen), torch.randn(LN_SHAPE, generator=gen)


def _layer_norm() -> nn.LayerNorm:
    """The same layer norm on every rank, its weight and bias not 1 and 0."""
    ln = nn.LayerNorm(LN_SHAPE[-1])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * torch.randn(ln.weight.shape, generator=gen))
        ln.bias.copy_(0.1 * torch.randn(ln.bias.shape, generator=gen))
    return ln


def _serial_grads(x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dweight, dL/dbias) of the layer norm run on ``x``, whole or a part."""
    ln = _layer_norm()
    ln(x).backward(upstream)
    return ln.weight.grad, ln.bias.grad


def _run_sp_layer_norm(fn) -> dict:
    grid = ParallelGrid(tp=TP, dp=DP)
    x, upstream = _ln_data(grid.dp_rank)
    ln = _layer_norm()
    with comm.record() as log:
        y = fn(ln, x.clone(), upstream.clone(), grid)
    return {"tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank,
            "y": y.detach() if isinstance(y, torch.Tensor) else y,
            "grads": (ln.weight.grad, ln.bias.grad),
            "all_reduces": log.count("all_reduce")}


def _same(got: tuple, want: tuple) -> bool:
    return all(g is not None and g.shape == w.shape and (g - w).abs().max().item() <= 1e-5
               for g, w in zip(got, want, strict=True))


def _ln_grads_hint(r: int, d: int, got: tuple) -> None:
    """Rank (tp r, dp d) has the wrong layer-norm gradients: name the mistake if it is known."""
    def part(replica: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, upstream = _ln_data(replica)
        return _serial_grads(x.chunk(TP, 1)[rank], upstream.chunk(TP, 1)[rank])

    whole = _serial_grads(*_ln_data(d))
    where = f"tp rank {r} of data-parallel replica {d}"
    if any(g is None for g in got):
        raise Hint(f"{where}: the layer norm's weight or bias has no gradient — run the backward "
                   "of its part with its part of dL/dy")
    if _same(got, part(d, r)):
        raise Hint(f"{where}: the gradients are of its own s/{TP} positions only — not summed "
                   "over the tensor-parallel group (grid.tp_group), or the sum not written back "
                   "into .grad. Each position's contribution lives on one rank: all-reduce them")
    if _same(got, tuple(g / TP for g in whole)):
        raise Hint(f"{where}: the gradients are half the serial layer norm's: averaged over tp. "
                   "The ranks hold different positions, not copies of the same batch: sum them")
    if _same(got, tuple(a + b for a, b in zip(part(0, r), part(1, r), strict=True))):
        raise Hint(f"{where}: summed over the data-parallel group — part {r} of both replicas' "
                   "batches. The sequence is split over the tensor-parallel group: sum over "
                   "grid.tp_group (dp averages the replicas' gradients later, in its own step)")
    everyone = tuple(a + b for a, b in zip(_serial_grads(*_ln_data(0)),
                                           _serial_grads(*_ln_data(1)), strict=True))
    if _same(got, everyone):
        raise Hint(f"{where}: summed over every rank — both data-parallel replicas' batches. Sum "
                   "over grid.tp_group only, the ranks that split this replica's sequence")
    if _same(got, tuple(TP * g for g in whole)):
        raise Hint(f"{where}: the gradients are {TP}× the serial layer norm's: every rank ran "
                   "the whole sequence, then they were summed. Run only this rank's part")
    raise Hint(f"{where}: the layer norm's gradients are not the serial layer norm's on the "
               "whole sequence")


@exercise("10.3", "the sequence-parallel layer norm's gradients",
          reference=(sum_replicated_grads_,))
def check_sp_layer_norm(fn) -> str:
    """fn(ln, x, dy, grid) on tp = 2 × dp = 2 ranks against the serial layer norm."""
    results = on_ranks(TP * DP, _run_sp_layer_norm, fn, timeout=TIMEOUT)
    b, s, h = LN_SHAPE
    for got in results:
        r, d, y = got["tp_rank"], got["dp_rank"], got["y"]
        x, upstream = _ln_data(d)
        want_y = _layer_norm()(x).detach()
        if not isinstance(y, torch.Tensor) or y.shape != (b, s // TP, h):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            what = {LN_SHAPE: " — the whole sequence: run only this rank's part",
                    (b // TP, s, h): " — a part of the batch: split the sequence, dim 1"}
            raise Hint(f"tp rank {r} returned {shape}{what.get(shape, '')}; return the layer "
                       f"norm's output on its part of the sequence, [b, s/t, h] = "
                       f"{(b, s // TP, h)}")
        if (y - want_y.chunk(TP, 1)[r]).abs().max().item() > 1e-5:
            first, last = r * s // TP, (r + 1) * s // TP - 1
            raise Hint(f"tp rank {r}'s output is not positions {first}…{last} of the layer "
                       "norm's: rank r holds part r of the sequence, dim 1 of "
                       "[b, s, h] (x.chunk(t, dim=1)[r]), not of the batch or the hidden size")
        if not _same(got["grads"], _serial_grads(x, upstream)):
            _ln_grads_hint(r, d, got["grads"])
    calls = results[0]["all_reduces"]
    return (f"on tp = {TP} × dp = {DP} ranks each tp rank's output is its part of the sequence, "
            "and the layer norm's weight and bias gradients equal the serial layer norm's on the "
            f"whole sequence, summed over tp with {calls} all-reduce{'s' if calls != 1 else ''} "
            "through comm (sum_replicated_grads_ makes one, of every replicated gradient "
            "flattened)")


# --- 10.4 ★★★ sequence parallelism's column layer -------------------------------------------------

SP_B, SP_S, SP_IN, SP_OUT = 2, 8, 4, 6     # x [b, s, in], W [out, in]: every split shape distinct


def _sp_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's x [b, s, in], the whole weight W [out, in], and dL/dy [b, s, out]."""
    gen = torch.Generator().manual_seed(104)
    return (torch.randn(SP_B, SP_S, SP_IN, generator=gen),
            torch.randn(SP_OUT, SP_IN, generator=gen),
            torch.randn(SP_B, SP_S, SP_OUT, generator=gen))


def _run_sp_linear(function) -> dict:
    """function.apply(x_r, W_r, group) on this rank's part of the sequence and rows of W, then
    backward from its columns of dL/dy: outputs, gradients, each pass's collectives, and the
    shapes saved for backward."""
    group = comm.world()
    t, r = group.size, group.rank
    x, weight, upstream = _sp_data()
    x = x.chunk(t, dim=1)[r].clone().requires_grad_()
    weight = weight.chunk(t, dim=0)[r].clone().requires_grad_()
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    out: dict = {"saved": saved}
    forward, backward = comm.CommLog(), comm.CommLog()   # kept when the learner's code raises
    try:
        with comm.record(forward), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = function.apply(x, weight, group)
        out["y"] = y.detach() if isinstance(y, torch.Tensor) else y
        if isinstance(y, torch.Tensor) and y.shape == (SP_B, SP_S, SP_OUT // t):
            with comm.record(backward):
                y.backward(upstream.chunk(t, dim=-1)[r])
    except NotImplementedError:
        raise                                           # a stub: "not done yet"
    except RuntimeError as err:
        out["error"] = str(err).strip().splitlines()[0]
    out.update(forward=[e.op for e in forward.events], backward=[e.op for e in backward.events],
               dx=x.grad, dw=weight.grad)
    return out


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    return not _differs(got, want, 1e-5)


def _sp_output_hint(r: int, y) -> None:
    """Rank r's y is not [b, s, out/t] of x·W_rᵀ: name the dimension it gathered, if known."""
    whole, weight, _ = _sp_data()
    want = whole @ weight.chunk(TP)[r].T
    shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
    if shape == (SP_B, SP_S // TP, SP_OUT // TP):
        raise Hint(f"rank {r}'s y has shape {shape}: its own s/t positions only. The column "
                   "layer's GEMM needs the whole sequence: all-gather x along dim 1 first "
                   "(comm.all_gather(x, group, dim=1)), sequence parallelism's g")
    if shape == (TP * SP_B, SP_S // TP, SP_OUT // TP):
        raise Hint(f"rank {r}'s y has shape {shape}: x was gathered along dim 0, the batch; "
                   "the ranks hold parts of the sequence, dim 1 of [b, s, h]")
    if shape != tuple(want.shape):
        raise Hint(f"rank {r}'s y has shape {shape}; expected [b, s, out/t] = "
                   f"{tuple(want.shape)}: the whole sequence through this rank's rows of W")
    if not _matches(y, want):
        raise Hint(f"rank {r}'s y is not x·W_rᵀ of the whole sequence: gather the ranks' parts "
                   "in rank order along dim 1 (comm.all_gather does), then F.linear(x, weight)")


def _sp_error_hint(r: int, got: dict) -> None:
    """Rank r raised: autograd refusing a gradient of the wrong shape (named), or another error."""
    error, backward = got["error"], got["backward"]
    wrong = re.search(r"invalid gradient at index (\d) - got \[([\d, ]*)\]", error)
    shape = tuple(map(int, wrong[2].split(","))) if wrong else ()
    if wrong and wrong[1] == "1":
        _sp_dw_shape_hint(r, shape)
    where = f"rank {r}'s gradient of x"
    if shape == (SP_B, SP_S, SP_IN):
        what = ("summed, by an all-reduce where a reduce-scatter belongs" if "all_reduce" in
                backward else "not reduced")
        raise Hint(f"{where} has shape {shape}, the whole sequence's, {what}. The rank holds s/t "
                   "positions: comm.reduce_scatter(dx, group, dim=1) sums the ranks' partial "
                   "gradients and leaves each its part [b, s/t, in]")
    if shape == (SP_B, TP * SP_S, SP_IN):
        raise Hint(f"{where} has shape {shape}: gathered in backward. The conjugate of the "
                   "forward's all-gather is a reduce-scatter: every rank used every position, "
                   "so their partial gradients are summed, and each keeps its own part")
    if shape in ((SP_B, SP_S, SP_IN // TP), (SP_B // TP, SP_S, SP_IN)):
        dim = "the hidden size, dim 2" if shape[-1] != SP_IN else "the batch, dim 0"
        raise Hint(f"{where} has shape {shape}: reduce-scattered along {dim}; the sequence is "
                   "split, dim 1")
    if "cannot be multiplied" in error and got["forward"] == ["all_gather"]:
        raise Hint(f"rank {r}'s x·Wᵀ failed ({error}): x was gathered along the hidden size, "
                   "dim 2, which W's columns must match; the ranks hold parts of the sequence: "
                   "gather dim 1")
    raise Hint(f"rank {r} raised RuntimeError: {error} — gather x along dim 1, the sequence; "
               "backward returns one gradient per input of forward, each of its input's shape: "
               "(dx, dweight, None)")


def _sp_dx_hint(r: int, dx) -> None:
    """Rank r's dx has the right shape but is wrong: name the reduction it is, if typical."""
    _, weight, upstream = _sp_data()
    partial = upstream.chunk(TP, dim=-1)[r] @ weight.chunk(TP)[r]      # [b, s, in], this rank's
    whole = upstream @ weight                                          # Σ over the ranks
    want = whole.chunk(TP, dim=1)[r]
    where = f"rank {r}'s gradient of x"
    if dx is None:
        raise Hint(f"{where} is None: backward returns (dx, dweight, None), dx first")
    if _matches(dx, partial.chunk(TP, dim=1)[r]):
        raise Hint(f"{where} is its own partial gradient, not summed: dY·W_r covers only this "
                   "rank's out/t columns, and every rank used every position of x. Sum over the "
                   "ranks and keep this rank's part: a reduce-scatter")
    if _matches(dx, TP * want):
        raise Hint(f"{where} is {TP}× too large: summed twice, an all-reduce and a "
                   "reduce-scatter; the reduce-scatter alone sums the ranks' partial gradients")
    other = next((q for q in range(TP) if q != r and _matches(dx, whole.chunk(TP, dim=1)[q])),
                 None)
    if other is not None:
        raise Hint(f"{where} is rank {other}'s part of the sequence: keep part {r} "
                   "(comm.reduce_scatter leaves each rank its own)")
    if not _matches(dx, want):
        raise Hint(f"{where} is not its part of dY·W summed over the ranks "
                   f"(positions {r * SP_S // TP}…{(r + 1) * SP_S // TP - 1})")


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X over every (sample, position) of dy [b, s, out] and x [b, s, in]."""
    return dy.flatten(0, 1).T @ x.flatten(0, 1)


def _sp_dw_shape_hint(r: int, shape) -> None:
    raise Hint(f"rank {r}'s gradient of its rows of W is {shape}; backward's second output is "
               f"dW_r = dYᵀ·X, of the weight's shape {(SP_OUT // TP, SP_IN)}")


def _sp_dw_hint(r: int, dw) -> None:
    """Rank r's dW is wrong: name its mistake, if it is a typical one."""
    x, _, upstream = _sp_data()
    columns = upstream.chunk(TP, dim=-1)                                # each rank's [b, s, out/t]
    want = _weight_grad(columns[r], x)
    where = f"rank {r}'s gradient of its rows of W"
    if dw is None:
        _sp_dw_shape_hint(r, None)
    own = slice(r * SP_S // TP, (r + 1) * SP_S // TP)
    if _matches(dw, _weight_grad(columns[r][:, own], x[:, own])):
        raise Hint(f"{where} is dYᵀ·X over its own s/t positions only: dW needs every "
                   "position's input — gather x again in backward")
    if _matches(dw, sum(_weight_grad(dy, x) for dy in columns)):
        raise Hint(f"{where} was all-reduced: each rank's rows of W are its own (a column-parallel "
                   "weight), and their gradient is complete once x is gathered again — no sum")
    if not _matches(dw, want):
        raise Hint(f"{where} is not dYᵀ·X over the whole sequence (dY: this rank's out/t "
                   "columns of the gradient, X: the input gathered again)")


def _sp_collectives_hint(r: int, got: dict) -> None:
    """The values are right: name what rank r's passes communicate and keep, if it is wrong."""
    forward, backward = got["forward"], got["backward"]
    if forward != ["all_gather"]:
        raise Hint(f"rank {r}'s forward made {forward or 'no collective through comm'}; it "
                   "needs one all-gather of the sequence, through comm (so that it is counted)")
    if "all_reduce" in backward:
        raise Hint(f"rank {r}'s backward all-reduces: every rank then receives the whole "
                   "sequence's gradient and throws away (t − 1)/t of it, twice a "
                   "reduce-scatter's bytes — comm.reduce_scatter(dx, group, dim=1)")
    if "all_gather" not in backward and "reduce_scatter" in backward:
        raise Hint(f"the values are right, but rank {r}'s backward gathered nothing: it kept the "
                   "gathered input from the forward, t× the input's memory — what sequence "
                   "parallelism exists to save (2205.05198 §4.2.2). Save this rank's part and "
                   "gather it again in backward")
    if sorted(backward) != ["all_gather", "reduce_scatter"]:
        raise Hint(f"rank {r}'s backward made {backward or 'no collective through comm'}; it "
                   "needs one all-gather (x again) and one reduce-scatter (dx), through comm")
    if (SP_B, SP_S, SP_IN) in got["saved"]:
        raise Hint(f"rank {r} saved the whole sequence's input [b, s, in] = "
                   f"{(SP_B, SP_S, SP_IN)} for backward, though it gathers it again: save its "
                   f"part [b, s/t, in] = {(SP_B, SP_S // TP, SP_IN)}")


@exercise("10.4", "sequence parallelism's column layer: gather forward, re-gather and "
          "reduce-scatter backward", reference=(_SequenceParallelLinear, comm._AllGather))
def check_sp_linear(function) -> str:
    """SequenceParallelLinear.apply(x_r, W_r, group) on 2 ranks against x·Wᵀ; its collectives."""
    if not hasattr(function, "apply"):
        raise Hint("pass the class itself — a torch.autograd.Function with forward and backward "
                   "— so that the checker can call SequenceParallelLinear.apply(x, weight, group)")
    results = on_ranks(TP, _run_sp_linear, function, timeout=TIMEOUT, may_deadlock=True)
    for r, got in enumerate(results):
        if "error" in got:
            _sp_error_hint(r, got)
        _sp_output_hint(r, got["y"])
    for r, got in enumerate(results):
        _sp_dx_hint(r, got["dx"])
        _sp_dw_hint(r, got["dw"])
    for r, got in enumerate(results):
        _sp_collectives_hint(r, got)
    return (f"on {TP} ranks y, dx and dW equal the serial layer's (x·Wᵀ on the whole sequence, "
            "each rank its out/t columns and its s/t positions of dx), with one all-gather "
            "forward, one all-gather of x again and one reduce-scatter of dx backward, and only "
            "the rank's [b, s/t, in] of x kept between them — the package's column layer under "
            "sequence parallelism (tensor_parallel/sequence_parallel.py)")
