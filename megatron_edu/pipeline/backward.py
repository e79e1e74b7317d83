"""A stage's backward pass: whole, or split into B (input gradient) and W (weight gradient).

2401.10241 §1, Figure 1: for a layer z = W·x the backward pass computes dL/dx = Wᵀ·dL/dz, which
the previous stage is waiting for (B), and dL/dW = dL/dz·xᵀ, which nobody needs before the
optimizer step (W). **Whole** (`backward`): autograd's engine, run directly since the output was
freed after its send (Megatron-LM's ``custom_backward``).

**Split** (`backward_input`, then `WeightPass.run`) cuts the stage's autograd graph in two, with
no knowledge of the model: the *trunk*, nodes that lead to the stage's input or to more than one
weight, and the *weight branches*, nodes that lead to one weight only (a linear's weight
transpose, a bias, a layer norm's scale). B runs autograd over the trunk only, so a matmul
computes Wᵀ·dL/dz and skips dL/dz·xᵀ; at every *fork*, a trunk node a branch leaves, a hook keeps
the arriving dL/dz. W restarts autograd at each fork for the branches and runs them down into
``.grad`` as a normal backward does (data-parallel hooks fire in W). Nothing is computed twice.

**Memory** (2401.10241 §2.3, Table 1): autograd frees a node's saved tensors only when it runs for
the last time, so the trunk's own (M_B − M_W) wait for W too: a microbatch holds its activations,
and the kept dL/dz, from F to W. A branch that two trunk nodes feed joins the
trunk (``_shared``). Limits: a custom function computing several gradients at once (sequence
parallelism's all-gather linear, non-reentrant checkpointing) runs whole in B and again in W:
correct, not split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.autograd.variable import Variable

__all__ = ["backward", "backward_input", "WeightPass"]

TRUNK = "trunk"  # what `_leads_to` says of a node that leads to the input or to several weights


def backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``torch.autograd.backward(out, grad)`` without its shape check, which an output freed after
    its send fails though its graph is intact (Megatron-LM's ``custom_backward``)."""
    if grad is None:
        out.backward()  # the loss: a scalar that was never freed
        return
    Variable._execution_engine.run_backward(
        tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


@dataclass
class WeightPass:
    """What B leaves for W: per fork, the gradient that arrived there (by input slot) and the
    edges of its weight branches; and gradients already at the top of a branch."""

    forks: list[tuple[Node, dict[int, torch.Tensor], list[GradientEdge]]] = field(
        default_factory=list)
    heads: dict[tuple[Node, int], torch.Tensor] = field(default_factory=dict)

    def run(self) -> None:
        """W: each fork's branch gradients (dL/dz·xᵀ), then every branch down to its weight,
        accumulated into ``.grad``. Frees what the microbatch kept for it."""
        heads = self.heads
        for fork, grads, branches in self.forks:
            slots = list(grads)
            computed = torch.autograd.grad([GradientEdge(fork, k) for k in slots],
                                           branches, [grads[k] for k in slots],
                                           allow_unused=True)
            for edge, g in zip(branches, computed, strict=True):
                if g is not None:
                    key = (edge.node, edge.output_nr)
                    heads[key] = heads[key] + g if key in heads else g
        if heads:
            torch.autograd.backward([GradientEdge(node, nr) for node, nr in heads],
                                    list(heads.values()))
        self.forks, self.heads = [], {}


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None
                   ) -> tuple[torch.Tensor | None, WeightPass]:
    """B: the gradient of the stage input ``x`` (None on the first stage), and what W needs;
    ``out`` is the stage's output (values may be freed) or its loss (``grad`` None). No ``.grad``
    is touched."""
    root = out.grad_fn
    grad = torch.ones_like(out) if grad is None else grad
    x_node = get_gradient_edge(x).node if x is not None and x.requires_grad else None
    leads = _leads_to(root, x_node)
    if leads[root] is not TRUNK:            # the whole pass is one weight's branch
        return None, WeightPass(heads={(root, out.output_nr): grad})
    trunk = [n for n, lead in leads.items() if lead is TRUNK and n is not x_node]
    branches = {n: [GradientEdge(c, i) for c, i in n.next_functions
                    if c is not None and leads[c] not in (TRUNK, None)] for n in trunk}
    kept: dict[Node, dict[int, torch.Tensor]] = {n: {} for n in trunk if branches[n]}
    bottoms = {n for n in trunk
               if not any(c is not None and leads[c] is TRUNK for c, _ in n.next_functions)}
    if root in bottoms:                     # a trunk of one node: nothing for B to walk
        kept[root][out.output_nr] = grad
        return None, _weight_pass(kept, branches)
    slots = sorted({(c, i) for n in trunk for c, i in n.next_functions if c in bottoms},
                   key=lambda slot: (slot[0]._sequence_nr(), slot[1]))
    inputs = ([get_gradient_edge(x)] if x_node is not None else []) \
        + [GradientEdge(c, i) for c, i in slots]
    hooks = [n.register_prehook(_keep(kept[n])) for n in kept if n not in bottoms]
    try:
        computed = Variable._execution_engine.run_backward(
            tensors=(out,), grad_tensors=(grad,), keep_graph=True, create_graph=False,
            inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=False)
    finally:
        for hook in hooks:
            hook.remove()
    heads = {}
    for (node, slot), g in zip(slots, computed[len(inputs) - len(slots):], strict=True):
        if g is None:
            continue
        if node in kept:                    # the gradient at the bottom of the trunk, a fork's
            kept[node][slot] = g
        else:                               # a weight two trunk nodes feed (``_shared``)
            heads[node, slot] = g
    return (computed[0] if x_node is not None else None), _weight_pass(kept, branches, heads)


