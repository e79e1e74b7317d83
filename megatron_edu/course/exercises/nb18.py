"""Checkers for notebook 18 (the Llama block under tensor, sequence and context parallelism).

18.1 ★    a fused [gate; up] weight (Phi-3's gate_up_proj, a serial Megatron checkpoint's fc1) as
          tensor-parallel rank r's rows of this package's SwiGLU fc: each unit's gate beside its
          up (rows 2i, 2i + 1), the units r·f/t … (r + 1)·f/t − 1
18.2 ★★   which kv heads tp rank r holds for g kv heads — g/t whole groups when t ≤ g, one head
          replicated on t/g ranks when t > g (vLLM's num_kv_head_replicas)
18.3 ★    the rotary positions of cp rank r's zig-zag chunk pair, in the order it holds them

All three are decided in this process, no ranks started. 18.1 reads every row of the learner's
tensor back as "the gate of unit 3" (every row of the test matrix is distinct) and names the
typical layouts — the [gate; up] weight cut down the middle, megatron-core's per-rank
[gates; ups], the pair swapped, another rank's units — then runs the package's ``bias_swiglu``
on each rank's rows and sums the ranks' products with down_proj's columns, as ``g`` would,
against the serial SwiGLU MLP. 18.2 compares with the kv heads of the rank's own query heads;
18.3 with ``context_parallel.positions_of`` of the rank's chunks, naming local, consecutive and
reversed positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_edu.context_parallel import chunk_ids, positions_of
from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.hf_llama import _fc_from_hf
from megatron_edu.model.fused import bias_swiglu

__all__ = ["kv_heads_of", "rope_positions"]  # the checkers register themselves (``@exercise``)

# --- 18.1 ★ a fused [gate; up] weight as rank r's interleaved fc rows ----------------------------

_F, _H = 8, 3            # units (ffn_hidden) and hidden size of the index matrix
_TPS = (2, 4, 1)    # t = 2 first: its mistakes are the typical ones


def _gate_up() -> torch.Tensor:
    """[2f, h], every entry distinct: row j is [j·h, j·h + 1, …] — gate rows 0 … f − 1, then up
    rows f … 2f − 1."""
    return torch.arange(2 * _F * _H, dtype=torch.float32).view(2 * _F, _H)


def _name(j: int) -> str:
    return f"the gate of unit {j}" if j < _F else f"the up of unit {j - _F}"


def _units(r: int, t: int) -> range:
    return range(r * _F // t, (r + 1) * _F // t)


def _expected_rows(r: int, t: int) -> list[int]:
    """The rows of [gate; up] that rank r of t holds, in order: gate_u, up_u for its units u."""
    return [j for u in _units(r, t) for j in (u, _F + u)]


def _span(units) -> str:
    units = list(units)
    return f"{units[0]}–{units[-1]}" if len(units) > 1 else f"{units[0]}"


def _which_rows(got: torch.Tensor) -> list[int] | None:
    """Each row of ``got`` as the row of [gate; up] it is; None if some row is none of them."""
    rows = _gate_up()
    found = []
    for row in got.detach().float():
        match = (rows == row).all(dim=1).nonzero().flatten().tolist()
        if not match:
            return None
        found.append(match[0])
    return found


def _rows_hint(found: list[int], r: int, t: int) -> str:
    """The typical wrong layouts of rank r's rows, named; else the first misplaced row."""
    want, where = _expected_rows(r, t), f"at t = {t} rank {r}"
    mine = list(_units(r, t))
    gates, ups = [j for j in found if j < _F], [j - _F for j in found if j >= _F]
    if found == list(range(2 * _F))[r * 2 * _F // t:(r + 1) * 2 * _F // t]:
        kind = ("gates" if not ups else "ups") if not (gates and ups) else "gates and ups"
        return (f"{where} holds rows {found[0]}–{found[-1]} of [gate; up], the {kind} of units "
                f"{_span(gates or ups)} alone — the weight cut down the middle, where a rank "
                f"holds gates without their ups and silu(gate_i)·up_i cannot be formed. Pair "
                f"each unit's gate with its up first (row 2i the gate of unit i, row 2i + 1 its "
                f"up), then cut the pairs into t parts")
    if sorted(found) == sorted(want) and found == [u for u in mine] + [_F + u for u in mine]:
        return (f"{where} holds the right units ({_span(mine)}), but as [gates; ups]: that is "
                f"megatron-core's per-rank layout, which its activation reads with "
                f"chunk(2, dim=-1). This package's bias_swiglu reads rows 2i and 2i + 1 as unit "
                f"i's gate and up: interleave them")
    if found == [j for u in mine for j in (_F + u, u)]:
        return (f"{where}: each pair is (up, gate); row 2i must be the gate — the row silu is "
                f"applied to — and row 2i + 1 the up")
    if len(found) == len(want) and all(found[k] == found[k + 1] - _F for k in
                                       range(0, len(found), 2)) and len(set(found)) == len(found):
        units = [found[k] for k in range(0, len(found), 2)]
        owner = next((q for q in range(t) if units == list(_units(q, t))), None)
        if owner is not None:
            return (f"{where} holds units {_span(units)}, which are rank {owner}'s: rank r holds "
                    f"units r·f/t … (r + 1)·f/t − 1, here {_span(mine)}")
        return (f"{where} holds units {units}: right pairs, but the row-parallel down_proj of "
                f"rank r holds the columns of units r·f/t … (r + 1)·f/t − 1 as one block "
                f"({_span(mine)}), so its fc must hold those same units")
    i = next((k for k, (a, b) in enumerate(zip(found, want, strict=False)) if a != b), None)
    if i is None:
        return f"{where} returned {len(found)} rows; it should hold {len(want)}"
    return (f"{where}: row {i} of your tensor is {_name(found[i])}; it should be "
            f"{_name(want[i])} — rank r holds, for each of its units i = r·f/t … (r + 1)·f/t − "
            f"1, the gate of unit i then its up")


def _serial_swiglu(x, gate, up, down) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@exercise("18.1", "a fused [gate; up] weight as a rank's SwiGLU rows", reference=(_fc_from_hf,),
          marks=(r"row2i\S{0,25}row2i\+1",            # row 2i the gate of unit i, 2i + 1 its up
                 r"rows2i,2i\+1",
                 r"torch\.stack`?alonganewdimension1"))  # the recipe: pair, flatten, cut
def check_swiglu_rows(fn) -> str:
    """fn(gate_up [2f, h], rank, t) → rank's fc rows [2f/t, h], at t = 1, 2, 4."""
    gate_up = _gate_up()
    for t in _TPS:
        for r in range(t):
            got = fn(gate_up.clone(), r, t)
            if not isinstance(got, torch.Tensor):
                raise Hint(f"return a tensor (rank {r}'s rows of fc), got {type(got).__name__}")
            want_shape = (2 * _F // t, _H)
            if tuple(got.shape) != want_shape:
                if tuple(got.shape) == (2 * _F, _H) and t > 1:
                    raise Hint(f"at t = {t} rank {r} returned all 2f = {2 * _F} rows: it keeps "
                               f"its 2f/t = {2 * _F // t}, the gates and ups of its f/t units")
                if tuple(got.shape) == (_H, 2 * _F // t):
                    raise Hint(f"your tensor is [h, 2f/t] = {list(got.shape)}: keep nn.Linear's "
                               f"[out, in] — the fc rows are its output features")
                raise Hint(f"at t = {t} rank {r}'s rows have shape {list(got.shape)}; expected "
                           f"[2f/t, h] = {list(want_shape)}")
            found = _which_rows(got)
            if found is None:
                raise Hint("a row of your tensor is not a row of gate_up: take whole rows (the "
                           "[2f, h] weight's dim 0) and reorder them; a reshape or transpose "
                           "across rows mixes the hidden columns")
            if found != _expected_rows(r, t):
                raise Hint(_rows_hint(found, r, t))
    # Right on the index matrix; now numbers: each rank's SwiGLU on its rows, summed as g sums.
    gen = torch.Generator().manual_seed(18)
    h, t = 6, 2
    gate, up = torch.randn(_F, h, generator=gen), torch.randn(_F, h, generator=gen)
    down, x = torch.randn(h, _F, generator=gen), torch.randn(2, 5, h, generator=gen)
    total = 0
    for r in range(t):
        rows = fn(torch.cat([gate, up]), r, t)
        if not torch.equal(rows, _fc_from_hf(gate, up, config=None).chunk(t)[r]):
            raise Hint(f"on real weights rank {r}'s rows differ from the package's layout "
                       "(megatron_edu/hf_llama.py); take rows of gate_up as they are")
        cols = slice(r * _F // t, (r + 1) * _F // t)
        total = total + F.linear(bias_swiglu(F.linear(x, rows), None), down[:, cols])
    diff = (total - _serial_swiglu(x, gate, up, down)).abs().max().item()
    if not diff < 1e-5:  # the package's own layout: never, unless bias_swiglu changed
        raise Hint(f"the ranks' SwiGLU outputs, summed, differ from the serial MLP by {diff:.3g}")
    return (f"rank r holds each of its units' gate beside its up (rows 2i, 2i + 1), units "
            f"r·f/t … (r + 1)·f/t − 1, at t = {', '.join(map(str, sorted(_TPS)))} — the layout "
            f"megatron_edu/hf_llama.py builds from gate_proj and up_proj; at t = 2 the package's "
            f"bias_swiglu on each rank's rows, times its columns of down_proj and summed over the "
            f"ranks as g sums them, equals the serial SwiGLU MLP")


# --- 18.2 ★★ kv-head ownership, replicated when t > g --------------------------------------------

_CASES_18_2 = ((8, 2), (8, 4), (2, 4), (2, 8),     # (g, t): t ≤ g, then t > g (replicated)
               (8, 1), (8, 8), (4, 2), (2, 2), (3, 3), (1, 2), (1, 4), (4, 8), (3, 6))


def kv_heads_of(rank: int, t: int, g: int) -> list[int]:
    """The kv heads that tp rank ``rank`` of ``t`` needs, g kv heads: those of its query heads
    (a = t·g of them here: rank r holds heads r·a/t …, head q in group q // (a/g))."""
    a = t * g
    return sorted({q // (a // g) for q in range(rank * a // t, (rank + 1) * a // t)})


def _heads(got, where: str) -> list[int]:
    if isinstance(got, int):
        return [got]
    if isinstance(got, torch.Tensor):
        got = got.flatten().tolist()
    try:
        if isinstance(got, str):
            raise TypeError
        got = list(got)
        heads = [int(h) for h in got]
    except (TypeError, ValueError):
        raise Hint(f"{where}: return the kv heads held as a list of ints (e.g. [0, 1]), got "
                   f"{type(got).__name__}") from None
    if any(h != x for h, x in zip(heads, got, strict=True)):
        raise Hint(f"{where}: kv heads are whole numbers, got {list(got)}")
    return heads


@exercise("18.2", "kv-head ownership under tensor parallelism, replicated when t > g",
          marks=(r"r//\(t/g\)",                        # the head of rank r when t > g
                 r"r·g/t",                              # its first head when t ≤ g
                 r"g/twholegroups"))
def check_kv_heads(fn) -> str:
    """fn(rank, t, g) → the kv heads rank holds, against the groups of its query heads."""
    for g, t in _CASES_18_2:
        answers = [_heads(fn(r, t, g), f"at t = {t}, g = {g}, rank {r}") for r in range(t)]
        want = [kv_heads_of(r, t, g) for r in range(t)]
        if answers == want:
            continue
        r = next(r for r in range(t) if sorted(answers[r]) != want[r] or answers[r] != want[r])
        got, where = answers[r], f"at t = {t}, g = {g}, rank {r}"
        a = t * g
        queries = f"heads {r * a // t}–{(r + 1) * a // t - 1} of a = {a}"
        if sorted(got) == want[r]:
            raise Hint(f"{where}: the right heads, {want[r]}, out of order — list them in "
                       f"increasing order, as the rank's rows of qkv hold them")
        if not got:
            raise Hint(f"{where} holds no kv head, but its query heads ({queries}) attend with "
                       f"kv head {want[r][0]}: when t > g there are fewer kv heads than ranks, "
                       f"and each kv head is replicated on t/g = {t // g} ranks")
        if t > g and [h % g for h in range(t)] == [x[0] if len(x) == 1 else None
                                                   for x in answers]:
            raise Hint(f"{where} holds kv head {got[0]} = r mod g (round robin); its query "
                       f"heads ({queries}) are a contiguous block, in group r // (t/g) = "
                       f"{want[r][0]}: the t/g = {t // g} replicas of a kv head sit on "
                       f"consecutive ranks, as their query heads do")
        if t < g and len(got) == 1:
            raise Hint(f"{where} holds one kv head; at t ≤ g each rank holds g/t = {g // t} "
                       f"whole groups, heads r·g/t … (r + 1)·g/t − 1 = {want[r]}")
        if len(got) > len(want[r]):
            raise Hint(f"{where} holds kv heads {got}; its query heads ({queries}) need only "
                       f"{want[r]} — a rank holds the groups of its own query heads, no more")
        raise Hint(f"{where} should hold kv heads {want[r]} (the groups of its query heads, "
                   f"{queries}, n = a/g = {a // g} per group); you said {got}")
    return ("at t ≤ g rank r holds g/t whole groups, kv heads r·g/t … (r + 1)·g/t − 1; at t > g "
            "one head, r // (t/g), replicated on t/g consecutive ranks (vLLM's "
            "num_kv_head_replicas) — in training each replica's k and v gradients cover only "
            "its own query heads, so the t/g replicas' gradients must be summed")


# --- 18.3 ★ the rotary positions of a zig-zag chunk pair -----------------------------------------

_CASES_18_3 = ((2, 16), (4, 16), (4, 32), (8, 64), (1, 8))   # (cp, s)


def rope_positions(rank: int, cp: int, s: int) -> list[int]:
    """The positions in the whole sequence of the tokens cp rank ``rank`` holds, in order."""
    parts = tuple((c, 2 * cp) for c in chunk_ids(rank, cp)) if cp > 1 else ((0, 1),)
    return positions_of(parts, s, 0, torch.device("cpu")).tolist()


def _positions(got, where: str) -> list[int]:
    if isinstance(got, torch.Tensor):
        got = got.flatten().tolist()
    try:
        if isinstance(got, str):
            raise TypeError
        return [int(p) for p in got]
    except (TypeError, ValueError):
        raise Hint(f"{where}: return the positions as a list (or a 1-d tensor) of ints, got "
                   f"{type(got).__name__}") from None


@exercise("18.3", "the rotary positions of a zig-zag chunk pair", reference=(positions_of,),
          marks=(r"\[4,5,6,7,8,9,10,11\]",              # rank 1's positions at cp = 2, s = 16
                 r"\[0,1,2,3,12,13,14,15\]",            # rank 0's
                 r"positions4[–-]11",
                 r"positions0[–-]3and12[–-]15"))
def check_rope_positions(fn) -> str:
    """fn(rank, cp, s) → the positions rank holds, against ``positions_of`` of its chunks."""
    for cp, s in _CASES_18_3:
        for r in reversed(range(cp)):  # the last rank first: rank 0's local positions are
            where = f"at cp = {cp}, s = {s}, rank {r}"  # its consecutive ones too
            got, want = _positions(fn(r, cp, s), where), rope_positions(r, cp, s)
            if got == want:
                continue
            c = s // (2 * cp)
            if len(got) != len(want):
                raise Hint(f"{where} returned {len(got)} positions; it holds s/cp = {len(want)} "
                           f"tokens: two chunks of s/(2·cp) = {c}")
            if got == list(range(s // cp)):
                raise Hint(f"{where} gave its local indices 0…{s // cp - 1}: rotary turns each "
                           f"token by its position in the whole sequence, and rank r holds "
                           f"chunks r and 2·cp − 1 − r of 2·cp; with local positions its late "
                           f"chunk would sit right after its early one, and q·k would see the "
                           f"wrong distance j − j′")
            if got == list(range(r * s // cp, (r + 1) * s // cp)):
                raise Hint(f"{where} gave positions {got[0]}…{got[-1]}, the consecutive part r "
                           f"of cp; the sequence is split zig-zag: chunks r and 2·cp − 1 − r "
                           f"of 2·cp (notebook 12)")
            if got == want[c:] + want[:c]:
                raise Hint(f"{where}: the right positions, in the wrong order — the rank holds "
                           f"its earlier chunk first ({want[0]}…{want[c - 1]}), as "
                           f"context_parallel.split concatenates its chunks in sequence order")
            i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            raise Hint(f"{where}: its token {i} is at position {want[i]}, you said {got[i]} "
                       f"(rank r holds chunks r and 2·cp − 1 − r, each of s/(2·cp) = {c} "
                       f"tokens)")
    return ("rank r's tokens are at the positions of chunks r and 2·cp − 1 − r, earlier chunk "
            "first, at cp = 1, 2, 4, 8 — what attention.Rotary turns q and k by "
            "(context_parallel.parts_held and positions_of); under sequence parallelism the same, "
            "since attention has gathered the tp pieces of the rank's chunks before it")
