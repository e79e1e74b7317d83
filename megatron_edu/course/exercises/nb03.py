"""Exercises of notebook 03: the vocabulary-parallel embedding and cross entropy (1909.08053 §3).

03.1 ★   the masked lookup: each rank looks up its own rows, zeros elsewhere, g sums them.
03.2 ★★  the loss's gradient, softmax − onehot on each rank's slice, with no communication.
03.3 ★★★ the fused loss: the global max, the sum-exp and the target logit — three exchanges of
         a few numbers per token, never the logits.

Each checker runs the learner's function on tensor-parallel ranks against the serial truth
(``F.embedding``, ``F.cross_entropy`` on the whole vocabulary) and counts, with
``comm.record()``, what it communicated.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_edu import comm
from megatron_edu.course.exercises.checking import Hint, close, exercise, on_ranks
from megatron_edu.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy
from megatron_edu.tensor_parallel.layers import VocabParallelEmbedding

TIMEOUT = 20.0  # s: a backstop; a collective some rank never reaches is a detected deadlock

# --- the data every rank sees -------------------------------------------------------------------

VOCAB, HIDDEN = 16, 3
IDS = torch.tensor([[3, 9, 14, 6], [0, 15, 7, 8]])  # [b, s]: ids in every rank's range


def _table() -> torch.Tensor:
    """The whole embedding table [V, h], the same on every rank and in the parent."""
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))


def _upstream(shape) -> torch.Tensor:
    """The gradient arriving from the layers above, the same on every tp rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(4))


def _logits() -> torch.Tensor:
    """Six tokens' logits over the whole vocabulary [6, V]; token 0's exceed 100 (exp overflows
    float32 above 88, so only a loss that subtracts the maximum survives them)."""
    logits = 3 * torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[0] += 100.0
    return logits


TARGETS = torch.tensor([13, 2, 7, 5, 15, 8])  # owned by ranks 3, 0, 1, 1, 3, 2 at t = 4


def _tp_group() -> comm.CommGroup:
    """Every launched rank in one tensor-parallel group (the default process group: no new
    group to connect, which is quicker and sturdier on a busy machine than a ParallelGrid)."""
    return comm.CommGroup("tp", tuple(range(dist.get_world_size())), dist.group.WORLD)


def _rank_slice(full: torch.Tensor, rank: int, t: int) -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s contiguous slice of the last (vocabulary) dimension, and its first id."""
    rows = full.shape[-1] // t
    return full[..., rank * rows:(rank + 1) * rows], rank * rows


def _events(log: comm.CommLog) -> list[tuple[str, int, str]]:
    return [(e.op, e.bytes, e.label) for e in log.events]


def _tensor_or_type(x):
    return x.detach() if isinstance(x, torch.Tensor) else type(x).__name__


def _calls(events: list[tuple[str, int, str]]) -> str:
    return ", ".join(f"{op} of {nbytes:,} bytes" for op, nbytes, _ in events)


def _same_shape(got, expected: torch.Tensor, what: str) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        close(got, expected, what)  # says what is wrong with the type or the shape


def _with_advice(hint: Hint, advice: dict[str, str]) -> Hint:
    """A rank's exception, in words, followed by the fix for the mistakes it usually means."""
    for symptom, fix in advice.items():
        if symptom in str(hint):
            return Hint(f"{hint} — {fix}")
    return hint


# What a rank's exception usually means here, and the fix.
ADVICE = {
    "out of range": "an index outside this rank's rows: subtract vocab_start, and only for the "
                    "ids (or targets) this rank holds",
    "out of bounds": "an index outside this rank's slice: subtract vocab_start, and only for the "
                     "targets this rank holds",
    "autograd kernel": "autograd cannot go through comm.all_reduce: use comm.g, an all-reduce "
                       "forward and the identity backward",
}


# --- 03.1 ★ the masked lookup -------------------------------------------------------------------

def _run_lookup(fn):
    group = _tp_group()
    rows = VOCAB // group.size
    start = group.rank * rows
    weight = _table()[start:start + rows].clone().requires_grad_()
    with comm.record() as forward:
        out = fn(IDS.clone(), weight, start, group)
    backward_events = []
    if isinstance(out, torch.Tensor) and out.requires_grad and out.shape == (*IDS.shape, HIDDEN):
        with comm.record() as backward, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "c10d::allreduce_: an autograd kernel")  # see 03.3
            out.backward(_upstream(out.shape))
        backward_events = _events(backward)
    grad = None if weight.grad is None else weight.grad.clone()
    return _tensor_or_type(out), grad, _events(forward), backward_events


