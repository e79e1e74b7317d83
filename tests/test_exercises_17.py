"""The capstone's checkers: the reference build and step pass on 8 ranks against the serial model,
each typical mistake gets the hint that names it, a stub gets "not done yet". The wrong builds
run in one launch (``nb17.build_verdicts``), the wrong steps in another (``nb17.step_verdicts``),
each step from a fresh PTDP's parts."""

import sys

import cloudpickle
import torch
from helpers import stub

from megatron_edu import comm
from megatron_edu.course.exercises import check, nb17
from megatron_edu.data_parallel import DataParallel
from megatron_edu.model import GPT
from megatron_edu.model.gpt import IGNORE_INDEX
from megatron_edu.optim import build_param_groups, clip_grad_norm_
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule

# The answers below travel to the ranks by value, as a notebook cell's functions do (by
# reference, each rank would import this module, and the whole course with it: ~1 s).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def build(config, grid, options, pipeline, group="dp", average=False, decay_all=False,
          whole=False):
    schedule = pipeline.make_schedule(grid.pp)
    chunks = [GPT(config)] if whole else build_chunks(config, grid, schedule.stages)
    ddp = DataParallel(chunks, getattr(grid, f"{group}_group"), options.bucket_mb,
                       options.overlap, average=average)
    groups = ([{"params": [p for c in chunks for p in c.parameters()],
                "weight_decay": options.weight_decay}] if decay_all
              else build_param_groups(chunks, options.weight_decay))
    optimizer = torch.optim.AdamW(groups, lr=options.lr, betas=options.betas, eps=options.eps)
    return nb17.Parts(config, grid, schedule, chunks, ddp, optimizer, options)


def step(parts, input_ids, labels, lr, iteration, *, local_tokens=False, tied=True,
         copies=True, norm_grid=True, clip=True, zero=True, loss_sum=True, sg=True,
         finish=True):
    grid, chunks = parts.grid, parts.chunks
    tokens = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    if not local_tokens:
        tokens = comm.all_reduce(tokens, grid.dp_group, "dp tokens")
    batch = Batch(input_ids, labels, iteration, grid.dp_rank * input_ids.shape[0],
                  int(tokens.item()))
    result = run_schedule(parts.schedule, chunks, grid, batch, RunSettings(
        scatter_gather=sg, grad_sync=lambda chunk, last: parts.ddp.sync(last and finish)))
    if finish:
        parts.ddp.finish_grad_sync()
    if tied and grid.pp > 1:
        held = [c.embedding.word.weight for c in chunks if c.first or c.last]
        total = comm.all_reduce(sum(p.grad for p in held), grid.embedding_group, "embedding grads")
        for p in held:
            p.grad.copy_(total)
    last = [c.embedding.word.weight for c in chunks if c.last and not c.first] if copies else []
    params = [p for c in chunks for p in c.parameters()]
    max_norm = parts.options.clip if clip else float("inf")
    norm = clip_grad_norm_(params, max_norm, grid if norm_grid else None, last)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    parts.optimizer.step()
    if zero:
        parts.ddp.zero_grad()
    loss = comm.all_reduce(result.loss, grid.dp_group, "dp loss") if loss_sum else result.loss
    return loss.item(), norm


def _failed(result, *fragments):
    return result.passed is False and all(f in result.message for f in fragments)


BUILD_MISTAKES = {
    "whole": ({"whole": True}, "the whole model"),
    "tp group": ({"group": "tp"}, "grid.dp_group"),
    "averaged": ({"average": True}, "average=False"),
    "decay everywhere": ({"decay_all": True}, "build_param_groups"),
}


def _build_with(**mistake):
    return lambda *a: build(*a, **mistake)


def test_17_1_build_every_mistake_is_named_and_the_reference_passes():
    verdicts = nb17.build_verdicts([build] + [_build_with(**kw) for kw, _ in
                                              BUILD_MISTAKES.values()])
    assert verdicts[0] == nb17.BUILT
    for (name, (_, fragment)), verdict in zip(BUILD_MISTAKES.items(), verdicts[1:], strict=True):
        assert fragment in verdict, (name, verdict)


def test_17_1_a_wrong_build_is_answered_with_its_hint_and_a_stub_is_not_done():
    assert _failed(check("17.1", stub), "not done yet")
    assert _failed(check("17.1", lambda *a: object()), "return Parts")


def _step_with(**mistake):
    return lambda *a: step(*a, **mistake)


STEP_MISTAKES = {
    "no dp sum": ({"finish": False}, "finish_grad_sync"),
    "local_tokens": ({"local_tokens": True}, "own token count"),
    "no tied sum": ({"tied": False}, "grid.embedding_group"),
    "embedding twice": ({"copies": False}, "counts the tied embedding twice"),
    "local norm": ({"norm_grid": False}, "no rank exchanged its squares"),
    "no clipping": ({"clip": False}, "clip the gradients to"),
    "no zero_grad": ({"zero": False}, "zero_grad"),
    "replica's share": ({"loss_sum": False}, "this replica's share"),
    "no scatter/gather": ({"sg": False}, "scatter_gather=True"),
}


def test_17_2_step_every_mistake_is_named_and_the_reference_passes():
    verdicts = nb17.step_verdicts([step] + [_step_with(**kw) for kw, _ in STEP_MISTAKES.values()])
    assert verdicts[0].startswith("on 8 ranks"), verdicts[0]
    assert "dp 0" not in verdicts[0]
    for (name, (_, fragment)), verdict in zip(STEP_MISTAKES.items(), verdicts[1:], strict=True):
        assert fragment in verdict, (name, verdict)


def test_17_2_a_stub_is_not_done():
    assert _failed(check("17.2", stub), "not done yet")
