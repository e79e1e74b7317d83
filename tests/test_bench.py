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


def test_the_moe_benchmark_times_its_contenders_at_a_tiny_shape():
    """Every contender of (j) runs, and grouped_mm agrees with the loop (checked inside)."""
    moe = importlib.import_module("bench.moe")
    common = importlib.import_module("bench.common")
    shape = moe.Shape(hidden=64, experts=4, topk=2, expert_ffn=32, batch=1, seq=16)
    device = common.Device("cpu", "fp32")
    layer, per_expert = moe.measure_layer(shape, device, rounds=2)
    assert sum(per_expert) == shape.tokens * shape.topk
    grouped = moe.measure_grouped(shape, device, rounds=2)
    assert {name: len(t) for name, t in {**layer.wall, **grouped.wall}.items()} == dict.fromkeys(
        ["moe", "dense", "experts", "grouped balanced", "loop balanced", "grouped skewed",
         "loop skewed"], 2)
    assert moe.skewed_counts(32, 4) == [17, 7, 5, 3]                 # ∝ 1, 1/2, 1/3, 1/4
