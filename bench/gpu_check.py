"""``make gpu-check``: megatron-edu on this machine's GPUs, in under 8 minutes on one GPU.

    python3 bench/gpu_check.py                      # what make gpu-check runs
    python3 bench/gpu_check.py --python ~/env/bin/python   # under a CUDA-enabled Python of yours

Without a GPU it says so in one line and exits 0. With one it

1. finds a Python whose torch sees the GPUs: ``.venv``'s, else ``.venv-gpu``'s, creating
   ``.venv-gpu`` (``pip install torch==2.13.0``, a CUDA build on Linux x86_64, then this package)
   when neither does: a one-off install of a few GB, not counted in the 8 minutes. Before it
   installs, it reads the driver's CUDA version from nvidia-smi's header and refuses a wheel
   built for a newer CUDA major version in one line naming the index to install from instead,
   and says in one line what Triton will miss (a C compiler, Python's headers);
2. measures the GPU's bf16 matmul rate (``perf.measure_matmul_flops``: 8192³ products queued,
   timed by CUDA events) and asks the performance model (``perf.advisor``) what MFU to expect
   of step 4's run (``bench.mfu.advisor_prediction``);
3. runs ``tests/test_device.py --device cuda``: a GPT's forward and backward, PTD-P steps and
   bf16 autocast on CUDA and NCCL against the CPU; on one GPU, dropout masks, the fused kernels,
   the fused and eager attention cores, ``torch.compile``, recomputation, fp16 loss scaling and
   no host sync inside a microbatch; on two GPUs or more, every layout that fits (tp with
   sequence parallelism, cp, ZeRO-1 and 3, pp with 1F1B and ZB-H1, ...) and the bytes on the
   wire under bf16;
4. trains GPT-2 medium (345M) in bf16 for a few steps, one rank per GPU, micro-batch 4, the
   fused attention core, and reads tokens/s and MFU — over the datasheet's dense bf16 peak and
   over the measured one — from its ``log.jsonl``, the first steps' compile and warm-up time
   apart from the step time;
5. runs the benchmarks that take a GPU: (a) at dropout 0 (like with like), (e) and (g);

then prints one table (check, result, figures) and exits 1 if a check failed. Each step runs in
a subprocess with a time limit, all of them within ``BUDGET_S`` on one GPU (a little more per
world size that more GPUs add). This file needs only the standard library: the interpreter
running it may have no torch, or a CPU-only one.
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
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = (ROOT / ".venv", ROOT / ".venv-gpu")   # tried in this order; the last one is made
BUDGET_S = 8 * 60          # every check together, on one GPU (a .venv-gpu install comes on top)
LIMIT_S = {"tests": 180, "training": 130, "bench": 150}
# the multi-GPU device tests launch once per world size of 2, 4, 8 that fits: time on top
WORLDS, PER_WORLD_S = (2, 4, 8), 90
INSTALL_LIMIT_S = 20 * 60
TRAIN_STEPS, WARM_STEPS = 30, 5   # figures are medians over the steps after the first 5
MICRO_BATCH, BATCH_PER_GPU, GPT2_SEQ_LEN = 4, 16, 1024
GPT2_MEDIUM = ("--preset", "gpt2-medium", "--micro-batch", str(MICRO_BATCH),
               "--attention", "fused")
BENCHES = (  # (a) like with like: both sides' attention is sdpa on a GPU, and dropout 0
    ("-m", "bench.overhead", "--device", "cuda", "--dtype", "bf16", "--dropout", "0"),
    ("-m", "bench", "--only", "e", "g", "j", "--device", "cuda", "--dtype", "bf16"),
)
RESULTS = ROOT / "bench" / "results.jsonl"
TORCH_SPEC = "torch==2.13.0"
# The CUDA that TORCH_SPEC's wheel from PyPI (Linux x86_64) is built with: it requires
# cuda-toolkit==13.0.3. Update the two together.
PYPI_WHEEL_CUDA = (13, 0)
# PyTorch's own index of a CUDA build, for a driver of each CUDA major version: a driver runs
# every minor version of its major one (CUDA's minor version compatibility), none of the next.
CUDA_INDEX = {12: "https://download.pytorch.org/whl/cu128",
              13: "https://download.pytorch.org/whl/cu130"}
PROBE = """\
import json, sys, sysconfig, torch
from megatron_edu.perf import datasheet_peak_flops, measure_matmul_flops
try:  # is_available() only says no; init() says why (no driver, a driver too old, ...)
    torch.cuda.init()
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
seen = {"torch": torch.__version__, "cuda": torch.version.cuda, "error": error,
        "gpus": [torch.cuda.get_device_name(i) for i in range(n)],
        "include": sysconfig.get_paths()["include"]}  # where Triton looks for Python.h
