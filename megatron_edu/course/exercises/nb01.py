"""Checkers for notebook 01 (the tensor-parallel MLP, 1909.08053 §3, Figure 3a).

01.1 ★    which slice of each MLP weight a rank keeps (nn.Linear stores [out, in])
01.2 ★★   f and g as ``torch.autograd.Function``s (forward and backward)
01.3 ★★★  the whole tensor-parallel MLP from the serial weights: each rank takes its slices

Each runs on 2 gloo ranks against the serial computation (the package's own ``MLP`` for 01.3),
compares outputs and every gradient, and counts the all-reduces of the forward and the backward
pass separately. Wrong answers that are typical — a partial sum never summed, a bias counted t
times, an all-reduce in the wrong pass, a slice on the wrong rank — are recognised by computing
them too, and named.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, close, exercise, on_ranks
from megatron_edu.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
)

__all__ = ["TP", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

TP = 2
TIMEOUT = 30.0


def _same(a, b, atol: float = 1e-5) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and (a.detach().float() - b.float()).abs().max().item() <= atol)


def _all_reduces(log: comm.CommLog) -> int:
    return log.count("all_reduce")


def _counts_hint(rank: int, forward: int, backward: int, want: tuple[int, int], what: str) -> None:
    """A Hint unless this rank made ``want`` = (forward, backward) all-reduces."""
    if (forward, backward) == want:
        return
    if forward == backward == 0:
        raise Hint(f"the values are right, but rank {rank} made no all-reduce through `comm`: "
                   f"call comm.all_reduce (or comm.f / comm.g), not torch.distributed directly, "
                   f"so that the communication is counted")
    raise Hint(f"rank {rank} made {forward} all-reduce(s) in the forward pass and {backward} in "
               f"the backward pass; {what} makes {want[0]} forward and {want[1]} backward")


def _backward(loss: torch.Tensor) -> bool:
    """``loss.backward()``; True if autograd went through a collective that has no backward rule
    (a plain comm.all_reduce in the graph: PyTorch warns, and may refuse in a later version)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.backward()
    return any("autograd kernel was not registered" in str(w.message) for w in caught)


_NO_AUTOGRAD = ("autograd went through comm.all_reduce, a plain collective with no backward "
                "rule (PyTorch warns that it falls back to passing the gradient through, and "
                "may refuse in a later version): use comm.g, whose backward is defined — the "
                "identity")