@exercise("03.1", "the masked lookup of the vocabulary-parallel embedding",
          reference=(VocabParallelEmbedding.forward,),
          marks=(r"\(ids-[\w.]*vocab_start\)\.masked_fill\(",         # a safe row for foreign ids
                 r"\.masked_fill\(\w+\.unsqueeze\(-1\),0(\.0?)?\)"))  # ...then zeros
def _masked_lookup(fn) -> str:
    t = 2
    try:
        results = on_ranks(t, _run_lookup, fn, timeout=TIMEOUT, may_deadlock=True)
    except Hint as hint:
        raise _with_advice(hint, ADVICE) from None
    table = _table().requires_grad_()
    expected = F.embedding(IDS, table)
    expected.backward(_upstream(expected.shape))
    rows = VOCAB // t
    for rank, (out, grad, forward, backward) in enumerate(results):
        start, end = rank * rows, (rank + 1) * rows
        ours = (IDS >= start) & (IDS < end)
        if isinstance(out, torch.Tensor) and out.shape == expected.shape:
            if torch.allclose(out, expected.detach() * ours.unsqueeze(-1), atol=1e-6):
                foreign = sorted(set(IDS[~ours].tolist()))
                raise Hint(f"rank {rank} returns only its own partial lookup, with zeros for ids "
                           f"{foreign} that other ranks hold: sum the partial lookups over the "
                           "group with comm.g (an all-reduce forward, the identity backward)")
            row0 = sum(table[r * rows] * (~((IDS >= r * rows) & (IDS < (r + 1) * rows)))
                       .unsqueeze(-1) for r in range(t))
            if torch.allclose(out, (expected + row0).detach(), atol=1e-5):
                raise Hint(f"ids outside a rank's range add that rank's row 0 (e.g. id "
                           f"{IDS[0, 1].item()} on rank 0): an id a rank does not hold must "
                           "contribute zeros — zero the looked-up rows where the id is outside "
                           "[vocab_start, vocab_start + rows) (masked_fill), after looking up a "
                           "safe row")
        close(out, expected, f"rank {rank}'s embedding")
        gathered = [e for e in forward if e[0] == "all_gather"]
        if gathered:
            raise Hint(f"the values are right, but rank {rank} all-gathered {gathered[0][1]:,} "
                       "bytes: gathering the table puts all V rows on every rank, which is what "
                       "the split avoids. Look up your own rows and sum the [b, s, h] partial "
                       "lookups with one all-reduce (comm.g)")
        if [op for op, _, _ in forward] != ["all_reduce"]:
            raise Hint(f"rank {rank} communicated {_calls(forward) or 'nothing'} in the forward "
                       "pass; the paper's lookup needs exactly one all-reduce of the [b, s, h] "
                       "partial lookups (comm.g)")
        if grad is None:
            raise Hint(f"no gradient reached rank {rank}'s weight: keep the lookup differentiable "
                       "(F.embedding on the weight, then comm.g — not a detached copy)")
        close(grad, table.grad[start:end], f"rank {rank}'s weight gradient")
        if backward:
            raise Hint(f"rank {rank}'s backward pass communicated ({_calls(backward)}): each "
                       "rank's rows get their gradient from the replicated upstream gradient "
                       "alone — g's backward is the identity")
    nbytes = results[0][2][0][1]
    return (f"every rank holds the whole lookup {tuple(expected.shape)} after one all-reduce of "
            f"b·s·h numbers ({nbytes} bytes), nothing in the backward pass; each rank's weight "
            "gradient is the serial one on its own rows")


# --- 03.2 ★★ the gradient, without communicating ----------------------------------------------

def _run_gradient(fn):
    group = _tp_group()
    softmax, start = _rank_slice(torch.softmax(_logits(), dim=-1), group.rank, group.size)
    with comm.record() as log:
        grad = fn(softmax.clone(), TARGETS.clone(), start, group)
    return _tensor_or_type(grad), _events(log)


@exercise("03.2", "the loss's gradient on each rank's slice, without communication",
          reference=(_VocabParallelCrossEntropy.backward,),
          marks=(r"softmax-(F\.)?one_hot\(",      # softmax − onehot, as code
                 r"\]-=1(\.0)?(?![0-9])"))         # Megatron's grad[arange, target] -= 1