if n:
    from bench.mfu import advisor_prediction  # the repository is the working directory
    seen["peak"] = datasheet_peak_flops("cuda")
    seen["measured"] = measure_matmul_flops("cuda", torch.bfloat16)
    seen["prediction"] = str(advisor_prediction(seen["peak"] or seen["measured"],
                                                micro_batch=int(sys.argv[1]),
                                                batch=int(sys.argv[2])))
print(json.dumps(seen))
"""


@dataclass
class Row:
    """One line of the summary table: ``ok`` True, False (FAILED) or None (not run: it does not
    apply here, which fails nothing)."""

    check: str
    ok: bool | None
    figures: str

    @property
    def result(self) -> str:
        return {True: "ok", False: "FAILED", None: "not run"}[self.ok]


@dataclass(frozen=True)
class Peaks:
    """A GPU's dense bf16 FLOP/s: its datasheet's (None if not in the table) and the rate its
    matmuls reached here (None if not measured)."""

    datasheet: float | None
    measured: float | None

    @property
    def used(self) -> float | None:
        """What MFU is reported against first: the datasheet's, else the measured one."""
        return self.datasheet or self.measured


@dataclass
class Machine:
    """A Python whose torch sees GPUs, and what it sees."""

    python: str
    torch: str
    cuda: str | None
    gpus: list[str]
    peaks: Peaks
    prediction: str | None   # the advisor's MFU for the training check (bench.mfu)
    include: str | None      # the directory of its Python.h


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi says: the GPUs, the newest CUDA the driver runs, why no GPU."""

    gpus: list[str]
    cuda: tuple[int, int] | None
    why_not: str = ""


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


def driver_cuda_version(text: str) -> tuple[int, int] | None:
    """The newest CUDA the driver runs, from nvidia-smi's header: "… CUDA Version: 12.2 |"."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else None


