"""reference.py's 1F1B loop against the engine running the same schedule as data: the same loss,
the same gradients and the same pipeline messages, on every rank."""

import copy
from dataclasses import dataclass

import pytest
import torch

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.pipeline.engine import Batch, build_chunks, run_schedule
from megatron_edu.pipeline.reference import pipeline_step
from megatron_edu.pipeline.schedules import gpipe, one_f_one_b

CONFIG = GPTConfig(vocab_size=64, seq_len=8, num_layers=4, hidden=32, num_heads=2, dropout=0.0)
BATCH = 8
SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
PP_LABELS = ("pp activation", "pp gradient")
CASES = {  # p: (schedule, m) — m ≥ p, and m < p (early ranks then warm up with every microbatch)
    2: [("1f1b", 4), ("1f1b", 2), ("1f1b", 1), ("gpipe", 4), ("gpipe", 1)],
    4: [("1f1b", 4), ("1f1b", 8), ("1f1b", 2), ("1f1b", 1), ("gpipe", 4), ("gpipe", 2)],
}


@dataclass
class Outcome:
    """One rank's result of one case: reference vs engine."""

    losses: tuple[torch.Tensor, torch.Tensor]
    grads: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
    sends: tuple[list[tuple[int, str]], list[tuple[int, str]]]   # (peer, label), in order
    receives: tuple[int, int]


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = labels[5, 2:] = -100  # microbatches with unequal numbers of target tokens
    return ids[:, :-1], labels


def _grads(stage):
    return {name: param.grad.clone() for name, param in stage.named_parameters()}


def _pp_messages(log, op):
    return [(e.peer, e.label) for e in log.select(op) if e.label in PP_LABELS]


def _compare(p, cases):
    """On this rank: for every case, the reference and the engine on copies of one stage."""
    grid = ParallelGrid(pp=p)
    [stage] = build_chunks(CONFIG, grid)
    ids, labels = _batch()
    outcomes = {}
    for name, m in cases:
        ref, eng = copy.deepcopy(stage), copy.deepcopy(stage)  # same weights, no gradients yet
        with comm.record() as ref_log:
            ref_loss = pipeline_step(ref, grid, ids, labels, m, CONFIG.hidden, schedule=name)
        with comm.record() as eng_log:
            eng_loss = run_schedule(SCHEDULES[name](p, m), [eng], grid, Batch(ids, labels)).loss
        outcomes[name, m] = Outcome(
            (ref_loss, eng_loss), (_grads(ref), _grads(eng)),
            (_pp_messages(ref_log, "send"), _pp_messages(eng_log, "send")),
            (len(_pp_messages(ref_log, "recv")), len(_pp_messages(eng_log, "recv"))))
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    """One launch per pipeline size, every case of that size in it."""
    launched = {}

    def of(p):
        if p not in launched:
            launched[p] = run(_compare, p, p, CASES[p])
        return launched[p]
    return of


ALL_CASES = [(p, name, m) for p, cases in CASES.items() for name, m in cases]


@pytest.mark.parametrize(("p", "name", "m"), ALL_CASES)
def test_reference_gives_the_engines_loss_and_gradients(outcomes, p, name, m):
    for rank, per_case in enumerate(outcomes(p)):
        out = per_case[name, m]
        ref_loss, eng_loss = out.losses
        assert ref_loss.dtype == torch.float32 and ref_loss.shape == ()
        torch.testing.assert_close(ref_loss, eng_loss, msg=f"rank {rank}")
        ref_grads, eng_grads = out.grads
        assert ref_grads.keys() == eng_grads.keys()
        for key, grad in eng_grads.items():
            assert grad.abs().sum() > 0, f"rank {rank}: {key} got no gradient"
            torch.testing.assert_close(ref_grads[key], grad, msg=f"rank {rank}: {key}")
    losses = [per_case[name, m].losses[0] for per_case in outcomes(p)]
    assert all(torch.equal(loss, losses[0]) for loss in losses)  # shared with every stage


@pytest.mark.parametrize(("p", "name", "m"), ALL_CASES)
def test_reference_sends_the_engines_messages(outcomes, p, name, m):
    """Each rank sends what the engine sends, in the same order: 2·m·(p − 1) in all."""
    total = 0
    for rank, per_case in enumerate(outcomes(p)):
        (ref_sends, eng_sends), (ref_receives, eng_receives) = (per_case[name, m].sends,
                                                                per_case[name, m].receives)
        assert ref_sends == eng_sends, f"rank {rank}"
        assert ref_receives == eng_receives == len(ref_sends), f"rank {rank}"
        total += len(ref_sends)
    assert total == 2 * m * (p - 1)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'1f1b' or 'gpipe'"):
        pipeline_step(None, None, torch.zeros(2, 8), torch.zeros(2, 8), 2, 32,
                      schedule="interleaved")
