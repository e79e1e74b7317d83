"""Dropout randomness under tensor parallelism, and activation recomputation that replays it.

1909.08053 Appendix B.2: dropout outside the tensor-parallel regions (on the embeddings and on
each residual branch, where every tp rank holds the same full [b, s, h] activation) must draw the
*same* mask on every tp rank — or the replicas drift apart. Dropout inside a region (on the
attention probabilities, where each rank holds its own heads) must draw a *different* mask on
each rank, or the heads of different ranks would share one pattern. Megatron keeps a separate
generator for the inside, seeded per tp rank ("CudaRNGStatesTracker").

Here both streams live in one small object handed to the model (no module global):

* ``REPLICATED``      seeded with ``seed + 100·pp_rank``: identical on every tp rank;
* ``TENSOR_PARALLEL`` seeded with ``seed + 100·pp_rank + 2718 + tp_rank``: one per tp rank
  (Megatron's offsets; the pipeline offset keeps different stages from repeating one mask).

``with tracker.fork(stream):`` swaps the device's default generator to that stream and back, so
``F.dropout`` and ``F.scaled_dot_product_attention`` draw from it unchanged. Everything is
reproducible from the seed, whatever else the program draws from the default generator.

Activation recomputation (2104.04473 §3.5) runs a block's forward a second time in the backward
pass; that second run must see the same masks. ``checkpoint`` saves the tracker's streams before
the forward and replays them during the recomputation (PyTorch's checkpoint already does the same
for the default generator) — what Megatron's ``CheckpointFunction`` does with its tracker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["REPLICATED", "TENSOR_PARALLEL", "RNGTracker", "Dropout", "checkpoint"]

REPLICATED = "replicated"            # outside the split regions: same mask on every tp rank
TENSOR_PARALLEL = "tensor-parallel"  # inside them: a different mask on each tp rank


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Two named streams, swapped in for the default generator of a device on ``fork``.

    A stream's state is created from its seed on first use on a device, so the model may be
    moved between devices freely.
    """

    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
        base = seed + 100 * pp_rank
        self.seeds = {REPLICATED: base, TENSOR_PARALLEL: base + 2718 + tp_rank}
        self.states: dict[tuple[str, torch.device], torch.Tensor] = {}

    @contextmanager
    def fork(self, stream: str, device: torch.device | str = "cpu") -> Iterator[None]:
        """Draw from ``stream`` inside the block; the default generator is untouched outside."""
        device = torch.device(device)
        key = (stream, device)
        if key not in self.states:
            self.states[key] = torch.Generator(device).manual_seed(self.seeds[stream]).get_state()
        outer = _get_state(device)
        _set_state(self.states[key], device)
        try:
            yield
        finally:
            self.states[key] = _get_state(device)
            _set_state(outer, device)

    def get_states(self) -> dict[tuple[str, torch.device], torch.Tensor]:
        return {key: state.clone() for key, state in self.states.items()}

    def set_states(self, states: dict[tuple[str, torch.device], torch.Tensor]) -> None:
        self.states = {key: state.clone() for key, state in states.items()}

    @contextmanager
    def replay(self, states: dict[tuple[str, torch.device], torch.Tensor]) -> Iterator[None]:
        """Run the block from ``states``, then return to the states we had."""
        now = self.get_states()
        self.set_states(states)
        try:
            yield
        finally:
            self.set_states(now)


class Dropout(nn.Module):
    """``F.dropout`` drawing its mask from one stream of the tracker."""

    def __init__(self, p: float, tracker: RNGTracker, stream: str) -> None:
        super().__init__()
        self.p, self.tracker, self.stream = p, tracker, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.stream, x.device):
            return F.dropout(x, self.p, training=True)


def checkpoint(fn: Callable[[torch.Tensor], torch.Tensor], tracker: RNGTracker,
               x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` keeping only ``x``; recomputed in backward with the same dropout masks."""
    states = tracker.get_states()  # before the forward draws anything
    return torch.utils.checkpoint.checkpoint(
        fn, x, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (nullcontext(), tracker.replay(states)))