def _loss_gradient(fn) -> str:
    t = 2
    try:
        results = on_ranks(t, _run_gradient, fn, timeout=TIMEOUT, may_deadlock=True)
    except Hint as hint:
        raise _with_advice(hint, ADVICE) from None
    softmax = torch.softmax(_logits(), dim=-1)
    onehot = F.one_hot(TARGETS, VOCAB).float()
    rows = VOCAB // t
    for rank, (grad, events) in enumerate(results):
        expected, start = _rank_slice(softmax - onehot, rank, t)
        if events:
            raise Hint(f"rank {rank} communicated ({_calls(events)}): the backward pass needs "
                       "none — softmax was saved by the forward pass with the global max and "
                       "sum-exp already in it, and each rank's gradient is its own slice")
        if isinstance(grad, torch.Tensor) and grad.shape == expected.shape:
            local_softmax, _ = _rank_slice(softmax, rank, t)
            local_onehot, _ = _rank_slice(onehot, rank, t)
            everywhere = F.one_hot(TARGETS % rows, rows).float()
            variants = {
                "missing": (local_softmax, "the −1 at each target is missing: the gradient of "
                            "the loss is softmax − onehot(target)"),
                "sign": (local_onehot - local_softmax, "the sign is flipped: the gradient is "
                         "softmax − onehot(target), not onehot − softmax"),
                "every rank": (local_softmax - everywhere, "subtracted 1 on every rank at "
                               "target mod V/t: only the rank that holds the target "
                               "(vocab_start ≤ target < vocab_start + V/t) subtracts it"),
            }
            for wrong, advice in variants.values():
                if not torch.allclose(expected, wrong) and torch.allclose(grad, wrong, atol=1e-6):
                    raise Hint(f"rank {rank}: {advice}")
        close(grad, expected, f"rank {rank}'s gradient (its vocabulary ids {start}-"
                              f"{start + rows - 1})")
    return ("each rank's slice of softmax − onehot(target), equal to the serial gradient, the −1 "
            "only on the rank holding the target, and no communication at all")


# --- 03.3 ★★★ the fused loss ------------------------------------------------------------------

def _run_loss(fn):
    group = _tp_group()
    logits, _ = _rank_slice(_logits(), group.rank, group.size)
    logits = logits.clone().requires_grad_()
    with comm.record() as forward:
        loss = fn(logits, TARGETS.clone(), group)
    backward_events = []
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.shape == TARGETS.shape:
        with comm.record() as backward, warnings.catch_warnings():
            # comm.all_reduce instead of comm.g: autograd passes the gradient through as the
            # identity (what g does) and warns; the checker compares the gradients anyway
            warnings.filterwarnings("ignore", "c10d::allreduce_: an autograd kernel")
            loss.sum().backward()
        backward_events = _events(backward)
    grad = None if logits.grad is None else logits.grad.clone()
    return _tensor_or_type(loss), grad, _events(forward), backward_events


