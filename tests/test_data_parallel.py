"""Data parallelism against the serial model: averaged gradients, buckets, accumulation, ZeRO's
three stages (their collectives in place in the buckets; ZeRO-3 under bf16 autocast), and the
global gradient norm under tp × pp (small MLPs defined here, fp32, gloo)."""

import math
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import Launches
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_edu import comm
from megatron_edu.data_parallel import STAGES, DataParallel
from megatron_edu.grid import ParallelGrid
from megatron_edu.optim import (
    build_param_groups,
    clip_grad_norm_,
    optimizer_state_bytes,
    warmup_cosine,
)
from megatron_edu.timing import BucketTimer, UnitTimer

TOL = 1e-6
STEPS = 3
GLOBAL_BATCH = 8
WIDTH = 16
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20   # one Linear(16, 16): weight + bias, in MiB


# --- small models and data, identical on every rank ----------------------------------------------

def _mlp(widths=(WIDTH,) * 5) -> nn.Sequential:
    """Linear layers with GELUs between them; the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.GELU()] if i else []
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def _batch(step: int, width_in: int = WIDTH, width_out: int = WIDTH):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(GLOBAL_BATCH, width_in, generator=gen),
            torch.randn(GLOBAL_BATCH, width_out, generator=gen))


def _my_slice(t: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    return t.chunk(grid.dp)[grid.dp_rank]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _serial_training(steps=STEPS, lr=1e-2) -> torch.Tensor:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for step in range(steps):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model.parameters())


def _dp_training(grid, bucket_mb, overlap, steps=STEPS, lr=1e-2):
    """Plain data parallelism, each replica on its 1/dp of the batch: the parameters after
    ``steps`` steps and, per step, the bucket timeline and the time backward returned."""
    model = _mlp()
    ddp = DataParallel(model, grid.dp_group, bucket_mb=bucket_mb, overlap=overlap)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    timer, timelines = BucketTimer(ddp), []
    for step in range(steps):
        x, y = _batch(step)
        with timer.step():
            F.mse_loss(model(_my_slice(x, grid)), _my_slice(y, grid)).backward()
            backward_end = time.perf_counter()
            ddp.finish_grad_sync()
        opt.step()
        ddp.zero_grad()
        timelines.append((timer.timeline, backward_end))
    return _flat(model.parameters()), timelines


def _every_training(dp):
    """One launch for every training run of sections 1, 3 and 5 (a rank's first optimizer costs
    seconds on a busy 2-core machine: torch imports its compiler)."""
    grid = ParallelGrid(dp=dp)
    return {"overlapped": _dp_training(grid, LAYER_MB, overlap=True),
            "one bucket after backward": _dp_training(grid, 1000.0, overlap=False),
            **{f"zero{stage}": _zero_vs_plain(grid, stage) for stage in ZERO_STAGES}}


def _trainings(dp) -> list[dict]:
    """Every rank's results of ``_every_training`` at ``dp``."""
    return LAUNCHES[f"trainings-dp{dp}"]


# --- 1. dp equals serial on the whole batch -----------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_training_equals_serial_training_on_the_global_batch(dp):
    serial = _serial_training()
    for ranks in _trainings(dp):
        params, _ = ranks["overlapped"]
        assert (params - serial).abs().max().item() < TOL


# --- 2. buckets, gradient accumulation, several model chunks -------------------------------------

def _chunks() -> list[nn.Module]:
    """Two model chunks (as an interleaved pipeline holds): layers 0–1 and layers 2–3."""
    model = _mlp()
    return [model[:3], model[3:]]


def _bucket_names(ddp: DataParallel, chunks) -> list[list[str]]:
    names = {id(p): f"chunk{c}.{n}" for c, m in enumerate(chunks) for n, p in m.named_parameters()}
    return [[names[id(p)] for p in b.params] for b in ddp.buckets]


