"""PTD-P with a zero-bubble schedule (2401.10241): W, not B, accumulates the weights' gradients,
so the data-parallel all-reduces, the tied embedding's sum and clipping see the same gradients —
the serial model's optimizer steps, as with 1F1B. Under ZB-V both embedding copies are on pipeline
rank 0 (first and last stage): their sum is local."""

import dataclasses

import pytest
import torch
from helpers import Launches
from test_memory_techniques import DROPOUT, _batch
from test_ptdp import STEPS, _check_equal_to_serial, _training, serial  # noqa: F401

from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions


def _sequence_parallel_steps(config, schedule, steps=2):
    grid = ParallelGrid(Layout(tp=2, pp=2))
    trainer = PTDP(config, grid, PTDPOptions(lr=1e-2, eps=1e-4),
                   pipeline=PipelineConfig(schedule, num_microbatches=2))
    losses = [trainer.train_step(*_batch(4, seed=step), 1e-2).loss for step in range(steps)]
    params = {}
    for chunk in trainer.chunks:
        params.update(chunk.full_state_dict())
    return losses, params


def _sequence_parallel(recompute, schedule):
    config = dataclasses.replace(DROPOUT, num_layers=4, sequence_parallel=True,
                                 recompute=recompute)
    return 4, _sequence_parallel_steps, (config, schedule)


LAUNCHES = Launches({  # every case on 4 ranks: one launch
    "zb-h1-dp2": _training(1, 2, 2, schedule="zb-h1", num_microbatches=4),
    "zb-h2-tp2": _training(2, 2, 1, schedule="zb-h2", num_microbatches=4),
    "zb-h1-zero1-buckets": _training(1, 2, 2, schedule="zb-h1", zero=1, bucket_mb=0.01),
    "zb-v-tp2": _training(2, 2, 1, schedule="zb-v", num_microbatches=4),
    "zb-v-zero1": _training(1, 2, 2, schedule="zb-v", num_microbatches=4, zero=1),
    **{f"sp-{recompute}-{schedule}": _sequence_parallel(recompute, schedule)
       for recompute in ("none", "full") for schedule in ("1f1b", "zb-h1")},
})


@pytest.mark.parametrize("name", ["zb-h1-dp2", "zb-h2-tp2", "zb-h1-zero1-buckets", "zb-v-tp2",
                                  "zb-v-zero1"])
def test_zero_bubble_schedules_take_the_serial_steps(serial, name):  # noqa: F811
    _check_equal_to_serial(serial, LAUNCHES[name])


def test_dp_gradients_are_all_reduced_once_per_step_after_the_last_w():
    # grad_sync wraps each W; the chunk's last W launches the bucket's all-reduce (the default
    # 25 MiB bucket holds the whole chunk; the tied embedding has a bucket of its own)
    for _, _, params, log in LAUNCHES["zb-h1-dp2"]:
        buckets = 2 if "embedding.word.weight" in params else 1
        assert log.count("all_reduce", group="dp", label="dp grads") == buckets * STEPS


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_sequence_parallel_and_recompute_under_zb_h1_take_1f1bs_steps(recompute):
    """Sequence parallelism's all-gather linear and full recomputation compute several gradients
    in one node: ``backward.py`` runs such a node whole in B and again in W — correct, if not
    split. Dropout on: the masks depend on neither the schedule nor the split."""
    plain, mine = LAUNCHES[f"sp-{recompute}-1f1b"], LAUNCHES[f"sp-{recompute}-zb-h1"]
    for (losses, params), (ref_losses, ref_params) in zip(mine, plain, strict=True):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)
