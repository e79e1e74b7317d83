"""Checkers for notebook 13 (ZeRO's three stages: Rajbhandari et al. 2020, arXiv 1910.02054; FSDP).

13.1 ★    what one rank holds of the weights, the gradients and the optimizer state at each stage
13.2 ★★   a ZeRO-3 layer as an autograd Function: gather forward, gather again and reduce-scatter
          backward
13.3 ★★   the bytes a rank sends per step at each stage, with m microbatches

13.1 and 13.3 are checked in this process against the ZeRO paper's model (§5 and Figure 1; §7);
13.2 runs on 2 gloo ranks against a plain ``nn.Linear`` and counts the collectives of each pass
through ``comm``. Typical wrong answers — a stage sharding only its own part, the optimizer's
master copy forgotten, the gathered weight kept for backward, the gradient not summed over the
ranks or all-reduced, accumulation charged to the stages that communicate once, ZeRO-3 gathered
once per microbatch — are named.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, exercise, on_ranks

__all__ = ["DP", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

DP = 2
TIMEOUT = 30.0
SHARDED_FROM = {"optimizer": 1, "grads": 2, "weights": 3}   # ZeRO §5: P_os, P_os+g, P_os+g+p
PRECISIONS = {"mixed-precision Adam": {"weights": 2, "grads": 2, "optimizer": 12},
              "fp32 Adam": {"weights": 4, "grads": 4, "optimizer": 8},
              "fp32 gradients": {"weights": 2, "grads": 4, "optimizer": 12}}


def _held(stage: int, psi: float, d: int, per_param: dict[str, float]) -> dict[str, float]:
    return {part: psi * nbytes / (d if stage >= SHARDED_FROM[part] else 1)
            for part, nbytes in per_param.items()}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _same(got: dict, want: dict) -> bool:
    return all(_close(got[k], want[k]) for k in want)


# --- 13.1 ★ what a rank holds -------------------------------------------------------------------

@exercise("13.1", "what a rank holds at each ZeRO stage",
          marks=(r"KΨ/d",                                   # the table: 2Ψ + 2Ψ + KΨ/d, (2 + K)Ψ/d
                 r"4\+12/d|2\+14/d",                        # per parameter: 4 + 12/d, 2 + 14/d
                 r"become7understage1",                     # 16 bytes → 7, 5.5, 4 at d = 4
                 r"31\.[34]\D.{0,60}16\.6",                 # Figure 1: 120, 31.4, 16.6, 1.9 GB
                 r"1,3/4,5/8(,|and)1/2"))                   # fp32 at d = 2, against plain DP
def check_held_bytes(fn) -> str:
    """fn(stage, psi, d, bytes_per_param) against the ZeRO paper's model, stages 0–3."""
    for (name, per_param), d, stage in itertools.product(PRECISIONS.items(), (1, 4, 64),
                                                         range(4)):
        psi = 7.5e9
        got = fn(stage, psi, d, dict(per_param))
        if not isinstance(got, dict) or set(got) != set(per_param):
            raise Hint(f"return a dict with the keys of bytes_per_param, {sorted(per_param)}, "
                       f"each the bytes of that part on one rank (got {type(got).__name__})")
        if not all(isinstance(v, (int, float)) for v in got.values()):
            raise Hint("each value should be a number of bytes")
        want = _held(stage, psi, d, per_param)
        if _same(got, want):
            continue
        where = f"at stage {stage}, d = {d} ({name})"
        wrong = [p for p in per_param if not _close(got[p], want[p])]
        alone = {p: psi * b / (d if SHARDED_FROM[p] == stage else 1) for p, b in per_param.items()}
        if _same(got, alone):
            raise Hint(f"{where}: only the part stage {stage} adds is sharded. The stages are "
                       "cumulative: stage 2 keeps stage 1's sharded optimizer state, stage 3 "
                       "both")
        everything = {p: psi * b / d for p, b in per_param.items()}
        if stage == 0 and _same(got, everything):
            raise Hint(f"{where}: stage 0 is plain data parallelism — every rank holds "
                       "everything, nothing divided by d")
        if _same(got, {p: psi * b for p, b in per_param.items()}) and d > 1:
            raise Hint(f"{where}: nothing is divided by d. Stage 1 (P_os) shards the optimizer "
                       "state, stage 2 (P_os+g) the gradients too, stage 3 (P_os+g+p) the "
                       "weights too")
        if _same(got, {p: psi * b for p, b in _per_param_shifted(stage, d, per_param).items()}):
            raise Hint(f"{where}: the parts are sharded in the wrong order. Stage 1 shards the "
                       "optimizer state (the largest part, used only in the update), stage 2 "
                       "the gradients, stage 3 the weights")
        if _same(got, {p: v / psi for p, v in want.items()}):
            raise Hint(f"{where}: these are bytes per parameter; multiply by psi, the number of "
                       "parameters")
        raise Hint(f"{where}: {', '.join(wrong)} should be "
                   + ", ".join(f"{want[p]:.4g}" for p in wrong)
                   + f" bytes, not {', '.join(f'{got[p]:.4g}' for p in wrong)}")
    figure1 = [sum(fn(s, 7.5e9, 64, dict(PRECISIONS["mixed-precision Adam"])).values()) / 1e9
               for s in range(4)]
    return ("every stage, precision and d as the ZeRO paper counts them — and Figure 1: 7.5B "
            "parameters on 64 GPUs hold " + ", ".join(f"{gb:.3g}" for gb in figure1)
            + " GB per GPU at stages 0, 1, 2, 3")