def _weight_pass(kept, branches, heads=None) -> WeightPass:
    return WeightPass([(n, grads, branches[n]) for n, grads in kept.items() if grads],
                      heads or {})


def _keep(store: dict[int, torch.Tensor]):
    """A pre-hook that keeps the gradients arriving at a fork, by input slot."""
    def hook(grad_outputs):
        store.update({k: g for k, g in enumerate(grad_outputs) if g is not None})
    return hook


def _leads_to(root: Node, x_node: Node | None) -> dict[Node, object]:
    """For every node reachable from ``root``: TRUNK if its paths lead to the stage input or to
    more than one weight, or to a branch two trunk nodes feed (``_shared``); the weight's
    AccumulateGrad node if they all lead to that one weight; None if they lead to nothing that
    wants a gradient."""
    pinned: set[Node] = set()
    leads = _walk(root, x_node, pinned)
    while shared := _shared(leads):
        pinned |= shared
        leads = _walk(root, x_node, pinned)
    return leads


def _walk(root: Node, x_node: Node | None, pinned: set[Node]) -> dict[Node, object]:
    """``_leads_to``'s classification with the ``pinned`` nodes trunk (post-order, no recursion)."""
    leads: dict[Node, object] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if node in leads:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not children_done and node is not x_node:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in leads)
            continue
        if node is x_node or node in pinned:
            leads[node] = TRUNK
        elif not children:     # a leaf: the AccumulateGrad node of a weight
            leads[node] = node if hasattr(node, "variable") else None
        else:
            below = {leads[c] for c in children} - {None}
            leads[node] = TRUNK if TRUNK in below or len(below) > 1 else next(iter(below), None)
    return leads


def _shared(leads: dict[Node, object]) -> set[Node]:
    """Branch nodes that more than one trunk node feeds (the embedding's output, read by the
    residual add and by the first layer norm when nothing is added to it: rotary positions). W
    would reach one from each fork through the trunk too, so they join the trunk: B sums their
    gradient, and W starts from them."""
    fed: dict[Node, set[Node]] = {}
    for fork in [n for n, lead in leads.items() if lead is TRUNK]:
        stack = [c for c, _ in fork.next_functions
                 if c is not None and leads[c] not in (TRUNK, None)]
        while stack:
            node = stack.pop()
            if fork not in fed.setdefault(node, set()):
                fed[node].add(fork)
                stack.extend(c for c, _ in node.next_functions
                             if c is not None and leads[c] not in (TRUNK, None))
    return {node for node, forks in fed.items() if len(forks) > 1}
