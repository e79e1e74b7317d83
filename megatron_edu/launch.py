"""Run a function on N processes with ``torch.distributed`` initialised — from a notebook, a test
or a script, and unchanged under ``torchrun``:

    results = run(fn, 4, x, y=2)      # fn(x, y=2) on ranks 0..3; returns [result of rank 0, ...]

* ``fn`` travels by value (cloudpickle): a function defined in a notebook cell runs too.
* Ranks start by ``forkserver`` with torch preloaded: ~0.1 s a launch, not spawn's 2–4 s, and safe
  after threaded torch ops (``fork`` can deadlock). A fresh file-store rendezvous per call.
* Each rank's fds 1 and 2 go to a file, printed afterwards rank by rank as ``[rank r] ...``: a
  deterministic order (nbval compares it), visible in Jupyter.
* Never a hang. A rank that raises or dies fails the run within seconds, however long a
  collective may wait: the parent polls its ranks, kills the others and raises ``RankError`` with
  the traceback. ``timeout`` cuts off a stuck call; opt-in, ``deadlock_after`` stops ranks all
  blocked on each other (no CPU used, none finishing) with ``DeadlockError``.
* Under ``torchrun`` (whose agent watches the processes), ``run`` initialises the process group,
  calls ``fn`` here and all-gathers the results. Either way the group ``run`` made is destroyed
  (after a barrier) before it returns: one left alive at interpreter exit can abort the process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

__all__ = ["run", "RankError", "DeadlockError", "resolve_backend", "under_torchrun"]

DEFAULT_TIMEOUT = 300.0  # seconds: a call from a notebook or a test, and its collectives
RENDEZVOUS_ATTEMPTS = 3
# CPU seconds a rank must use to count as moving: a rank blocked in gloo's waits uses about one
# 10 ms tick in 5 s (background threads), a computing one this much in well under 0.1 s.
CPU_MOVED = 0.05


class RankError(RuntimeError):
    """A rank raised or died; the message holds its traceback and its captured output."""


class DeadlockError(TimeoutError):
    """The unfinished ``ranks`` sat blocked, using no CPU, for ``idle`` s (``deadlock_after``)."""

    def __init__(self, message: str, ranks: list[int], idle: float) -> None:
        super().__init__(message)
        self.ranks, self.idle = ranks, idle


class _RendezvousError(RankError):
    """Ranks failed to connect to each other before any of them ran ``fn``: safe to retry."""


@dataclass
class _Outcome:
    ok: bool
    payload: bytes  # cloudpickled return value, or the formatted traceback (utf-8)
    in_rendezvous: bool = False  # failed in init_process_group, before fn


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher setting these variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> NCCL when every rank of this machine (LOCAL_WORLD_SIZE under torchrun) can have a
    GPU of its own, else gloo; 'nccl' without them is refused before any rank starts."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() \
        else world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < local:
        raise ValueError(f"the nccl backend needs a GPU per rank: {local} ranks on this machine, "
                         f"{gpus} GPUs (use fewer ranks, or gloo)")
    if backend != "auto":
        return backend
    return "nccl" if gpus >= local else "gloo"


def run(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
        timeout: float | None = DEFAULT_TIMEOUT, collective_timeout: float | None = None,
        threads_per_rank: int | None = None, capture_output: bool = True,
        deadlock_after: float | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``backend``: "auto" (``resolve_backend``), "gloo" or "nccl". ``timeout`` (s) bounds the call,
    None nothing (long runs); ``collective_timeout`` each collective (gloo's timeout, NCCL's
    watchdog), by default ``timeout`` or DEFAULT_TIMEOUT. ``threads_per_rank``: by default an even
    share of the cores. ``capture_output=False``: ranks write straight to the terminal.
    ``deadlock_after`` (s, local launch): raise ``DeadlockError`` once every running rank has used
    no CPU for that long and none finished. Opt-in, as a rank in ``time.sleep`` looks blocked too;
    where CPU times cannot be read (not Linux) ``timeout`` alone decides.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout),
                        ("deadlock_after", deadlock_after)):
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    collective_timeout = collective_timeout or timeout or DEFAULT_TIMEOUT
    backend = resolve_backend(backend, world_size)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, collective_timeout)
    payload = cloudpickle.dumps((fn, args, kwargs))
    attempt = 1
    while True:
        # gloo's full-mesh connect can fail on an overloaded machine ("Connection closed by
        # peer"); no rank has run fn then, since none gets past init without all the others.
        with tempfile.TemporaryDirectory(prefix="megatron_edu_") as tmp:
            try:
                return _launch(payload, world_size, backend, timeout, collective_timeout,
                               threads_per_rank, capture_output, deadlock_after, Path(tmp))
            except _RendezvousError:
                if attempt == RENDEZVOUS_ATTEMPTS:
                    raise
                attempt += 1


# --- under torchrun: this process is one rank already ------------------------------------------
def _run_under_torchrun(fn, world_size, args, kwargs, backend, collective_timeout) -> list[Any]:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"run(..., world_size={world_size}) under torchrun with "
                         f"WORLD_SIZE={env_world}: they must be equal")
    owner = not dist.is_initialized()  # a group the caller made is the caller's to destroy
    if owner:
        device = _bind_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout),
                                device_id=device)
    result = fn(*args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if owner:
        _shut_down()
    return gathered


# --- local launch: the parent starts, watches and reaps the ranks ------------------------------
def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo: every torch.optim optimizer imports it on construction (~2.5 s a rank)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "megatron_edu.launch"])
        return ctx
    return mp.get_context("spawn")  # Windows


def _launch(payload, world_size, backend, timeout, collective_timeout, threads, capture,
            deadlock_after, tmp: Path) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    logs = [tmp / f"rank{r}.log" for r in range(world_size)]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, backend, str(tmp / "store"), collective_timeout,
                               threads, str(logs[r]) if capture else None, payload, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    stop = _KillRanksOnSigterm()
    try:
        outcomes = _collect(procs, queue, timeout, logs if capture else None, deadlock_after)
    finally:
        _reap(procs)
        queue.close()
        stop.restore()
    if capture:
        _print_logs(logs)
    return [cloudpickle.loads(outcomes[r].payload) for r in range(world_size)]


class _KillRanksOnSigterm:
    """While ranks run, SIGTERM (a job scheduler, ``kill``) exits the parent through the
    ``finally`` that kills them, not orphaning them. Only the main thread may set the handler."""

    def __init__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._exit)

    @staticmethod
    def _exit(signum, frame) -> None:
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _collect(procs, queue, timeout: float, logs, deadlock_after=None) -> dict[int, _Outcome]:
    """Read outcomes as they arrive (before joining: a full pipe would block a child's exit)."""
    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    watch = _DeadlockWatch(procs, deadlock_after) if deadlock_after is not None else None
    while len(outcomes) < len(procs):
        _drain(queue, outcomes, wait=0.1)
        if _failures(procs, outcomes, logs):
            # The first failure is often a consequence (a peer's "connection closed") and a dead
            # rank's result may still be in the pipe: wait a moment, report every failed rank.
            _drain(queue, outcomes, wait=1.0)
            if failures := _failures(procs, outcomes, logs):
                failed = [o for o in outcomes.values() if not o.ok]
                rendezvous = len(failures) == len(failed) and all(o.in_rendezvous
                                                                  for o in failed)
                raise (_RendezvousError if rendezvous else RankError)("\n\n".join(failures))
        if watch is not None and (stuck := watch.stuck(outcomes)):
            for r in stuck:  # blocked for good: no grace to wait out in _reap
                procs[r].kill()
            raise _deadlock(stuck, deadlock_after, sorted(outcomes), logs)
        if time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in outcomes]
            raise TimeoutError(
                f"ranks {missing} did not finish within {timeout:g} s (a stuck collective, or a "
                f"rank waiting for a peer that never sends?)" + _tail_logs(logs, missing))
    return outcomes