def _per_param_shifted(stage: int, d: int, per_param: dict[str, float]) -> dict[str, float]:
    """The stages reversed: stage 1 shards the weights, 2 the gradients too, 3 the optimizer."""
    reversed_from = {"weights": 1, "grads": 2, "optimizer": 3}
    return {p: b / (d if stage >= reversed_from[p] else 1) for p, b in per_param.items()}


# --- 13.2 ★★ a ZeRO-3 layer -----------------------------------------------------------------------

OUT, IN, ROWS = 6, 4, 3           # W [6, 4] split in 2 shards of 3 rows; x [3, 4] per rank


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weight() -> torch.Tensor:
    return _seeded(13, OUT, IN)


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _seeded(100 + rank, ROWS, IN), _seeded(200 + rank, ROWS, OUT)   # x, dL/dy


def _run_zero3_linear(function) -> dict:
    group = comm.world()
    d, r = group.size, group.rank
    shard = _weight().chunk(d)[r].clone().requires_grad_()
    x, upstream = _rank_data(r)
    x = x.clone().requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    out = {"saved": saved}
    try:
        with comm.record() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = function.apply(x, shard, group)
        out["forward"] = [e.op for e in forward.events]
        if not isinstance(y, torch.Tensor) or y.shape != (ROWS, OUT):
            out["y"] = y if not isinstance(y, torch.Tensor) else y.detach()
            return out
        with comm.record() as backward:
            y.backward(upstream)
        out["backward"] = [e.op for e in backward.events]
    except NotImplementedError:
        raise                                           # a stub: "not done yet"
    except RuntimeError as err:
        out["error"] = str(err).strip().splitlines()[0]
        return out
    out.update(y=y.detach(), dx=x.grad, dshard=shard.grad)
    return out


def _reference(d: int) -> dict:
    """A plain nn.Linear on every rank's x, the loss the sum of the ranks' Σ y·dL/dy."""
    linear = nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        linear.weight.copy_(_weight())
    ys, dxs = [], []
    for r in range(d):
        x, upstream = _rank_data(r)
        x = x.clone().requires_grad_()
        y = linear(x)
        y.backward(upstream)
        ys.append(y.detach())
        dxs.append(x.grad)
    return {"y": ys, "dx": dxs, "dW": linear.weight.grad.clone()}


def _close_tensor(got, want, atol: float = 1e-5) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and (got.float() - want.float()).abs().max().item() <= atol)