def nvidia_smi() -> Driver:
    """The GPUs nvidia-smi lists and its header's CUDA version, or why it lists none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Driver([], None, "nvidia-smi not found")
    status, out = run_step([exe, "-L"], 60)
    names = gpus_nvidia_smi_lists(out) if status == 0 else []
    if not names:
        first = out.strip().splitlines()[0] if out.strip() else "no output"
        return Driver([], None, f"nvidia-smi lists no GPU: {first}")
    status, header = run_step([exe], 60)
    return Driver(names, driver_cuda_version(header) if status == 0 else None)


def wheel_cuda_version(torch_spec: str) -> tuple[int, int] | None:
    """The CUDA that ``pip install <torch_spec>`` brings: an index's or a local version's
    ``cu<major><minor>`` (cu128 → 12.8), None for a CPU build (``cpu``), else PyPI's wheel's."""
    if re.search(r"(/|\+)cpu\b", torch_spec):
        return None
    found = re.search(r"\bcu(\d+)(\d)\b", torch_spec.replace("+", " "))
    return (int(found[1]), int(found[2])) if found else PYPI_WHEEL_CUDA


def _version(cuda: tuple[int, int]) -> str:
    return ".".join(map(str, cuda))


def driver_problem(driver: tuple[int, int] | None, torch_spec: str) -> str:
    """'' if a driver running CUDA ``driver`` (None: unknown) can run the wheel ``torch_spec``
    brings, else one line: why not, and what to install instead."""
    wheel = wheel_cuda_version(torch_spec)
    if wheel is None:
        return f"{torch_spec!r} installs a CPU-only torch: name a CUDA build (TORCH_SPEC=...)"
    if driver is None or driver[0] >= wheel[0]:
        return ""
    torch_version = torch_spec.split()[0]
    index = CUDA_INDEX.get(driver[0])
    instead = (f'make gpu-check TORCH_SPEC="{torch_version} --index-url {index}"' if index
               else f"no {torch_version} build runs on CUDA {driver[0]}")
    return (f"the driver's CUDA {_version(driver)} is older than the wheel's "
            f"{_version(wheel)}: {instead}, or update the NVIDIA driver")


def c_compiler(environ: dict[str, str] | None = None) -> str | None:
    """The C compiler Triton builds its kernels' launchers with (``triton/runtime/build.py``):
    $CC, else gcc, else clang on PATH; None if none is there."""
    environ = os.environ if environ is None else environ
    path = environ.get("PATH")
    if environ.get("CC"):
        return shutil.which(environ["CC"], path=path)
    return shutil.which("gcc", path=path) or shutil.which("clang", path=path)


def toolchain_problem(compiler: str | None, include: str | None) -> str:
    """'' if Triton (torch.compile: the fused kernels, a GPU's dropout masks, ``--compile``) has
    what it builds with, else one line: what is missing. ``include``: the Python's include
    directory (None: not known), where its launchers' ``#include <Python.h>`` looks."""
    missing = []
    if compiler is None:
        missing.append("a C compiler ($CC, gcc or clang on PATH: apt-get install gcc)")
    if include is not None and not (Path(include) / "Python.h").exists():
        missing.append(f"Python's headers (no Python.h in {include}: apt-get install "
                       f"python3-dev)")
    return ("Triton (torch.compile) needs " + " and ".join(missing)) if missing else ""


def probe(python: str) -> tuple[Machine | None, str]:
    """What torch under ``python`` sees, or None and why not: torch's own error where it has one
    (a CUDA build that cannot reach the driver), else what is known."""
    if not Path(python).exists():
        return None, f"{python} does not exist"
    status, out = run_step([python, "-c", PROBE, str(MICRO_BATCH), str(BATCH_PER_GPU)], 120)
    answer = [line for line in out.splitlines() if line.startswith("{")]
    if status != 0 or not answer:
        return None, f"torch under {python} could not be asked: {tail(out, 3)}"
    seen = json.loads(answer[-1])
    if not seen["gpus"]:
        why = seen["error"] or f"torch {seen['torch']} has no CUDA (a CPU-only build?)"
        return None, why
    return Machine(python, seen["torch"], seen["cuda"], seen["gpus"],
                   Peaks(seen["peak"], seen["measured"]), seen["prediction"],
                   seen["include"]), ""


def make_gpu_venv(torch_spec: str, driver: Driver) -> tuple[Machine | None, Row]:
    """Create the last of ``VENVS`` with ``torch_spec`` and this package (with its tests),
    unless the driver cannot run the wheel: then one line saying which to install instead."""
    venv = VENVS[-1]
    if problem := driver_problem(driver.cuda, torch_spec):
        return None, Row("setup", False, f"{venv.name} not made: {problem}")
    if problem := toolchain_problem(c_compiler(), _python_include()):
        print(f"gpu-check: {problem}", flush=True)
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
                         f"gpu-check TORCH_SPEC=\"{TORCH_SPEC} --index-url ...\")")
    return machine, Row("setup", True, f"{venv.name}: torch {machine.torch}")


def _python_include() -> str:
    """This interpreter's include directory: a venv made from it uses the same headers."""
    return sysconfig.get_paths()["include"]


# ---- the checks -------------------------------------------------------------------------------


