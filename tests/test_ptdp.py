"""PTD-P: every layout of the grid takes the serial model's optimizer steps (2104.04473 §3)."""

import contextlib
import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import Launches

from megatron_edu import comm
from megatron_edu.grid import Layout, ParallelGrid, all_layouts
from megatron_edu.model import GPTConfig, LlamaConfig, build_model
from megatron_edu.model.moe import aux_loss_scale, step_stats
from megatron_edu.model.transformer import IGNORE_INDEX
from megatron_edu.optim import build_param_groups
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions
from megatron_edu.tensor_parallel.random import DropoutKey

CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=8, hidden=64, num_heads=8, dropout=0.0)
GLOBAL_BATCH, STEPS, LR, CLIP = 16, 2, 1e-2, 0.5
# Adam divides by sqrt(v) + ε. The key bias has a zero gradient in exact arithmetic (softmax
# ignores a constant added to every score of a row), so in floats its "gradient" is rounding
# noise, which Adam with ε = 1e-8 would blow up to ±lr steps in both runs, differently.
# A larger ε keeps noise as noise; every real gradient here is far above it.
EPS = 1e-4


def _batches(masked=False):
    """STEPS global batches; ``masked``: sequence i ignores its first 2·i targets (−100), so
    microbatches and replicas hold different numbers of target tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, CONFIG.seq_len + 1),
                        generator=g)
    batches = [(step[:, :-1], step[:, 1:].clone()) for step in ids]
    if masked:
        for _, labels in batches:
            for i in range(GLOBAL_BATCH):
                labels[i, :min(2 * i, CONFIG.seq_len - 1)] = IGNORE_INDEX
    return batches


def _serial(config=CONFIG, masked=False):
    model = build_model(config)
    optimizer = torch.optim.AdamW(build_param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95),
                                  eps=EPS)
    losses, norms = [], []
    for step, (ids, labels) in enumerate(_batches(masked)):
        with aux_loss_scale(1 / (labels != IGNORE_INDEX).sum()):   # a mixture of experts'
            loss = model(ids, labels, dropout_key=DropoutKey.first(GLOBAL_BATCH, step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        if config.moe_experts:                  # the step's routing: the expert bias moves
            step_stats([model], config, [])
        losses.append(loss.item())
    return losses, norms, model.full_state_dict()


def _ptdp(layout, options, split, config=CONFIG, masked=False):
    grid = ParallelGrid(layout, embedding_ranks=split["pipeline"].stages(layout.pp).ends)
    trainer = PTDP(config, grid, options, **split)
    dp = layout.dp
    losses, norms = [], []
    with comm.record() as log:
        for ids, labels in _batches(masked):
            mine = slice(grid.dp_rank * GLOBAL_BATCH // dp, (grid.dp_rank + 1) * GLOBAL_BATCH // dp)
            result = trainer.train_step(ids[mine], labels[mine], LR)
            losses.append(result.loss)
            norms.append(result.grad_norm)
    params = {}
    with trainer.gathered():                     # ZeRO-3: the whole weights, for a moment
        for chunk in trainer.chunks:
            params.update(chunk.full_state_dict())
    return losses, norms, params, log


@pytest.fixture(scope="module")
def serial():
    losses, norms, params = LAUNCHES["serial"][0]
    assert max(norms) > CLIP  # the clipping path is really exercised
    return losses, norms, params


def _check_equal_to_serial(serial, out):
    """Every rank — every tp rank of every replica, both stages holding the tied embedding —
    reports the serial losses and norms and holds the serial weights."""
    serial_losses, serial_norms, serial_params = serial
    held = set()
    for rank, (losses, norms, params, _) in enumerate(out):
        assert losses == pytest.approx(serial_losses, abs=1e-5), rank
        # a norm sums ~10⁵ squares, after Adam has scaled rounding in near-zero gradients up
        assert norms == pytest.approx(serial_norms, rel=5e-5, abs=1e-5), rank
        for name, value in params.items():
            torch.testing.assert_close(value, serial_params[name], atol=1e-5, rtol=0,
                                       msg=f"rank {rank}: {name}")
        held |= params.keys()
    assert held == serial_params.keys()


PIPELINE_FIELDS = {"schedule", "chunks", "num_microbatches"}


def _split(tp, pp, dp, cp=1, zero=0, **overrides):
    """(the Layout, the PTDPOptions, PTDP's pipeline and zero) of a run: two microbatches
    unless said otherwise."""
    pipeline = {k: v for k, v in overrides.items() if k in PIPELINE_FIELDS}
    options = {k: v for k, v in overrides.items() if k not in PIPELINE_FIELDS}
    return (Layout(tp, pp, dp, cp), PTDPOptions(**{"lr": LR, "clip": CLIP, "eps": EPS, **options}),
            dict(pipeline=PipelineConfig(**{"num_microbatches": 2, **pipeline}), zero=zero))


DROPOUT = dataclasses.replace(CONFIG, dropout=0.1)


def _every_layout_of_8(config=CONFIG):
    return [_ptdp(*_split(layout.tp, layout.pp, layout.dp), config) for layout in all_layouts(8)]


# The Llama block (issue 33): RMSNorm, rotary positions, SwiGLU, grouped-query attention (16
# heads in 2 groups: tp = 4 and 8 replicate each kv head on 2 and 4 ranks), no biases, an
# untied output layer. Every layout of 8 ranks runs it with experts (tests/test_moe.py: 8
# heads in 2 groups, a SwiGLU shared expert); here under SP, cp, interleaving, ZeRO and ZB.
LLAMA = LlamaConfig(vocab_size=100, seq_len=8, num_layers=8, hidden=64, num_heads=16,
                    num_kv_heads=2, ffn_hidden=96)


def _inf_on_one_rank(tp, pp, dp, zero1, bad_rank):
    layout, options, split = _split(tp, pp, dp, zero=int(zero1))
    grid = ParallelGrid(layout)
    trainer = PTDP(CONFIG, grid, options, **split)
    (ids, labels), *_ = _batches()
    mine = slice(grid.dp_rank * GLOBAL_BATCH // dp, (grid.dp_rank + 1) * GLOBAL_BATCH // dp)
    before = {k: v.clone() for c in trainer.chunks for k, v in c.state_dict().items()}
    sum_tied = trainer._sum_tied_embedding_grads

    def poison():  # after the dp reduction: only this rank's gradient is bad
        sum_tied()
        if grid.rank == bad_rank:
            grad = (next(piece.tensor.grad for piece in trainer.optimizer.pieces  # its shard
                         if piece.param.tp_dim is not None) if zero1 else
                    next(iter(trainer.chunks[0].blocks.values())).mlp.fc.weight.grad)
            grad.view(-1)[0] = float("inf")

    trainer._sum_tied_embedding_grads = poison
    result = trainer.train_step(ids[mine], labels[mine], LR)
    unchanged = all(torch.equal(v, before[k]) for c in trainer.chunks
                    for k, v in c.state_dict().items())
    trainer._sum_tied_embedding_grads = sum_tied
    after = trainer.train_step(ids[mine], labels[mine], LR)  # the next step goes on
    return result.skipped, unchanged, after.skipped, trainer.iteration


def _training(tp, pp, dp, config=CONFIG, masked=False, **overrides):
    """A PTD-P run's case: (world size, the function each rank runs, its arguments)."""
    return (tp * pp * dp * overrides.get("cp", 1), _ptdp,
            (*_split(tp, pp, dp, **overrides), config, masked))


HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def _counting_host_syncs() -> Iterator[Counter]:
    """Counts the package's calls that read a tensor back to the host (on a GPU each waits for
    the stream): ``.item()``, ``.tolist()``, ``bool()``/``float()``/``int()`` of a tensor, ...
    by patching ``torch.Tensor``; by method and the caller's file, when it is megatron_edu's."""
    calls, methods = Counter(), {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}

    def counting(name, method):
        def call(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if "megatron_edu" in caller.co_filename:
                calls[name, Path(caller.co_filename).name] += 1
            return method(self, *args, **kwargs)
        return call

    for name, method in methods.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield calls
    finally:
        for name, method in methods.items():
            setattr(torch.Tensor, name, method)


def _a_bf16_step(tp, pp, dp, config, zero, schedule="1f1b", chunks=None):
    """One PTD-P step under CPU bf16 autocast, dropout on, after a first one (warm-up): the host
    syncs the package made during it, and its tp and pipeline traffic (op, label, dtype, bytes)."""
    layout, options, split = _split(tp, pp, dp, zero=zero, schedule=schedule, chunks=chunks)
    grid = ParallelGrid(layout, embedding_ranks=split["pipeline"].stages(pp).ends)
    trainer = PTDP(config, grid, options, **split)
    ids, labels = _batches()[0]
    mine = slice(grid.dp_rank * GLOBAL_BATCH // dp, (grid.dp_rank + 1) * GLOBAL_BATCH // dp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.train_step(ids[mine], labels[mine], LR)
        with _counting_host_syncs() as syncs, comm.record() as log:
            trainer.train_step(ids[mine], labels[mine], LR)
    return dict(syncs), [(e.op, e.label, e.dtype, e.bytes) for e in log.events
                         if e.group in ("tp", "p2p")]


SP = dataclasses.replace(CONFIG, sequence_parallel=True)
CASES = {  # name -> (world size, function, arguments); every case of one size in one launch
    "serial": (1, _serial, ()),
    "serial-dropout": (1, _serial, (DROPOUT,)),
    "serial-masked": (1, _serial, (CONFIG, True)),
    "interleaved": _training(1, 2, 2, schedule="interleaved", chunks=2),
    "gpipe-tp": _training(2, 2, 1, schedule="gpipe"),
    "zero1-tp2": _training(2, 1, 2, zero=1),
    "zero1-buckets": _training(1, 2, 2, zero=1, bucket_mb=0.01),
    "zero2-dp4": _training(1, 1, 4, zero=2, bucket_mb=0.01),
    "zero2-tp2": _training(2, 1, 2, zero=2),
    "zero3-dp4": _training(1, 1, 4, zero=3),
    "zero3-tp2": _training(2, 1, 2, zero=3),
    "one-bucket": _training(1, 2, 2, overlap=False, bucket_mb=1e6),
    "cp2": _training(1, 1, 1, cp=2),
    "tp2-cp2": _training(2, 1, 1, cp=2),
    "pp2-cp2": _training(1, 2, 1, cp=2),
    "dp2-cp2": _training(1, 1, 2, cp=2),
    "pp2-cp2-zero1": _training(1, 2, 1, cp=2, zero=1),
    "tp2-cp2-sp": _training(2, 1, 1, SP, cp=2),
    "zero3-full-recompute": _training(2, 1, 2, dataclasses.replace(CONFIG, recompute="full"),
                                      zero=3),
    "zero3-sp-selective": _training(2, 1, 2, dataclasses.replace(SP, recompute="selective"),
                                    zero=3),
    "accumulate-4": _training(1, 2, 2, num_microbatches=4, bucket_mb=1e6),
    "scatter-gather-off": _training(2, 2, 1, scatter_gather=False),
    "scatter-gather-on": _training(2, 2, 1, scatter_gather=True),
    "dropout-serial-ptdp": _training(1, 1, 1, DROPOUT),
    "dropout-pp2": _training(1, 2, 1, DROPOUT),
    "dropout-pp4": _training(1, 4, 1, DROPOUT),
    "dropout-interleaved": _training(1, 2, 1, DROPOUT, schedule="interleaved", chunks=2),
    "dropout-dp2": _training(1, 1, 2, DROPOUT),
    "dropout-dp4": _training(1, 1, 4, DROPOUT),
    "dropout-pp2-dp2-zero1": _training(1, 2, 2, DROPOUT, zero=1),
    "dropout-cp4": _training(1, 1, 1, DROPOUT, cp=4),
    "dropout-dp2-zero2": _training(1, 1, 2, DROPOUT, zero=2),
    "dropout-dp4-zero3": _training(1, 1, 4, DROPOUT, zero=3),
    "dropout-tp2": _training(2, 1, 1, DROPOUT),
    "dropout-tp2-pp2-dp2": _training(2, 2, 2, DROPOUT, schedule="interleaved", chunks=2),
    "dropout-tp2-cp2-sp": _training(2, 1, 1, dataclasses.replace(DROPOUT, sequence_parallel=True),
                                    cp=2),
    "masked-pp2-dp2": _training(1, 2, 2, masked=True),
    "masked-tp2-dp2": _training(2, 1, 2, masked=True),
    "masked-dp4": _training(1, 1, 4, masked=True),
    "masked-dp2-cp2": _training(1, 1, 2, masked=True, cp=2),
    "inf-pp2-dp2": (4, _inf_on_one_rank, (1, 2, 2, False, 3)),
    "inf-tp2-dp2-zero1": (4, _inf_on_one_rank, (2, 1, 2, True, 1)),
    "inf-dp4": (4, _inf_on_one_rank, (1, 1, 4, False, 2)),
    "every-layout-of-8": (8, _every_layout_of_8, ()),
    "llama-serial": (1, _serial, (LLAMA,)),
    "llama-tp2-cp2-sp": _training(2, 1, 1, dataclasses.replace(LLAMA, sequence_parallel=True),
                                  cp=2),
    "llama-interleaved-zero1": _training(1, 2, 2, LLAMA, schedule="interleaved", chunks=2,
                                         zero=1),
    "llama-zb-h1": _training(1, 2, 2, LLAMA, schedule="zb-h1", num_microbatches=4),
    "llama-tp4-sp-zero3-dp2": _training(4, 1, 2, dataclasses.replace(LLAMA,
                                                                    sequence_parallel=True),
                                        zero=3),
    "bf16-tp2-pp2-dp2": (8, _a_bf16_step, (2, 2, 2, DROPOUT, 1, "interleaved", 2)),
    "bf16-sp-tp2-dp4-zero3": (8, _a_bf16_step, (2, 1, 4, dataclasses.replace(
        DROPOUT, sequence_parallel=True), 3)),
}
LAUNCHES = Launches(CASES)  # LAUNCHES[name]: every rank's result of case name


@pytest.mark.parametrize("index", range(len(all_layouts(8))),
                         ids=[f"tp{g.tp}-pp{g.pp}-dp{g.dp}" for g in all_layouts(8)])
def test_every_layout_of_8_ranks_takes_the_serial_steps(serial, index):
    _check_equal_to_serial(serial, [rank[index] for rank in LAUNCHES["every-layout-of-8"]])


@pytest.mark.parametrize("name", ["interleaved", "gpipe-tp", "zero1-tp2", "zero1-buckets",
                                  "zero2-dp4", "zero2-tp2", "zero3-dp4", "zero3-tp2",
                                  "one-bucket"])
def test_schedules_zero_stages_and_buckets_take_the_serial_steps(serial, name):
    """Two microbatches a step (gradient accumulation: ZeRO-2 and 3 reduce-scatter both) and
    clipping; ZeRO-3 gathers every block for its forward and again for its backward."""
    _check_equal_to_serial(serial, LAUNCHES[name])


@pytest.mark.parametrize("name", ["cp2", "tp2-cp2", "pp2-cp2", "dp2-cp2", "pp2-cp2-zero1",
                                  "tp2-cp2-sp"])
def test_context_parallel_layouts_take_the_serial_steps(serial, name):
    """Each cp rank runs its zig-zag chunks of the replica's sequences; the token count, the
    loss and the gradients are summed over dp × cp, ZeRO-1 shards over dp × cp (here over the
    two cp ranks, the tied embedding's shard included), and sequence parallelism splits each cp
    rank's chunks over tp."""
    _check_equal_to_serial(serial, LAUNCHES[name])


@pytest.mark.parametrize("name", ["zero3-full-recompute", "zero3-sp-selective"])
def test_zero3_with_recomputation_and_sequence_parallelism_takes_the_serial_steps(serial, name):
    """Full recomputation runs a block's forward again inside backward: ZeRO-3 must keep it
    gathered there; sequence parallelism sums the layer norms' gradient shards over tp."""
    _check_equal_to_serial(serial, LAUNCHES[name])


def test_dp_gradients_are_all_reduced_once_per_step_not_per_microbatch():
    for _, _, params, log in LAUNCHES["accumulate-4"]:
        buckets = 2 if "embedding.word.weight" in params else 1   # the tied embedding: its own
        assert log.count("all_reduce", group="dp", label="dp grads") == buckets * STEPS
        assert log.count(label="embedding grads") == STEPS  # pp=2: both stages hold a copy


def test_scatter_gather_divides_the_bytes_between_stages_by_tp():
    plain, split = LAUNCHES["scatter-gather-off"], LAUNCHES["scatter-gather-on"]
    for (losses_a, *_, log_a), (losses_b, *_, log_b) in zip(plain, split, strict=True):
        assert losses_a == pytest.approx(losses_b, abs=1e-6)
        assert log_a.total_bytes("send") == 2 * log_b.total_bytes("send") > 0


# --- dropout on: every layout draws the serial model's masks, tp > 1 too -------------------------

@pytest.fixture(scope="module")
def serial_with_dropout():
    return LAUNCHES["serial-dropout"][0]


@pytest.mark.parametrize("name", ["serial-ptdp", "pp2", "pp4", "interleaved", "dp2", "dp4",
                                  "pp2-dp2-zero1", "cp4", "dp2-zero2", "dp4-zero3", "tp2",
                                  "tp2-pp2-dp2", "tp2-cp2-sp"])
def test_with_dropout_every_layout_takes_the_serial_steps(serial_with_dropout, name):
    """Each tp rank draws its heads' part of the serial attention masks (``random.py``)."""
    _check_equal_to_serial(serial_with_dropout, LAUNCHES[f"dropout-{name}"])


def test_dropout_changes_the_steps(serial, serial_with_dropout):
    assert serial[0][0] != pytest.approx(serial_with_dropout[0][0], abs=1e-3)


# --- the loss is the mean over the global batch's target tokens ---------------------------------

@pytest.fixture(scope="module")
def serial_masked():
    return LAUNCHES["serial-masked"][0]


@pytest.mark.parametrize("name", ["pp2-dp2", "tp2-dp2", "dp4", "dp2-cp2"])
def test_a_masked_batch_gives_the_global_token_mean_on_every_layout(serial_masked, name):
    """cp = 2: each cp rank's chunks hold different numbers of target tokens."""
    _check_equal_to_serial(serial_masked, LAUNCHES[f"masked-{name}"])


# --- a non-finite gradient skips the step on every rank -----------------------------------------

@pytest.mark.parametrize("name", ["pp2-dp2", "tp2-dp2-zero1", "dp4"])
def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(name):
    for skipped, unchanged, next_skipped, iteration in LAUNCHES[f"inf-{name}"]:
        assert skipped and unchanged and not next_skipped and iteration == 2


# --- ZeRO-1 sums only the shard of the tied embedding it updates --------------------------------

def test_zero1_sums_a_dp_th_of_the_tied_embedding():
    """pp = 2 × dp = 2, the tied embedding in a bucket of its own either way."""
    def embedding_bytes(name):
        return LAUNCHES[name][0][3].total_bytes(label="embedding grads")

    assert embedding_bytes("zero1-buckets") * 2 == embedding_bytes("one-bucket") > 0


# --- on a GPU, fast by construction: checked here on CPU ------------------------------------------

@pytest.mark.parametrize("name", ["bf16-tp2-pp2-dp2", "bf16-sp-tp2-dp4-zero3"])
def test_a_step_reads_back_to_the_host_once(name):
    """No host sync inside a microbatch, one a step: the loss and the gradient norm together
    (``PTDP.train_step``), on every rank (ZeRO-1 and 3, dropout on, interleaved or 1F1B)."""
    for rank, (syncs, _) in enumerate(LAUNCHES[name]):
        assert syncs == {("tolist", "ptdp.py"): 1}, rank


@pytest.mark.parametrize("name", ["bf16-tp2-pp2-dp2", "bf16-sp-tp2-dp4-zero3"])
def test_under_bf16_every_activation_crosses_tp_and_pp_in_2_bytes(name):
    """The embedding's reduction, each layer's f and g (or SP's gathers and scatters), the pipeline
    messages: bf16, as Megatron-LM sends them. Only the vocabulary-parallel cross entropy's
    [b, s] statistics stay fp32 (1909.08053 §3: it sends b·s values, not b·s·v), and, not
    activations, the fp32 gradients of SP's replicated parameters summed over tp."""
    for rank, (_, traffic) in enumerate(LAUNCHES[name]):
        dtypes = Counter(dtype for op, label, dtype, _ in traffic
                         if not label.startswith("ce ") and label != "sp replicated grads")
        assert set(dtypes) == {torch.bfloat16} and dtypes.total() > 20, (rank, dtypes)


# --- the Llama block under every parallelism ----------------------------------------------------

@pytest.fixture(scope="module")
def llama_serial():
    return LAUNCHES["llama-serial"][0]


@pytest.mark.parametrize("name", ["tp2-cp2-sp", "interleaved-zero1", "tp4-sp-zero3-dp2",
                                  "zb-h1"])
def test_the_llama_under_sp_cp_interleaving_and_zero_takes_the_serial_steps(llama_serial, name):
    """Rotary positions on each cp rank's zig-zag chunks, RMSNorm's gradient summed over tp
    under SP; the interleaved schedule and ZeRO-1 over dp; replicated kv heads (tp = 4) whose
    copies ZeRO-3 shards over dp; zero bubble's B/W split of a first stage whose embedding
    output two trunk nodes read (no position table: pipeline/backward.py's ``_shared``)."""
    _check_equal_to_serial(llama_serial, LAUNCHES[f"llama-{name}"])
