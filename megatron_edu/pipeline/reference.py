"""1F1B you can read as a loop: 2104.04473's Figure 4 (top) in code, as Megatron-LM runs it.

``pipeline_step`` is Megatron-LM's ``forward_backward_pipelining_without_interleaving``
(§2.2.1), its paired operations under their names:

* warm-up, min(p − r − 1, m) times: ``recv_forward``, forward, ``send_forward``;
* steady, the other m − warm-up: forward, ``send_forward_recv_backward``, the oldest
  microbatch's backward, ``send_backward_recv_forward`` (after the last: ``send_backward``);
* cool-down, warm-up times: ``recv_backward``, backward, ``send_backward``.

GPipe (Figure 3) is the same loop with a warm-up of m. Rank r holds at most p − r microbatches'
activations (GPipe: all m). No deadlock, on gloo or NCCL: each call is one waited
``batch_isend_irecv`` with one neighbour (nothing stays posted, as NCCL requires), and along each
link the calls match one to one, in order: r's ``send_forward``, ``send_forward_recv_backward``,
``recv_backward`` meet r + 1's ``recv_forward``, ``send_backward_recv_forward``,
``send_backward`` (r + 1 warms up once less). ``engine.py`` runs any schedule given as data.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model.gpt import IGNORE_INDEX

__all__ = ["pipeline_step"]

ACT, GRAD = "pp activation", "pp gradient"  # the messages' labels in comm.record(), as the engine's


def pipeline_step(stage: nn.Module, grid: ParallelGrid, input_ids: torch.Tensor,
                  labels: torch.Tensor, num_microbatches: int, hidden: int, *,
                  schedule: str = "1f1b") -> torch.Tensor:
    """One forward-backward of the batch [b, s], cut into ``num_microbatches``, over this rank's
    GPT ``stage`` ("1f1b" or "gpipe"); gradients accumulate in its parameters. Returns the
    batch's token-mean loss (labels ≠ −100), a float32 scalar, on every pipeline rank."""
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
    p, r, m = grid.pp, grid.pp_rank, num_microbatches
    if input_ids.shape[0] % m:
        raise ValueError(f"{input_ids.shape[0]} sequences do not split into {m} microbatches")
    prev = grid.pp_group.ranks[r - 1] if r > 0 else None     # no wrap-around: a line of stages
    nxt = grid.pp_group.ranks[r + 1] if r < p - 1 else None
    ids, targets = input_ids.chunk(m), labels.chunk(m)
    num_tokens = int((labels != IGNORE_INDEX).sum())         # the loss is the batch's token mean
    shape = (input_ids.shape[0] // m, input_ids.shape[1], hidden)
    dtype = next(stage.parameters()).dtype                   # activations: the parameters' dtype
    losses: list[torch.Tensor] = []

    def p2p(peer: int | None, send: tuple[torch.Tensor, str] | None = None,
            recv: str | None = None) -> torch.Tensor | None:
        """One batch with ``peer``, waited on: send (tensor, label), receive one labelled tensor."""
        if peer is None:
            return None                                      # first or last stage: nobody there
        buffer = torch.empty(shape, dtype=dtype, device=grid.device) if recv else None
        ops = [comm.P2POp("send", send[0].detach().contiguous(), peer, send[1])] if send else []
        ops += [comm.P2POp("recv", buffer, peer, recv)] if recv else []
        for work in comm.batch_isend_irecv(ops, grid.pp_group):
            work.wait()                                      # nothing stays posted
        return buffer

    # Megatron-LM's p2p_communication, by name: one waited batch each (or nothing at an end)
    def recv_forward() -> torch.Tensor | None:
        return p2p(prev, recv=ACT)
    def send_forward(y: torch.Tensor) -> None:
        p2p(nxt, send=(y, ACT))
    def send_forward_recv_backward(y: torch.Tensor) -> torch.Tensor | None:
        return p2p(nxt, send=(y, ACT), recv=GRAD)
    def send_backward_recv_forward(dx: torch.Tensor | None) -> torch.Tensor | None:
        return p2p(prev, send=(dx, GRAD), recv=ACT)
    def recv_backward() -> torch.Tensor | None:
        return p2p(nxt, recv=GRAD)
    def send_backward(dx: torch.Tensor | None) -> None:
        p2p(prev, send=(dx, GRAD))

    def forward(i: int, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = ids[i] if prev is None else x.requires_grad_()   # stage 0 reads token ids
        if nxt is None:                                      # last stage: its share of the loss
            y = stage(x, targets[i], loss_reduction="sum") / num_tokens
            losses.append(y.detach())
            return x, y
        return x, stage(x)

    def backward(x: torch.Tensor, y: torch.Tensor, dy: torch.Tensor | None) -> torch.Tensor | None:
        torch.autograd.backward(y, dy)                       # from the loss, or the next's dy
        return None if prev is None else x.grad

    warmup = m if schedule == "gpipe" else min(p - r - 1, m)  # Megatron's num_warmup_microbatches
    steady = m - warmup
    in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, y): forward done, not backward
    for i in range(warmup):                                  # warm-up: forward passes only
        x, y = forward(i, recv_forward())
        send_forward(y)
        in_flight.append((x, y))                             # at most p − r of them (§2.2.1)
    x_next = recv_forward() if steady else None
    for i in range(steady):                                  # steady state: 1F, then 1B
        x, y = forward(warmup + i, x_next)
        dy = send_forward_recv_backward(y)
        in_flight.append((x, y))
        dx = backward(*in_flight.pop(0), dy)                 # the oldest microbatch in flight
        if i == steady - 1:
            send_backward(dx)
        else:
            x_next = send_backward_recv_forward(dx)
    for _ in range(warmup):                                  # cool-down: backward passes only
        send_backward(backward(*in_flight.pop(0), recv_backward()))
    loss = torch.stack(losses).sum().float() if losses else torch.zeros((), device=grid.device)
    return comm.all_reduce(loss, grid.pp_group, label="pp loss")