class _DeadlockWatch:
    """Are the running ranks blocked on each other? Yes once, for ``after`` s, none used CPU_MOVED
    s of CPU (one waiting in gloo uses none) and none finished (a finished one is not waited on)."""

    def __init__(self, procs, after: float) -> None:
        self.procs, self.after = procs, after
        self.marks: dict[int, float] = {}  # CPU seconds of each running rank when last moving
        self.finished, self.since = 0, time.monotonic()

    def stuck(self, outcomes: dict[int, _Outcome]) -> list[int]:
        """The ranks still running if they have been blocked for ``after`` s, else []."""
        running = [r for r in range(len(self.procs)) if r not in outcomes]
        cpu = {r: _cpu_seconds(self.procs[r].pid) for r in running}
        if None in cpu.values():
            return []  # CPU times unknown: the timeout decides
        now = time.monotonic()
        moved = any(cpu[r] - self.marks.get(r, -math.inf) > CPU_MOVED for r in running)
        if moved or len(outcomes) != self.finished:
            self.marks, self.finished, self.since = cpu, len(outcomes), now
            return []
        return running if now - self.since >= self.after else []


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (/proc/<pid>/stat fields 14, 15); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # after "(name)", which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _deadlock(stuck: list[int], after: float, finished: list[int], logs) -> DeadlockError:
    done = f"; ranks {finished} had finished" if finished else ""
    return DeadlockError(
        f"ranks {stuck} did not finish: blocked, using no CPU, for {after:g} s — a deadlock, "
        f"detected (a send without its recv, or a collective some rank never reaches?){done}"
        + _tail_logs(logs, stuck), stuck, after)


