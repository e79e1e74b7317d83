"""``make gpu-check``: megatron-edu on this machine's GPUs, in under 8 minutes on one GPU.

    python3 bench/gpu_check.py                      # what make gpu-check runs
    python3 bench/gpu_check.py --python ~/env/bin/python   # under a CUDA-enabled Python of yours

Without a GPU it says so in one line and exits 0. With one it

1. finds a Python whose torch sees the GPUs: ``.venv``'s, else ``.venv-gpu``'s, creating
   ``.venv-gpu`` (``pip install torch==2.13.0``, a CUDA build on Linux x86_64, then this package)
   when neither does: a one-off install of a few GB, not counted in the 8 minutes;
2. runs ``tests/test_device.py --device cuda``: a GPT's forward and backward, PTD-P steps and
   bf16 autocast on CUDA and NCCL against the CPU; on one GPU, dropout masks, the fused kernels,
   recomputation and fp16 loss scaling; pp = 2 pipelines when there are 2 GPUs;
3. trains GPT-2 medium (345M) in bf16 for a few steps, one rank per GPU, and reads tokens/s and
   MFU (against the datasheet's dense bf16 peak) from its ``log.jsonl``;
4. runs the benchmarks that take a GPU, ``python -m bench --device cuda --dtype bf16``;

then prints one table (check, result, figures) and exits 1 if a check failed. Each step runs in
a subprocess with a time limit, all of them within ``BUDGET_S``. This file needs only the
standard library: the interpreter running it may have no torch, or a CPU-only one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = (ROOT / ".venv", ROOT / ".venv-gpu")   # tried in this order; the last one is made
BUDGET_S = 8 * 60          # every check together, on one GPU (a .venv-gpu install comes on top)
LIMIT_S = {"tests": 150, "training": 150, "bench": 150}
INSTALL_LIMIT_S = 20 * 60
TRAIN_STEPS, WARM_STEPS = 30, 5   # figures are medians over the steps after the first 5
GPT2_MEDIUM = ("--preset", "gpt2-medium")
RESULTS = ROOT / "bench" / "results.jsonl"
PROBE = """\
import json, torch
from megatron_edu.perf import datasheet_peak_flops
try:  # is_available() only says no; init() says why (no driver, a driver too old, ...)
    torch.cuda.init()
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpus": [torch.cuda.get_device_name(i) for i in range(n)],
                  "peak": datasheet_peak_flops("cuda") if n else None, "error": error}))
"""


@dataclass
class Row:
    """One line of the summary table."""

    check: str
    ok: bool
    figures: str


@dataclass
class Machine:
    """A Python whose torch sees GPUs, and what it sees."""

    python: str
    torch: str
    cuda: str | None
    gpus: list[str]
    peak: float | None   # the datasheet's dense bf16 FLOP/s per GPU, None if not in the table


# ---- running a step ---------------------------------------------------------------------------


def run_step(cmd: list[str], limit: float) -> tuple[int | None, str]:
    """Run ``cmd`` in the repository root; (exit status, or None past ``limit`` s; its output).
    Past the limit its whole process group is killed: ranks it started die with it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(limit, 1))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out + f"\n(stopped after {limit:.0f} s)"


