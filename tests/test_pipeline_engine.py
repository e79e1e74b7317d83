"""The schedules executed over real send/recv give the serial model's loss and gradients."""

import pytest
import torch
from helpers import Launches

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule
from megatron_edu.pipeline.p2p import LABELS
from megatron_edu.pipeline.schedules import make_schedule, messages_of

CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=8, hidden=32, num_heads=4, dropout=0.0)
BATCH, MICROBATCHES = 8, 4


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _serial():
    model = GPT(CONFIG)
    loss = model(*_batch())
    loss.backward()
    return loss.detach(), model.full_state_dict(grads=True)


def _pipelined(name, tp, pp, v, scatter_gather=False, transport="auto"):
    grid = ParallelGrid(tp=tp, pp=pp)
    schedule = make_schedule(name, pp, MICROBATCHES, v)
    chunks = build_chunks(CONFIG, grid, schedule.stages)
    with comm.record() as log:
        result = run_schedule(schedule, chunks, grid, Batch(*_batch()),
                              RunSettings(scatter_gather, transport))
    grads = [chunk.full_state_dict(grads=True) for chunk in chunks]
    return result.loss, grads, result.timeline, log


def _bytes_per_activation_element(autocast: bool, param_dtype: torch.dtype) -> float:
    grid = ParallelGrid(pp=2)
    chunks = [c.to(param_dtype) for c in build_chunks(CONFIG, grid)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), comm.record() as log:
        result = run_schedule(make_schedule("1f1b", 2, MICROBATCHES), chunks, grid,
                              Batch(*_batch()))
    assert torch.isfinite(result.loss)
    send = log.select("send")[0]
    return send.bytes / (BATCH // MICROBATCHES * CONFIG.seq_len * CONFIG.hidden)


LAYOUTS = [  # (schedule, tp, pp, v)
    ("gpipe", 1, 2, 1), ("1f1b", 1, 2, 1), ("interleaved", 1, 2, 2),
    ("gpipe", 1, 4, 1), ("1f1b", 1, 4, 1), ("interleaved", 1, 4, 2),
    ("1f1b", 2, 2, 1), ("interleaved", 2, 2, 2),
    ("zb-h1", 1, 2, 1), ("zb-h2", 1, 2, 1), ("zb-v", 1, 2, 2),
    ("zb-h1", 1, 4, 1), ("zb-h2", 1, 4, 1), ("zb-v", 1, 4, 2),
    ("zb-h1", 2, 2, 1), ("zb-h2", 2, 2, 1), ("zb-v", 2, 2, 2),
]
DTYPES = {"fp32": (False, torch.float32), "bf16-autocast": (True, torch.float32),  # (autocast,
          "bf16-weights": (False, torch.bfloat16)}                       # the weights' dtype)
LAUNCHES = Launches({  # name -> (world size, function, arguments): one launch per world size
    "serial": (1, _serial, ()),
    **{"-".join(map(str, layout)): (layout[1] * layout[2], _pipelined, layout)
       for layout in LAYOUTS},
    **{transport: (4, _pipelined, ("interleaved", 1, 4, 2, False, transport))
       for transport in ("mailbox", "batched")},
    "1f1b-2-2-1-scatter-gather": (4, _pipelined, ("1f1b", 2, 2, 1, True)),
    **{f"bytes-{name}": (2, _bytes_per_activation_element, dtypes)
       for name, dtypes in DTYPES.items()},
})


@pytest.fixture(scope="module")
def serial():
    return LAUNCHES["serial"][0]


def _merge_stage_grads(per_rank, tp):
    """Every parameter's gradient once (tp rank 0 of each stage; full_state_dict gathered the
    shards); the two copies of the tied embedding summed, as the embedding-group all-reduce of
    the 3D step does in training (under ZB-V both copies are on rank 0)."""
    merged = {}
    for _, chunk_grads, _, _ in per_rank[::tp]:
        for grads in chunk_grads:
            for name, grad in grads.items():
                merged[name] = merged[name] + grad if name in merged else grad
    return merged


@pytest.mark.parametrize(("name", "tp", "pp", "v"), LAYOUTS)
def test_pipeline_equals_serial(serial, name, tp, pp, v):
    serial_loss, serial_grads = serial
    out = LAUNCHES[f"{name}-{tp}-{pp}-{v}"]
    for loss, *_ in out:
        torch.testing.assert_close(loss, serial_loss, atol=1e-5, rtol=0)
    merged = _merge_stage_grads(out, tp)
    assert merged.keys() == serial_grads.keys()
    for key, grad in serial_grads.items():
        torch.testing.assert_close(merged[key], grad, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("transport", ["mailbox", "batched"])
def test_each_rank_sends_what_its_schedule_produces_in_its_order(transport):
    """Per rank, the sends on the wire are its actions' outputs (messages_of), in its order."""
    p, v = 4, 2
    schedule = make_schedule("interleaved", p, MICROBATCHES, v)
    out = LAUNCHES[transport]
    for rank, (_, _, _, log) in enumerate(out):
        expected = [(schedule.stages.receiver(m), LABELS[m.kind]) for a in schedule[rank]
                    if (m := messages_of(a, rank, schedule.stages)[1]) is not None]
        assert [(e.peer, e.label) for e in log.select("send")] == expected
        assert len(expected) == MICROBATCHES * (2 * v - (rank == 0) - (rank == p - 1))


def test_scatter_gather_sends_a_tp_th_of_the_bytes_with_the_same_result():
    plain, split = LAUNCHES["1f1b-2-2-1"], LAUNCHES["1f1b-2-2-1-scatter-gather"]
    for (loss_a, [grads_a], _, log_a), (loss_b, [grads_b], _, log_b) in zip(plain, split,
                                                                            strict=True):
        torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=0)
        for key in grads_a:
            torch.testing.assert_close(grads_a[key], grads_b[key], atol=1e-6, rtol=0)
        assert log_b.total_bytes("send") * 2 == log_a.total_bytes("send")
        assert log_b.count("send") == log_a.count("send") == MICROBATCHES  # act or grad each mb


@pytest.mark.parametrize(("dtypes", "expected"), [("fp32", 4), ("bf16-autocast", 2),
                                                  ("bf16-weights", 2)])
def test_messages_travel_in_the_residual_streams_dtype(dtypes, expected):
    # under autocast the residual stream is in the compute dtype from the embedding on (bf16,
    # as Megatron-LM's): half fp32's bytes between stages
    assert LAUNCHES[f"bytes-{dtypes}"] == [expected] * 2