def _accumulated_step(dp, microbatches, bucket_mb, zero=0):
    grid = ParallelGrid(dp=dp)
    chunks = _chunks()
    ddp = STAGES[zero](chunks, grid.dp_group, bucket_mb=bucket_mb,
                       units=[m for c in chunks for m in c if isinstance(m, nn.Linear)])
    x, y = (_my_slice(t, grid) for t in _batch(0))
    with comm.record() as log:
        for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches),
                                         strict=True)):
            with ddp.sync(i == microbatches - 1):
                (F.mse_loss(chunks[1](chunks[0](xm)), ym) / microbatches).backward()
        ddp.finish_grad_sync()
    if zero:
        return len(ddp.buckets), log.count("reduce_scatter", "dp", "dp grads")
    grads = _flat(p.grad for c in chunks for p in c.parameters())
    return _bucket_names(ddp, chunks), log.count("all_reduce", "dp", "dp grads"), grads


def _serial_grads() -> torch.Tensor:
    model = _mlp()
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    return _flat(p.grad for p in model.parameters())


def test_buckets_follow_reverse_registration_order_one_layer_each():
    names, _, _ = LAUNCHES["accumulated-dp2"][0]
    assert names == [["chunk1.6.bias", "chunk1.6.weight"], ["chunk1.4.bias", "chunk1.4.weight"],
                     ["chunk0.2.bias", "chunk0.2.weight"], ["chunk0.0.bias", "chunk0.0.weight"]]


def test_a_bucket_never_spans_two_model_chunks():
    names, _, _ = LAUNCHES["accumulated-dp2-big-buckets"][0]
    assert [len(b) for b in names] == [4, 4]


@pytest.mark.parametrize("dp", [2, 4])
def test_accumulation_all_reduces_each_bucket_once_per_step(dp):
    for names, all_reduces, _ in LAUNCHES[f"accumulated-dp{dp}"]:
        assert all_reduces == len(names) == 4


@pytest.mark.parametrize(("zero", "per_microbatch"), [(1, False), (2, True), (3, True)])
def test_zero_reduce_scatters_once_a_step_or_once_a_microbatch(zero, per_microbatch):
    """ZeRO-1 keeps whole gradients and reduce-scatters each bucket once per step; ZeRO-2 and 3
    hold none between backwards: each of the 2 microbatches' backward reduce-scatters every
    bucket, exactly once (the last one's left to finish_grad_sync)."""
    for buckets, reduce_scatters in LAUNCHES[f"accumulated-dp2-zero{zero}"]:
        assert reduce_scatters == buckets * (2 if per_microbatch else 1)


@pytest.mark.parametrize("dp", [2, 4])
def test_accumulated_gradients_equal_the_serial_global_batch_gradient(dp):
    serial = _serial_grads()
    for _, _, grads in LAUNCHES[f"accumulated-dp{dp}"]:
        assert (grads - serial).abs().max().item() < TOL


def _bucket_sizes(alone) -> list[int]:
    model = _mlp()
    ddp = STAGES[1](model, comm.CommGroup("dp", (0,)), bucket_mb=1000.0,
                    alone=[model[i].weight for i in alone])
    return [len(b.params) for b in ddp.buckets]


def test_a_parameter_named_alone_gets_a_bucket_of_its_own():
    # ZeRO-1's tied embedding: its shards must line up with its copy's on another stage
    assert _bucket_sizes(alone=[2]) == [5, 1, 2]


def test_otherwise_parameters_share_buckets():
    assert _bucket_sizes(alone=[]) == [8]


def _early_sync():
    grid = ParallelGrid(dp=2)
    model = _mlp()
    ddp = DataParallel(model, grid.dp_group, bucket_mb=LAYER_MB)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()           # forgot ddp.sync(False): buckets launch
    try:
        F.mse_loss(model(x), y).backward()
    except RuntimeError as error:
        return str(error)
    finally:
        ddp.finish_grad_sync()
    return "no error"


def test_a_gradient_for_a_bucket_in_flight_is_an_error_naming_the_fix():
    assert all("ddp.sync(False)" in message for message in LAUNCHES["early-sync"])


# --- 3. overlapped buckets equal one bucket after backward ---------------------------------------