def _drain(queue, outcomes: dict[int, _Outcome], wait: float) -> None:
    end = time.monotonic() + wait
    while (left := end - time.monotonic()) > 0:
        try:
            rank, outcome = queue.get(timeout=left)
        except Exception:  # queue.Empty
            return
        outcomes[rank] = outcome


def _failures(procs, outcomes: dict[int, _Outcome], logs) -> list[str]:
    """Ranks that died without a result, then ranks that raised, in the order they reported
    (the first to raise is usually the cause; its peers then fail with "connection closed")."""
    died = [f"rank {r} exited with code {p.exitcode} without a result (killed, out of memory, "
            f"or os._exit?)" + _tail_logs(logs, [r])
            for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
    raised = [f"rank {r} raised:\n{o.payload.decode()}" + _tail_logs(logs, [r])
              for r, o in outcomes.items() if not o.ok]
    return died + raised


def _reap(procs, grace: float = 2.0) -> None:
    """Join the ranks within ``grace`` seconds in all; kill those still alive (stuck ones)."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _tail_logs(logs, ranks, lines: int = 20) -> str:
    if logs is None:
        return ""
    parts = []
    for r in ranks:
        text = logs[r].read_text(errors="replace") if logs[r].exists() else ""
        if text.strip():
            tail = "\n".join(text.rstrip().splitlines()[-lines:])
            parts.append(f"\n--- last output of rank {r} ---\n{tail}")
    return "".join(parts)


def _print_logs(logs) -> None:
    for r, log in enumerate(logs):
        for line in log.read_text(errors="replace").splitlines():
            print(f"[rank {r}] {line}")


# --- inside a child ----------------------------------------------------------------------------
def _rank_main(rank, world_size, backend, store_path, collective_timeout, threads, log, payload,
               queue):
    if log is not None:
        _redirect_output(log)
    try:
        torch.set_num_threads(threads)
        device = _bind_device(backend, rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout),
                                device_id=device)
    except Exception:
        outcome = _Outcome(False, traceback.format_exc().encode(), in_rendezvous=True)
    else:
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            outcome = _Outcome(True, cloudpickle.dumps(fn(*args, **kwargs)))
        except BaseException:
            outcome = _Outcome(False, traceback.format_exc().encode())
    sys.stdout.flush()
    sys.stderr.flush()
    queue.put((rank, outcome))
    queue.close()
    queue.join_thread()
    if outcome.ok:
        _shut_down()


# --- both modes --------------------------------------------------------------------------------
def _bind_device(backend: str, local_rank: int) -> torch.device | None:
    """Under NCCL: this rank's GPU, made current and passed as ``device_id``, so that NCCL creates
    each group's communicator eagerly, when every rank makes the group — never lazily inside a
    pipeline schedule, where two ranks could each wait in communicator creation for the other."""
    if backend != "nccl":
        return None
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _shut_down() -> None:
    """Leave the process group before the interpreter exits: one alive at exit is torn down by
    static destructors while its threads run — SIGABRT about one exit in three, a failed job to
    torchrun. The barrier lets every rank finish its last messages first."""
    dist.barrier()
    dist.destroy_process_group()


def _redirect_output(path: str) -> None:
    """Point this process's fds 1 and 2 (Python *and* C-level writes) at a file of its own."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the rank
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
