"""Memory, measured: the bytes of tensors allocated inside a block and still alive, on any device.

A GPU's caching allocator counts its bytes (``torch.cuda.max_memory_allocated``); a CPU's does
not. ``MemoryMeter`` counts them itself, the same way on both: every operation inside the block
passes through it (a ``TorchDispatchMode``, the hook PyTorch offers below autograd), and each
output whose storage is new — not one of the operation's inputs, so views and in-place results
are not counted twice — is added to the live total until that storage is freed (a weak reference
tells). Parameters and anything made before the block are not counted; optimizer state, gradient
buffers and activations made inside it are. What the notebooks state about memory (1F1B keeps at
most p microbatches in flight where GPipe keeps m) is asserted with it in the tests.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["MemoryMeter"]


class MemoryMeter(TorchDispatchMode):
    """``with MemoryMeter() as meter: ...`` → ``meter.current`` and ``meter.peak`` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}   # storage address -> bytes
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _address(t) not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or address in self.live:
            return
        self.live[address] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, address)

    def _free(self, address: int) -> None:
        self.current -= self.live.pop(address)


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