@pytest.mark.parametrize("dp", [2, 4])
def test_bucketed_overlapped_training_equals_one_bucket_after_backward(dp):
    for ranks in _trainings(dp):
        overlapped, baseline = ranks["overlapped"][0], ranks["one bucket after backward"][0]
        assert (overlapped - baseline).abs().max().item() < TOL


def test_overlap_launches_every_bucket_during_backward():
    for timeline, backward_end in _trainings(2)[0]["overlapped"][1]:
        assert [t.launched_at < backward_end for t in timeline] == [True, True, True, True]


def test_without_overlap_the_one_bucket_launches_after_backward():
    for timeline, backward_end in _trainings(2)[0]["one bucket after backward"][1]:
        assert [t.launched_at > backward_end for t in timeline] == [True]


# --- 4. parameters without gradients -------------------------------------------------------------

class _Partly(nn.Module):
    """``sometimes`` is used on dp rank 0 only, ``never`` nowhere: their buckets sit between others
    (backward order last, never, sometimes, first), so a rank that launched out of order would
    pair the wrong collectives and hang."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.sometimes, self.never, self.last = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, use_sometimes: bool):
        h = self.first(x)
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.last(h)


def _partly_used_step(grid, zero):
    model = _Partly()
    ddp = STAGES[zero](model, grid.dp_group, bucket_mb=1e-6)
    out = model(torch.ones(2, 4) * (grid.dp_rank + 1), use_sometimes=grid.dp_rank == 0)
    out.pow(2).mean().backward()
    ddp.finish_grad_sync()
    ddp.optimizer(model.parameters(), torch.optim.AdamW, lr=0.1).step()
    return model


def _unused_params():
    """(ZeRO-3 needs every rank to run the same units: a unit's gather is a collective.)"""
    grid = ParallelGrid(dp=2)
    plain = _partly_used_step(grid, zero=0)
    sharded = [_flat(_partly_used_step(grid, zero).parameters()) for zero in (1, 2)]
    return plain.sometimes.weight.grad, plain.never.weight.grad, sharded


def _unused_runs():
    return LAUNCHES["unused-params"]


def test_a_parameter_unused_on_some_ranks_gets_the_same_average_everywhere():
    (rank0, _, _), (rank1, _, _) = _unused_runs()
    assert torch.equal(rank0, rank1) and rank0.abs().sum() > 0


def test_a_parameter_unused_on_every_rank_gets_a_zero_gradient():
    assert [never.abs().sum().item() for _, never, _ in _unused_runs()] == [0.0, 0.0]


def test_zero1_and_2_with_unused_parameters_keep_the_replicas_equal():
    (_, _, rank0), (_, _, rank1) = _unused_runs()
    for mine, theirs in zip(rank0, rank1, strict=True):
        assert torch.equal(mine, theirs)


# --- 5. ZeRO-1, 2 and 3 equal plain data parallelism -------------------------------------------

ODD = (63, 65, 64, 3)   # 8,579 parameters, not divisible by dp: padding, parameters split by shards
ODD_BUCKET_MB = 8000 / 2**20                     # two buckets: layers 2–1 and layer 0
MAX_NORM = 0.05
ZERO_STAGES = (0, 1, 2, 3)


def _zero_vs_plain(grid, zero):
    """3 steps of AdamW with decay groups, warm-up/cosine lr and clipping, plain DP or ZeRO-1–3
    (ZeRO-3: each Linear a unit). Returns the parameters, the global norm of each step, the
    optimizer state bytes, the number of buckets, the bytes each rank holds between steps of
    parameters and gradients, and of the last step the comm log, ZeRO-3's unit timeline and
    the all-gathers and reduce-scatters that reached torch.distributed."""
    model = _mlp(ODD)
    ddp = STAGES[zero](model, grid.dp_group, bucket_mb=ODD_BUCKET_MB,
                       units=[m for m in model if isinstance(m, nn.Linear)])
    opt = ddp.optimizer(build_param_groups(model, weight_decay=0.1), torch.optim.AdamW,
                        lr=0.0, betas=(0.9, 0.95))
    timer = UnitTimer(ddp) if zero == 3 else BucketTimer(ddp)
    norms = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, warmup=1, total=STEPS, lr=3e-3, min_lr=3e-4)
        x, y = _batch(step, ODD[0], ODD[-1])
        with comm.record() as log, timer.step(), _BufferCollectives(ddp) as collectives:
            F.mse_loss(model(_my_slice(x, grid)), _my_slice(y, grid)).backward()
            ddp.finish_grad_sync()
            norms.append(ddp.clip_grad_norm_(MAX_NORM, grid).item())
            opt.step()
        ddp.zero_grad()
    held = {"params": _storage_bytes([*model.parameters(),
                                      *(b.param_shard for b in ddp.buckets)]),
            "grads": _storage_bytes([*ddp.held_grads(), *(b.grad_data for b in ddp.buckets)])}
    with ddp.gathered():
        params = _flat(model.parameters())
    return (params, norms, optimizer_state_bytes(opt), len(ddp.buckets), held, log,
            getattr(timer, "events", None), collectives.calls)


