"""PTD-P: every layout of the grid takes the serial model's optimizer steps (2104.04473 §3)."""

import pytest
import torch

from megatron_edu import comm
from megatron_edu.grid import GridLayout, ParallelGrid, all_layouts
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.optim import build_param_groups
from megatron_edu.ptdp import PTDP, PTDPOptions

CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=8, hidden=64, num_heads=8, dropout=0.0)
GLOBAL_BATCH, STEPS, LR, CLIP = 16, 3, 1e-2, 0.5
# Adam divides by sqrt(v) + ε. The key bias has a zero gradient in exact arithmetic (softmax
# ignores a constant added to every score of a row), so in floats its "gradient" is rounding
# noise, which Adam with ε = 1e-8 would blow up to ±lr steps in both runs, differently.
# A larger ε keeps noise as noise; every real gradient here is far above it.
EPS = 1e-4


def _batches():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, CONFIG.seq_len + 1),
                        generator=g)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _serial():
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(build_param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95),
                                  eps=EPS)
    losses, norms = [], []
    for ids, labels in _batches():
        loss = model(ids, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.full_state_dict()


def _ptdp(tp, pp, dp, options):
    grid = ParallelGrid(tp=tp, pp=pp, dp=dp)
    trainer = PTDP(CONFIG, grid, options)
    losses, norms = [], []
    with comm.record() as log:
        for ids, labels in _batches():
            mine = slice(grid.dp_rank * GLOBAL_BATCH // dp, (grid.dp_rank + 1) * GLOBAL_BATCH // dp)
            result = trainer.train_step(ids[mine], labels[mine], LR)
            losses.append(result.loss)
            norms.append(result.grad_norm)
    params = {}
    for chunk in trainer.chunks:
        params.update(chunk.full_state_dict())
    return losses, norms, params, log


@pytest.fixture(scope="module")
def serial():
    losses, norms, params = run(_serial, 1)[0]
    assert max(norms) > CLIP  # the clipping path is really exercised
    return losses, norms, params


def _check_equal_to_serial(serial, out, layout):
    serial_losses, serial_norms, serial_params = serial
    for losses, norms, _, _ in out:
        assert losses == pytest.approx(serial_losses, abs=1e-5)
        assert norms == pytest.approx(serial_norms, abs=1e-5)
    merged = {}
    for rank, (_, _, params, _) in enumerate(out):
        if layout.coords(rank)[0] == 0 and layout.coords(rank)[2] == 0:  # tp 0 of replica 0
            merged.update(params)
    assert merged.keys() == serial_params.keys()
    for name, value in serial_params.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=0, msg=name)


def _options(**overrides):
    return PTDPOptions(**{"num_microbatches": 2, "lr": LR, "clip": CLIP, "eps": EPS, **overrides})


@pytest.mark.parametrize("layout", all_layouts(8), ids=lambda g: f"tp{g.tp}-pp{g.pp}-dp{g.dp}")
def test_every_layout_of_8_ranks_takes_the_serial_steps(serial, layout):
    out = run(_ptdp, 8, layout.tp, layout.pp, layout.dp, _options())
    _check_equal_to_serial(serial, out, layout)


@pytest.mark.parametrize(("tp", "pp", "dp", "overrides"), [
    (1, 2, 2, dict(schedule="interleaved", num_chunks=2)),
    (2, 2, 1, dict(schedule="gpipe")),
    (1, 1, 4, dict(zero1=True)),
    (2, 1, 2, dict(zero1=True)),
    (1, 2, 2, dict(zero1=True, bucket_mb=0.01)),
    (1, 2, 2, dict(overlap=False, bucket_mb=1e6)),
], ids=["interleaved", "gpipe-tp", "zero1-dp4", "zero1-tp2", "zero1-buckets", "one-bucket"])
def test_schedules_zero1_and_buckets_take_the_serial_steps(serial, tp, pp, dp, overrides):
    out = run(_ptdp, tp * pp * dp, tp, pp, dp, _options(**overrides))
    _check_equal_to_serial(serial, out, GridLayout(tp, pp, dp))


def test_dp_gradients_are_all_reduced_once_per_step_not_per_microbatch():
    out = run(_ptdp, 4, 1, 2, 2, _options(num_microbatches=4, bucket_mb=1e6))
    for *_, log in out:
        assert log.count("all_reduce", group="dp", label="dp grads") == STEPS  # one bucket
        assert log.count(label="embedding grads") == STEPS  # pp=2: both stages hold a copy


def test_scatter_gather_divides_the_bytes_between_stages_by_tp():
    plain = run(_ptdp, 4, 2, 2, 1, _options(scatter_gather=False))
    split = run(_ptdp, 4, 2, 2, 1, _options(scatter_gather=True))
    for (losses_a, *_, log_a), (losses_b, *_, log_b) in zip(plain, split, strict=True):
        assert losses_a == pytest.approx(losses_b, abs=1e-6)
        assert log_a.total_bytes("send") == 2 * log_b.total_bytes("send") > 0
