"""Checkers for notebook 00 (launching and collectives).

00.1 ★    an all-gather from one all-reduce (slots of zeros)
00.2 ★★   the grid's coordinates: which (tp, pp, dp) a global rank is (2104.04473 §3)
00.3 ★★★  a ring all-reduce from send and recv: reduce-scatter, then all-gather (notebook 00 §4)

The collective exercises run on 4 gloo ranks and give each rank inputs that say where they came
from: rank r's values are multiples of 10^r, so every number a learner returns can be read back
as "the sum of ranks 0 and 2, at position 5", and a wrong answer named in those words.
"""

from __future__ import annotations

import itertools

import torch

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, close, exercise, on_ranks
from megatron_edu.grid import Layout

WORLD = 4
RING_TIMEOUT = 20.0  # s: a backstop; the ring is deadlock-prone, and a deadlock is detected


# --- shared: inputs that say where they came from ------------------------------------------------

def _digits(value: float, places: int = WORLD) -> list[int] | None:
    """A sum of multiples of 10^r read back as how many times each rank r is in it (or None)."""
    n = round(value)
    if abs(value - n) > 1e-3 or n < 0:
        return None
    digits = [(n // 10**r) % 10 for r in range(places)]
    return digits if n < 10**places else None


def _ranks_in(digits: list[int]) -> str:
    return ", ".join(str(r) for r, d in enumerate(digits) if d) or "none"


def _events(log: comm.CommLog) -> list[tuple[str, int]]:
    return [(e.op, e.bytes) for e in log.events]


# --- 00.1 all-gather from all-reduce -------------------------------------------------------------

_GATHER_N = 3  # elements per rank


def _run_gather(fn):
    group = comm.world()
    x = (torch.arange(_GATHER_N, dtype=torch.float32) + 1) * 10**group.rank  # (i + 1)·10^r
    with comm.record() as log:
        out = fn(x, group)
    return out, _events(log)


@exercise("00.1", "an all-gather from one all-reduce",
          marks=(r"slot[^.]{0,80}zeros", r"zeros[^.]{0,80}slot"))  # x in its slot, 0 elsewhere
def _all_gather_by_all_reduce(fn) -> str:
    results = on_ranks(WORLD, _run_gather, fn)
    n = _GATHER_N
    expected = torch.cat([(torch.arange(n, dtype=torch.float32) + 1) * 10**r
                          for r in range(WORLD)])
    for rank, (out, events) in enumerate(results):
        ops = sorted({op for op, _ in events})
        if ops != ["all_reduce"] or len(events) != 1:
            used = ", ".join(f"{op} ({sum(o == op for o, _ in events)}×)" for op in ops)
            raise Hint(f"rank {rank} called {used or 'no comm collective'}: the exercise is to "
                       f"use exactly one comm.all_reduce (and no all_gather), through `comm` so "
                       f"that it is counted")
        if isinstance(out, torch.Tensor):
            if out.shape != expected.shape:
                raise Hint(f"rank {rank} returned shape {tuple(out.shape)}, expected "
                           f"{tuple(expected.shape)}: the all-gather of {WORLD} tensors of {n} "
                           f"elements has t·n = {WORLD * n} — build a buffer of t·n zeros, put "
                           f"x in this rank's slot, all-reduce the buffer")
            hint = _slot_hint(rank, out)
            if hint:
                raise Hint(hint)
        close(out, expected, f"rank {rank}'s result")
    ar_bytes = results[0][1][0][1]
    ring = 2 * (WORLD - 1) / WORLD * ar_bytes
    return (f"every rank holds the {WORLD} tensors in rank order, from one all-reduce of a "
            f"{ar_bytes}-byte buffer — which a ring sends as 2(t − 1)/t of it, {ring:.0f} bytes "
            f"per rank, twice the {ring / 2:.0f} of comm.all_gather: right, but the dedicated "
            f"collective is cheaper")


def _slot_hint(rank: int, out: torch.Tensor) -> str | None:
    """Name what the first wrong slot of a [t·n] result holds, if it can be read."""
    n = _GATHER_N
    for slot in range(WORLD):
        part = out[slot * n:(slot + 1) * n].detach().float()
        scale = part / (torch.arange(n, dtype=torch.float32) + 1)
        digits = _digits(scale[0].item())
        if digits == [int(r == slot) for r in range(WORLD)]:
            continue
        if digits is None or not torch.allclose(scale, scale[0].expand(n)):
            return (f"rank {rank}'s slot {slot} (positions {slot * n}…{slot * n + n - 1}) holds "
                    f"values that are no rank's x: start from torch.zeros, not torch.empty")
        if sum(digits) == 0:
            return (f"rank {rank}'s slot {slot} is zero: rank {slot}'s x never reached it — "
                    f"rank r must write its x into slot r (positions r·n … (r+1)·n − 1)")
        if sum(digits) == 1:
            source = digits.index(1)
            return (f"rank {rank}'s slot {slot} holds rank {source}'s x: rank r must write its "
                    f"x into slot r = group.rank (positions r·n … (r+1)·n − 1)")
        return (f"rank {rank}'s slot {slot} holds the sum of ranks {_ranks_in(digits)}'s x: "
                f"every slot but a rank's own must be zero before the all-reduce, or the "
                f"all-reduce adds the ranks' copies together")
    return None


# --- 00.2 the grid's coordinates -----------------------------------------------------------------

_AXES = ("tp", "pp", "dp")
_LAYOUTS = [Layout(tp=2, pp=3, dp=4)] + [Layout(*s) for s in
                                             ((2, 2, 2), (4, 2, 1), (1, 2, 4), (2, 4, 2),
                                              (8, 1, 2), (3, 2, 5), (1, 1, 6))]


def _coords_in_order(layout: Layout, rank: int, fastest_first: tuple[str, ...]) -> tuple:
    """(tp, pp, dp) of ``rank`` when the ranks are numbered with ``fastest_first[0]`` fastest."""
    size = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    coords, rest = {}, rank
    for axis in fastest_first:
        coords[axis], rest = rest % size[axis], rest // size[axis]
    return tuple(coords[a] for a in _AXES)


def _wrong_stride(layout: Layout, got: list[tuple]) -> str | None:
    """A hint if one coordinate is computed right but for its stride: rank // s (mod its size or
    not) with s another product of the sizes than its own (tp 1, dp tp, pp tp·dp)."""
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}
    own = {"tp": ("1", 1), "dp": ("tp", layout.tp), "pp": ("tp·dp", layout.tp * layout.dp)}
    strides = {"1": 1, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
               "tp·pp": layout.tp * layout.pp, "tp·dp": layout.tp * layout.dp,
               "pp·dp": layout.pp * layout.dp}
    ranks = range(layout.world_size)
    for i, axis in enumerate(_AXES):
        mine = [answer[i] for answer in got]
        for name, s in strides.items():
            if s != own[axis][1] and mine in ([r // s for r in ranks],
                                               [r // s % sizes[axis] for r in ranks]):
                return (f"your {axis}_rank is rank // {name}: the ranks of one {axis} coordinate "
                        f"are {own[axis][0]} apart, so {axis}_rank = rank // {own[axis][0]}"
                        + ("" if axis == "pp" else f" % {axis}") + " — rank = pp_rank·(dp·tp) "
                        "+ dp_rank·tp + tp_rank")
    return None


@exercise("00.2", "the grid's coordinates of a rank", reference=(Layout.coords,),
          marks=(r"rank%tp\b", r"rank//\((tp[·*]dp|dp[·*]tp)\)", r"\(rank//tp\)%dp",
                 r"rankmodtp", r"rank//tp%dp"))
def _grid_coords(fn) -> str:
    for layout in _LAYOUTS:
        sizes = dict(tp=layout.tp, pp=layout.pp, dp=layout.dp)
        got = [fn(rank, layout.tp, layout.pp, layout.dp) for rank in range(layout.world_size)]
        expected = [layout.coords(rank) for rank in range(layout.world_size)]
        for rank, answer in enumerate(got):
            if not (isinstance(answer, tuple | list) and len(answer) == 3
                    and all(isinstance(c, int) for c in answer)):
                raise Hint(f"grid_coords({rank}, tp={layout.tp}, pp={layout.pp}, "
                           f"dp={layout.dp}) returned {answer!r}: return a tuple of three ints, "
                           f"(tp_rank, pp_rank, dp_rank)")
        got = [tuple(answer) for answer in got]
        if got == expected:
            continue
        where = f"tp={layout.tp}, pp={layout.pp}, dp={layout.dp}"
        for order in itertools.permutations(_AXES):
            if order != ("tp", "dp", "pp") and got == [
                    _coords_in_order(layout, r, order) for r in range(layout.world_size)]:
                raise Hint(f"with {where} you numbered the ranks {order[0]} fastest, then "
                           f"{order[1]}, then {order[2]}; Megatron numbers tp fastest, then dp, "
                           f"then pp: rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank")
        for perm in itertools.permutations(range(3)):
            if got == [tuple(e[i] for i in perm) for e in expected]:
                names = ", ".join(f"{_AXES[i]}_rank" for i in perm)
                raise Hint(f"the coordinates are right but in the order ({names}): return "
                           f"(tp_rank, pp_rank, dp_rank), as Layout.coords does")
        stride = _wrong_stride(layout, got)
        if stride:
            raise Hint(f"with {where} {stride}")
        for rank, answer in enumerate(got):
            for axis, c in zip(_AXES, answer, strict=True):
                if not 0 <= c < sizes[axis]:
                    raise Hint(f"rank {rank} of {where}: your {axis}_rank {c} is outside 0…"
                               f"{sizes[axis] - 1} — each coordinate is taken modulo its size")
        rank = next(r for r in range(layout.world_size) if got[r] != expected[r])
        raise Hint(f"rank {rank} of {where}: you said (tp, pp, dp) = {got[rank]}, it is "
                   f"{expected[rank]} — rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank")
    worlds = sorted({layout.world_size for layout in _LAYOUTS})
    return (f"every rank of {len(_LAYOUTS)} layouts ({', '.join(map(str, worlds))} ranks) has "
            f"Layout's coordinates: tp fastest, then dp, then pp, as in Megatron")


# --- 00.3 the ring all-reduce --------------------------------------------------------------------

_RING_N = 8  # elements per rank: t = 4 chunks of 2


def _ring_input(rank: int) -> torch.Tensor:
    """10^r + 10^4·i at position i: a sum reads back as which ranks, and which position."""
    return 10.0**rank + 1e4 * torch.arange(_RING_N, dtype=torch.float32)


def _run_ring(fn):
    group = comm.world()
    x = _ring_input(group.rank)
    before = x.clone()
    with comm.record() as log:
        out = fn(x, group)
    return out, _events(log), torch.equal(x, before)


def _read_ring_value(value: float) -> tuple[list[int], float] | None:
    """(times each rank is in the sum, position it came from), if the number can be read."""
    digits = _digits(value % 1e4)
    if digits is None or sum(digits) == 0:
        return None
    return digits, (value - value % 1e4) / 1e4 / sum(digits)


def _ring_value_hint(rank: int, out: torch.Tensor) -> str:
    expected = sum(_ring_input(r) for r in range(WORLD))
    chunk = _RING_N // WORLD
    for i in range(_RING_N):
        got = out[i].item()
        if abs(got - expected[i].item()) < 0.5:
            continue
        where = f"rank {rank} position {i} (chunk {i // chunk})"
        read = _read_ring_value(got)
        if read is None:
            return (f"{where} holds {got:g}, expected {expected[i].item():g} (the sum of the 4 "
                    f"ranks' values there)")
        digits, source = read
        if abs(source - round(source)) > 1e-3 or not 0 <= round(source) < _RING_N:
            return (f"{where} holds {got:g}, expected {expected[i].item():g}: it mixes "
                    f"different positions — add the received chunk to the same chunk of yours")
        if round(source) != i:
            return (f"{where} holds the sum for position {round(source)} (chunk "
                    f"{round(source) // chunk}): a chunk index is off — at step k, rank r sends "
                    f"chunk (r − k) mod t and receives chunk (r − k − 1) mod t (all-gather: "
                    f"shifted by one, rank r starts with its finished chunk (r + 1) mod t)")
        if max(digits) > 1:
            twice = [r for r, d in enumerate(digits) if d > 1]
            return (f"{where} counts rank {twice[0]}'s value {digits[twice[0]]} times: a chunk "
                    f"was added more than once — add only in the reduce-scatter phase; in the "
                    f"all-gather phase replace your chunk with the one you receive")
        missing = [r for r, d in enumerate(digits) if not d]
        return (f"{where} holds the sum of ranks {_ranks_in(digits)} only, missing rank(s) "
                f"{', '.join(map(str, missing))}: after the t − 1 = {WORLD - 1} reduce-scatter "
                f"steps rank r has one finished chunk, (r + 1) mod t, the last it added to; the "
                f"t − 1 all-gather steps must start from that one and pass every finished chunk "
                f"all the way round")
    return ""


@exercise("00.3", "a ring all-reduce from send and recv",
          marks=(r"\(r[−-]k\)(mod|%)t", r"\(r[−-]k[−-]1\)(mod|%)t",  # at step k, rank r…
                 r"chunk`?\(r\+1\)(mod|%)t", r"\(r\+1[−-]k\)(mod|%)t"))  # …and where it ends
def _ring_all_reduce(fn) -> str:
    results = on_ranks(WORLD, _run_ring, fn, timeout=RING_TIMEOUT, may_deadlock=True,
                       deadlock_advice="In a ring, if every rank first calls a blocking "
                       "comm.send, each waits for a recv its neighbour never reaches: start the "
                       "send with comm.isend, then recv, then wait on the send (or let even "
                       "ranks send first and odd ranks receive first)")
    expected = sum(_ring_input(r) for r in range(WORLD))
    chunk_bytes = expected.numel() // WORLD * expected.element_size()
    for rank, (out, events, untouched) in enumerate(results):
        other = sorted({op for op, _ in events} - {"send", "recv"})
        if other:
            raise Hint(f"rank {rank} called comm.{', comm.'.join(other)}: build the all-reduce "
                       f"from comm.send/comm.recv (or isend/irecv) only")
        if not untouched:
            raise Hint(f"rank {rank}'s input x was changed: work on a copy (x.clone()) — the "
                       f"caller still needs its tensor")
        if isinstance(out, torch.Tensor) and out.shape == expected.shape:
            hint = _ring_value_hint(rank, out.detach().float())
            if hint:
                raise Hint(hint)
        close(out, expected, f"rank {rank}'s result", atol=0.5)
    for rank, (_, events, _) in enumerate(results):
        sends = [b for op, b in events if op == "send"]
        if not sends:
            raise Hint(f"rank {rank} sent nothing through comm: use comm.send/comm.isend (not "
                       f"torch.distributed directly) so that the messages are counted")
        whole = WORLD * chunk_bytes
        if set(sends) == {whole}:
            raise Hint(f"rank {rank} sent {len(sends)} messages of the whole tensor ({whole} "
                       f"bytes): passing whole tensors round the ring costs (t − 1)·n = "
                       f"{(WORLD - 1) * whole} bytes per rank, the ring's 2(t − 1)/t · n only "
                       f"{2 * (WORLD - 1) * chunk_bytes} — cut the tensor into t chunks and send "
                       f"one chunk per step")
        if len(sends) != 2 * (WORLD - 1) or set(sends) != {chunk_bytes}:
            sizes = ", ".join(f"{b}" for b in sorted(set(sends)))
            raise Hint(f"rank {rank} sent {len(sends)} messages of {sizes} bytes; the ring sends "
                       f"2(t − 1) = {2 * (WORLD - 1)} messages of 1/t of the tensor "
                       f"({chunk_bytes} bytes) — t − 1 to reduce-scatter, t − 1 to all-gather: "
                       f"2(t − 1)/t · n in all, which barely grows with t")
    total = 2 * (WORLD - 1) * chunk_bytes
    return (f"every rank holds the sum; each sent {2 * (WORLD - 1)} messages of {chunk_bytes} "
            f"bytes (1/t of the tensor), {total} bytes = 2(t − 1)/t · n, as the ring of §4 does")
