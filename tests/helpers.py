"""Shared test helpers: a tiny model, a batch, comparisons of whole (gathered) tensors, and a
world of one process for unit tests of collective code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_edu.model import GPTConfig, build_model

TOL = 1e-5  # fp32, dropout 0: parallel and serial agree to rounding


def tiny_config(**overrides) -> GPTConfig:
    """2 layers, hidden 32, 4 heads, vocabulary 100 (padded to 128·tp), sequences up to 16."""
    fields = dict(vocab_size=100, seq_len=16, num_layers=2, hidden=32, num_heads=4,
                  dropout=0.0, seed=7)
    return GPTConfig(**{**fields, **overrides})


def batch(config: GPTConfig, b: int = 2, s: int = 8, seed: int = 0):
    """Token ids and next-token labels [b, s], the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a − b| over tensors of the same names (the names must match exactly)."""
    if a.keys() != b.keys():
        raise AssertionError(f"different names: {sorted(a.keys() ^ b.keys())}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_two_stages_chain_into_serial(config: GPTConfig, ids: torch.Tensor,
                                        labels: torch.Tensor) -> None:
    """A 2-layer model cut into two pipeline stages (``build_model``: a GPT, or a BERT for a
    ``BertConfig``) gives the serial model's gradients, the tied embedding's two copies summed."""
    serial = build_model(config)
    stages = [build_model(config, layers=range(0, 1), last=False),
              build_model(config, layers=range(1, 2), first=False)]
    serial(ids, labels).backward()
    stages[1](stages[0](ids), labels).backward()
    grads = {**stages[0].full_state_dict(grads=True), **stages[1].full_state_dict(grads=True)}
    grads["embedding.word.weight"] = sum(s.embedding.word.weight.grad
                                         for s in stages)[:config.vocab_size]
    assert max_diff(grads, serial.full_state_dict(grads=True)) < TOL


@contextmanager
def world_of_one(store: Path) -> Iterator[None]:
    """torch.distributed initialised in this very process as a world of one rank (gloo): a
    unit test of collective code — a ParallelGrid, a PTDP, a save — without launching ranks."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def poisoned_checkpoint(source, out, value: float = float("nan"), position: int = 12):
    """A copy of the single-file checkpoint ``source`` in ``out`` whose position embedding of
    ``position`` is ``value`` (NaN): the logits at that position and after it are not finite."""
    import json
    import shutil

    shutil.copytree(source, out)
    shard = out / "model_tp0_pp0.pt"
    state = torch.load(shard, weights_only=True)
    state["params"]["embedding.position.weight"][position] = value
    torch.save(state, shard)
    meta = json.loads((out / "meta.json").read_text())
    meta["files"][shard.name] = shard.stat().st_size
    (out / "meta.json").write_text(json.dumps(meta))
    return out