def _tflops(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s"


def gpus_row(machine: Machine) -> Row:
    names = sorted(set(machine.gpus))
    peaks = machine.peaks
    datasheet = (f"{_tflops(peaks.datasheet)} bf16 (datasheet)" if peaks.datasheet
                 else "not in the datasheet table")
    measured = f", {_tflops(peaks.measured)} measured (8192³ bf16 matmuls)" \
        if peaks.measured else ""
    return Row("GPUs", True, f"{len(machine.gpus)} × {', '.join(names)}; torch {machine.torch}, "
                             f"CUDA {machine.cuda}; peak {datasheet}{measured}")


def environment_row(driver: Driver, machine: Machine) -> Row:
    """The driver's CUDA against torch's, and what Triton builds with: one line of what is
    missing, where something is."""
    torch_cuda = tuple(map(int, machine.cuda.split(".")[:2])) if machine.cuda else None
    problems = [p for p in (
        f"the driver's CUDA {_version(driver.cuda)} is older than torch's {machine.cuda}"
        if driver.cuda and torch_cuda and driver.cuda[0] < torch_cuda[0] else "",
        toolchain_problem(c_compiler(), machine.include)) if p]
    if problems:
        return Row("environment", False, "; ".join(problems))
    found = (f"driver's CUDA {_version(driver.cuda)}" if driver.cuda
             else "driver's CUDA not in nvidia-smi's header")
    return Row("environment", True, f"{found}, torch's {machine.cuda}; C compiler "
                                    f"{c_compiler()}, Python.h in {machine.include}")


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


def _seq_len(model: tuple[str, ...]) -> int:
    """The sequence length a training command's model flags give (the GPT-2 presets': 1024)."""
    return int(model[model.index("--seq-len") + 1]) if "--seq-len" in model else GPT2_SEQ_LEN


def check_training(python: str, nproc: int, limit: float, peaks: Peaks, *,
                   model: tuple[str, ...] = GPT2_MEDIUM, steps: int = TRAIN_STEPS,
                   extra: tuple[str, ...] = ()) -> Row:
    """A bf16 training run, one rank per GPU, told the peak ``peaks.used`` (none: it measures
    its own); its tokens/s, MFU and times from OUT/log.jsonl."""
    batch = BATCH_PER_GPU * nproc
    peak = ("--peak-tflops", repr(peaks.used / 1e12)) if peaks.used else ()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
        cmd = [python, "-m", "megatron_edu.train", *model, "--dtype", "bf16",
               "--nproc", str(nproc), "--global-batch", str(batch), "--steps", str(steps),
               "--warmup", "5", "--eval-interval", str(steps), "--eval-batches", "1",
               "--save-interval", str(steps), "--sample-tokens", "0", "--no-progress",
               "--out", out, *peak, *extra]
        start = time.monotonic()
        status, output = run_step(cmd, limit)
        wall = time.monotonic() - start
        log = Path(out) / "log.jsonl"
        records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    row = training_row(records, nproc, peaks, batch * _seq_len(model), wall)
    if status != 0:
        print(tail(output, 40))
        row = Row(row.check, False, "did not finish: " + output.strip().splitlines()[-1]
                  if output.strip() else "did not finish")
    return row


def training_row(records: list[dict], nproc: int, peaks: Peaks,
                 tokens_per_step: int | None = None, wall_s: float | None = None) -> Row:
    """Medians over the steps after the first ``WARM_STEPS`` (start-up, allocator warm-up,
    compilation): tokens/s, MFU over each peak known, and — given the tokens of a step — the
    step time, the first steps' time beyond it (warm-up) and, given the run's wall time, the
    rest of it (start-up, evaluation, checkpoint)."""
    steps = [r for r in records if "mfu" in r]
    timed = [r for r in steps if r["step"] > WARM_STEPS] or steps
    name = f"bf16 training, {nproc} rank{'s' if nproc > 1 else ''}"
    if not timed:
        return Row(name, False, "no step records in log.jsonl")
    tokens = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)   # over peaks.used: the run was told it
    if peaks.used:
        achieved = mfu * peaks.used                    # model FLOP/s per GPU
        against = [f"{achieved / peak:.1%} of the {kind} {_tflops(peak)}"
                   for kind, peak in (("datasheet's", peaks.datasheet),
                                      ("measured", peaks.measured)) if peak]
    else:
        against = [f"{mfu:.1%} of the run's own measured matmul rate"]
    figures = (f"{tokens:,.0f} tokens/s, MFU {', '.join(against)} (median of steps "
               f"{timed[0]['step']}-{timed[-1]['step']})")
    if tokens_per_step:
        seconds = {r["step"]: tokens_per_step / r["tokens_per_s"] for r in steps}
        step = statistics.median(seconds[r["step"]] for r in timed)
        warm = sum(t - step for s, t in seconds.items() if s <= WARM_STEPS)
        figures += f"; step {step * 1e3:.0f} ms, warm-up {warm:.1f} s over it (steps ≤ " \
                   f"{WARM_STEPS}: compilation, allocator)"
        if wall_s is not None:
            figures += f", the rest {wall_s - sum(seconds.values()):.0f} s (start-up, " \
                       f"evaluation, checkpoint)"
    finite = all(math.isfinite(r["loss"]) for r in steps)
    return Row(name, finite and 0 < mfu < 1,
               f"{figures}; loss {steps[0]['loss']:.2f} → {steps[-1]['loss']:.2f}")