def tail(text: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


# ---- is there a GPU, and a torch that sees it? ------------------------------------------------


def gpus_nvidia_smi_lists(text: str) -> list[str]:
    """GPU names from ``nvidia-smi -L``: "GPU 0: NVIDIA H200 (UUID: GPU-…)"."""
    return re.findall(r"^GPU \d+: (.+?) \(UUID", text, flags=re.MULTILINE)


def nvidia_smi() -> tuple[list[str], str]:
    """The GPUs nvidia-smi lists, and why none when it lists none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi not found"
    status, out = run_step([exe, "-L"], 60)
    names = gpus_nvidia_smi_lists(out) if status == 0 else []
    first = out.strip().splitlines()[0] if out.strip() else "no output"
    return names, "" if names else f"nvidia-smi lists no GPU: {first}"


def probe(python: str) -> tuple[Machine | None, str]:
    """What torch under ``python`` sees, or None and why not: torch's own error where it has one
    (a CUDA build that cannot reach the driver), else what is known."""
    if not Path(python).exists():
        return None, f"{python} does not exist"
    status, out = run_step([python, "-c", PROBE], 120)
    answer = [line for line in out.splitlines() if line.startswith("{")]
    if status != 0 or not answer:
        return None, f"torch under {python} could not be asked: {tail(out, 3)}"
    seen = json.loads(answer[-1])
    if not seen["gpus"]:
        why = seen["error"] or f"torch {seen['torch']} has no CUDA (a CPU-only build?)"
        return None, why
    return Machine(python, seen["torch"], seen["cuda"], seen["gpus"], seen["peak"]), ""


def make_gpu_venv(torch_spec: str) -> tuple[Machine | None, Row]:
    """Create the last of ``VENVS`` with ``torch_spec`` and this package (with its tests)."""
    venv = VENVS[-1]
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    deadline = time.monotonic() + INSTALL_LIMIT_S
    print(f"gpu-check: installing {torch_spec} into {venv.name} (once; a few GB) ...", flush=True)
    for cmd in ([sys.executable, "-m", "venv", str(venv)], [*pip, *shlex.split(torch_spec)],
                [*pip, "-e", ".[test]"]):
        status, out = run_step(cmd, deadline - time.monotonic())
        if status != 0:
            print(tail(out))
            return None, Row("setup", False, f"{shlex.join(cmd[2:])} failed ({venv.name})")
    machine, why = probe(python)
    if machine is None:
        return None, Row("setup", False, f"torch in {venv.name} sees no GPU: {why} (make "
                         f"gpu-check TORCH_SPEC=\"torch==2.13.0 --index-url ...\")")
    return machine, Row("setup", True, f"{venv.name}: torch {machine.torch}")


# ---- the checks -------------------------------------------------------------------------------


def gpus_row(machine: Machine) -> Row:
    names = sorted(set(machine.gpus))
    peak = f"{machine.peak / 1e12:.0f} TFLOP/s bf16 (datasheet)" if machine.peak \
        else "no datasheet peak: MFU against a timed matmul"
    return Row("GPUs", True, f"{len(machine.gpus)} × {', '.join(names)}; torch {machine.torch}, "
                             f"CUDA {machine.cuda}; {peak}")


def pytest_counts(output: str) -> dict[str, int]:
    """{"passed": 5, "skipped": 2, …} from pytest's last summary line."""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                     last)}


def check_tests(python: str, limit: float) -> Row:
    """tests/test_device.py on CUDA and NCCL; a run where every test skipped fails."""
    status, out = run_step([python, "-m", "pytest", "tests/test_device.py", "--device", "cuda",
                            "-q", "-p", "no:cacheprovider"], limit)
    counts = pytest_counts(out)
    ok = status == 0 and counts.get("passed", 0) > 0
    if not ok:
        print(tail(out, 40))
    figures = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary"
    return Row("tests/test_device.py on cuda", ok, figures)


def check_training(python: str, nproc: int, limit: float, peak: float | None, *,
                   model: tuple[str, ...] = GPT2_MEDIUM, steps: int = TRAIN_STEPS,
                   extra: tuple[str, ...] = ()) -> Row:
    """A bf16 training run, one rank per GPU; its tokens/s and MFU from OUT/log.jsonl."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
        cmd = [python, "-m", "megatron_edu.train", *model, "--dtype", "bf16",
               "--nproc", str(nproc), "--global-batch", str(16 * nproc), "--steps", str(steps),
               "--warmup", "5", "--eval-interval", str(steps), "--eval-batches", "1",
               "--save-interval", str(steps), "--sample-tokens", "0", "--no-progress",
               "--out", out, *extra]
        status, output = run_step(cmd, limit)
        log = Path(out) / "log.jsonl"
        records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    row = training_row(records, nproc, peak)
    if status != 0:
        print(tail(output, 40))
        row = Row(row.check, False, "did not finish: " + output.strip().splitlines()[-1]
                  if output.strip() else "did not finish")
    return row


def training_row(records: list[dict], nproc: int, peak: float | None) -> Row:
    """Medians over the steps after the first ``WARM_STEPS`` (start-up, allocator warm-up)."""
    steps = [r for r in records if "mfu" in r]
    timed = [r for r in steps if r["step"] > WARM_STEPS] or steps
    name = f"bf16 training, {nproc} rank{'s' if nproc > 1 else ''}"
    if not timed:
        return Row(name, False, "no step records in log.jsonl")
    tokens = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    against = f"{peak / 1e12:.0f} TFLOP/s per GPU" if peak else "the measured matmul rate"
    finite = all(math.isfinite(r["loss"]) for r in steps)
    return Row(name, finite and 0 < mfu < 1,
               f"{tokens:,.0f} tokens/s, MFU {mfu:.1%} of {against} (median of steps "
               f"{timed[0]['step']}-{timed[-1]['step']}); loss {steps[0]['loss']:.2f} → "
               f"{steps[-1]['loss']:.2f}")


def check_bench(python: str, limit: float) -> Row:
    """``python -m bench --device cuda --dtype bf16``; its figures are the records it appends."""
    before = len(RESULTS.read_text().splitlines()) if RESULTS.exists() else 0
    status, out = run_step([python, "-m", "bench", "--device", "cuda", "--dtype", "bf16"], limit)
    records = [json.loads(x) for x in RESULTS.read_text().splitlines()[before:]] \
        if RESULTS.exists() else []
    if status != 0:
        print(tail(out, 40))
    return Row("python -m bench --device cuda", status == 0 and bool(records),
               "; ".join(bench_figure(r) for r in records) or "no records")


def bench_figure(record: dict) -> str:
    figure = f"{record['bench']} {record['metric']} {record['median']:.3g}"
    if "percent_of_datasheet_peak" in record:
        figure += f" ({record['percent_of_datasheet_peak']:.1f} % of the datasheet peak)"
    return figure


# ---- the whole ---------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  result  figures", f"{'-' * width}  ------  -------"]
    lines += [f"{r.check:<{width}}  {'ok' if r.ok else 'FAILED':<6}  {r.figures}" for r in rows]
    return "\n".join(lines)


def find_machine(args: argparse.Namespace) -> tuple[Machine | None, list[Row], str]:
    """A Python whose torch sees the GPUs (made if need be), the setup's rows, and, where there
    is no GPU, why not."""
    gpus, why_not = nvidia_smi()
    pythons = [args.python] if args.python else [str(v / "bin" / "python") for v in VENVS]
    for python in pythons:
        machine, why = probe(python)
        if machine is not None:
            return machine, [], ""
    if not gpus:
        return None, [], why_not
    if args.python:
        return None, [Row("setup", False, f"torch under {args.python} sees no GPU: {why}")], ""
    machine, row = make_gpu_venv(args.torch_spec)
    return machine, [row], ""


def run_checks(machine: Machine, deadline: float) -> list[Row]:
    nproc = len(machine.gpus)
    steps = {
        "tests": lambda limit: check_tests(machine.python, limit),
        "training": lambda limit: check_training(machine.python, nproc, limit, machine.peak),
        "bench": lambda limit: check_bench(machine.python, limit),
    }
    rows = [gpus_row(machine)]
    for name, step in steps.items():
        left = deadline - time.monotonic()
        if left < 10:
            rows.append(Row(name, False, f"not run: the {BUDGET_S // 60}-minute budget is spent"))
            continue
        limit = min(LIMIT_S[name], left)
        print(f"gpu-check: {name} (at most {limit:.0f} s) ...", flush=True)
        start = time.monotonic()
        rows.append(step(limit))
        print(f"gpu-check: {name} {'ok' if rows[-1].ok else 'FAILED'} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="run the checks under this Python (its torch must "
                        "see the GPUs) instead of .venv's or .venv-gpu's")
    parser.add_argument("--torch-spec", default="torch==2.13.0",
                        help="what pip installs into .venv-gpu when it is made")
    args = parser.parse_args(argv)
    start = time.monotonic()
    machine, rows, why_not = find_machine(args)
    if machine is None and not rows:
        print(f"gpu-check: no GPU on this machine ({why_not}); nothing to check")
        return 0
    if rows:  # .venv-gpu was made: the install does not count against the budget
        start = time.monotonic()
    if machine is not None:
        rows += run_checks(machine, start + BUDGET_S)
    print("\n" + table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