def _tensor(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- 01.1 which slice each rank keeps -----------------------------------------------------------

_H, _FFN = 4, 16
_NAMES = ("fc.weight", "fc.bias", "proj.weight", "proj.bias")


def _mlp_weights():
    """fc.weight [4h, h], fc.bias [4h], proj.weight [h, 4h], proj.bias [h]: [out, in] weights."""
    return (_tensor(31, _FFN, _H), _tensor(32, _FFN), _tensor(33, _H, _FFN),
            _tensor(34, _H))


def _run_shards(fn):
    """The learner's slices and the package's: an MLP built for this rank, its parameters'
    ``tp_dim`` read, and each whole tensor cut by ``tensor_parallel.shard``."""
    from megatron_edu.model import GPTConfig
    from megatron_edu.model.transformer import MLP
    from megatron_edu.tensor_parallel import shard

    group = comm.world()  # the 2 ranks as the tensor-parallel group
    config = GPTConfig(vocab_size=8, seq_len=4, num_layers=1, hidden=_H, num_heads=1,
                       ffn_hidden=_FFN, dropout=0.0)
    mlp = MLP(config, group)
    full = dict(zip(_NAMES, _mlp_weights(), strict=True))
    package = {name: shard(full[name], p.tp_dim, group) for name, p in mlp.named_parameters()}
    dims = {name: p.tp_dim for name, p in mlp.named_parameters()}
    return fn(*_mlp_weights(), group.rank, group.size), package, dims


def _shard_hint(name: str, got, full: torch.Tensor, rank: int, t: int, dim: int | None) -> None:
    """Name what the learner's slice of ``name`` is, when it is a typical wrong one."""
    if not isinstance(got, torch.Tensor):
        raise Hint(f"the {name} slice should be a tensor, got {type(got).__name__}")
    if dim is None:
        if got.shape != full.shape:
            raise Hint(f"{name} is not split: it is added once, after g's all-reduce, so every "
                       f"rank keeps all of it (yours has shape {list(got.shape)})")
        return
    other = 1 - dim if full.dim() == 2 else None
    if other is not None and _same(got, full.chunk(t, dim=other)[rank]):
        across = ("its columns (dim 1) — but nn.Linear stores [out, in], and the column split "
                  "A = [A_0, A_1] cuts A's output features: the rows of the stored weight "
                  "(dim 0)") if dim == 0 else (
                  "its rows (dim 0) — but the row split B = [B_0; B_1] cuts B's input features, "
                  "and nn.Linear stores [out, in]: the columns of the stored weight (dim 1)")
        raise Hint(f"at t = {t} you cut {name} along {across}")
    if got.shape == full.shape:
        raise Hint(f"rank {rank} kept the whole {name} at t = {t}: it keeps 1/t of it, the same "
                   f"slice as {'fc.weight' if name == 'fc.bias' else 'its neighbours'}")
    for r, part in enumerate(full.chunk(t, dim=dim)):
        if r != rank and _same(got, part):
            raise Hint(f"at t = {t}, rank {rank} kept slice {r} of {name}: rank i keeps slice "
                       f"i, the i-th of t equal parts along dim {dim}")


@exercise("01.1", "which slice of each MLP weight a rank keeps",
          marks=(r"(?i)(output|input)(rows|columns)", r"(?i)(rows|columns)of(the)?`?\[out,in\]",
                 r"chunk\(t,dim=[01]\)\[r(ank)?\]"))
def _mlp_shards(fn) -> str:
    results = on_ranks(TP, _run_shards, fn, timeout=TIMEOUT)
    dims = results[0][2]
    for t in (TP, 4):  # the package's own slices on 2 real ranks, then t = 4 by the same rule
        for rank in range(t):
            if t == TP:
                got, package, _ = results[rank]
            else:
                got = fn(*_mlp_weights(), rank, t)
                package = {name: w if dims[name] is None else w.chunk(t, dim=dims[name])[rank]
                           for name, w in zip(_NAMES, _mlp_weights(), strict=True)}
            if not (isinstance(got, tuple | list) and len(got) == 4):
                raise Hint("return the four slices as a tuple: (fc_weight_i, fc_bias_i, "
                           "proj_weight_i, proj_bias_i)")
            for name, mine, full in zip(_NAMES, got, _mlp_weights(), strict=True):
                _shard_hint(name, mine, full, rank, t, dims[name])
                close(mine, package[name], f"rank {rank}'s {name} at t = {t}", atol=0)
    shapes = ", ".join(f"{name} {list(results[0][1][name].shape)}" for name in _NAMES)
    return (f"every rank keeps what the package's MLP holds (t = 2 on 2 ranks, and t = 4): "
            f"{shapes} at t = 2 — fc cut by output features (rows of [out, in]), proj by "
            f"input features (columns), proj.bias whole")


# --- 01.2 f and g as autograd functions ---------------------------------------------------------

_W = torch.tensor([1.0, 10.0, 100.0])


def _run_f_and_g(ops):
    f_op, g_op = ops
    group = comm.world()
    r = group.rank
    out = {}
    try:
        stage = "f"
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)  # the same on every rank
        with comm.record() as forward:
            y = f_op.apply(x, group)
        with comm.record() as backward:
            (y * _W * (r + 1)).sum().backward()  # rank r's own use of x
        out["f"] = (y.detach(), x.grad, _all_reduces(forward), _all_reduces(backward))

        stage = "g"
        x = (torch.tensor([1.0, 2.0, 3.0]) * (r + 1)).requires_grad_()  # a partial sum
        with comm.record() as forward:
            z = g_op.apply(x, group)
        with comm.record() as backward:
            (z * _W).sum().backward()  # the same loss on every rank
        out["g"] = (z.detach(), x.grad, _all_reduces(forward), _all_reduces(backward))

        stage = "the MLP"
        out["mlp"] = _mlp_with(f_op, g_op, group)
    except NotImplementedError:
        raise  # a student stub: "not done yet"
    except RuntimeError as err:
        out["error"] = (stage, str(err).strip().splitlines()[0])
    return out