def check_bench(python: str, limit: float) -> Row:
    """The GPU benchmarks, ``BENCHES``; their figures are the records they append."""
    before = len(RESULTS.read_text().splitlines()) if RESULTS.exists() else 0
    deadline, ok = time.monotonic() + limit, True
    for args in BENCHES:
        status, out = run_step([python, *args], deadline - time.monotonic())
        if status != 0:
            print(tail(out, 40))
            ok = False
    records = [json.loads(x) for x in RESULTS.read_text().splitlines()[before:]] \
        if RESULTS.exists() else []
    return Row("benchmarks (a) at dropout 0, (e), (g) on cuda", ok and bool(records),
               "; ".join(bench_figure(r) for r in records) or "no records")


def bench_figure(record: dict) -> str:
    figure = f"{record['bench']} {record['metric']} {record['median']:.3g}"
    if "percent_of_datasheet_peak" in record:
        figure += f" ({record['percent_of_datasheet_peak']:.1f} % of the datasheet peak)"
    return figure


# ---- the whole ---------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  result   figures", f"{'-' * width}  -------  -------"]
    lines += [f"{r.check:<{width}}  {r.result:<7}  {r.figures}" for r in rows]
    return "\n".join(lines)


def find_machine(args: argparse.Namespace, driver: Driver) -> tuple[Machine | None, list[Row]]:
    """A Python whose torch sees the GPUs (made if need be) and the setup's rows; None and no
    row where there is no GPU."""
    pythons = [args.python] if args.python else [str(v / "bin" / "python") for v in VENVS]
    for python in pythons:
        machine, why = probe(python)
        if machine is not None:
            return machine, []
    if not driver.gpus:
        return None, []
    if args.python:
        return None, [Row("setup", False, f"torch under {args.python} sees no GPU: {why}")]
    machine, row = make_gpu_venv(args.torch_spec, driver)
    return machine, [row]


def budget_s(nproc: int) -> float:
    """``BUDGET_S``, and ``PER_WORLD_S`` more for each multi-GPU world the tests launch."""
    return BUDGET_S + PER_WORLD_S * sum(w <= nproc for w in WORLDS)


def run_checks(machine: Machine, driver: Driver, deadline: float) -> list[Row]:
    nproc = len(machine.gpus)
    extra = budget_s(nproc) - BUDGET_S
    steps = {
        "tests": lambda limit: check_tests(machine.python, limit),
        "training": lambda limit: check_training(machine.python, nproc, limit, machine.peaks),
        "bench": lambda limit: check_bench(machine.python, limit),
    }
    rows = [gpus_row(machine), environment_row(driver, machine)]
    for name, step in steps.items():
        left = deadline - time.monotonic()
        if left < 10:
            rows.append(Row(name, False, f"not run: the {budget_s(nproc) / 60:.1f}-minute "
                                         f"budget is spent"))
            continue
        limit = min(LIMIT_S[name] + (extra if name == "tests" else 0), left)
        print(f"gpu-check: {name} (at most {limit:.0f} s) ...", flush=True)
        start = time.monotonic()
        rows.append(step(limit))
        print(f"gpu-check: {name} {rows[-1].result} ({time.monotonic() - start:.0f} s)",
              flush=True)
        if name == "training" and machine.prediction:
            rows.append(Row("advisor's prediction for it (1 GPU)", True, machine.prediction))
    if nproc == 1:
        rows.append(Row("layouts on 2+ GPUs (NCCL)", None, "one GPU here: tp with SP, cp, "
                        "ZeRO-1/3, pp 1F1B/ZB-H1 and the bf16 wire need two"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="run the checks under this Python (its torch must "
                        "see the GPUs) instead of .venv's or .venv-gpu's")
    parser.add_argument("--torch-spec", default=TORCH_SPEC,
                        help="what pip installs into .venv-gpu when it is made")
    args = parser.parse_args(argv)
    start = time.monotonic()
    driver = nvidia_smi()
    machine, rows = find_machine(args, driver)
    if machine is None and not rows:
        print(f"gpu-check: no GPU on this machine ({driver.why_not}); nothing to check")
        return 0
    if rows:  # .venv-gpu was made: the install does not count against the budget
        start = time.monotonic()
    if machine is not None:
        rows += run_checks(machine, driver, start + budget_s(len(machine.gpus)))
    print("\n" + table(rows))
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
