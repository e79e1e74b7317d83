"""The launcher: results in rank order, output captured deterministically, failures fast,
deadlocks detected where asked."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from megatron_edu.launch import DeadlockError, RankError, run


def _rank_and_args(a, b=0):
    print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()}")
    return dist.get_rank(), a, b


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    assert run(_rank_and_args, world_size, "x", b=3) == [(r, "x", 3) for r in range(world_size)]


def test_output_is_prefixed_by_rank_in_rank_order(capsys):
    run(_rank_and_args, 3, None)
    assert capsys.readouterr().out.splitlines() == [
        f"[rank {r}] hello from rank {r} of 3" for r in range(3)]


def test_a_locally_defined_function_runs():  # like a notebook cell's: pickled by value
    offset = 10

    def local(x):
        return x + offset + dist.get_rank()

    assert run(local, 2, 1) == [11, 12]


def test_tensors_come_back():
    out = run(lambda: torch.full((2,), float(dist.get_rank())), 2)
    assert torch.equal(out[1], torch.ones(2))


def _fail_on_rank_2():
    print("about to fail" if dist.get_rank() == 2 else "waiting in a barrier")
    if dist.get_rank() == 2:
        raise ValueError("rank two is unhappy")
    dist.barrier()  # the others would wait for ever


def test_a_raising_rank_fails_the_call_fast_with_its_traceback():
    """Collectives may wait an hour (a checkpoint barrier on a slow filesystem): the launcher
    watches its ranks, so the peers waiting in a barrier are not what ends the call."""
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run(_fail_on_rank_2, 4, timeout=120, collective_timeout=3600)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "rank 2 raised" in message and "ValueError: rank two is unhappy" in message
    assert "about to fail" in message  # its captured output comes along


def _die():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_a_dying_rank_fails_the_call():
    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        run(_die, 2, timeout=60)


def _stuck():
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def test_a_stuck_rank_is_cut_off_by_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 3 s"):
        run(_stuck, 2, timeout=3)
    assert time.monotonic() - start < 10


def _recv_from_each_other():
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())  # each waits for the other's send


def test_a_deadlock_is_detected_not_waited_out():
    # a DeadlockError, not the TimeoutError that the 120 s timeout would raise
    with pytest.raises(DeadlockError, match=r"ranks \[0, 1\] did not finish: blocked") as err:
        run(_recv_from_each_other, 2, timeout=120, deadlock_after=1.0)
    assert (err.value.ranks, err.value.idle) == ([0, 1], 1.0)


def _recv_from_a_rank_that_returns():
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 returns without sending


def test_a_rank_that_finished_is_not_waited_for():
    with pytest.raises(DeadlockError, match=r"ranks \[0\] did not finish") as err:
        run(_recv_from_a_rank_that_returns, 2, timeout=120, deadlock_after=1.0)
    assert "ranks [1] had finished" in str(err.value)


def _compute_then_send(cpu_seconds):
    """Rank 0 computes for ``cpu_seconds`` of CPU time, then sends; rank 1 waits in its recv."""
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        start = time.process_time()
        while time.process_time() - start < cpu_seconds:
            t += 1
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    return t.item() > 0


def test_a_busy_rank_is_not_mistaken_for_a_deadlock():
    # rank 1 waits four times longer than deadlock_after, but rank 0 computes meanwhile
    assert run(_compute_then_send, 2, 2.0, timeout=120, deadlock_after=0.5) == [True, True]


def test_calls_run_back_to_back():
    assert [run(_rank_and_args, 2, i)[1][1] for i in range(3)] == [0, 1, 2]


@pytest.mark.parametrize(("world_size", "timeouts", "message"), [
    (0, {}, "world_size must be a positive integer"),
    (-1, {}, "world_size must be a positive integer"),
    (1.5, {}, "world_size must be a positive integer"),
    (2, {"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    (2, {"collective_timeout": float("inf")}, "collective_timeout must be a positive number"),
    (2, {"deadlock_after": -1}, "deadlock_after must be a positive number of seconds, got -1"),
    (64, {"backend": "nccl"}, "the nccl backend needs a GPU per rank: 64 ranks on this machine"),
])
def test_bad_arguments_are_rejected_before_launch(world_size, timeouts, message):
    with pytest.raises(ValueError, match=message):
        run(_rank_and_args, world_size, None, **timeouts)


TORCHRUN_LAUNCHES = 4  # a rank aborted at exit in ~1/3 of launches: 4 catch that 80 %


def test_under_torchrun_it_initialises_gathers_and_exits_cleanly(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, pathlib, sys
        import torch.distributed as dist
        from megatron_edu.launch import run
        def work(x):
            return dist.get_rank() * x
        results = run(work, 2, 10)
        assert not dist.is_initialized()  # run destroyed the group it made
        pathlib.Path(sys.argv[1], f"rank{os.environ['RANK']}.txt").write_text(str(results))
    """))
    outs = [tmp_path / f"launch{launch}" for launch in range(TORCHRUN_LAUNCHES)]
    launches = []
    for out in outs:   # side by side: each torchrun is mostly three processes importing torch
        out.mkdir()
        launches.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    for launch, (proc, out) in enumerate(zip(launches, outs, strict=True)):
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"launch {launch}: {stderr}"  # every exit clean, not most
        for rank in (0, 1):  # every rank gets every rank's result
            assert (out / f"rank{rank}.txt").read_text() == "[0, 10]"


def test_a_failed_rendezvous_is_retried_then_reported_without_running_fn(tmp_path):
    marker = tmp_path / "ran"

    def touch():
        marker.touch()

    with pytest.raises(RankError, match="rank 0 raised") as err:
        run(touch, 2, backend="no-such-backend", timeout=30)
    assert "init_process_group" in str(err.value)
    assert not marker.exists()


def test_sigterm_to_the_parent_stops_its_ranks_too(tmp_path):
    """A scheduler's kill must not leave ranks running on their own."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, pathlib, time
        from megatron_edu.launch import run
        def wait():
            pathlib.Path(r"{tmp_path}", f"pid{{os.getpid()}}").touch()
            time.sleep(120)
        if __name__ == "__main__":
            run(wait, 2, timeout=300)
    """))
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.name[3:]) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2, "the ranks did not start"
    parent.terminate()
    assert parent.wait(timeout=30) != 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
