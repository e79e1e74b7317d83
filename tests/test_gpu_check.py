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
    row = gpu_check.check_training(sys.executable, 1, 240, gpu_check.Peaks(None, None),
                                   model=TINY, steps=8, extra=("--cache-dir", str(data_cache)))
    assert row.ok, row.figures
    assert "tokens/s, MFU" in row.figures and "(median of steps 6-8)" in row.figures
    assert "warm-up" in row.figures and "the rest" in row.figures


def _records(losses, seconds, tokens=16 * 1024, mfu=0.4):
    return [{"step": s, "loss": loss, "tokens_per_s": tokens / t, "mfu": mfu}
            for s, (loss, t) in enumerate(zip(losses, seconds, strict=True), start=1)]


def test_a_diverged_run_fails_the_training_check():
    records = _records([10.9, 9.1, math.nan, 8.0, 7.9, 7.8, 7.7], [1] * 7)
    assert not gpu_check.training_row(records, 1, gpu_check.Peaks(989e12, None)).ok
    records[2]["loss"] = 8.5
    row = gpu_check.training_row(records, 1, gpu_check.Peaks(989e12, None))
    assert row.ok and "MFU 40.0% of the datasheet's 989 TFLOP/s (median of steps 6-7)" \
        in row.figures


def test_mfu_is_read_over_the_datasheet_and_the_measured_peak_and_warm_up_apart():
    """The run is told the datasheet's peak: what it achieved over the measured one follows.
    Steps 1-5 took 20, 1, 1, 1, 1 s against 0.5 s later: 21.5 s of warm-up over the step; the
    run's 60.4 s less its 25.5 s of steps is the rest."""
    records = _records([10.9, 9.1, 8.5, 8.0, 7.9, 7.8, 7.7, 7.6], [20, 1, 1, 1, 1, .5, .5, .5])
    row = gpu_check.training_row(records, 1, gpu_check.Peaks(989e12, 700e12), 16 * 1024, 60.4)
    assert row.ok
    assert ("32,768 tokens/s, MFU 40.0% of the datasheet's 989 TFLOP/s, 56.5% of the measured "
            "700 TFLOP/s (median of steps 6-8); step 500 ms, warm-up 21.5 s over it") \
        in row.figures
    assert "the rest 35 s (start-up, evaluation, checkpoint)" in row.figures


def test_the_training_run_is_told_the_peak_and_uses_the_fused_core_at_micro_batch_4():
    assert gpu_check.Peaks(989e12, 700e12).used == 989e12    # the datasheet's, where it has one
    assert gpu_check.Peaks(None, 700e12).used == 700e12      # an unknown GPU: the measured one
    assert gpu_check.Peaks(None, None).used is None          # the run measures its own
    model = gpu_check.GPT2_MEDIUM
    assert model[model.index("--attention") + 1] == "fused"
    assert model[model.index("--micro-batch") + 1] == "4" and gpu_check._seq_len(model) == 1024
    assert gpu_check._seq_len(TINY) == 32


NVIDIA_SMI = """\
Tue Dec  2 10:00:00 2026
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.104.05             Driver Version: 535.104.05   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
"""


def test_the_drivers_cuda_version_is_read_from_nvidia_smis_header():
    assert gpu_check.driver_cuda_version(NVIDIA_SMI) == (12, 2)
    assert gpu_check.driver_cuda_version(NVIDIA_SMI.replace("12.2", "13.0")) == (13, 0)
    assert gpu_check.driver_cuda_version("No devices were found\n") is None


@pytest.mark.parametrize(("spec", "cuda"), [
    ("torch==2.13.0", (13, 0)),                 # PyPI's wheel: cuda-toolkit 13.0
    ("torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128", (12, 8)),
    ("torch==2.13.0 --index-url https://download.pytorch.org/whl/cu118", (11, 8)),
    ("torch==2.13.0+cu126", (12, 6)),
    ("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu", None),
])
def test_the_wheels_cuda_version_is_read_from_the_torch_spec(spec, cuda):
    assert gpu_check.wheel_cuda_version(spec) == cuda


def test_a_driver_too_old_for_the_wheel_is_one_line_naming_the_index_to_use():
    line = gpu_check.driver_problem((12, 2), "torch==2.13.0")
    assert line == ("the driver's CUDA 12.2 is older than the wheel's 13.0: make gpu-check "
                    "TORCH_SPEC=\"torch==2.13.0 --index-url "
                    "https://download.pytorch.org/whl/cu128\", or update the NVIDIA driver")
    assert "no torch==2.13.0 build runs on CUDA 11" in gpu_check.driver_problem((11, 8),
                                                                                "torch==2.13.0")
    # a newer minor version of the driver's own major one runs (minor version compatibility)
    assert gpu_check.driver_problem((12, 2), gpu_check.CUDA_INDEX[12]) == ""
    assert gpu_check.driver_problem((13, 0), "torch==2.13.0") == ""
    assert gpu_check.driver_problem(None, "torch==2.13.0") == ""         # unknown: try
    assert "CPU-only" in gpu_check.driver_problem((13, 0), "torch==2.13.0+cpu")


