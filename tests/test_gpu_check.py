"""``make gpu-check`` (bench/gpu_check.py) on a CPU: the one-line answer where there is no GPU, and
the parts that run without one: the training check on a tiny model, the parsing of what the
tools print."""

import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "gpu-check: no GPU on this machine (nvidia-smi not found); nothing to check\n"
TINY = ("--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
        "--vocab-size", "512", "--micro-batch", "8")


def _load_gpu_check():
    """bench/gpu_check.py as a module (bench/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def _no_gpu_env(tmp_path: Path) -> dict[str, str]:
    """No nvidia-smi on PATH and no GPU for torch: the same answer on a machine with GPUs."""
    return {**os.environ, "PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True,
                          text=True, env=_no_gpu_env(tmp_path), timeout=300)
    assert (done.returncode, done.stdout, done.stderr) == (0, NO_GPU, "")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_runs_it(tmp_path):
    # --no-print-directory: under an outer make (make test) a nested one announces its folder
    done = subprocess.run([shutil.which("make"), "--no-print-directory", "gpu-check",
                           f"PYTHON={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, env=_no_gpu_env(tmp_path),
                          timeout=300)
    assert (done.returncode, done.stdout) == (0, NO_GPU)


def test_the_training_check_reads_tokens_per_s_and_mfu_from_the_log(data_cache):
    row = gpu_check.check_training(sys.executable, 1, 240, None, model=TINY, steps=8,
                                   extra=("--cache-dir", str(data_cache)))
    assert row.ok, row.figures
    assert "tokens/s, MFU" in row.figures and "(median of steps 6-8)" in row.figures


def test_a_diverged_run_fails_the_training_check():
    records = [{"step": s, "loss": loss, "tokens_per_s": 1e5, "mfu": 0.4}
               for s, loss in enumerate([10.9, 9.1, math.nan, 8.0, 7.9, 7.8, 7.7], start=1)]
    assert not gpu_check.training_row(records, 1, 989e12).ok
    records[2]["loss"] = 8.5
    row = gpu_check.training_row(records, 1, 989e12)
    assert row.ok and "MFU 40.0% of 989 TFLOP/s per GPU (median of steps 6-7)" in row.figures


def test_gpus_are_read_from_nvidia_smi():
    listing = ("GPU 0: NVIDIA H200 (UUID: GPU-0a1b)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2c3d)\n")
    assert gpu_check.gpus_nvidia_smi_lists(listing) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert gpu_check.gpus_nvidia_smi_lists("No devices were found\n") == []


def test_pytest_counts_come_from_its_last_line():
    output = "....s\n=== short test summary info ===\n5 passed, 2 skipped in 12.3s\n"
    assert gpu_check.pytest_counts(output) == {"passed": 5, "skipped": 2}


def test_the_table_has_a_line_per_check():
    rows = [gpu_check.Row("GPUs", True, "1 × NVIDIA H200"), gpu_check.Row("bench", False, "x")]
    assert gpu_check.table(rows).splitlines()[2:] == ["GPUs   ok      1 × NVIDIA H200",
                                                      "bench  FAILED  x"]


def test_a_torch_that_sees_no_gpu_says_why_in_its_own_words():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine's torch sees a GPU")
    # torch's words depend on its build: the CPU wheel's AssertionError "Torch not compiled with
    # CUDA enabled", the CUDA wheel's RuntimeError "Found no NVIDIA driver on your system. ..."
    with pytest.raises((AssertionError, RuntimeError)) as refused:
        torch.cuda.init()
    machine, why = gpu_check.probe(sys.executable)
    assert machine is None
    assert why == f"{type(refused.value).__name__}: {refused.value}"
