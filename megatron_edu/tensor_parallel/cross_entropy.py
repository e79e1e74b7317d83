"""Cross entropy over vocabulary-parallel logits, without ever gathering them (1909.08053 §3).

The output layer leaves each of t ranks with the logits of its own vocabulary slice,
[b, s, V/t]. Gathering them would move b·s·V numbers (V = 51,200: the largest tensor of the
model). Instead, for each token, the ranks exchange three numbers (§3, last paragraph: "we fuse
the output of the parallel GEMM with the cross entropy loss"):

    m      = max over all V logits                  (stability: exp never overflows)
    Z      = Σ_v exp(z_v − m)                        all-reduce of each rank's partial sum
    z_y    = the target's logit, found on one rank   all-reduce of (z_y − m on that rank, else 0)
    loss   = log Z − (z_y − m)

and the gradient is local: ∂loss/∂z_v = softmax_v − [v = y], computed from the saved
exp(z − m)/Z on each rank's own slice, with no communication in the backward pass.

Megatron all-reduces m with a MAX reduction; ``comm`` offers sums only, so here each rank's local
maximum is all-gathered (t numbers per token) and the maximum taken locally — the same value.

Padded vocabulary entries (ids ≥ ``vocab_size``, added so the vocabulary divides evenly) are set to
−inf before anything else: they never win the maximum, add nothing to Z, and get zero gradient.
Targets equal to ``ignore_index`` (−100, as in ``F.cross_entropy``) give zero loss and gradient.
"""

from __future__ import annotations

import torch

from megatron_edu import comm
from megatron_edu.comm import CommGroup

__all__ = ["vocab_parallel_cross_entropy", "mask_padded_vocab", "vocab_range"]


def vocab_range(local_vocab: int, group: CommGroup) -> tuple[int, int]:
    """[start, end) of the global vocabulary ids whose logits this rank holds."""
    return group.rank * local_vocab, (group.rank + 1) * local_vocab


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, group: CommGroup) -> torch.Tensor:
    """Set the logits of padded vocabulary entries (global id ≥ vocab_size) to −inf."""
    start, end = vocab_range(logits.shape[-1], group)
    if end <= vocab_size:
        return logits
    padded = torch.arange(start, end, device=logits.device) >= vocab_size  # [V/t]
    return logits.masked_fill(padded, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from logits [.., V/t] split over the group; targets [..] global ids."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        start, end = vocab_range(logits.shape[-1], group)
        # m: the global maximum per token (gathered local maxima, see the module docstring)
        local_max = logits.max(dim=-1, keepdim=True).values                    # [.., 1]
        m = comm.all_gather(local_max, group, label="ce max").max(dim=-1, keepdim=True).values
        shifted = logits - m                                                   # [.., V/t]
        # z_y − m: on the rank that owns the target, zero elsewhere, then summed
        ours = (target >= start) & (target < end)                              # [..]
        local_target = (target - start).masked_fill(~ours, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(ours, target_logit, 0.0)  # not ·ours: −inf·0 would be nan
        target_logit = comm.all_reduce(target_logit, group, "ce target logit")
        # Z = Σ exp(z − m): partial sums, then summed
        exp = shifted.exp()                                                    # [.., V/t]
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group, "ce sum-exp")        # [..]
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid                          # [..]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, ours & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, hit, valid = ctx.saved_tensors
        onehot = hit.unsqueeze(-1).to(softmax.dtype)                 # 1 at the target, on its rank
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -onehot)  # softmax − onehot
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: CommGroup, *,
    vocab_size: int | None = None, ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross entropy [..] from this rank's logit slice [.., V/t] (computed in fp32).

    ``vocab_size``: the real vocabulary; logits of padded ids beyond it are masked to −inf.
    Every tp rank returns the same losses.
    """
    logits = logits.float()
    if vocab_size is not None:
        logits = mask_padded_vocab(logits, vocab_size, group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
