"""Memory, measured: the bytes of tensors allocated inside a block and still alive, on any device;
and the bytes a transformer layer keeps for its backward pass, beside the formula for them.

A GPU's caching allocator counts its bytes (``torch.cuda.max_memory_allocated``); a CPU's does
not. ``MemoryMeter`` counts them itself, the same way on both: every operation inside the block
passes through it (a ``TorchDispatchMode``, the hook PyTorch offers below autograd), and each
output whose storage is new — not one of the operation's inputs, so views and in-place results
are not counted twice — is added to the live total until that storage is freed (a weak reference
tells). Parameters and anything made before the block are not counted; optimizer state, gradient
buffers and activations made inside it are. What the notebooks state about memory (1F1B keeps at
most p microbatches in flight where GPipe keeps m) is asserted with it in the tests.

``saved_bytes`` counts what autograd *saves* for backward instead — the activations of
Korthikanti et al. 2022 (arXiv 2205.05198 §4), each storage once, parameters excluded — and
``layer_activation_bytes`` measures one transformer layer of the package that way, to set beside
``perf.memory.activation_bytes_per_layer`` (recomputation, sequence parallelism, tp).

``measure_mfu`` times a GPT's training steps against large matmuls of as many FLOPs, alternately:
the model FLOPs utilization of this machine, against what its own matmuls reach.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_edu.comm import CommGroup

from .flops import training_flops_of

__all__ = ["MemoryMeter", "saved_bytes", "layer_activation_bytes", "measure_mfu"]


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


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages autograd keeps for backward while ``fn()`` runs, each storage
    counted once; the storages of ``exclude`` (the parameters) are not counted."""
    fixed = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        address = t.untyped_storage().data_ptr()
        if address not in fixed:
            kept[address] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())


def layer_activation_bytes(config, group: CommGroup, microbatch: int,
                           cp_group: CommGroup | None = None) -> int:
    """What one transformer layer of ``config`` keeps for backward on this tp rank, measured: a
    training-mode forward of a ``Block`` on a [b, s, h] input ([b, s/t, h] under sequence
    parallelism; this context rank's [b, s/cp, h] with a ``cp_group``, attention by the ring),
    wrapped like the model wraps it under ``config.recompute``."""
    from megatron_edu.model.transformer import Block
    from megatron_edu.tensor_parallel.init import init_parameters
    from megatron_edu.tensor_parallel.random import DropoutKey, checkpoint

    block = Block(replace(config, recompute="none" if config.recompute == "full"
                          else config.recompute), group, 0, cp_group)
    init_parameters(block, config.seed, group)
    parts = group.size if config.sequence_parallel and group.size > 1 else 1
    parts *= 1 if cp_group is None else cp_group.size
    x = torch.randn(microbatch, config.seq_len // parts, config.hidden, requires_grad=True)
    key = DropoutKey.first(microbatch)
    if config.recompute == "full":   # 2104.04473 §3.5: the model keeps only the layer's input
        return saved_bytes(lambda: checkpoint(block, x, None, key), block.parameters())
    return saved_bytes(lambda: block(x, None, key), block.parameters())


def measure_mfu(model: torch.nn.Module, batch: int, rounds: int = 3,
                matmul_size: int = 1024) -> tuple[float, float]:
    """(model FLOP/s, matmul FLOP/s) on one thread: training steps of the GPT ``model`` (or
    Llama) on ``batch`` random sequences, their FLOPs counted as 2104.04473 §5.1 does without
    recomputation (``training_flops_of``: the model's block), and runs of square matmuls of as
    many FLOPs, timed alternately for ``rounds`` rounds, medians. Their ratio is the MFU
    against this machine's own matmul rate. A measurement: it changes from run to run."""
    config = model.config
    flops = training_flops_of(config, batch, recompute=False, vocab=config.padded_vocab())
    repeats = max(1, round(flops / (2 * matmul_size**3)))
    ids = torch.randint(config.vocab_size, (batch, config.seq_len + 1))
    optimizer = torch.optim.AdamW(model.parameters())
    a, b = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)

    def step() -> None:
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def matmuls() -> None:
        for _ in range(repeats):
            torch.mm(a, b)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: less at the mercy of other processes
    try:
        step_s, matmul_s = (statistics.median(t) for t in _alternate((step, matmuls), rounds))
    finally:
        torch.set_num_threads(threads)
    return flops / step_s, 2 * matmul_size**3 * repeats / matmul_s


def _alternate(fns: Sequence[Callable[[], None]], rounds: int) -> list[list[float]]:
    """Seconds of each call of each function, run in turn for ``rounds`` rounds after a warm-up:
    a slow moment of a shared machine falls on both alike."""
    for fn in fns:
        fn()
    seconds: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, seconds, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return seconds
