"""The run folder's lock: one writer at a time, a stale lock taken over, another host's lock
live until it has not been refreshed for STALE_AFTER_S — unless it is this very job's, left by
an attempt killed before a requeue (a run's refusal, a requeued run and the lock's release on
SIGTERM through the command line: tests/test_train.py)."""

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


def _lock(folder, pid, host=None, age_s=0.0, job=None):
    since = time.time() - age_s
    (folder / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                           "since": since, "job": job}))
    os.utime(folder / LOCK, (since, since))


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """No job identity unless a test sets one (the tests may run inside a SLURM job)."""
    for variable in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)


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



def test_a_lock_left_by_this_job_on_another_host_is_taken_over_with_a_line(tmp_path, capsys,
                                                                         monkeypatch):
    """SLURM requeue: the attempt killed with SIGKILL left its lock, fresh, on another node."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _lock(tmp_path, 1, host="another-node", job="4242")
    acquire_lock(tmp_path)
    mine = json.loads((tmp_path / LOCK).read_text())
    assert (mine["pid"], mine["job"]) == (os.getpid(), "4242")
    assert capsys.readouterr().err.startswith(
        f"warning: taking over the lock of {tmp_path} left by this job 4242 before it was "
        f"requeued or restarted: pid 1 on host another-node, job 4242, since ")


@pytest.mark.parametrize(("env", "owner_job"), [
    ({"SLURM_JOB_ID": "4243"}, "4242"),                   # another job
    ({}, "4242"),                                         # a run outside any job
    ({"SLURM_JOB_ID": "4242"}, None),                     # a lock without a job
    ({"TORCHELASTIC_RUN_ID": "none"}, "none"),            # torchrun's default is no identity
], ids=["another-job", "no-job", "lock-without-job", "torchrun-default"])
def test_a_lock_of_another_job_or_of_none_is_refused_as_before(tmp_path, monkeypatch, env,
                                                               owner_job):
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    _lock(tmp_path, 1, host="another-node", job=owner_job)
    with pytest.raises(RunFolderError, match=f"{tmp_path} is in use by another run: pid 1 on "
                       f"host another-node{f', job {owner_job}' if owner_job else ''}, since"):
        acquire_lock(tmp_path)


def test_the_job_is_slurms_else_torchruns_and_a_live_process_here_is_never_taken_over(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gpt-8b")
    _lock(tmp_path, os.getppid(), job="gpt-8b")           # this host, alive: the same job twice
    with pytest.raises(RunFolderError, match="in use by another run"):
        acquire_lock(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")            # SLURM's id comes first
    _lock(tmp_path, 1, host="another-node", job="gpt-8b")
    with pytest.raises(RunFolderError, match="in use by another run"):
        acquire_lock(tmp_path)
    _lock(tmp_path, 1, host="another-node", job="4242")
    assert json.loads(acquire_lock(tmp_path).read_text())["job"] == "4242"