class _BufferCollectives(TorchDispatchMode):
    """The all-gathers and reduce-scatters that reach torch.distributed inside the block, each as
    (op, on a bucket's buffer?, in place?): an all-gather whose output is a bucket's
    ``param_data`` and whose input is this rank's own chunk of it; a reduce-scatter whose input is
    a bucket's ``grad_data`` and whose output is this rank's own chunk of it."""

    OPS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self, ddp: DataParallel) -> None:
        super().__init__()
        self.ddp, self.calls = ddp, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = self.OPS.get(func.overloadpacket.__name__)
        if op is not None:
            out, x = args[:2]
            whole, part = (out, x) if op == "all_gather" else (x, out)
            buffers = [b.param_data if op == "all_gather" else b.grad_data
                       for b in self.ddp.buckets]
            own = whole.data_ptr() + self.ddp.group.rank * part.numel() * part.element_size()
            self.calls.append((op, any(b is not None and b.data_ptr() == whole.data_ptr()
                                       for b in buffers), part.data_ptr() == own))
        return func(*args, **(kwargs or {}))


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (None and empty ones: nothing)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None and t.numel()}
    return sum(storages.values())


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_zero_training_equals_plain_dp_with_decay_schedule_and_clipping(dp, zero):
    plain = _trainings(dp)[0]["zero0"][0]
    for ranks in _trainings(dp):
        assert (ranks[f"zero{zero}"][0] - plain).abs().max().item() < TOL


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_global_norm_equals_plain_dp_and_clipping_was_active(dp):
    plain_norms = _trainings(dp)[0]["zero0"][1]
    for ranks in _trainings(dp):
        for zero in (1, 2, 3):
            assert ranks[f"zero{zero}"][1] == pytest.approx(plain_norms, rel=TOL)
        assert min(ranks["zero1"][1]) > MAX_NORM


def test_the_odd_model_fills_two_buckets_and_zero3_one_per_linear():
    assert [_trainings(2)[0][f"zero{z}"][3] for z in ZERO_STAGES] == [2, 2, 2, 3]


@pytest.mark.parametrize("dp", [2, 4])
def test_each_stage_shards_what_the_zero_paper_says(dp):
    """Between steps, per rank, Ψ the fp32 bytes of the parameters: Adam's two moments, 2Ψ,
    /dp from stage 1; the gradients, Ψ, /dp from stage 2; the parameters, Ψ, /dp at stage 3
    (Rajbhandari et al. 2020, Figure 1; the flat buffers' padding is within 1 %)."""
    for ranks in _trainings(dp):
        psi = ranks["zero0"][4]["params"]
        for zero in ZERO_STAGES:
            _, _, state, _, held, *_ = ranks[f"zero{zero}"]
            assert state * (dp if zero else 1) == pytest.approx(2 * psi, rel=0.01), zero
            assert held["grads"] * (dp if zero >= 2 else 1) == pytest.approx(psi, rel=0.01)
            assert held["params"] * (dp if zero == 3 else 1) == pytest.approx(psi, rel=0.01)


