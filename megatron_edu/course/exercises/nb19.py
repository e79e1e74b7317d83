"""Checkers for notebook 19 (experts and expert parallelism).

19.1 ★    top-k routing with renormalised weights (Mixtral): each token's k most probable experts,
          their softmax probabilities divided by their sum
19.2 ★★   the dispatch's permutation and its inverse: the T·k slots sorted by expert, stably, each
          slot's token row; then each expert output back at its slot, weighted and summed per token
19.3 ★★   the reduction of an expert's gradient: which ranks (those holding the same experts, the
          expert-data-parallel group) and divided by what (the dense data-parallel size dp·cp)

All three are decided in this process, no ranks started. 19.1 runs the package's ``Router`` on
the same logits (its weight the identity) and compares the chosen experts, the weights paired
with them and their gradient, naming the smallest k, the weights left unnormalised, a softmax
over the tokens, equal weights and detached weights. 19.2 compares with ``Dispatch`` and
``ExpertDispatcher`` at ep = 1 on routings with ties and an expert nobody chose, naming an
unstable sort, a descending one, slots numbered j·T + t, ``x.repeat`` for
``x.repeat_interleave``, rows left in expert order, the permutation applied twice and the weights
forgotten or taken in sorted order. 19.3 compares with ``Layout.edp_groups`` and dp·cp, naming
the ep group, the whole data-parallel group, the ep×-too-large divisor (pytorch#160285) and a
divisor that forgets cp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.expert_parallel import Dispatch, ExpertDispatcher
from megatron_edu.grid import Layout
from megatron_edu.model import GPTConfig
from megatron_edu.model.moe import ExpertGroups, Router
from megatron_edu.tensor_parallel import init_parameters, serial_group

__all__ = ["routed", "edp_reduction"]  # the checkers register themselves (``@exercise``)

# --- 19.1 ★ top-k routing, renormalised -----------------------------------------------------------

_CASES_19_1 = ((8, 2), (8, 4), (4, 2))                 # (E, k): Mixtral's first
_TOKENS = 12


def routed(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's Router on ``logits`` [T, E] (its weight the identity, so that these are its
    logits): each token's k experts [T, k] and their weights [T, k], differentiable."""
    experts = logits.shape[-1]
    config = GPTConfig(vocab_size=16, seq_len=8, num_layers=1, hidden=experts, num_heads=1,
                       ffn_hidden=experts, moe_experts=experts, moe_topk=k)
    router = Router(config, ExpertGroups.serial())
    init_parameters(router, 0, serial_group())
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    ids, weights = router(logits.unsqueeze(0))
    return ids[0], weights[0]


def _logits(experts: int, seed: int) -> torch.Tensor:
    return torch.randn(_TOKENS, experts, generator=torch.Generator().manual_seed(seed)) * 2