def _mlp_data():
    return _tensor(21, 4, 6), _tensor(22, 6, 8), _tensor(23, 8, 6), _tensor(24, 4, 6)


def _mlp_with(f_op, g_op, group):
    """Z = g(GeLU(f(X)·A_r)·B_r): A split by columns, B by rows (Figure 3a)."""
    x, a, b, upstream = _mlp_data()
    cols = slice(group.rank * a.shape[1] // TP, (group.rank + 1) * a.shape[1] // TP)
    x = x.clone().requires_grad_()
    a_r, b_r = a[:, cols].clone().requires_grad_(), b[cols].clone().requires_grad_()
    with comm.record() as forward:
        z = g_op.apply(F.gelu(f_op.apply(x, group) @ a_r) @ b_r, group)
    with comm.record() as backward:
        (z * upstream).sum().backward()
    return (z.detach(), x.grad, a_r.grad, b_r.grad, _all_reduces(forward),
            _all_reduces(backward))


def _serial_mlp():
    x, a, b, upstream = (t.clone().requires_grad_() for t in _mlp_data())
    z = F.gelu(x @ a) @ b
    (z * upstream.detach()).sum().backward()
    return z.detach(), x.grad, a.grad, b.grad


def _f_hints(rank: int, y, grad, forward: int, backward: int) -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    if _same(y, TP * x):
        raise Hint("f's forward all-reduced x (it came out t times bigger): f is the identity "
                   "in the forward pass — every rank already holds the whole X; its all-reduce "
                   "belongs in the backward pass")
    close(y, x, f"f(x) on rank {rank} (f is the identity forward)")
    if _same(grad, _W * (rank + 1)):
        raise Hint(f"f's backward returned rank {rank}'s own gradient only: the true ∂L/∂X is "
                   f"the sum over the ranks — all-reduce it: comm.all_reduce(grad, ctx.group) "
                   f"(keep the group in ctx during forward)")
    close(grad, _W * sum(range(1, TP + 1)), f"x.grad after f's backward on rank {rank}")
    _counts_hint(rank, forward, backward, (0, 1), "f")


def _g_hints(rank: int, z, grad, forward: int, backward: int) -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    if _same(z, x * (rank + 1)):
        raise Hint(f"g's forward returned rank {rank}'s partial sum unchanged: g must add the "
                   f"ranks' partial sums — an all-reduce in the forward pass")
    close(z, x * sum(range(1, TP + 1)), f"g(x) on rank {rank}")
    if _same(grad, _W * TP):
        raise Hint("g's backward all-reduced the gradient (it came out t times bigger): every "
                   "rank already holds the whole ∂L/∂Z, so g's backward is the identity — the "
                   "backward all-reduce is f's")
    close(grad, _W, f"x.grad after g's backward on rank {rank} (g is the identity backward)")
    _counts_hint(rank, forward, backward, (1, 0), "g")


@exercise("01.2", "f and g as autograd functions", reference=(comm._F, comm._G),
          marks=(r"all_reduce\(grad,ctx\.group", r"returngrad,None"))
def _f_and_g(ops) -> str:
    if not (isinstance(ops, tuple | list) and len(ops) == 2):
        raise Hint("pass the two classes as a pair: check(\"01.2\", (MyF, MyG))")
    results = on_ranks(TP, _run_f_and_g, tuple(ops), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        if "error" in out:
            stage, message = out["error"]
            if "incorrect number of gradients" in message:
                raise Hint(f"testing {stage} on rank {rank}: {message} — backward returns one "
                           f"gradient per input of forward, so (grad, None): None for the group")
            raise Hint(f"testing {stage}, rank {rank} raised RuntimeError: {message}")
        _f_hints(rank, *out["f"])
        _g_hints(rank, *out["g"])
    serial = _serial_mlp()
    for rank, out in enumerate(results):
        z, x_grad, a_grad, b_grad, forward, backward = out["mlp"]
        cols = slice(rank * 8 // TP, (rank + 1) * 8 // TP)
        close(z, serial[0], f"the MLP's output on rank {rank}")
        close(x_grad, serial[1], f"the MLP's input gradient on rank {rank}")
        close(a_grad, serial[2][:, cols], f"rank {rank}'s gradient of its columns of A")
        close(b_grad, serial[3][cols], f"rank {rank}'s gradient of its rows of B")
        _counts_hint(rank, forward, backward, (1, 1), "the MLP of Figure 3a")
    return ("f: identity forward, all-reduce backward; g: all-reduce forward, identity backward; "
            "the MLP g(GeLU(f(X)·A_i)·B_i) on 2 ranks equals the serial one, gradients included, "
            "with 1 all-reduce forward and 1 backward (Figure 3a)")


# --- 01.3 the whole MLP from the serial weights --------------------------------------------------

def _mlp_input():
    return _tensor(35, 2, 3, _H), _tensor(36, 2, 3, _H)


def _run_tp_mlp(fn):
    group = comm.world()
    x, upstream = _mlp_input()
    x = x.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in _mlp_weights()]
    with comm.record() as forward:
        out = fn(x, *weights, group)
    if not isinstance(out, torch.Tensor) or out.shape != upstream.shape:
        return out, None, [None] * 4, _all_reduces(forward), 0, False
    with comm.record() as backward:
        no_rule = _backward((out * upstream).sum())
    return (out.detach(), x.grad, [w.grad for w in weights], _all_reduces(forward),
            _all_reduces(backward), no_rule)


def _reference_mlp():
    """The package's own serial MLP with these weights: output and gradients."""
    from megatron_edu.model import GPTConfig
    from megatron_edu.model.transformer import MLP
    from megatron_edu.tensor_parallel import init_parameters, serial_group

    mlp = MLP(GPTConfig(vocab_size=8, seq_len=4, num_layers=1, hidden=_H, num_heads=1,
                        ffn_hidden=_FFN, dropout=0.0), serial_group())
    init_parameters(mlp, 0, serial_group())  # real tensors, then these weights copied in
    with torch.no_grad():
        for p, w in zip((mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias),
                        _mlp_weights(), strict=True):
            p.copy_(w)
    x, upstream = _mlp_input()
    x = x.clone().requires_grad_()
    out = mlp(x)
    (out * upstream).sum().backward()
    grads = [mlp.fc.weight.grad, mlp.fc.bias.grad, mlp.proj.weight.grad, mlp.proj.bias.grad]
    return out.detach(), x.grad, grads


def _variant(x, w1, b1, w2, b2, rank_slice, gelu="tanh"):
    """One rank's GeLU(x·A_s)·B_s with A, B cut at ``rank_slice`` (no bias on the output)."""
    y = F.gelu(F.linear(x, w1[rank_slice], b1[rank_slice]), approximate=gelu)
    return F.linear(y, w2[:, rank_slice])


def _tp_mlp_output_hints(rank: int, out) -> None:
    x, _ = _mlp_input()
    w1, b1, w2, b2 = _mlp_weights()
    width = _FFN // TP
    parts = [slice(r * width, (r + 1) * width) for r in range(TP)]
    mine = _variant(x, w1, b1, w2, b2, parts[rank])
    serial = sum(_variant(x, w1, b1, w2, b2, p) for p in parts) + b2
    if _same(out, mine) or _same(out, mine + b2):
        raise Hint(f"rank {rank} returned its own partial sum GeLU(X·A_i)·B_i: the partial "
                   f"sums must be added — pass the row-parallel product through comm.g")
    if _same(out, serial + (TP - 1) * b2):
        raise Hint(f"the output is off by (t − 1)·proj.bias: the bias was added before g, so it "
                   f"was summed t = {TP} times — add it once, after g")
    for r, part in enumerate(parts):
        same_slice = TP * _variant(x, w1, b1, w2, b2, part)
        if _same(out, same_slice + b2) or _same(out, same_slice + TP * b2):
            raise Hint(f"every rank used slice {r}: rank i must take its own slice, rows "
                       f"i·4h/t … (i+1)·4h/t − 1 of fc.weight and fc.bias and the same columns "
                       f"of proj.weight (i = group.rank)")
    exact = sum(_variant(x, w1, b1, w2, b2, p, gelu="none") for p in parts) + b2
    if _same(out, exact):
        raise Hint("nearly right, but with the exact GeLU: GPT-2 (and this package's MLP) use "
                   "its tanh approximation, F.gelu(y, approximate=\"tanh\")")


_SPLIT_DIM = {"fc.weight": 0, "fc.bias": 0, "proj.weight": 1}  # proj.bias is replicated


def _part(rank: int) -> slice:
    width = _FFN // TP
    return slice(rank * width, (rank + 1) * width)


def _rank_grads(rank: int, serial: list[torch.Tensor]) -> list[torch.Tensor]:
    """What rank ``rank``'s gradients of the whole weights must be: the serial gradient on its
    slice and zeros elsewhere (proj.bias, replicated and added after g: the whole gradient)."""
    out = []
    for name, ref in zip(_NAMES, serial, strict=True):
        if name in _SPLIT_DIM:
            expected = torch.zeros_like(ref)
            cut = (slice(None),) * _SPLIT_DIM[name] + (_part(rank),)
            expected[cut] = ref[cut]
            ref = expected
        out.append(ref)
    return out


def _slices_hint(rank: int, grads: list) -> None:
    """A Hint if this rank computed with rows (columns) other than its own, read off where its
    gradients of the whole weights are not zero."""
    part = _part(rank)
    for name, grad in zip(_NAMES, grads, strict=True):
        if name not in _SPLIT_DIM or not isinstance(grad, torch.Tensor):
            continue
        used = _used(grad, _SPLIT_DIM[name])
        if used and used != list(range(part.start, part.stop)):
            kind = "columns" if name == "proj.weight" else "rows"
            raise Hint(f"rank {rank} computed with {kind} {used[0]}…{used[-1]} of {name}; rank "
                       f"i takes {kind} i·4h/t … (i+1)·4h/t − 1 of it, here {part.start}…"
                       f"{part.stop - 1} (i = group.rank)")


def _used(grad: torch.Tensor, dim: int) -> list[int]:
    """The indices along ``dim`` where ``grad`` is not zero: the slice a rank computed with."""
    other = [d for d in range(grad.dim()) if d != dim]
    touched = grad.abs().sum(dim=other) if other else grad.abs()
    return (touched > 0).nonzero().flatten().tolist()


@exercise("01.3", "the tensor-parallel MLP from the serial weights",
          marks=(r"(?i)gelu\(f\(x\)·A_?i\+a_?i\)", r"(?i)·B_?i\)\+b",
                 r"comm\.g\(F\.linear\(y,proj_w"),
          reference=(ColumnParallelLinear.forward, RowParallelLinear.forward,
                     TensorParallel.column_linear, TensorParallel.reduce))
def _tp_mlp(fn) -> str:
    results = on_ranks(TP, _run_tp_mlp, fn, timeout=TIMEOUT)
    out_ref, x_grad_ref, grads_ref = _reference_mlp()
    for rank, result in enumerate(results):
        _slices_hint(rank, result[2])
    for rank, (out, x_grad, grads, forward, backward, no_rule) in enumerate(results):
        if isinstance(out, torch.Tensor) and out.shape == out_ref.shape:
            _tp_mlp_output_hints(rank, out)
        close(out, out_ref, f"rank {rank}'s output")
        if no_rule:
            raise Hint(_NO_AUTOGRAD)
        if not _same(x_grad, x_grad_ref) and backward == 0:
            raise Hint(f"x.grad on rank {rank} is only the part that flowed through its own "
                       f"slice of fc: pass x through comm.f first, whose backward all-reduces "
                       f"the gradient")
        close(x_grad, x_grad_ref, f"x.grad on rank {rank}")
        if _same(grads[3], grads_ref[3] / TP):
            raise Hint(f"proj.bias.grad on rank {rank} is 1/t of the serial one: adding "
                       f"proj.bias/t before g gets the output right but the gradient of the "
                       f"replicated bias wrong — add the whole bias once, after g")
        for name, grad, expected in zip(_NAMES, grads, _rank_grads(rank, grads_ref),
                                        strict=True):
            close(grad, expected, f"{name}.grad on rank {rank}")
        _counts_hint(rank, forward, backward, (1, 1), "the MLP of Figure 3a")
    return ("on 2 ranks each rank used its own slices (rows of fc, columns of proj); output and "
            "every gradient equal the package's serial MLP; 1 all-reduce forward (g), 1 backward "
            "(f)")
