"""Pipeline messages: NCCL's matched batches, checked on paper for every schedule and recorded on
real ranks (gloo) — both sides of every neighbour pair issue the same batches in the same order —
and both transports give the serial model's gradients."""

import itertools

import pytest
import torch

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule
from megatron_edu.pipeline.p2p import exchange_plan
from megatron_edu.pipeline.schedules import make_schedule, messages_of
from megatron_edu.pipeline.stages import Message, StageMap

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
             ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]  # 2401.10241: W sends nothing


def _cases():
    for p, (name, v), per in itertools.product((2, 3, 4), SCHEDULES, (1, 2)):
        yield name, p, per * p, v  # m = p and 2p (the interleaved schedule needs m % p == 0)


@pytest.mark.parametrize(("name", "p", "m", "v"), list(_cases()),
                         ids=lambda x: str(x))
def test_the_plan_matches_both_sides_and_delivers_every_input_in_time(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    stages, plan = schedule.stages, exchange_plan(schedule)
    for a, b in itertools.combinations(range(p), 2):  # the same batches, in the same order
        seen_by_a = [e.messages for point in plan[a] for e in point if e.peer == b]
        seen_by_b = [e.messages for point in plan[b] for e in point if e.peer == a]
        assert seen_by_a == seen_by_b, (a, b)
    sent = []
    for rank, row in enumerate(schedule):
        inbox: set[Message] = set()
        for i, action in enumerate([*row, None]):  # the last point comes after the last action
            for exchange in plan[rank][i]:
                assert exchange.peer != rank and exchange.messages
                inbox |= {msg for msg in exchange.messages if stages.receiver(msg) == rank}
                sent += [msg for msg in exchange.messages if stages.sender(msg) == rank]
            if action is None:
                break
            needs, sends = messages_of(action, rank, stages)
            if sends is not None and stages.is_local(sends):
                inbox.add(sends)  # ZB-V's turn: handed to the same rank's next chunk
            assert needs is None or needs in inbox, f"rank {rank} runs {action} without {needs}"
            inbox.discard(needs)
        assert not inbox
    produced = [messages_of(a, r, stages)[1] for r, row in enumerate(schedule) for a in row]
    assert sorted(sent, key=repr) == sorted(  # each once, on the wire unless local
        (m for m in produced if m is not None and not stages.is_local(m)), key=repr)


def test_a_weight_pass_neither_receives_nor_sends():
    for name, v in SCHEDULES[4:]:
        schedule = make_schedule(name, 4, 8, v)
        for rank, row in enumerate(schedule):
            for action in row:
                if action.kind == "W":
                    assert messages_of(action, rank, schedule.stages) == (None, None)


def test_zb_v_hands_its_turn_over_on_the_last_rank():
    """Stage p − 1 (chunk 0) and stage p (chunk 1) both live on rank p − 1: no wire."""
    plan = exchange_plan(make_schedule("zb-v", 2, 4))
    on_wire = {m for row in plan for point in row for e in point for m in e.messages}
    assert Message("act", 0, 2) not in on_wire and Message("grad", 0, 1) not in on_wire
    v = StageMap(2, 2, "v")
    assert v.is_local(Message("act", 0, 2)) and not v.is_local(Message("act", 0, 1))


def test_1f1b_steady_state_pairs_send_forward_with_receive_backward():
    """Megatron-LM's send_forward_recv_backward: after F, stage 0 sends the activation and
    receives a gradient in one batch with stage 1."""
    plan = exchange_plan(make_schedule("1f1b", 2, 3))
    assert [e.messages for e in plan[0][2]] == [(Message("act", 1, 1), Message("grad", 0, 0))]


# --- on real ranks ------------------------------------------------------------------------------

def _config(p, v):
    return GPTConfig(vocab_size=32, seq_len=4, num_layers=p * v, hidden=16, num_heads=2,
                     dropout=0.0)


def _batch(m):
    ids = torch.randint(0, 32, (m, 5), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def _batches_of_every_schedule(p):
    """On each rank, per schedule: the batched p2p ops it issued, and its gradients."""
    grid = ParallelGrid(pp=p)
    results = {}
    for name, v in SCHEDULES:
        m = 2 * p
        schedule = make_schedule(name, p, m, v)
        chunks = build_chunks(_config(p, v), grid, schedule.stages)
        batched = RunSettings(transport="batched")
        with comm.record() as log:
            run_schedule(schedule, chunks, grid, Batch(*_batch(m)), batched)
        grads = [c.full_state_dict(grads=True) for c in chunks]
        results[name, v] = (_batches(log), grads)
    return results


def _serial_grads(p, v):
    model = GPT(_config(p, v))
    model(*_batch(2 * p)).backward()
    return model.full_state_dict(grads=True)


def _batches(log):
    """[(batch number, [(op, peer, bytes, label), ...]), ...] in issue order."""
    events = log.select(group="p2p")
    assert all(e.batch is not None for e in events)  # nothing outside a batch on this path
    by_batch = itertools.groupby(events, key=lambda e: e.batch)
    return [[(e.op, e.peer, e.bytes, e.label) for e in batch] for _, batch in by_batch]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_recorded_batches_match_one_to_one_and_gradients_equal_serial(p):
    out = run(_batches_of_every_schedule, p, p)
    flip = {"send": "recv", "recv": "send"}
    for (name, v) in SCHEDULES:
        for a, b in itertools.combinations(range(p), 2):
            a_side = [[(op, n, label) for op, peer, n, label in batch if peer == b]
                      for batch in out[a][name, v][0]]
            b_side = [[(flip[op], n, label) for op, peer, n, label in batch if peer == a]
                      for batch in out[b][name, v][0]]
            assert [x for x in a_side if x] == [x for x in b_side if x], (name, v, a, b)
        merged = {}  # every stage's gradients; the tied embedding's two copies summed
        for rank in out:
            for grads in rank[name, v][1]:
                for key, grad in grads.items():
                    merged[key] = merged[key] + grad if key in merged else grad
        for key, grad in _serial_grads(p, v).items():
            torch.testing.assert_close(merged[key], grad, atol=1e-5, rtol=0, msg=key)


def test_the_plan_is_made_once_per_schedule():
    """A run asks for its plan every step: equal schedules share one (immutable) plan."""
    first = exchange_plan(make_schedule("interleaved", 4, 8, 2))
    assert exchange_plan(make_schedule("interleaved", 4, 8, 2)) is first
    assert exchange_plan(make_schedule("interleaved", 4, 12, 2)) is not first
    assert isinstance(first[0][0], tuple)
