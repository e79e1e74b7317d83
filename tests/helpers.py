"""Shared test helpers: a tiny model, a batch, comparisons of whole (gathered) tensors, a world
of one process for unit tests of collective code, and one launch per world size for a module's
runs on several ranks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_edu.course.exercises import MARKS, check
from megatron_edu.launch import run
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


def each(cases):
    """One rank's share of many cases, ``[(function, arguments), ...]``, run one after another in
    the same processes."""
    return [fn(*args) for fn, args in cases]


class Launches:
    """A test module's runs on several ranks, ``{name: (world size, function, arguments)}``: every
    case of one world size runs in one launch, once a session (a launch costs each rank a process
    start and a rendezvous); ``launches[name]`` is every rank's result of case ``name``. A launch
    that failed fails each of its cases' tests with the same error, without running again."""

    def __init__(self, cases: dict, timeout: float = 600.0) -> None:
        self.cases, self.timeout, self._done = cases, timeout, {}

    def __getitem__(self, name: str) -> list:
        size = self.cases[name][0]
        if size not in self._done:
            names = [n for n, (s, *_) in self.cases.items() if s == size]
            try:
                ranks = run(each, size, [self.cases[n][1:] for n in names], timeout=self.timeout)
                self._done[size] = {n: [rank[i] for rank in ranks] for i, n in enumerate(names)}
            except Exception as error:   # kept: raised again for each case of the launch
                self._done[size] = error
        if isinstance(self._done[size], Exception):
            raise self._done[size]
        return self._done[size][name]


def stub(*args):
    """An exercise not done yet (a checker answers "not done yet")."""
    raise NotImplementedError("exercise NN.k: your code here")


def failed(result, *fragments) -> bool:
    """Whether a check failed with each of ``fragments`` in its hint."""
    return result.passed is False and all(f in result.message for f in fragments)


def marked(exercise: str, text: str) -> bool:
    """Whether one of the exercise's marks (``@exercise(..., marks=)``, what
    megatron_edu/course/reveals.py searches for) is in ``text``, its spaces removed."""
    return any(re.search(mark, re.sub(r"\s+", "", text)) for mark in MARKS[exercise])


def verdict(exercise, answer, *fragments):
    """Check ``answer``: passed if no fragments are given, else failed with each in its hint."""
    result = check(exercise, answer)
    assert result.passed if not fragments else failed(result, *fragments), result
    return result


@dataclass
class Result:
    """A model's logits of the inputs [b, s, V], its mean loss, and every gradient, under this
    package's names (a Hugging Face model's compared with the package's)."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def assert_same(ours: Result, theirs: Result) -> None:
    assert (ours.logits - theirs.logits).abs().max() < TOL, "logits"
    assert (ours.loss - theirs.loss).abs() < TOL, "loss"
    assert max_diff(ours.grads, theirs.grads) < TOL, "gradients"
