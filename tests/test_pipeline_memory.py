"""What a pipeline schedule holds in memory, measured on real ranks (2104.04473 §2.2.1): 1F1B
keeps at most p microbatches' activations on stage 0 where GPipe keeps all m, and nothing is
kept longer than the schedule says (sent tensors and sent outputs are freed). Zero-bubble
schedules (2401.10241) keep each microbatch from F to W, and between B and W also the gradients
W starts from: ZB-H1 holds p microbatches on every rank, ZB-H2 2p − 1."""

import functools

import pytest
import torch

from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.perf.measure import MemoryMeter
from megatron_edu.pipeline.backward import backward_input
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import make_schedule
from megatron_edu.tensor_parallel.random import DropoutKey

P, M, MICRO = 4, 8, 2
CONFIG = GPTConfig(vocab_size=64, seq_len=64, num_layers=8, hidden=64, num_heads=4, dropout=0.1)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-h2": 1}
TRANSPORTS = ["mailbox", "batched"]


def _batch():
    ids = torch.randint(0, 64, (M * MICRO, 65), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def _one_microbatch_bytes(chunks):
    """Per chunk: the bytes one microbatch's forward leaves alive until its backward — what it
    saved, and its input (received from the previous stage), without its output (sent, freed);
    and the bytes it holds after B (input gradient only) until W: the same, plus the gradients
    kept for W."""
    sizes, after_b = [], []
    for chunk in chunks:
        with MemoryMeter() as meter:
            x = (_batch()[0][:MICRO].clone() if chunk.first else
                 torch.randn(MICRO, CONFIG.seq_len, CONFIG.hidden, requires_grad=True))
            out = chunk(x, dropout_key=DropoutKey.first(MICRO))
            if chunk.last:
                out = out.sum()
            grad = None if chunk.last else torch.randn_like(out)
            out.data = torch.empty(1) if not chunk.last else out.data
            sizes.append(meter.current - (grad.nbytes if grad is not None else 0))
            x_grad, weight_pass = backward_input(out, grad, x if not chunk.first else None)
            del grad, x_grad
            after_b.append(meter.current)
            del weight_pass
    return sizes, after_b


def _memory(grid, name, transport):
    schedule = make_schedule(name, P, M, SCHEDULES[name])
    chunks = build_chunks(CONFIG, grid, schedule.stages)
    per_microbatch, after_b = _one_microbatch_bytes(chunks)
    for p in (p for c in chunks for p in c.parameters()):  # as in training, gradients exist:
        p.grad = torch.zeros_like(p)                       # accumulated in place, not counted
    with MemoryMeter() as meter:
        result = run_schedule(schedule, chunks, grid, Batch(*_batch()),
                              RunSettings(transport=transport))
    actions = schedule[grid.pp_rank]
    return dict(peak=meter.peak, boundary=result.peak_boundary_tensors,
                expected=_held_by_schedule(actions, per_microbatch, after_b),
                in_flight=_held_by_schedule(actions, [1] * len(chunks), [1] * len(chunks)),
                per_microbatch=per_microbatch, after_b=after_b)


def _held_by_schedule(actions, per_microbatch, after_b):
    """The peak of what the rank holds, walking its list: F adds its chunk's share, B frees it —
    or, when the backward is split, B grows it to ``after_b`` and W frees that."""
    split, held, peak = any(a.kind == "W" for a in actions), 0, 0
    for action in actions:
        c = action.chunk
        held += {"F": per_microbatch[c], "W": -after_b[c],
                 "B": after_b[c] - per_microbatch[c] if split else -per_microbatch[c]}[action.kind]
        peak = max(peak, held)
    return peak


def _every_schedule():
    grid = ParallelGrid(pp=P)
    return {(transport, name): _memory(grid, name, transport)
            for transport in TRANSPORTS for name in SCHEDULES}


def _measure(transport):
    """{schedule: every rank's measurement}, all schedules of both transports in one launch."""
    return {name: [rank[transport, name] for rank in _every_rank()] for name in SCHEDULES}


@functools.cache
def _every_rank():
    return run(_every_schedule, P)


@pytest.fixture(scope="module", params=TRANSPORTS)
def measured(request):
    return _measure(request.param)


@pytest.fixture(scope="module")
def batched():
    """Boundary tensors are counted under the batched transport: it exchanges at fixed points of
    the schedule, so the count is the schedule's alone. The mailbox sends at once and a send's
    tensor lives until the peer has posted its receive — how many are in transit then depends on
    how the OS schedules the ranks (on 2 cores, one to three more on a slow run)."""
    return _measure("batched")


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_rank_holds_what_its_schedule_says(measured, name):
    for rank, m in enumerate(measured[name]):
        # peak = the schedule's activations, plus at most one microbatch's transient tensors
        # (a forward's temporaries, received buffers, the gradients flowing back)
        assert m["expected"] <= m["peak"] <= m["expected"] + max(m["per_microbatch"]), rank


def test_1f1b_holds_p_microbatches_on_stage_0_where_gpipe_holds_m(measured):
    one = measured["1f1b"][0]["per_microbatch"][0]
    assert measured["1f1b"][0]["expected"] == P * one
    assert measured["gpipe"][0]["expected"] == M * one
    assert measured["1f1b"][0]["peak"] < (P + 1) * one
    assert measured["gpipe"][0]["peak"] > (M - 0.5) * one


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sent_tensors_do_not_outlive_their_send(batched, name):
    # Boundary tensors alive: the received inputs of the microbatches in flight, and a few
    # more waiting for their exchange (before the fix, every sent tensor lived until the step's
    # end: M·v more).
    for m in batched[name]:
        assert m["boundary"] <= m["in_flight"] + 3


def test_zb_h1_holds_p_microbatches_on_every_rank_plus_what_w_keeps(measured):
    one, after_b = measured["1f1b"][0]["per_microbatch"][0], measured["zb-h1"][0]["after_b"][0]
    assert measured["zb-h1"][0]["expected"] == P * one + (after_b - one)  # F0..F3 B0, then W0
    assert after_b > one  # W needs more than the forward saved: the gradients it starts from
    for rank, m in enumerate(measured["zb-h1"]):
        assert m["in_flight"] == P, rank  # 1F1B's p − rank, plus the W's delayed by rank


def test_zb_h2_holds_2p_minus_1_microbatches_and_more_memory_than_zb_h1(measured):
    for rank, (h1, h2) in enumerate(zip(measured["zb-h1"], measured["zb-h2"], strict=True)):
        assert h2["in_flight"] == 2 * P - 1, rank
        assert h2["peak"] > h1["peak"], rank


def test_1f1b_stage_0_frees_each_output_once_sent(batched):
    # not M: an output lives until its send is waited for, at the next exchange (a batch of
    # sends only is left in flight while the rank computes on: Megatron-LM's overlap_p2p_comm)
    assert batched["1f1b"][0]["boundary"] == 2
