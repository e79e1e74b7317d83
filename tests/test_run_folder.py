"""The run folder's lock: one writer at a time, a stale lock taken over, another host's lock
live until it has not been refreshed for STALE_AFTER_S (a run's refusal through the command
line: tests/test_train.py)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_edu.run_folder import (
    LOCK,
    STALE_AFTER_S,
    RunFolderError,
    acquire_lock,
    release_lock,
)


def _lock(folder, pid, host=None, age_s=0.0):
    since = time.time() - age_s
    (folder / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                           "since": since}))
    os.utime(folder / LOCK, (since, since))


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_lock_is_exclusive_and_released_only_by_its_owner(tmp_path):
    lock = acquire_lock(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(RunFolderError, match=rf"{tmp_path} is in use by another run: pid "
                       rf"{os.getpid()} on host {socket.gethostname()}, since "):
        acquire_lock(tmp_path)
    release_lock(tmp_path)
    assert not lock.exists()
    _lock(tmp_path, os.getppid())                        # someone else's: left alone
    release_lock(tmp_path)
    assert lock.exists()


def test_a_stale_lock_on_this_host_is_taken_over_with_a_line(tmp_path, capsys):
    _lock(tmp_path, pid := _dead_pid())
    acquire_lock(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert capsys.readouterr().err.startswith(
        f"warning: taking over the stale lock of {tmp_path}: pid {pid} on host ")


def test_another_hosts_lock_is_live_until_not_refreshed_for_hours(tmp_path):
    _lock(tmp_path, 1, host="elsewhere", age_s=STALE_AFTER_S - 60)
    with pytest.raises(RunFolderError, match="pid 1 on host elsewhere"):
        acquire_lock(tmp_path)
    _lock(tmp_path, 1, host="elsewhere", age_s=STALE_AFTER_S + 60)
    acquire_lock(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["host"] == socket.gethostname()