def test_a_driver_too_old_stops_before_anything_is_installed(monkeypatch):
    def no_install(*args, **kwargs):
        raise AssertionError("nothing may be installed")

    monkeypatch.setattr(gpu_check, "run_step", no_install)
    machine, row = gpu_check.make_gpu_venv("torch==2.13.0",
                                           gpu_check.Driver(["NVIDIA A100"], (12, 2)))
    assert machine is None and not row.ok
    assert row.figures.startswith(".venv-gpu not made: the driver's CUDA 12.2 is older")


def test_tritons_compiler_is_cc_else_gcc_else_clang_on_path(tmp_path):
    def tool(name):
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return str(path)

    assert gpu_check.c_compiler({"PATH": str(tmp_path)}) is None
    clang = tool("clang")
    assert gpu_check.c_compiler({"PATH": str(tmp_path)}) == clang
    gcc = tool("gcc")
    assert gpu_check.c_compiler({"PATH": str(tmp_path)}) == gcc
    assert gpu_check.c_compiler({"PATH": str(tmp_path), "CC": "clang"}) == clang
    assert gpu_check.c_compiler({"PATH": str(tmp_path), "CC": "icx"}) is None


def test_what_triton_misses_is_said_in_one_line(tmp_path):
    line = gpu_check.toolchain_problem(None, str(tmp_path))
    assert line == ("Triton (torch.compile) needs a C compiler ($CC, gcc or clang on PATH: "
                    f"apt-get install gcc) and Python's headers (no Python.h in {tmp_path}: "
                    "apt-get install python3-dev)")
    (tmp_path / "Python.h").write_text("")
    assert gpu_check.toolchain_problem("/usr/bin/gcc", str(tmp_path)) == ""
    assert gpu_check.toolchain_problem("/usr/bin/gcc", None) == ""


def test_gpus_are_read_from_nvidia_smi():
    listing = ("GPU 0: NVIDIA H200 (UUID: GPU-0a1b)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2c3d)\n")
    assert gpu_check.gpus_nvidia_smi_lists(listing) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert gpu_check.gpus_nvidia_smi_lists("No devices were found\n") == []


def test_pytest_counts_come_from_its_last_line():
    output = "....s\n=== short test summary info ===\n5 passed, 2 skipped in 12.3s\n"
    assert gpu_check.pytest_counts(output) == {"passed": 5, "skipped": 2}


def test_the_table_has_a_line_per_check_and_says_not_run():
    rows = [gpu_check.Row("GPUs", True, "1 × NVIDIA H200"), gpu_check.Row("bench", False, "x"),
            gpu_check.Row("2 GPUs", None, "not run: one GPU here")]
    assert gpu_check.table(rows).splitlines()[2:] == ["GPUs    ok       1 × NVIDIA H200",
                                                      "bench   FAILED   x",
                                                      "2 GPUs  not run  not run: one GPU here"]


def test_a_check_that_does_not_apply_fails_nothing_one_that_failed_fails_the_run(monkeypatch):
    machine = gpu_check.Machine("python", "2.13.0", "13.0", ["NVIDIA H200"],
                                gpu_check.Peaks(989e12, 700e12), "MFU 40.0%", None)
    monkeypatch.setattr(gpu_check, "find_machine", lambda args, driver: (machine, []))
    monkeypatch.setattr(gpu_check, "nvidia_smi", lambda: gpu_check.Driver(["NVIDIA H200"], None))
    for ok, status in ((None, 0), (True, 0), (False, 1)):
        monkeypatch.setattr(gpu_check, "run_checks",
                            lambda machine, driver, deadline, ok=ok: [gpu_check.Row("x", ok, "")])
        assert gpu_check.main([]) == status


def test_one_gpu_gets_the_8_minutes_more_gpus_a_little_more_per_world_they_add():
    assert gpu_check.budget_s(1) == 8 * 60
    assert sum(gpu_check.LIMIT_S.values()) <= 8 * 60   # every step's limit fits in it
    assert gpu_check.budget_s(2) == 8 * 60 + gpu_check.PER_WORLD_S
    assert gpu_check.budget_s(8) == 8 * 60 + 3 * gpu_check.PER_WORLD_S


def test_the_advisors_prediction_for_the_training_check_says_what_it_assumes():
    from bench.mfu import advisor_prediction

    prediction = advisor_prediction(989e12, micro_batch=gpu_check.MICRO_BATCH,
                                    batch=gpu_check.BATCH_PER_GPU)
    assert 0.2 < prediction.mfu < 0.62          # below its GEMMs' efficiency: not all is GEMMs
    assert str(prediction).startswith(f"MFU {prediction.mfu:.1%}, ")
    assert "989 TFLOP/s peak, GEMMs at η = 0.62" in str(prediction)
    assert "3.35 TB/s of HBM" in str(prediction) and "flash attention" in str(prediction)


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
