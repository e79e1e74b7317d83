"""Expert parallelism: the experts of each MoE layer split over ep ranks, each token carried to its
k experts and back by two all-to-alls (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021;
megatron-core's ``MoEAlltoAllTokenDispatcher``).

One dispatch, on the ranks of ``grid.ep_group`` (ep consecutive data-parallel ranks: they hold
the same dense weights and different tokens):

1. **permute**: the T·k slots (token t's j-th choice is slot t·k + j) sorted by expert, a stable
   sort: expert 0's slots first, each expert's in slot order;
2. **exchange the counts**: each rank tells every other how many of its rows go to each of the
   other's experts (an all-to-all of E integers), so that every rank knows what it will receive;
3. **dispatch**: one ``all_to_all_single`` with uneven splits, rank r's rows for experts
   [r·E/ep, (r+1)·E/ep) going to rank r;
4. **compute**: the rows arrive grouped by source rank; sorted by local expert they make one
   grouped GEMM (``model.moe.Experts``);
5. **return**: the inverse permutation, the all-to-all back, and un-permute: each token's k
   outputs are weighted by its router weights at its home rank and summed in slot order.

At ep = 1 both all-to-alls are the identity (``comm.all_to_all`` on a group of one): the serial
layer is this code with nothing sent. Each all-to-all's backward is the other direction
(``comm.all_to_all_rows``), so an expert's gradient arrives at the rank that holds it.

**The gradients of the experts.** A rank's expert gradient is the sum over the tokens of its ep
group that chose the expert; the other ep groups hold the other tokens. So expert gradients are
summed over the expert-data-parallel group (``grid.edp_group``, dp·cp/ep ranks) and divided by the
*dense* data-parallel size dp·cp, the count of all the batch's shares: not by the edp group's size,
which makes them ep× too large (the most-reported EP bug: pytorch#160285). PTD-P's loss is each
replica's share of the global token mean, so its sum over edp is already right; ``DataParallel``
averaging divides by its dense group's size for every bucket.

**Safe on NCCL, by construction.** The counts are read to the host before the dispatch (NCCL's
all-to-all takes host split sizes; megatron-core syncs here too), every rank of the ep group
issues the same two all-to-alls per layer in the same order (a rank that receives nothing still
calls them, with zero rows), and each is complete when ``all_to_all_single`` returns on the
current stream, before its output is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_edu import comm
from megatron_edu.comm import CommGroup

__all__ = ["Dispatch", "ExpertDispatcher", "dispatch_bytes", "gather_experts", "own_experts"]


class Dispatch:
    """One microbatch's routing, as the dispatcher moved it: ``order`` (the ``kept`` slots sorted
    by expert: a dropped slot's id is E, sorted last),
    the rows this rank sent to each ep rank (``send``) and received from each (``receive``),
    ``received`` [ep, E/ep] (rows from each source rank for each local expert) and ``by_expert``
    (received rows sorted by local expert)."""

    def __init__(self, ids: torch.Tensor, group: CommGroup, num_experts: int,
                 kept: int | None = None) -> None:
        ep, self.k, self.slots = group.size, ids.shape[1], ids.numel()
        flat = ids.flatten()                                         # E: dropped (capacity)
        self.order = flat.argsort(stable=True)[:kept]                # kept slots by expert
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        counts = counts.view(ep, num_experts // ep)
        self.received = comm.all_to_all(counts, group, [1] * ep, [1] * ep, "expert counts")
        self.send, self.receive = counts.sum(1), self.received.sum(1)
        local = torch.arange(num_experts // ep, device=ids.device).repeat(ep)
        expert_of_row = local.repeat_interleave(self.received.flatten())
        self.by_expert = expert_of_row.argsort(stable=True)
        self.per_expert = self.received.sum(0)                       # rows of each local expert


class ExpertDispatcher:
    """Carry tokens to the experts of the ep ranks that own them and back (module docstring)."""

    def __init__(self, num_experts: int, group: CommGroup) -> None:
        self.num_experts, self.group = num_experts, group

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 kept: int | None = None) -> torch.Tensor:
        """x [T, h], each token's k experts ``ids`` [T, k] and ``weights`` [T, k] →
        Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]), [T, h]. ``experts(rows, per_expert)`` runs
        this rank's experts on rows grouped by local expert. ``kept``: the slots not dropped
        (id < E; None: all)."""
        route = Dispatch(ids, self.group, self.num_experts, kept)
        rows = self.dispatch(x, route)
        out = experts(rows, route.per_expert)
        slots = self.combine(out, route)                             # [T·k, h] in slot order
        weighted = slots.view(*weights.shape, -1) * weights.unsqueeze(-1).to(slots.dtype)
        return weighted.sum(1)                                       # the k slots, in order

    def dispatch(self, x: torch.Tensor, route: Dispatch) -> torch.Tensor:
        """Each slot's token row, sent to its expert's rank: [rows here, h] by local expert."""
        sent = x[route.order // route.k]                             # permute (1)
        rows = comm.all_to_all_rows(sent, self.group, route.send, route.receive, "dispatch")
        return rows[route.by_expert]                                 # (4)

    def combine(self, out: torch.Tensor, route: Dispatch) -> torch.Tensor:
        """The experts' rows back at their tokens' ranks, in slot order [T·k, h], zeros for
        dropped slots (5)."""
        by_source = out[route.by_expert.argsort()]
        back = comm.all_to_all_rows(by_source, self.group, route.receive, route.send, "combine")
        return back.new_zeros(route.slots, back.shape[1]).index_copy(0, route.order, back)


def dispatch_bytes(route: Dispatch, hidden: int, element_size: int) -> int:
    """The bytes this rank's two forward all-to-alls send (its own part included, as
    ``comm.all_to_all`` records): its dispatched rows, then the rows it returns. Backward sends
    the same again, the other way."""
    return (int(route.send.sum()) + int(route.receive.sum())) * hidden * element_size


def gather_experts(tensor: torch.Tensor, param: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """A stack of experts [E/ep, …] (``param.expert_ids``) whole over ep, [E, …]; other tensors as
    they are. A collective of the ep group."""
    if param.expert_ids is None:
        return tensor
    return comm.all_gather(tensor, group, dim=0, label="gather experts")


def own_experts(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a whole stack [E, …] (other tensors as they are)."""
    ids = param.expert_ids
    return full if ids is None else full[ids.start:ids.stop]
