"""The benchmarks still run against the package as it is (their figures are measured by hand,
`make bench`; here only that every one imports, and that the bubble benchmark's stages speak the
engine's interface)."""

import importlib
import sys
from pathlib import Path

import pytest

from megatron_edu.launch import run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODULES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports(name):
    importlib.import_module(f"bench.{name}")


def test_the_sleeping_stages_run_a_1f1b_step_on_the_engine():
    bubble = importlib.import_module("bench.bubble")
    per_rank = run(bubble.timelines_on_ranks, bubble.P, "sleep", 1)
    for timelines in per_rank:
        assert [len(t) for t in timelines] == [2 * bubble.M]
