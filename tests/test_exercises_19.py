"""The checkers of notebook 19: each reference solution passes, each typical mistake gets the hint
that names it, a stub gets "not done yet" — all decided in this process, no ranks started."""

import pytest
import torch
from helpers import stub, verdict

from megatron_edu.course.exercises import EXERCISES, REFERENCES, check
from megatron_edu.course.exercises.nb19 import edp_reduction, routed
from megatron_edu.expert_parallel import ExpertDispatcher
from megatron_edu.grid import Layout
from megatron_edu.model.moe import Router


def test_the_exercises_of_notebook_19_are_registered_with_what_they_rewrite():
    assert {"19.1", "19.2", "19.3"} <= set(EXERCISES)
    assert REFERENCES["19.1"] == (Router.forward,)
    assert REFERENCES["19.2"] == (ExpertDispatcher.dispatch, ExpertDispatcher.combine)
    assert REFERENCES["19.3"] == (Layout.edp_groups,)


# --- 19.1 top-k routing, renormalised -------------------------------------------------------------

def route(logits, k):
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def mixtral(logits, k):  # Mixtral's code: top-k of the logits, then a softmax over those k
    top, ids = logits.topk(k, dim=-1)
    return ids, top.softmax(-1)


def by_expert_id(logits, k):  # each token's pairs sorted by expert id: any order is fine
    ids, weights = route(logits, k)
    order = ids.argsort(-1)
    return ids.gather(-1, order), weights.gather(-1, order)


def test_19_1_the_solution_passes_in_any_order_of_the_k_pairs_and_is_the_package_s_router():
    result = verdict("19.1", route)
    assert "E = 8 with k = 2 and 4" in result.message
    verdict("19.1", mixtral)
    verdict("19.1", by_expert_id)
    logits = torch.randn(5, 8)
    ids, weights = routed(logits, 2)
    want_ids, want_weights = route(logits, 2)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


def unpaired(logits, k):  # weights sorted apart from their ids
    ids, weights = by_expert_id(logits, k)
    return ids, weights.sort(-1, descending=True).values


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda logits, k: logits.softmax(-1).topk(k, dim=-1)[::-1], ("E = 8, k = 2",
                                                                  "summing to 0.",
                                                                  "divide them by their sum")),
    (lambda logits, k: route(-logits, k), ("least likely", "largest")),
    (lambda logits, k: (route(logits, k)[0], logits.softmax(0).gather(-1, route(logits, k)[0])),
     ("over dim 0, the tokens",)),
    (lambda logits, k: (lambda top: (top[1], top[0].softmax(0)))(logits.topk(k, dim=-1)),
     ("over dim 0, the tokens",)),
    (lambda logits, k: (route(logits, k)[0], torch.full((logits.shape[0], k), 1 / k)),
     ("every weight is 1/k",)),
    (lambda logits, k: (route(logits, k)[0], (lambda raw: raw / raw.sum(-1, keepdim=True))(
        logits.gather(-1, route(logits, k)[0]))), ("logits can be negative", "softmax first")),
    (lambda logits, k: tuple(t.detach() for t in route(logits, k)), ("no gradient",
                                                                     "learns only through")),
    (lambda logits, k: (route(logits, k)[0], route(logits.detach(), k)[1] * 1.0),
     ("no gradient",)),
    (lambda logits, k: logits.softmax(-1).topk(k, dim=0)[::-1], ("over dim 0 picks tokens",)),
    (lambda logits, k: (route(logits, k)[0].float(), route(logits, k)[1]), ("int64",)),
    (lambda logits, k: (route(logits, k)[0][:, :1].expand(-1, k), route(logits, k)[1]),
     ("the same expert twice",)),
    (lambda logits, k: (route(logits, k)[0].roll(1, 0), route(logits, k)[1]), ("token 0 chose",
                                                                               "most probable")),
    (unpaired, ("not paired",)),
    (lambda logits, k: route(logits, k)[0], ("pair of tensors",)),
    (stub, ("not done yet",)),
], ids=["unnormalised", "smallest", "softmax-over-tokens", "top-k-softmax-over-tokens", "equal",
        "raw-logits", "detached", "detached-softmax", "topk-dim-0",
        "float-ids", "repeated", "another-token", "unpaired", "ids-only", "stub"])
