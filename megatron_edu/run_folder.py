"""A run's output folder (``--out``): one writer at a time, writable, room for a checkpoint —
all checked before any rank starts.

**The lock.** A run holds ``OUT/.lock`` while it runs: a JSON line with its pid, host, start
time and job, created with ``O_CREAT | O_EXCL`` (exactly one of two racing runs creates it) and
removed when the run ends, also when it fails. A second run on the same folder is refused,
naming the first. A lock is *stale*, and taken over with a line saying so, when its owner is gone:

* on this host, when no process has its pid (``os.kill(pid, 0)``);
* from another host — a multi-node job, the folder on a shared filesystem — the pid cannot be
  checked, so the lock counts as live unless it has not been refreshed for ``STALE_AFTER_S``
  (2 hours): rank 0 of a run touches it at most once a minute (``refresh_lock``), so only a run
  that stopped long ago looks stale. The hosts' clocks must roughly agree (NTP).

**Released on every exit it can see:** the end of the run, an error, Ctrl-C (SIGINT raises
KeyboardInterrupt) and SIGTERM — what SLURM sends at preemption or when ``--time`` runs out, and
torchrun's agent to its workers — which ``exit_on_sigterm`` turns into ``SystemExit(143)`` so
that the ``finally`` releasing the lock runs. A run killed with SIGKILL (after SLURM's grace
period, out of memory, a lost node) leaves its lock behind: the next run on this host takes it
over; on another host it waits out ``STALE_AFTER_S`` — unless it is the same job.

**The same job is the same run.** The lock records the job's identity, ``SLURM_JOB_ID`` (kept
by ``sbatch --requeue`` and by every restart of the job), else ``TORCHELASTIC_RUN_ID`` (torchrun's
``--rdzv-id``), when set. A lock of the same job is this run's own, left by the attempt that was
killed — a requeued job usually starts on another node — and is taken over with a line naming
the job and the old host and pid; only a live process of this host is never taken over. A lock
of another job, or of none, is refused as above. (Two runs of one job on one folder at the same
time cannot be told apart from a requeue: give each its own ``--out``.) Under torchrun only
global rank 0 takes the lock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RunFolderError", "LOCK", "STALE_AFTER_S", "prepare_folder", "acquire_lock",
           "release_lock", "refresh_lock", "exit_on_sigterm", "check_space", "format_bytes"]

LOCK = ".lock"
STALE_AFTER_S = 2 * 3600.0
REFRESH_EVERY_S = 60.0
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


class RunFolderError(RuntimeError):
    """The output folder cannot be used: locked by another run, not writable, or too full."""


def prepare_folder(out: Path) -> None:
    """Create ``out`` (and missing parents) or check that it is a writable folder; a
    RunFolderError naming the folder (or the parent) that is in the way."""
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in out.parents if p.exists()), Path("/"))
        why = "is a file" if not blocker.is_dir() else "is not writable"
        raise RunFolderError(f"cannot create the output folder {out}: {blocker} {why} "
                             f"({err.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunFolderError(f"the output folder {out} is not writable")


def _job_id() -> str | None:
    """This process's job: ``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID`` (torchrun's default
    ``none`` is no identity), else None."""
    return next((os.environ[v] for v in JOB_VARIABLES
                 if os.environ.get(v, "none") not in ("", "none")), None)


def _owner_line(owner: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
    job = f", job {owner['job']}" if owner.get("job") else ""
    return f"pid {owner.get('pid')} on host {owner.get('host')}{job}, since {since}"


def _is_live(owner: dict, age_s: float, same_job: bool) -> bool:
    """Is the run that wrote this lock still there? (see the module docstring)"""
    if owner.get("host") != socket.gethostname():
        return not same_job and age_s < STALE_AFTER_S
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:                  # another user's process: alive
        return True
    return True


def acquire_lock(out: Path) -> Path:
    """Take ``out``'s lock for this process (see the module docstring); its path. A
    RunFolderError naming the owner if another live run holds it; a stale lock, or one left by
    this very job (a requeue, a restart), is taken over, with a line on stderr."""
    lock = out / LOCK
    job = _job_id()
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                       "job": job})
    for _ in range(2):                       # the second try: after removing a stale lock
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(mine + "\n")
            return lock
        try:
            owner, age = json.loads(lock.read_text()), time.time() - lock.stat().st_mtime
        except FileNotFoundError:            # released meanwhile: try again
            continue
        except (OSError, ValueError):
            raise RunFolderError(f"{out} has an unreadable lock {lock}: delete it if no run "
                                 f"uses this folder") from None
        same_job = job is not None and owner.get("job") == job
        if _is_live(owner, age, same_job):
            raise RunFolderError(f"{out} is in use by another run: {_owner_line(owner)} (its "
                                 f"lock {lock}; delete it if that run is gone)")
        print(_takeover_line(out, owner, same_job), file=sys.stderr)
        lock.unlink(missing_ok=True)
    raise RunFolderError(f"{out}: another run took the lock {lock} at the same moment")


def _takeover_line(out: Path, owner: dict, same_job: bool) -> str:
    """The warning that a lock is taken over: this job's own, or a stale one."""
    if same_job:
        return (f"warning: taking over the lock of {out} left by this job {owner['job']} before "
                f"it was requeued or restarted: {_owner_line(owner)}")
    return f"warning: taking over the stale lock of {out}: {_owner_line(owner)} is no longer " \
           f"running"


def release_lock(out: Path) -> None:
    """Remove ``out``'s lock if this process holds it (never another run's)."""
    lock = out / LOCK
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def refresh_lock(out: Path) -> None:
    """Touch ``out``'s lock (at most once a minute): a heartbeat that runs on other hosts read
    (``STALE_AFTER_S``). Called by rank 0 every step."""
    lock = out / LOCK
    try:
        if time.time() - lock.stat().st_mtime >= REFRESH_EVERY_S:
            os.utime(lock)
    except OSError:
        pass                                 # no lock (a run started by other code)


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM raises ``SystemExit(128 + 15)``, as SIGINT raises
    KeyboardInterrupt: a scheduler's stop unwinds through the ``finally`` that releases the lock
    instead of killing the process on the spot. The previous handler comes back after the
    block. Only the main thread may set a handler: elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def format_bytes(n: float) -> str:
    """``1.2 GB``: bytes in powers of 1000, as ``df -H`` and disk makers count them."""
    units = ("B", "kB", "MB", "GB", "TB")
    power = 0
    while abs(n) >= 1000 and power < len(units) - 1:
        n, power = n / 1000, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def check_space(folder: Path, need: int, what: str) -> int:
    """Raise a RunFolderError naming ``folder``, the bytes ``what`` needs and those free if they
    do not fit on its filesystem; else the free bytes."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise RunFolderError(f"not enough disk space in {folder}: {what} takes about "
                             f"{format_bytes(need)}, {format_bytes(free)} are free")
    return free

