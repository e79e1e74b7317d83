"""The checkers of notebook 18: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet" — all decided in this process, no ranks started."""

import pytest
import torch
from helpers import stub, verdict

from megatron_edu.course.exercises import EXERCISES, REFERENCES
from megatron_edu.course.exercises.nb18 import kv_heads_of, rope_positions
from megatron_edu.hf_llama import _fc_from_hf


def test_the_exercises_of_notebook_18_are_registered_with_what_they_rewrite():
    assert {"18.1", "18.2", "18.3"} <= set(EXERCISES)
    assert REFERENCES["18.1"] == (_fc_from_hf,)


# --- 18.1 a fused [gate; up] weight as rank r's interleaved rows ---------------------------------

def swiglu_rows(gate_up, rank, t):
    gate, up = gate_up.chunk(2)
    return torch.stack([gate, up], dim=1).flatten(0, 1).chunk(t)[rank]


def per_rank_blocks(gate_up, rank, t):  # megatron-core's local layout: [gate_r; up_r]
    gate, up = gate_up.chunk(2)
    return torch.cat([gate.chunk(t)[rank], up.chunk(t)[rank]])


def swapped(gate_up, rank, t):
    gate, up = gate_up.chunk(2)
    return torch.stack([up, gate], dim=1).flatten(0, 1).chunk(t)[rank]


def units_strided(gate_up, rank, t):
    gate, up = gate_up.chunk(2)
    return torch.stack([gate, up], dim=1)[rank::t].flatten(0, 1)


def test_18_1_the_solution_passes():
    result = verdict("18.1", swiglu_rows)
    assert "t = 1, 2, 4" in result.message and "hf_llama" in result.message


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda gate_up, r, t: gate_up.chunk(t)[r], ("rows 0–7 of [gate; up]", "gates of units 0–7",
                                                 "without their ups")),
    (per_rank_blocks, ("[gates; ups]", "megatron-core", "interleave")),
    (swapped, ("(up, gate)",)),
    (lambda gate_up, r, t: swiglu_rows(gate_up, 0, t), ("rank 1 holds units 0–3",
                                                        "which are rank 0's")),
    (units_strided, ("units [0, 2, 4, 6]", "down_proj")),
    (lambda gate_up, r, t: swiglu_rows(gate_up, 0, 1), ("returned all 2f = 16 rows",)),
    (lambda gate_up, r, t: swiglu_rows(gate_up, r, t).t(), ("[h, 2f/t]", "[out, in]")),
    (lambda gate_up, r, t: swiglu_rows(gate_up, r, t).t().reshape(-1, 3),
     ("not a row of gate_up",)),
    (lambda gate_up, r, t: swiglu_rows(gate_up, r, t).tolist(), ("return a tensor",)),
    (stub, ("not done yet",)),
], ids=["down-the-middle", "megatron-blocks", "swapped", "rank-0", "strided", "whole", "transposed",
        "reshaped", "list", "stub"])
def test_18_1_typical_mistakes_get_their_hint(answer, fragments):
    verdict("18.1", answer, *fragments)


# --- 18.2 kv-head ownership ----------------------------------------------------------------------

def kv_heads(rank, t, g):
    if t <= g:
        return list(range(rank * g // t, (rank + 1) * g // t))
    return [rank // (t // g)]


def test_18_2_the_solution_passes_and_agrees_with_the_query_heads():
    verdict("18.2", kv_heads)
    assert [kv_heads_of(r, 4, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert [kv_heads_of(r, 2, 8) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda r, t, g: list(range(r * g // t, (r + 1) * g // t)), ("at t = 4, g = 2, rank 0",
                                                                 "holds no kv head",
                                                                 "replicated on t/g = 2")),
    (lambda r, t, g: kv_heads(r, t, g) if t <= g else [r % g], ("round robin", "r // (t/g)")),
    (lambda r, t, g: [r] if t <= g else kv_heads(r, t, g),
     ("at t = 2, g = 8, rank 0 holds one kv head", "g/t = 4")),
    (lambda r, t, g: list(range(g)), ("need only", "no more")),
    (lambda r, t, g: kv_heads(r, t, g)[::-1], ("out of order",)),
    (lambda r, t, g: kv_heads(r, t, g)[0] if t > g else kv_heads(r, t, g), ()),  # an int: fine
    (lambda r, t, g: "0", ("list of ints",)),
    (lambda r, t, g: [r + 1] if t > g else kv_heads(r, t, g), ("should hold kv heads [0]",
                                                                "you said [1]")),
    (lambda r, t, g: None, ("list of ints",)),
    (stub, ("not done yet",)),
], ids=["empty-when-replicated", "round-robin", "one-head", "all-heads", "reversed", "int",
        "string", "head-0", "none", "stub"])
def test_18_2_typical_mistakes_get_their_hint(answer, fragments):
    verdict("18.2", answer, *fragments)


# --- 18.3 the rotary positions of a zig-zag chunk pair -------------------------------------------

def positions(rank, cp, s):
    c = s // (2 * cp)
    return [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def test_18_3_the_solution_passes_and_is_what_the_package_computes():
    verdict("18.3", positions)
    verdict("18.3", lambda r, cp, s: torch.tensor(positions(r, cp, s)))
    assert rope_positions(1, 2, 16) == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda r, cp, s: list(range(s // cp)), ("local indices", "chunks r and 2·cp − 1 − r")),
    (lambda r, cp, s: list(range(r * s // cp, (r + 1) * s // cp)), ("consecutive part",)),
    (lambda r, cp, s: positions(r, cp, s)[s // (2 * cp):] + positions(r, cp, s)[:s // (2 * cp)],
     ("wrong order", "earlier chunk first")),
    (lambda r, cp, s: positions(r, cp, s)[:s // (2 * cp)], ("it holds s/cp = 8 tokens",)),
    (lambda r, cp, s: [p + 1 for p in positions(r, cp, s)], ("its token 0 is at position",)),
    (lambda r, cp, s: None, ("list (or a 1-d tensor) of ints",)),
    (stub, ("not done yet",)),
], ids=["local", "consecutive", "reversed", "one-chunk", "off-by-one", "none", "stub"])
def test_18_3_typical_mistakes_get_their_hint(answer, fragments):
    verdict("18.3", answer, *fragments)