def _wrong_losses(t: int) -> dict[str, tuple[torch.Tensor, str]]:
    """The per-token losses of the usual mistakes, and what to say about each."""
    logits, rows = _logits(), VOCAB // t
    slices = logits.split(rows, dim=-1)
    m = logits.max(dim=-1).values
    target = logits.gather(-1, TARGETS[:, None]).squeeze(-1)
    sum_exp = (logits - m[:, None]).exp().sum(-1)
    local_m = [s.max(dim=-1).values for s in slices]
    mixed = sum((s - lm[:, None]).exp().sum(-1) for s, lm in zip(slices, local_m, strict=True))
    owner_m = torch.stack(local_m)[TARGETS // rows, torch.arange(len(TARGETS))]
    everyone = sum(s.gather(-1, (TARGETS % rows)[:, None]).squeeze(-1) - m for s in slices)
    return {
        "local max": (mixed.log() - (target - owner_m),
                      "each rank subtracted its own maximum: the partial sums Σ exp(z − m) "
                      "that the all-reduce adds must share one m. Take the maximum over the "
                      "group first: all-gather the local maxima (comm.all_gather), then max"),
        "every rank": (sum_exp.log() - everyone,
                       "the target logit came from every rank (at target mod V/t): only the rank "
                       "that holds the target (vocab_start ≤ target < vocab_start + V/t) "
                       "contributes z_y − m, the others 0, before the all-reduce"),
    }


@exercise("03.3", "the vocabulary-parallel cross entropy: three exchanges, not the logits",
          reference=(_VocabParallelCrossEntropy.forward,),
          marks=(r"all_gather\(\w*max",           # the global maximum from the local ones
                 r"sum_exp\.log\(\)-"))           # log Σ exp(z − m) − (z_y − m), as code
def _parallel_loss(fn) -> str:
    t = 4
    try:
        results = on_ranks(t, _run_loss, fn, timeout=TIMEOUT, may_deadlock=True)
    except Hint as hint:
        raise _with_advice(hint, ADVICE) from None
    whole = _logits().requires_grad_()
    expected = F.cross_entropy(whole, TARGETS, reduction="none")
    expected.sum().backward()
    for rank, (loss, _, _, _) in enumerate(results):
        _same_shape(loss, expected, f"rank {rank}'s loss")
        if not torch.isfinite(loss).all():
            token = int((~torch.isfinite(loss)).nonzero()[0])
            raise Hint(f"rank {rank}'s loss is {loss[token].item()} on token {token}, whose "
                       f"largest logit is {_logits()[token].max().item():.0f}: exp overflows "
                       "float32 above 88 — subtract the global maximum m before exp "
                       "(loss = log Σ exp(z − m) − (z_y − m))")
    losses = torch.stack([loss for loss, *_ in results])
    if not torch.allclose(losses, losses[0].expand_as(losses), atol=1e-5):
        gap = (losses - losses[0]).abs()
        far, token = divmod(int(gap.argmax()), gap.shape[1])
        raise Hint(f"the ranks return different losses (token {token}: {losses[0, token]:.4f} on "
                   f"rank 0, {losses[far, token]:.4f} on rank {far}): every rank must end with "
                   "the same value — are the sum-exp and the target logit both all-reduced (the "
                   "target logit as 0 on the ranks that do not hold it)?")
    for wrong, advice in _wrong_losses(t).values():
        if torch.allclose(losses[0], wrong, atol=1e-4):
            raise Hint(advice)
    close(losses[0], expected, "the loss")
    for rank, (_, grad, forward, backward) in enumerate(results):
        if grad is None:
            raise Hint(f"no gradient reached rank {rank}'s logits: keep the loss differentiable "
                       "in the local logits (the collectives of comm pass gradients through as "
                       "the identity)")
        close(grad, _rank_slice(whole.grad, rank, t)[0],
              f"rank {rank}'s gradient of the summed loss (if the loss is right, is the maximum "
              "m a constant for autograd? Its terms cancel only across ranks)")
        if any(label.startswith("ce ") for _, _, label in forward):
            raise Hint("that is the package's own vocab_parallel_cross_entropy (its collectives "
                       "are labelled 'ce …'): write the three exchanges yourself")
        logits_bytes = whole.numel() * 4
        if any(nbytes >= logits_bytes for _, nbytes, _ in forward):
            op, nbytes, _ = max(forward, key=lambda e: e[1])
            raise Hint(f"the values are right, but rank {rank} made an {op} of {nbytes:,} bytes: "
                       f"that is the whole logits [{whole.shape[0]}, V] — the largest tensor of "
                       "a GPT. The fused loss exchanges three numbers per token (the max, the "
                       "sum-exp and the target logit), never the logits")
        if not forward:
            raise Hint("the values are right, but no collective went through comm: call "
                       "comm.all_gather / comm.all_reduce (not torch.distributed directly) so "
                       "that they can be counted")
        if len(forward) != 3:
            raise Hint(f"rank {rank} made {len(forward)} collectives ({_calls(forward)}); the "
                       "paper's fused loss needs three: the max (comm offers sums only: "
                       "all-gather the local maxima), the sum-exp and the target logit "
                       "(all-reduces)")
        if backward:
            raise Hint(f"rank {rank}'s backward pass communicated ({_calls(backward)}): the "
                       "gradient softmax − onehot is local to each rank's slice")
    sizes = sorted({nbytes for _, nbytes, _ in results[0][2]})
    return (f"every rank's loss and gradient equal F.cross_entropy on the whole logits, overflow "
            f"included; 3 exchanges of {' and '.join(map(str, sizes))} bytes instead of "
            f"{whole.numel() * 4} for the logits, and nothing in the backward pass")