@pytest.mark.parametrize("dp", [2, 4])
def test_each_stage_sends_what_the_zero_paper_says(dp):
    """Wire bytes per rank and step: the all-reduce's 2(d−1)/d·Ψ for stages 0–2 (ZeRO-1 and 2 as
    a reduce-scatter and an all-gather), 3(d−1)/d·Ψ for stage 3 — every unit gathered twice and
    reduce-scattered once: 1.5× (the ZeRO paper's §7)."""
    for ranks in _trainings(dp):
        psi = ranks["zero0"][4]["params"]
        for zero, ops, factor in ((0, {"all_reduce"}, 2), (1, {"reduce_scatter", "all_gather"}, 2),
                                  (2, {"reduce_scatter", "all_gather"}, 2),
                                  (3, {"reduce_scatter", "all_gather"}, 3)):
            events = [e for e in ranks[f"zero{zero}"][5].events if e.label.startswith("dp ")]
            assert {e.op for e in events} == ops, zero
            wire = sum(e.wire_bytes for e in events)
            assert wire == pytest.approx(factor * (dp - 1) / dp * psi, rel=0.01), zero


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_collectives_work_in_place_in_the_bucket_buffers(dp):
    """Each all-gather of the last step wrote straight into its bucket's flat buffer, its input
    this rank's own chunk of it (ZeRO-3: the unit's storage itself, no copy of the unit); each
    reduce-scatter reduced a bucket's gradient buffer into this rank's own chunk of it
    (Megatron-LM's buckets) — one torch.distributed call per recorded collective, no other."""
    for ranks in _trainings(dp):
        for zero in (1, 2, 3):
            log, calls = ranks[f"zero{zero}"][5], ranks[f"zero{zero}"][7]
            recorded = [e.op for e in log.events if e.op in ("all_gather", "reduce_scatter")]
            assert calls == [(op, True, True) for op in recorded], zero
            assert {"all_gather", "reduce_scatter"} <= set(recorded), zero


def _state_of_a_tiny_model(dp, sharded):
    """One AdamW step of a model smaller than dp (3 numbers): under ZeRO-1 some ranks hold no
    piece and no optimizer state at all; every rank still assembles the whole state."""
    grid = ParallelGrid(dp=dp)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    ddp = STAGES[int(sharded)](model, grid.dp_group)
    opt = ddp.optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    model(torch.ones(4, 2)).sum().backward()
    ddp.finish_grad_sync()
    opt.step()
    states = opt.param_states() if sharded else {p: opt.state[p] for p in model.parameters()}
    return [{k: v.clone() for k, v in states[p].items()} for p in model.parameters()], \
        len(opt.state)


def test_zero1_state_assembles_on_every_rank_even_one_without_a_piece():
    plain, _ = LAUNCHES["tiny-model-serial"][0]
    out = LAUNCHES["tiny-model-zero1-dp4"]
    assert min(pieces for _, pieces in out) == 0   # a rank with no state took part
    for states, _ in out:
        for mine, reference in zip(states, plain, strict=True):
            assert mine.keys() == reference.keys()
            for key in reference:
                torch.testing.assert_close(mine[key].float(), reference[key].float())


# --- 6. the global gradient norm -----------------------------------------------------------------

def _clipped(dp):
    grid = ParallelGrid(dp=dp)
    model = _mlp()
    ddp = DataParallel(model, grid.dp_group)
    x, y = _batch(0)
    F.mse_loss(model(_my_slice(x, grid)), _my_slice(y, grid)).backward()
    ddp.finish_grad_sync()
    norm = clip_grad_norm_(model.parameters(), 0.1, grid)
    return norm, _flat(p.grad for p in model.parameters())


def test_clip_grad_norm_equals_torch_on_the_serial_model():
    model = _mlp()
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    serial_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
    serial_grads = _flat(p.grad for p in model.parameters())
    for norm, grads in LAUNCHES["clipped-dp2"]:
        assert norm == pytest.approx(serial_norm, rel=TOL)
        assert (grads - serial_grads).abs().max().item() < TOL