@exercise("13.2", "a ZeRO-3 layer: gather forward, gather and reduce-scatter backward")
def check_zero3_linear(function) -> str:
    """Zero3Linear.apply(x, shard, group) on 2 ranks against nn.Linear; its collectives."""
    if not hasattr(function, "apply"):
        raise Hint("pass the class itself — a torch.autograd.Function with forward and backward "
                   "— so that the checker can call Zero3Linear.apply(x, shard, group)")
    results = on_ranks(DP, _run_zero3_linear, function, timeout=TIMEOUT)
    ref = _reference(DP)
    whole = OUT * IN
    for r, got in enumerate(results):
        if "error" in got:
            raise Hint(f"rank {r} raised RuntimeError: {got['error']} — gather the shards along "
                       "dim 0 (they are rows of W), and return a gradient for x and for the "
                       "shard, each of its input's shape, and None for the group")
        y = got["y"]
        if isinstance(y, torch.Tensor) and y.shape == (ROWS, OUT // DP):
            raise Hint(f"rank {r}'s y has shape {tuple(y.shape)}: it used its own shard only. "
                       "All-gather the shards into the whole weight [out, in] first "
                       "(comm.all_gather(shard, group, dim=0))")
        if not _close_tensor(y, ref["y"][r]):
            raise Hint(f"rank {r}'s y is not x · Wᵀ with W the whole weight: gather the shards "
                       "in rank order along dim 0, and multiply by its transpose")
        if got["forward"].count("all_gather") != 1 or len(got["forward"]) != 1:
            calls = got["forward"] or "no collective through comm"
            raise Hint(f"rank {r}'s forward made {calls}; it needs exactly one all-gather of the "
                       "shards (comm.all_gather, so that it is counted)")
    for r, got in enumerate(results):
        if not _close_tensor(got["dx"], ref["dx"][r]):
            raise Hint(f"rank {r}'s gradient of x is not dy · W: the input's gradient needs the "
                       "whole weight, gathered again in backward")
        dshard, mine = got["dshard"], ref["dW"].chunk(DP)[r]
        own = (_rank_data(r)[1].T @ _rank_data(r)[0]).chunk(DP)[r]   # this rank's batch only
        if not isinstance(dshard, torch.Tensor) or dshard.shape != mine.shape:
            raise Hint(f"rank {r}'s shard gradient should have the shard's shape "
                       f"{tuple(mine.shape)}")
        if _close_tensor(dshard, own) and not _close_tensor(own, mine):
            raise Hint(f"rank {r}'s shard gradient is its rows of its own dW = dyᵀ · x only; "
                       "every rank's batch contributes to every row: sum over the ranks with "
                       "comm.reduce_scatter(dW, group, dim=0), which leaves each rank its rows")
        if _close_tensor(dshard, mine / DP):
            raise Hint(f"rank {r}'s shard gradient is the sum over the ranks divided by d = "
                       f"{DP}: the reduce-scatter's sum is what is asked (DataParallel divides "
                       "by d before, when it averages)")
        if not _close_tensor(dshard, mine):
            raise Hint(f"rank {r}'s shard gradient should be its rows of Σ over ranks of "
                       "dyᵀ · x (rows r·out/d … (r + 1)·out/d)")
    for r, got in enumerate(results):
        ops = got["backward"]
        if "all_reduce" in ops:
            raise Hint(f"rank {r}'s backward all-reduces: that hands every rank the whole "
                       "gradient, twice a reduce-scatter's bytes — ZeRO keeps only the shard: "
                       "comm.reduce_scatter")
        if ops.count("all_gather") == 0 and ops.count("reduce_scatter") == 1:
            raise Hint(f"the values are right, but rank {r}'s backward gathered nothing: the "
                       "whole weight was kept from the forward. ZeRO-3 frees it after the "
                       "forward (that is its memory saving); save the shard and gather again "
                       "in backward")
        if sorted(ops) != ["all_gather", "reduce_scatter"]:
            raise Hint(f"rank {r}'s backward made {ops or 'no collective through comm'}; it needs "
                       "one all-gather (the weight again) and one reduce-scatter (the gradient), "
                       "through comm")
        if any(n == whole for n in got["saved"]):
            raise Hint(f"the values and collectives are right, but rank {r} saved a tensor of the "
                       f"whole weight's {whole} values for backward: save the shard — the "
                       "gathered weight should not outlive the forward")
    return (f"on {DP} ranks y, dx and the shard's gradient equal nn.Linear's (the weight's "
            "gradient summed over the ranks' batches, each rank its rows), with one all-gather "
            "forward, one all-gather and one reduce-scatter backward, and no whole weight kept "
            "between them: 3(d − 1)/d of the weight's bytes per use, ZeRO's 1.5×")


# --- 13.3 ★★ the bytes of a step ------------------------------------------------------------------

def _halves(stage: int, m: int) -> int:
    return {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]


def _bytes(stage: int, psi: float, d: int, m: int) -> float:
    return _halves(stage, m) * (d - 1) / d * psi


@exercise("13.3", "the bytes of a step, with m microbatches",
          marks=(r"ZeRO-2\W*(sends)?\W*m\+1",               # the halves: ZeRO-2 m + 1,
                 r"ZeRO-3\W*(sends)?\W*3m|3mhalves",        # ZeRO-3 3m
                 r"3\(d[−-]1\)/d·4Ψ",                       # ZeRO-3's bytes at m = 1
                 r"8401,255,680|16402,092,800|101802,473,984"))  # §4's table: counts, bytes
def check_dp_bytes(fn) -> str:
    """fn(stage, grad_bytes, d, m) against the ZeRO paper's counts (§7), accumulation included."""
    psi = 1e9
    for stage, d, m in itertools.product(range(4), (2, 4, 8, 1), (1, 2, 4, 8)):
        got = fn(stage, psi, d, m)
        if not isinstance(got, (int, float)):
            raise Hint(f"return a number of bytes (got {type(got).__name__})")
        want = _bytes(stage, psi, d, m)
        if _close(got, want):
            continue
        where = f"at stage {stage}, d = {d}, m = {m}"
        if stage <= 1 and _close(got, m * want):
            raise Hint(f"{where}: {m}× too much. Plain DP and ZeRO-1 hold the whole gradients, "
                       "so the microbatches only accumulate: one all-reduce (or one "
                       "reduce-scatter and one all-gather) per step, whatever m is")
        if stage == 1 and _close(got, 1.5 * want):
            raise Hint(f"{where}: ZeRO-1's reduce-scatter and all-gather are the two halves of "
                       "one all-reduce — together 2(d − 1)/d of the gradients' bytes, not more")
        if stage == 2 and _close(got, _bytes(1, psi, d, m)):
            raise Hint(f"{where}: that is ZeRO-1's count. ZeRO-2 holds no whole gradients "
                       "between two backward passes: each microbatch's backward reduce-scatters "
                       "— m reduce-scatters and one all-gather per step")
        if stage == 3 and _close(got, 2 * m * (d - 1) / d * psi):
            raise Hint(f"{where}: ZeRO-3 gathers every unit twice per microbatch — for its "
                       "forward and again for its backward — and reduce-scatters once: 3 halves "
                       "per microbatch")
        if stage == 3 and _close(got, _bytes(3, psi, d, 1)) and m > 1:
            raise Hint(f"{where}: that is one microbatch's. Each of the m microbatches gathers "
                       "the weights again for its forward and its backward, and reduce-scatters "
                       "its gradients")
        if stage == 3 and _close(got, (3 * m + 1) * (d - 1) / d * psi):
            raise Hint(f"{where}: one half too many — ZeRO-3 gathers nothing after the update; "
                       "each rank keeps its shard until the next forward gathers it")
        if d > 1 and _close(got * (d - 1) / d, want):
            raise Hint(f"{where}: the ring's factor is missing — in a reduce-scatter or an "
                       "all-gather each rank sends (d − 1)/d of the buffer (an all-reduce "
                       "twice that)")
        if d == 1:
            raise Hint(f"{where}: one rank sends nothing — (d − 1)/d of each buffer")
        raise Hint(f"{where} a rank sends {want:.4g} bytes of a {psi:.4g}-byte model, not "
                   f"{got:.4g}")
    return ("every stage, d = 1 … 8, m = 1 … 8: plain DP and ZeRO-1 2 halves per step, ZeRO-2 "
            "m + 1, ZeRO-3 3m, each (d − 1)/d of the gradients' bytes — what §4 measured; at "
            f"m = 8, ZeRO-3 sends {_halves(3, 8) / 2:g}× plain DP's bytes")