def test_19_1_typical_mistakes_get_their_hint(answer, fragments):
    verdict("19.1", answer, *fragments)


def test_19_1_a_gradient_cut_in_the_renormalisation_is_caught():
    def half_detached(logits, k):
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        return ids, weights / weights.detach().sum(-1, keepdim=True)
    verdict("19.1", half_detached, "gradient to the logits is not the router's")


# --- 19.2 the permutation and its inverse ---------------------------------------------------------

def permute(x, ids):
    order = ids.flatten().argsort(stable=True)
    return x[order // ids.shape[1]], order


def unpermute(out, order, weights):
    slots = torch.zeros_like(out).index_copy(0, order, out)
    return (slots.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(1)


def unstable(x, ids):  # grouped by expert, each expert's slots in reverse
    slots = torch.arange(ids.numel())
    order = (ids.flatten() * ids.numel() - slots).argsort()
    return x[order // ids.shape[1]], order


def descending(x, ids):
    order = (-ids.flatten()).argsort(stable=True)
    return x[order // ids.shape[1]], order


def column_major(x, ids):
    order = ids.t().flatten().argsort(stable=True)
    return x[order // ids.shape[1]], order


def repeated(x, ids):
    order = ids.flatten().argsort(stable=True)
    return x.repeat(ids.shape[1], 1)[order], order


def tokens_indexed(x, ids):
    order = ids.flatten().argsort(stable=True)
    return x[order], order


def shuffled(x, ids):
    order = ids.flatten().argsort(stable=True)
    return x[order // ids.shape[1]].flip(0), order


def not_grouped(x, ids):
    order = torch.arange(ids.numel())
    return x[order // ids.shape[1]], order


def with_unpermute(fn):
    return (permute, fn)


@pytest.mark.parametrize(("answer", "fragments"), [
    ((unstable, unpermute), ("not in slot order", "stable=True")),
    ((descending, unpermute), ("from the last expert to the first",)),
    ((column_major, unpermute), ("j·T + t",)),
    ((not_grouped, unpermute), ("not grouped by expert",)),
    ((lambda x, ids: (permute(x, ids)[0], permute(x, ids)[1][:-1]), unpermute),
     ("expected [T·k, h]",)),
    ((lambda x, ids: (permute(x, ids)[0], torch.cat([permute(x, ids)[1][:-1],
                                                     permute(x, ids)[1][:1]])), unpermute),
     ("each slot 0 … T·k − 1",)),
    ((repeated, unpermute), ("x.repeat(k, 1)", "s // k")),
    ((tokens_indexed, unpermute), ("IndexError", "s // k")),
    ((shuffled, unpermute), ("the token of slot order[i]",)),
    ((lambda x, ids: permute(x, ids)[0], unpermute), ("pair of tensors (rows, order)",)),
    (with_unpermute(lambda out, order, w: (out.view(*w.shape, -1) * w.unsqueeze(-1)).sum(1)),
     ("still in expert order",)),
    (with_unpermute(lambda out, order, w: (out[order].view(*w.shape, -1) * w.unsqueeze(-1))
                    .sum(1)), ("a second time",)),
    (with_unpermute(lambda out, order, w: out[order.argsort()].view(*w.shape, -1).sum(1)),
     ("without the router's weights",)),
    (with_unpermute(lambda out, order, w: out[order.argsort()].view(*w.shape, -1).mean(1)),
     ("averaged",)),
    (with_unpermute(lambda out, order, w: (out * w.flatten().unsqueeze(1))[order.argsort()]
                    .view(*w.shape, -1).sum(1)), ("weights.flatten()[order[i]]",)),
    (with_unpermute(lambda out, order, w: unpermute(out, order, w).detach()), ("no gradient",)),
    (with_unpermute(lambda out, order, w: unpermute(out, order, w)[:, :1]), ("shape",)),
    (with_unpermute(lambda out, order, w: unpermute(out, order, w) + 1), ("token outputs off",)),
    (with_unpermute(lambda out, order, w: unpermute(out, order, w).tolist()), ("a tensor y",)),
    (permute, ("pair of functions",)),
    ((stub, stub), ("not done yet",)),
], ids=["unstable", "descending", "column-major", "not-grouped", "short", "not-a-permutation",
        "repeat", "token-index", "rows-shuffled", "order-missing", "not-inverted", "applied-twice",
        "unweighted", "mean", "weights-sorted", "detached", "shape", "off", "list", "one-function",
        "stub"])
def test_19_2_typical_mistakes_get_their_hint(answer, fragments):
    verdict("19.2", answer, *fragments)


def test_19_2_the_solution_passes():
    result = verdict("19.2", (permute, unpermute))
    assert "stable sort" in result.message and "x[order // k]" in result.message


def test_19_2_a_half_written_answer_is_checked_and_a_stub_alone_is_not_done():
    assert "not done yet" in check("19.2", (permute, stub)).message
    assert "not done yet" in check("19.2", (stub, unpermute)).message


# --- 19.3 the expert-gradient reduction -----------------------------------------------------------

def test_19_3_the_solution_passes_and_names_the_holders():
    result = verdict("19.3", edp_reduction)
    assert "pytorch#160285" in result.message
    assert edp_reduction(Layout(dp=4, ep=2), 1) == ([1, 3], 4)
    assert edp_reduction(Layout(tp=2, dp=4, ep=2), 0) == ([0, 4], 4)
    assert edp_reduction(Layout(dp=2, cp=2, ep=2), 2) == ([0, 2], 4)


def _group_of(groups, rank):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize(("answer", "fragments"), [
    (lambda layout, r: (edp_reduction(layout, r)[0], len(edp_reduction(layout, r)[0])),
     ("ep = 2 times too large", "pytorch#160285", "divide by dp·cp")),
    (lambda layout, r: (_group_of(layout.ep_groups(), r), layout.dp * layout.cp),
     ("is the ep group", "other experts")),
    (lambda layout, r: (_group_of(layout.dp_cp_groups(), r), layout.dp * layout.cp),
     ("whole data-parallel group", "mixes experts")),
    (lambda layout, r: (edp_reduction(layout, r)[0], layout.dp), ("cp splits each sequence",)),
    (lambda layout, r: (edp_reduction(layout, r)[0], 1), ("dp·cp = 4", "you said 1")),
    (lambda layout, r: ([q for q in edp_reduction(layout, r)[0] if q != r] or [r + 1],
                        layout.dp * layout.cp), ("leaves out rank 0 itself",)),
    (lambda layout, r: ([r, r + layout.ep], layout.dp * layout.cp),
     ("rank 2", "held by global ranks [0, 2]", "you said [2, 4]")),
    (lambda layout, r: (edp_reduction(Layout(dp=layout.dp, cp=layout.cp, ep=layout.ep),
                                      layout.coords(r)[2] * layout.cp + layout.cp_rank(r))[0],
                        layout.dp * layout.cp), ("at tp = 2", "within the dp × cp ranks",
                                                 "global ranks", "[0, 4]")),
    (lambda layout, r: "edp", ("return (ranks, divisor)",)),
    (lambda layout, r: (edp_reduction(layout, r)[0], "4"), ("return (ranks, divisor)",)),
    (stub, ("not done yet",)),
], ids=["edp-size", "ep-group", "dp-group", "forgets-cp", "sum", "without-itself",
        "next-ranks", "dp-indices", "string", "string-divisor", "stub"])
def test_19_3_typical_mistakes_get_their_hint(answer, fragments):
    verdict("19.3", answer, *fragments)