def _whole_model_grads() -> dict[str, torch.Tensor]:
    """The gradients a serial model would hold: a tied embedding, a split W and a replicated
    layer norm per pipeline stage."""
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen) for name, shape in
            [("embedding", (8, 6)), ("w0", (4, 6)), ("ln0", (6,)), ("w1", (4, 6)), ("ln1", (6,))]}


def _param(grad: torch.Tensor, tp_dim) -> nn.Parameter:
    p = nn.Parameter(torch.zeros_like(grad))
    p.grad, p.tp_dim = grad.clone(), tp_dim
    return p


def _tp_pp_norm():
    """tp=2 × pp=2: split tensors are this tp rank's rows; the last stage holds a copy of the
    embedding (a tied copy) besides its own W and layer norm."""
    grid = ParallelGrid(tp=2, pp=2)
    full = _whole_model_grads()
    mine = {k: v.chunk(2)[grid.tp_rank] for k, v in full.items() if k in ("embedding", "w0", "w1")}
    stage = grid.pp_rank
    params = [_param(mine["embedding"], 0), _param(mine[f"w{stage}"], 0),
              _param(full[f"ln{stage}"], None)]
    return clip_grad_norm_(params, 1e9, grid, tied_copies=params[:1] if stage == 1 else [])


def test_global_norm_counts_tp_replicas_and_the_pipeline_embedding_copy_once():
    expected = math.sqrt(sum(g.pow(2).sum().item() for g in _whole_model_grads().values()))
    assert LAUNCHES["norm-tp2-pp2"] == pytest.approx([expected] * 4, rel=TOL)


# --- 7. weight-decay groups and the learning-rate schedule ---------------------------------------

