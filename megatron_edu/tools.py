"""The tools of the trade around a training run: its flags from a file, its record, a trace.

* ``--config run.toml`` (or ``.yaml``, ``.json``): any flag, named as on the command line
  without the dashes (``global-batch = 32`` or ``global_batch``); the command line overrides the
  file. Each value goes through the flag's own check, as if typed (``flags_from_file``).
* ``OUT/run.json``, written before any rank starts: the resolved arguments, the package's and
  torch's versions, the layout (``write_run_record``) — what a run was, beside what it logged.
* ``--profile START:END``: a ``torch.profiler`` trace of steps START … END − 1 (numbered from 1,
  as the log numbers them) in Chrome/Perfetto JSON, ``OUT/profile_rank{r}.json``, of rank 0 or
  of every rank (``--profile-ranks all``); the collectives appear under torch.distributed's own
  names (``c10d::allreduce_``, ``gloo:all_reduce``, ``nccl:all_reduce``). Open it in
  https://ui.perfetto.dev or chrome://tracing (docs/troubleshooting.md). On a GPU also a memory
  snapshot of the same steps, ``OUT/profile_rank{r}_memory.pickle``: every allocation with its
  stack, for https://pytorch.org/memory_viz (``CudaMemorySnapshot``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

__all__ = ["flags_from_file", "step_range", "write_run_record", "StepProfiler",
           "CudaMemorySnapshot"]


def flags_from_file(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``parser``'s defaults as the file ``path`` sets them (a ValueError naming the file and
    the key it cannot use). A value is handed over as text where the flag has a type, so that
    argparse checks it as it checks the command line's."""
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json":
        table = json.loads(text)
    elif path.suffix == ".toml":
        if sys.version_info < (3, 11):
            raise ValueError(f"--config {path}: TOML needs Python 3.11 (tomllib); give a .json")
        import tomllib
        table = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--config {path}: YAML needs the pyyaml package (pip install "
                             f"pyyaml); or give a .toml or a .json") from None
        table = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"--config {path}: a .toml, .yaml or .json file, got "
                         f"{path.suffix or 'none'}")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "config"}
    defaults = {}
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None or action.dest == "help":
            raise ValueError(f"--config {path}: no flag --{key.replace('_', '-')}")
        typed = action.type is not None and not isinstance(value, list)
        defaults[action.dest] = str(value) if typed else value
    return defaults


def step_range(text: str) -> tuple[int, int]:
    """``--profile START:END``: steps START … END − 1, 1 ≤ START < END."""
    try:
        start, end = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be START:END, two step numbers, got {text}") \
            from None
    if not 1 <= start < end:
        raise argparse.ArgumentTypeError(f"must be START:END with 1 ≤ START < END, got {text}")
    return start, end


def write_run_record(out: Path, args: argparse.Namespace, parallelism: Any) -> Path:
    """``OUT/run.json``: the resolved arguments, the versions, the layout; its path."""
    record = {
        "args": {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items()},
        "megatron_edu": metadata.version("megatron-edu"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "layout": asdict(parallelism.layout), "pipeline": asdict(parallelism.pipeline),
        "zero": parallelism.zero,
    }
    path = out / "run.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


class StepProfiler:
    """``torch.profiler`` around steps START … END − 1 of this rank, if it is one to profile;
    ``at(step)`` before each step (numbered from 1), ``close()`` after the last."""

    def __init__(self, steps: tuple[int, int] | None, path: Path, device: torch.device) -> None:
        self.steps, self.path, self.device, self.profile = steps, path, device, None
        self.memory = SNAPSHOTS.get(device.type, _NoSnapshot)(
            path.with_name(f"{path.stem}_memory.pickle"))

    def at(self, step: int) -> None:
        if self.steps is None:
            return
        if step == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities,
                                                  profile_memory=self.device.type == "cuda")
            self.profile.__enter__()
            self.memory.start()
        elif step == self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (and the memory snapshot), if one is running."""
        if self.profile is not None:
            self.profile.__exit__(None, None, None)
            self.profile.export_chrome_trace(str(self.path))
            self.memory.stop()
            self.profile = None


class CudaMemorySnapshot:
    """PyTorch's CUDA caching allocator recording every allocation and free with its stack
    from ``start`` to ``stop``, then dumped to ``path`` (``torch.cuda.memory``'s documented
    ``_record_memory_history`` / ``_dump_snapshot``, "Understanding CUDA Memory Usage"): open
    it in https://pytorch.org/memory_viz. Recording off again after the dump."""

    ENTRIES = 100_000   # the allocator's ring of events: enough for a few steps of a big model

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.ENTRIES)

    def stop(self) -> None:
        torch.cuda.memory._dump_snapshot(str(self.path))
        torch.cuda.memory._record_memory_history(enabled=None)


class _NoSnapshot:
    """A CPU keeps no allocator history: nothing to record."""

    def __init__(self, path: Path) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


SNAPSHOTS = {"cuda": CudaMemorySnapshot}  # the device's memory snapshot, chosen once