def _pair(got, where: str, k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's (ids, weights), checked for type and shape."""
    if not (isinstance(got, tuple | list) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise Hint(f"{where}: return a pair of tensors (ids, weights), got {type(got).__name__}")
    ids, weights = got
    for name, t in (("ids", ids), ("weights", weights)):
        if tuple(t.shape) != (_TOKENS, k):
            hint = (" — top-k over dim 0 picks tokens for each expert; pick experts for each "
                    "token, over the last dim") if tuple(t.shape) in ((k, experts),
                                                                      (experts, k)) else ""
            raise Hint(f"{where}: {name} has shape {list(t.shape)}; expected [T, k] = "
                       f"{[_TOKENS, k]}{hint}")
    if ids.is_floating_point():
        raise Hint(f"{where}: ids are {ids.dtype}; they index experts — keep topk's int64 indices")
    return ids, weights


def _weights_hint(got: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, where: str) -> str:
    """The typical wrong weights for the right experts, named; else the size of the error."""
    probs = logits.softmax(-1).gather(-1, ids)
    sums = got.detach().sum(-1)
    if torch.allclose(got.detach(), probs, atol=1e-5):
        return (f"{where}: the weights are the k softmax probabilities as they are, summing to "
                f"{sums.mean():.2f} on average: divide them by their sum, so that each token's k "
                f"weights add to 1 (Mixtral: a softmax over the k chosen logits, the same numbers)")
    over_tokens = logits.softmax(0).gather(-1, ids)
    if any(torch.allclose(got.detach(), wrong, atol=1e-5) for wrong in (
            over_tokens, over_tokens / over_tokens.sum(-1, keepdim=True),
            logits.gather(-1, ids).softmax(0))):
        return (f"{where}: the softmax ran over dim 0, the tokens: each expert's probabilities "
                f"over the tokens. A token's probabilities are over the experts, dim −1")
    if torch.allclose(got.detach(), torch.full_like(got, 1 / ids.shape[-1])):
        return (f"{where}: every weight is 1/k: the right experts, but a token's output weighs "
                f"them by their renormalised probabilities, not equally")
    raw = logits.gather(-1, ids)
    if torch.allclose(got.detach(), raw / raw.sum(-1, keepdim=True), atol=1e-5):
        return (f"{where}: the chosen logits divided by their sum — logits can be negative; take "
                f"the softmax first, then renormalise the k probabilities")
    diff = (got.detach() - probs / probs.sum(-1, keepdim=True)).abs().max().item()
    return (f"{where}: the right experts, but their weights are off by up to {diff:.3g}: each is "
            f"the expert's softmax probability divided by the sum of the k chosen ones")


def _matched(ids: torch.Tensor, weights: torch.Tensor, ref_ids: torch.Tensor) -> torch.Tensor:
    """The learner's weights in the order of the reference's ids (each token's k pairs may come
    in any order)."""
    where = (ids.unsqueeze(-1) == ref_ids.unsqueeze(-2)).float().argmax(-2)   # [T, k]
    return weights.gather(-1, where)


@exercise("19.1", "top-k routing with renormalised weights", reference=(Router.forward,))
def check_topk_routing(fn: Callable) -> str:
    """fn(logits [T, E], k) → (ids [T, k], weights [T, k]), against the package's Router."""
    for experts, k in _CASES_19_1:
        where = f"E = {experts}, k = {k}"
        logits = _logits(experts, experts + k)
        mine = logits.clone().requires_grad_()
        ids, weights = _pair(fn(mine, k), where, k, experts)
        ref_logits = logits.clone().requires_grad_()
        ref_ids, ref_weights = routed(ref_logits, k)
        chosen, want = ids.sort(-1).values, ref_ids.sort(-1).values
        if not torch.equal(chosen, want):
            smallest = (-logits).topk(k, dim=-1).indices.sort(-1).values
            if torch.equal(chosen, smallest):
                raise Hint(f"{where}: you chose each token's k least likely experts: topk takes "
                           f"the largest by default (largest=False takes the smallest)")
            if (ids.sort(-1).values[:, 1:] == ids.sort(-1).values[:, :-1]).any():
                raise Hint(f"{where}: a token chose the same expert twice: its k experts are "
                           f"distinct, the k largest of its E probabilities")
            t = int((chosen != want).any(-1).nonzero()[0])
            raise Hint(f"{where}: token {t} chose experts {chosen[t].tolist()}; its k most "
                       f"probable are {want[t].tolist()}")
        paired = _matched(ids, weights, ref_ids)
        if not torch.allclose(paired.detach(), ref_weights.detach(), atol=1e-5):
            if torch.allclose(weights.detach().sort(-1).values,
                              ref_weights.detach().sort(-1).values, atol=1e-5):
                raise Hint(f"{where}: the right experts and the right weights, but not paired: "
                           f"weights[t, j] must be the weight of expert ids[t, j] (sort them "
                           f"together, or gather the weights at the ids)")
            raise Hint(_weights_hint(paired, logits, ref_ids, where))
        if not weights.requires_grad:
            raise Hint(f"{where}: the weights carry no gradient to the logits (detached, or "
                       f"computed under no_grad): the router learns only through them, since "
                       f"they multiply the experts' outputs")
        probe = torch.arange(1.0, 1.0 + experts)       # a distinct factor for each expert
        (paired * probe[ref_ids]).sum().backward()
        (ref_weights * probe[ref_ids]).sum().backward()
        if mine.grad is None or not torch.allclose(mine.grad, ref_logits.grad, atol=1e-5):
            raise Hint(f"{where}: the weights' gradient to the logits is not the router's: "
                       f"compute them from the softmax of the logits, without detaching a part")
    return ("each token's k most probable experts, their softmax probabilities divided by their "
            "sum, paired and differentiable — megatron_edu's Router at E = 8 with k = 2 and 4, "
            "and E = 4 (Mixtral §2.1 writes it as a softmax over the k chosen logits: the same "
            "numbers)")


# --- 19.2 ★★ the permutation and its inverse -----------------------------------------------------

_CASES_19_2 = ((6, 2, 4), (5, 3, 8))      # (T, k, E)
_HIDDEN = 3


def _routing(tokens: int, k: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k]: each token's k distinct experts, many tokens sharing one (ties for the sort),
    expert 2 chosen by no token; weights [T, k] summing to one per token."""
    gen = torch.Generator().manual_seed(tokens * k)
    allowed = torch.tensor([e for e in range(experts) if e != 2])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def _tokens(tokens: int) -> torch.Tensor:
    """Row t is [10t, 10t + 1, 10t + 2]: every row names its token."""
    return (10 * torch.arange(tokens).unsqueeze(1) + torch.arange(_HIDDEN)).float()


def _per_expert(rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
    """Stand-in experts: expert e multiplies its rows by e + 1 and adds e (each output names its
    expert)."""
    expert = torch.arange(len(per_expert)).repeat_interleave(per_expert).unsqueeze(1).float()
    return rows * (expert + 1) + expert


def _order_hint(order: torch.Tensor, ids: torch.Tensor, where: str) -> str:
    flat = ids.flatten()
    want = flat.argsort(stable=True)
    if sorted(order.tolist()) != list(range(flat.numel())):
        return (f"{where}: order must hold each slot 0 … T·k − 1 = {flat.numel() - 1} once (slot "
                f"t·k + j is token t's j-th choice); yours is {order.tolist()}")
    if torch.equal(order, ids.t().flatten().argsort(stable=True)):
        return (f"{where}: your slots are numbered j·T + t (ids.t() flattened); slot t·k + j is "
                f"token t's j-th choice: ids.flatten(), row by row")
    experts = flat[order]
    if (experts[1:] <= experts[:-1]).all():
        return f"{where}: the slots run from the last expert to the first; sort them ascending"
    if not (experts[1:] >= experts[:-1]).all():
        return (f"{where}: the slots are not grouped by expert: row i goes to expert "
                f"{experts.tolist()}; sort the slots by ids.flatten()")
    return (f"{where}: grouped by expert, but within an expert not in slot order ({order.tolist()}"
            f" where a stable sort gives {want.tolist()}): use argsort(stable=True), so that "
            f"each expert's rows keep the order of their slots, on every rank and every run")


def _permute(fn: Callable, ids: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = _tokens(ids.shape[0])
    try:
        got = fn(tokens.clone(), ids.clone())
    except IndexError as err:
        raise Hint(f"{where}: permute raised IndexError ({err}) — order holds slots t·k + j, up "
                   f"to T·k − 1; the token of slot s is s // k") from None
    if not (isinstance(got, tuple | list) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise Hint(f"{where}: permute returns a pair of tensors (rows, order), got "
                   f"{type(got).__name__}")
    rows, order = got
    slots = ids.numel()
    if tuple(order.shape) != (slots,) or tuple(rows.shape) != (slots, _HIDDEN):
        raise Hint(f"{where}: rows has shape {list(rows.shape)} and order {list(order.shape)}; "
                   f"expected [T·k, h] = {[slots, _HIDDEN]} and [T·k] = {[slots]}")
    return rows, order.long()


def _unpermute_hint(got: torch.Tensor, out: torch.Tensor, order: torch.Tensor,
                    weights: torch.Tensor, where: str) -> str:
    tokens, k = weights.shape

    def weighted(slots: torch.Tensor, w: torch.Tensor = weights) -> torch.Tensor:
        return (slots.view(tokens, k, -1) * w.unsqueeze(-1)).sum(1)

    in_slot_order = out[order.argsort()]
    named = {
        "rows are still in expert order: put row i back at its slot order[i] first (index_copy, "
        "or out[order.argsort()])": weighted(out),
        "out[order] applies the permutation a second time instead of undoing it: slot order[i] "
        "holds row i, so take out[order.argsort()] (or index_copy rows into their slots)":
            weighted(out[order]),
        "the k outputs of a token are added without the router's weights": weighted(
            in_slot_order, torch.ones_like(weights)),
        "the k outputs of a token are averaged: weigh each by its router weight instead":
            weighted(in_slot_order, torch.full_like(weights, 1 / k)),
        "row i was weighted by weights.flatten()[i], but row i is slot order[i]: its weight is "
        "weights.flatten()[order[i]]": weighted(
            (out * weights.flatten().unsqueeze(1))[order.argsort()], torch.ones_like(weights)),
    }
    for hint, candidate in named.items():
        if got.shape == candidate.shape and torch.allclose(got.detach(), candidate, atol=1e-5):
            return f"{where}: {hint}"
    if got.shape != (tokens, out.shape[1]):
        return f"{where}: unpermute returned shape {list(got.shape)}; expected [T, h]"
    return (f"{where}: token outputs off: y[t] is Σ_j weights[t, j] · (the row whose slot is "
            f"t·k + j)")


@exercise("19.2", "the dispatch's permutation and its inverse",
          reference=(ExpertDispatcher.dispatch, ExpertDispatcher.combine))
def check_permutation(answer) -> str:
    """answer = (permute, unpermute): permute(x [T, h], ids [T, k]) → (rows [T·k, h], order
    [T·k]); unpermute(out [T·k, h], order, weights [T, k]) → y [T, h]; against the package at
    ep = 1."""
    if not (isinstance(answer, tuple | list) and len(answer) == 2):
        raise Hint("check the pair of functions: check(\"19.2\", (permute, unpermute))")
    permute, unpermute = answer
    group = serial_group("ep")
    for tokens, k, experts in _CASES_19_2:
        where = f"T = {tokens}, k = {k}, E = {experts}"
        ids, weights = _routing(tokens, k, experts)
        route = Dispatch(ids, group, experts)
        rows, order = _permute(permute, ids, where)
        if not torch.equal(order, route.order):
            raise Hint(_order_hint(order, ids, where))
        x = _tokens(tokens)
        if not torch.equal(rows, x[order // k]):
            if torch.equal(rows, x.repeat(k, 1)[order]):
                raise Hint(f"{where}: x.repeat(k, 1) stacks k whole copies of x, so slot s gets "
                           f"token s mod T; slot s = t·k + j is token s // k: x[order // k] (or "
                           f"x.repeat_interleave(k, dim=0)[order])")
            raise Hint(f"{where}: the right order, but row i should be the token of slot order[i]"
                       f", x[order[i] // k]")
        dispatcher = ExpertDispatcher(experts, group)
        want = dispatcher(x, ids, weights, _per_expert)
        out = _per_expert(rows, route.per_expert).requires_grad_()
        mine_weights = weights.clone().requires_grad_()
        got = unpermute(out, order.clone(), mine_weights)
        if not isinstance(got, torch.Tensor):
            raise Hint(f"{where}: unpermute returns a tensor y [T, h], got {type(got).__name__}")
        if got.shape != want.shape or not torch.allclose(got.detach(), want, atol=1e-5):
            raise Hint(_unpermute_hint(got, out.detach(), order, weights, where))
        if not got.requires_grad:
            raise Hint(f"{where}: y carries no gradient to the expert outputs and the weights "
                       f"(detached, or written into a tensor under no_grad): both need it")
        got.sum().backward()
        if mine_weights.grad is None or out.grad is None:
            raise Hint(f"{where}: no gradient reached the "
                       f"{'weights' if mine_weights.grad is None else 'expert outputs'}")
    return ("the T·k slots sorted by expert with a stable sort (the same order on every run), "
            "each slot's token row x[order // k]; each output put back at its slot and weighed "
            "by its token's router weight — what megatron_edu's Dispatch and ExpertDispatcher do "
            "around the all-to-alls, with ties and an expert no token chose")


# --- 19.3 ★★ the expert-gradient reduction --------------------------------------------------------

_LAYOUTS_19_3 = (Layout(dp=4, ep=2), Layout(dp=4, ep=4), Layout(tp=2, dp=4, ep=2),
                 Layout(dp=2, cp=2, ep=4), Layout(dp=2, cp=2, ep=2), Layout(dp=4),
                 Layout(tp=2, pp=2, dp=4, ep=2))


def edp_reduction(layout: Layout, rank: int) -> tuple[list[int], int]:
    """The ranks over which rank's expert gradients are summed (its edp group), and the divisor:
    the dense data-parallel size dp·cp."""
    group = next(g for g in layout.edp_groups() if rank in g)
    return sorted(group), layout.dp * layout.cp


def _answer(got, where: str) -> tuple[list[int], int]:
    try:
        ranks, divisor = got
        ranks = sorted(int(r) for r in ranks)
        if isinstance(divisor, bool) or int(divisor) != divisor:
            raise ValueError
        return ranks, int(divisor)
    except (TypeError, ValueError):
        raise Hint(f"{where}: return (ranks, divisor): a list of global ranks and an int, got "
                   f"{got!r}") from None


@exercise("19.3", "the expert-gradient reduction: which ranks, divided by what",
          reference=(Layout.edp_groups,))
def check_edp_reduction(fn: Callable) -> str:
    """fn(layout, rank) → (ranks, divisor), against Layout.edp_groups and dp·cp."""
    for layout in _LAYOUTS_19_3:
        for rank in range(layout.world_size):
            where = (f"at tp = {layout.tp}, pp = {layout.pp}, dp = {layout.dp}, cp = {layout.cp}, "
                     f"ep = {layout.ep}, rank {rank}")
            ranks, divisor = _answer(fn(layout, rank), where)
            want, dense = edp_reduction(layout, rank)
            if ranks != want:
                ep_group = next(g for g in layout.ep_groups() if rank in g)
                dp_group = next(g for g in layout.dp_cp_groups() if rank in g)
                _, _, d = layout.coords(rank)
                flat = Layout(dp=layout.dp, cp=layout.cp, ep=layout.ep)
                if ranks == edp_reduction(flat, d * layout.cp + layout.cp_rank(rank))[0]:
                    raise Hint(f"{where}: {ranks} numbers the holders within the dp × cp ranks "
                               f"(0 … dp·cp − 1); the group needs global ranks, with the tp "
                               f"(and pp) ranks in between: {want}")
                if ranks == sorted(ep_group) and layout.ep > 1:
                    raise Hint(f"{where}: {ranks} is the ep group, the ranks that split the "
                               f"experts among them: each holds other experts. An expert's "
                               f"gradient is summed over the ranks holding the same experts, "
                               f"{want} here (the edp group)")
                if ranks == sorted(dp_group) and layout.ep > 1:
                    raise Hint(f"{where}: {ranks} is the whole data-parallel group, but only "
                               f"{want} hold rank {rank}'s experts; the others hold other "
                               f"experts, and adding their gradients mixes experts")
                if rank not in ranks:
                    raise Hint(f"{where}: the group leaves out rank {rank} itself; its own "
                               f"gradient is one of those summed ({want})")
                raise Hint(f"{where}: rank {rank}'s experts are held by global ranks {want} (the "
                           f"same position in each ep group of its dp × cp ranks); you said "
                           f"{ranks}")
            if divisor != dense:
                if divisor == len(want) and layout.ep > 1:
                    raise Hint(f"{where}: dividing by the {len(want)} ranks summed makes the "
                               f"gradient ep = {layout.ep} times too large (pytorch#160285): "
                               f"between them those ranks saw every one of the batch's dp·cp = "
                               f"{dense} shares, each share's tokens carried to them by the "
                               f"all-to-all; divide by dp·cp, as the dense weights are")
                if divisor == layout.dp and layout.cp > 1:
                    raise Hint(f"{where}: divided by dp = {layout.dp}, but cp splits each "
                               f"sequence too: the batch is cut into dp·cp = {dense} shares")
                raise Hint(f"{where}: the divisor is the number of shares the batch was cut "
                           f"into, dp·cp = {dense} (as for a dense weight); you said {divisor}")
    return ("an expert's gradient is summed over the dp·cp/ep ranks that hold the same experts "
            "(Layout.edp_groups: the same place in each ep group) and divided by the dense dp·cp "
            "— not by the edp group's size, which is ep× too large (pytorch#160285) — at seven "
            "layouts with tp, pp and cp, ep 1 to 4")