def test_param_groups_decay_matrices_and_embeddings_but_not_biases_or_layer_norms():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    decay, no_decay = build_param_groups(model, weight_decay=0.1)
    assert [tuple(p.shape) for p in decay["params"]] == [(10, 4), (4, 4)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(4,), (4,), (4,)]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_warmup_rises_linearly_to_lr():
    assert [warmup_cosine(s, 4, 20, 1.0, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_is_halfway_at_mid_decay_and_min_lr_at_the_end():
    assert warmup_cosine(12, 4, 20, 1.0, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(20, 4, 20, 1.0, 0.1) == 0.1
    assert warmup_cosine(99, 4, 20, 1.0, 0.1) == 0.1


def test_zero3_gathers_each_unit_twice_and_prefetches_the_next():
    """Each Linear (a unit) is gathered for its forward and again for its backward; units run
    forward in order and backward in reverse, and while one computes the next one's gather is
    already on its way (launched before the unit's pass ends): FSDP's prefetch."""
    events = _trainings(2)[0]["zero3"][6]
    units = sorted({e.unit for e in events})
    for u in units:
        assert sorted(e.kind for e in events if e.unit == u) == ["backward", "forward",
                                                                 "gather", "gather"]
    passes = {kind: [e for e in events if e.kind == kind] for kind in ("forward", "backward")}
    assert [e.unit for e in passes["forward"]] == units
    assert [e.unit for e in passes["backward"]] == units[::-1]
    gathers = {u: sorted(e.start for e in events if e.kind == "gather" and e.unit == u)
               for u in units}                   # launched: [for the forward, the backward]
    for which, (kind, order) in enumerate((("forward", units), ("backward", units[::-1]))):
        for unit, nxt in zip(order, order[1:], strict=False):
            current = next(e for e in passes[kind] if e.unit == unit)
            assert gathers[nxt][which] < current.end, (kind, unit)   # not after it: prefetched


# --- 8. ZeRO-3 under bf16 autocast -------------------------------------------------------------

WIDE = 128   # six Linear(128, 128) units: their weights dwarf the activations of 4 rows


class _Held(TorchDispatchMode):
    """What a ZeRO-3 rank holds, in bytes, now: its shards, its units' flat buffers (resized in
    place, which no operation allocates) and every storage an operation made inside the block —
    autocast's casts and what autograd keeps of them included — each at its size now."""

    def __init__(self, ddp: DataParallel) -> None:
        super().__init__()
        self.ddp, self.made = ddp, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                known = self.made.get(id(storage))
                if known is None or known() is None:     # new (or a dead one's id reused)
                    self.made[id(storage)] = weakref.ref(storage)
        return out

    def bytes(self) -> int:
        storages = [r() for r in self.made.values()] + [
            t.untyped_storage() for b in self.ddp.buckets for t in (b.param_data, b.param_shard)
            if t is not None]
        return sum(s.nbytes() for s in {id(s): s for s in storages if s is not None}.values())


def _trained_under_autocast(zero: int):
    """Two AdamW steps of six units under bf16 autocast, as ``train.py`` runs a step, the weights
    read whole after each (a checkpoint's ``gathered``). Returns those weights and, for ZeRO-3,
    the bytes held after each unit's forward in the second step."""
    grid = ParallelGrid(dp=2)
    model = _mlp((WIDE,) * 7)
    ddp = STAGES[zero](model, grid.dp_group, units=[m for m in model if isinstance(m, nn.Linear)])
    opt = ddp.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    meter, held, weights = None, [], []
    for m in model[::2]:                        # after ZeRO-3's own hook: the unit is freed
        m.register_forward_hook(lambda *_: held.append(meter.bytes()))
    for step in range(2):
        x, y = (_my_slice(t, grid) for t in _batch(step, WIDE, WIDE))
        meter, held[:] = _Held(ddp), []         # what the step makes, not the first's Adam state
        with torch.autocast("cpu", dtype=torch.bfloat16), meter:
            F.mse_loss(model(x), y).backward()
            ddp.finish_grad_sync()
            opt.step()
        ddp.zero_grad()
        with ddp.gathered():
            weights.append(_flat(model.parameters()))
    return weights, held


def _zero3_under_autocast():
    unit = (WIDE * WIDE + WIDE) * 4
    return _trained_under_autocast(0)[0], *_trained_under_autocast(3), unit


def test_zero3_under_bf16_autocast_trains_as_plain_dp_under_it():
    """Gathered in bf16, a unit's weights are autocast's casts of the fp32 master weights: the
    same forward, the same gradients (reduce-scattered in fp32), the same steps."""
    for plain, zero3, *_ in LAUNCHES["zero3-autocast"]:
        for a, b in zip(plain, zero3, strict=True):
            assert (a - b).abs().max().item() < TOL


def test_zero3_under_bf16_autocast_holds_its_shards_and_one_unit_between_units():
    """Between units a ZeRO-3 rank holds its shards, Ψ/dp, and at most the next unit (prefetched):
    each unit is gathered in bf16 (FSDP2's param_dtype) and freed after its forward, and what
    autograd keeps of it is a view of the freed storage. Gathered in fp32, autocast's bf16 casts
    would stay alive for backward, whatever its cache: 3 units more here by the last unit, a
    bf16 copy of the whole model."""
    for _, _, held, unit in LAUNCHES["zero3-autocast"]:
        psi = 6 * unit
        assert len(held) == 6
        assert max(held) <= psi / 2 + unit


# --- the runs on several ranks above: one launch per world size ---------------------------------

LAUNCHES = Launches({  # name -> (world size, function, arguments)
    **{f"trainings-dp{dp}": (dp, _every_training, (dp,)) for dp in (1, 2, 4)},
    **{f"accumulated-dp{dp}": (dp, _accumulated_step, (dp, 2, LAYER_MB)) for dp in (2, 4)},
    "accumulated-dp2-big-buckets": (2, _accumulated_step, (2, 2, 1000.0)),
    **{f"accumulated-dp2-zero{zero}": (2, _accumulated_step, (2, 2, LAYER_MB, zero))
       for zero in (1, 2, 3)},
    "early-sync": (2, _early_sync, ()),
    "unused-params": (2, _unused_params, ()),
    "tiny-model-serial": (1, _state_of_a_tiny_model, (1, False)),
    "tiny-model-zero1-dp4": (4, _state_of_a_tiny_model, (4, True)),
    "clipped-dp2": (2, _clipped, (2,)),
    "norm-tp2-pp2": (4, _tp_pp_norm, ()),
    "zero3-autocast": (2, _zero3_under_autocast, ()),
})
