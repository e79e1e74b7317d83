"""The same tests on CPUs (gloo) and on GPUs (NCCL): ``pytest tests/test_device.py --device cuda``
(``make gpu-check`` runs them so); the default ``--device cpu`` runs them on gloo.

Each checks the device against the serial model on the CPU, the one serial truth
(docs/principles.md, principle 1): a GPT's forward and backward, bf16 autocast against fp32,
PTD-P training steps at world size 1 and over a two-stage pipeline (1F1B, interleaved) on two
devices. Then what only a GPU runs differently, on one device: dropout masks computed there (the
CPU's, bit for bit; one microbatch or four, the same masks), the compiled fused kernels, the
fused attention core (flash attention) against the eager one, ``torch.compile``d blocks against
eager ones, selective and full recomputation with dropout on, fp16 loss scaling skipping an
overflow and recovering, and a microbatch's forward and backward that never waits for the GPU
(no host sync). On two GPUs or more, each on NCCL against the serial CPU steps: tp = 2 with
sequence parallelism, cp = 2, ZeRO-1 and ZeRO-3, pp = 2 under 1F1B and ZB-H1, every layout
tp·cp·pp·dp of 2, 4 and 8 ranks that fits the GPUs present, and the bytes on the wire under
bf16 autocast (2 per value, tensor-parallel collectives and pipeline messages alike). TF32 is
off, so a GPU's fp32 matmuls are fp32. The tests of what only a GPU runs skip on the CPU, where
other files cover them (named in each).
"""

import dataclasses
import itertools

import pytest
import torch
from helpers import Launches, batch, tiny_config

import megatron_edu.model
from megatron_edu import comm
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.optim import build_param_groups
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions
from megatron_edu.tensor_parallel import DropoutKey

BACKEND = {"cpu": "gloo", "cuda": "nccl"}
# fp32 on both sides. A GPU's kernels sum in other orders than the CPU's, hence its looser bound
# (a guess until measured: the machine these tests were written on has no GPU).
TOL = {"cpu": 1e-5, "cuda": 1e-4}

CONFIG = GPTConfig(vocab_size=100, seq_len=8, num_layers=4, hidden=32, num_heads=4, dropout=0.0)
GLOBAL_BATCH, STEPS, LR, CLIP = 4, 2, 1e-2, 0.5
EPS = 1e-4  # Adam's ε above rounding noise, as in tests/test_ptdp.py


def _exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# ---- one GPT, forward and backward ----


def _forward_backward(config: GPTConfig, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """In a rank: the loss and gradients of the GPT on this rank's device and of the serial GPT
    on the CPU, as CPU tensors, and the device the first one ran on."""
    _exact_fp32()
    on_rank, serial = GPT(config, ParallelGrid()), GPT(config)
    out = {"device": next(on_rank.parameters()).device.type}
    for where, model in (("rank", on_rank), ("serial", serial)):
        on = next(model.parameters()).device
        loss = model(ids.to(on), labels.to(on))
        loss.backward()
        out[where] = {"loss": loss.detach().cpu(),
                      **{name: p.grad.cpu() for name, p in model.named_parameters()}}
    return out


def test_gpt_forward_and_backward_on_the_device_equal_the_cpu(device):
    config = tiny_config()
    out = run(_forward_backward, 1, config, *batch(config), backend=BACKEND[device])[0]
    assert out["device"] == device
    torch.testing.assert_close(out["rank"], out["serial"], atol=TOL[device], rtol=0)


# ---- bf16 autocast ----


def test_bf16_autocast_forward_is_finite_and_close_to_fp32(device):
    config = tiny_config()
    model = GPT(config).to(device).eval()
    ids, labels = (t.to(device) for t in batch(config))
    with torch.no_grad():
        fp32, fp32_loss = model(ids), model(ids, labels)
        with torch.autocast(device, dtype=torch.bfloat16):
            bf16, bf16_loss = model(ids), model(ids, labels)
    real = slice(0, config.vocab_size)   # the padded vocabulary's logits are −inf
    assert bf16.dtype == torch.bfloat16
    assert torch.isfinite(bf16[..., real]).all() and torch.isfinite(bf16_loss)
    torch.testing.assert_close(bf16[..., real].float(), fp32[..., real], atol=1e-2, rtol=1e-2)
    assert bf16_loss.item() == pytest.approx(fp32_loss.item(), rel=1e-2)


# ---- PTD-P steps: world size 1, and pp = 2 over two devices ----


def _batches(config: GPTConfig = CONFIG,
             global_batch: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (STEPS, global_batch, config.seq_len + 1),
                        generator=g)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _serial(config: GPTConfig = CONFIG,
            global_batch: int = GLOBAL_BATCH) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT(config)
    optimizer = torch.optim.AdamW(build_param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95),
                                  eps=EPS)
    losses = []
    for ids, labels in _batches(config, global_batch):
        loss = model(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict()


def _ptdp(layout: Layout, options: PTDPOptions,
          pipeline: PipelineConfig) -> tuple[str, list[float], dict[str, torch.Tensor]]:
    """In a rank: this rank's device, the losses of ``STEPS`` steps and its stage's parameters."""
    _exact_fp32()
    grid = ParallelGrid(layout)
    trainer = PTDP(CONFIG, grid, options, pipeline=pipeline)
    losses = [trainer.train_step(ids, labels, LR).loss for ids, labels in _batches()]
    params = {name: value.cpu() for chunk in trainer.chunks
              for name, value in chunk.full_state_dict().items()}
    return grid.device.type, losses, params


@pytest.fixture(scope="module")
def serial():
    return run(_serial, 1, backend="gloo")[0]


@pytest.mark.parametrize(("pp", "schedule", "chunks"), [
    (1, "1f1b", 1), (2, "1f1b", 1), (2, "interleaved", 2),
], ids=["world1", "pp2-1f1b", "pp2-interleaved"])
def test_ptdp_steps_on_the_device_equal_the_serial_cpu_steps(device, serial, pp, schedule,
                                                             chunks):
    if device == "cuda" and torch.cuda.device_count() < pp:
        pytest.skip(f"pp = {pp} needs {pp} GPUs, this machine has {torch.cuda.device_count()}")
    pipeline = PipelineConfig(schedule, chunks, num_microbatches=2)
    out = run(_ptdp, pp, Layout(pp=pp), PTDPOptions(lr=LR, clip=CLIP, eps=EPS), pipeline,
              backend=BACKEND[device])
    serial_losses, serial_params = serial
    merged = {}
    for on, losses, params in out:
        assert on == device
        assert losses == pytest.approx(serial_losses, abs=TOL[device])
        merged.update(params)
    torch.testing.assert_close(merged, serial_params, atol=TOL[device], rtol=0)


# ---- what only a GPU runs differently: masks, fused kernels, fp16, recomputation ----
# On the CPU these are covered by tests/test_memory_techniques.py and tests/test_ptdp.py; here
# they run on the device against the same model on that device (make gpu-check).

def _on_device_only(device: str,
                    covered: str = "tests/test_memory_techniques.py and test_ptdp.py") -> None:
    if device == "cpu":
        pytest.skip(f"covered on the CPU by {covered}")


def _loss_and_grads(model: GPT, ids, labels, keys) -> tuple[torch.Tensor, dict]:
    """Σ of the summed token losses over the slices ``keys`` names, and the gradients."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(ids[list(key.samples)], labels[list(key.samples)], dropout_key=key,
                     loss_reduction="sum") for key in keys)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_dropout_masks_on_the_device_do_not_depend_on_the_microbatches(device):
    """The same four samples in one microbatch or in four: the same masks, the same gradients."""
    config = tiny_config(dropout=0.1)
    model = GPT(config).to(device).train()
    ids, labels = (t.to(device) for t in batch(config, b=4))
    whole = _loss_and_grads(model, ids, labels, [DropoutKey(3, (0, 1, 2, 3))])
    split = _loss_and_grads(model, ids, labels, [DropoutKey(3, (i,)) for i in range(4)])
    torch.testing.assert_close(split, whole, atol=TOL[device], rtol=TOL[device])  # sums of 32


def test_dropout_masks_on_the_device_are_the_cpus_bit_for_bit(device):
    """Integer hashes, no generator: the same masks on any device (a sequence part too)."""
    _on_device_only(device)
    from megatron_edu.tensor_parallel import Dropout

    key, x = DropoutKey(3, (5, 9, 2)), torch.ones(3, 64, 4, 33)
    for dropout in (Dropout(0.1, 7, 2, "attention probs", parts=((1, 2),)),
                    Dropout(0.5, 7, 2, "mlp output", parts=((1, 2),))):
        assert torch.equal(dropout.keep(key, x.to(device)).cpu(), dropout.keep(key, x))


@pytest.mark.parametrize(("change", "dropout"), [(dict(fused=True, attention="fused"), 0.0),
                                                 (dict(attention="fused"), 0.0),
                                                 (dict(fused=True), 0.1),
                                                 (dict(recompute="selective"), 0.1),
                                                 (dict(recompute="full"), 0.1)],
                         ids=["fused", "fused-attention", "fused-dropout", "selective", "full"])
def test_fused_kernels_and_recomputation_on_the_device_equal_the_plain_model(device, change,
                                                                             dropout):
    """The compiled kernels (Triton on a GPU) and the fused attention core (flash attention)
    give the plain model's values; with dropout on, the fused bias kernels and the recomputed
    forward its masks too."""
    _on_device_only(device)
    config = tiny_config(dropout=dropout)
    ids, labels = (t.to(device) for t in batch(config, b=4))
    key = [DropoutKey(0, (0, 1, 2, 3))]
    plain, other = (GPT(c).to(device).train()
                    for c in (config, dataclasses.replace(config, **change)))
    torch.testing.assert_close(_loss_and_grads(other, ids, labels, key),
                               _loss_and_grads(plain, ids, labels, key), atol=1e-4, rtol=1e-4)


def _fp16_on_the_device(device: str) -> list[tuple[bool, float]]:
    grid = ParallelGrid()
    trainer = PTDP(CONFIG, grid, PTDPOptions(loss_scaling=True, lr=LR))
    trainer.loss_scale.growth_interval = 2
    unscale = trainer._sum_tied_embedding_grads

    def overflow_at_step_1():
        unscale()
        if trainer.iteration == 1:
            trainer.chunks[0].blocks["0"].mlp.fc.weight.grad.view(-1)[0] = float("inf")

    trainer._sum_tied_embedding_grads = overflow_at_step_1
    out = []
    for ids, labels in _batches() * 2:
        with torch.autocast(grid.device.type, dtype=torch.float16):
            result = trainer.train_step(ids, labels, LR)
        out.append((result.skipped, result.loss_scale))
    return out


def test_fp16_loss_scaling_on_the_device_skips_an_overflow_and_recovers(device):
    _on_device_only(device)
    assert run(_fp16_on_the_device, 1, device, backend=BACKEND[device])[0] == [
        (False, 65536.0), (True, 65536.0), (False, 32768.0), (False, 32768.0)]


# ---- the attention cores in bf16, torch.compile, and no host sync inside a microbatch ----


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fused_and_eager_attention_cores_agree_in_bf16_at_dropout_0(device):
    """Under bf16 autocast, where a GPU's fused core is flash attention (head dim 64, 128
    tokens): the eager core's loss and gradients to bf16's precision (the loss within 1 %, each
    gradient within 5 % of its norm: two orders of rounding 16-bit scores). On the CPU:
    tests/test_memory_techniques.py."""
    _on_device_only(device)
    config = tiny_config(hidden=256, num_heads=4, seq_len=128)
    ids, labels = (t.to(device) for t in batch(config, b=4, s=128))
    out = {}
    for core in ("eager", "fused"):
        model = GPT(dataclasses.replace(config, attention=core)).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids, labels)
        loss.backward()
        out[core] = loss.float(), {n: p.grad for n, p in model.named_parameters()}
    (eager_loss, eager), (fused_loss, fused) = out["eager"], out["fused"]
    assert _relative_error(fused_loss, eager_loss) < 1e-2
    assert {n: e for n, g in fused.items() if (e := _relative_error(g, eager[n])) > 5e-2} == {}


def test_compiled_blocks_equal_the_eager_model(device):
    """``model.compile_blocks`` (``train --compile``): each block's forward compiled by
    torch.compile (Triton kernels on a GPU), with dropout on: the eager model's loss and
    gradients, its masks included. On the CPU: tests/test_memory_techniques.py (its graphs
    captured by ``aot_eager``)."""
    _on_device_only(device)
    compile_blocks = getattr(megatron_edu.model, "compile_blocks", None)
    if compile_blocks is None:
        pytest.skip("megatron_edu.model.compile_blocks is not there yet")
    _exact_fp32()
    config = tiny_config(dropout=0.1)
    ids, labels = (t.to(device) for t in batch(config, b=4))
    key = [DropoutKey(0, (0, 1, 2, 3))]
    eager, compiled = (GPT(config).to(device).train() for _ in range(2))
    compile_blocks(compiled)
    torch.testing.assert_close(_loss_and_grads(compiled, ids, labels, key),
                               _loss_and_grads(eager, ids, labels, key), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["eager", "fused"])
def test_a_microbatch_never_waits_for_the_device(device, attention):
    """One microbatch's forward and backward at tp = 1, bf16, dropout on, under
    ``torch.cuda.set_sync_debug_mode("error")``: any operation that makes the host wait for
    the GPU (``.item()``, a copy from pageable memory, ``nonzero``, …) raises. A training step
    syncs once, after its microbatches (the loss and the gradient norm); the host queues the
    rest ahead of the GPU. Two microbatches first, of two steps (new dropout keys), compile
    what compiles."""
    _on_device_only(device, "nothing: a CPU has no host sync to avoid")
    config = tiny_config(dropout=0.1, attention=attention)
    model = GPT(config).to(device).train()
    ids, labels = (t.to(device) for t in batch(config, b=4))

    def microbatch(step: int) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids, labels, dropout_key=DropoutKey(step, (0, 1, 2, 3)),
                         loss_reduction="sum")
        loss.backward()

    for step in (0, 1):
        microbatch(step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        microbatch(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- two GPUs or more: every layout against the serial steps, the bytes on the wire ----
# On the CPU: tests/test_ptdp.py (the layouts), tests/test_tensor_parallel.py and
# tests/test_pipeline_engine.py (the bytes under bf16 autocast).

LAYOUT_CONFIG = GPTConfig(vocab_size=100, seq_len=16, num_layers=8, hidden=64, num_heads=8,
                          dropout=0.0)   # tp, pp up to 8; cp up to 8 (2·cp chunks of a sequence)
LAYOUT_BATCH = 16                        # dp up to 8, two microbatches each
WORLDS = (2, 4, 8)                       # bench/gpu_check.py gives each launch its time


def _layout_steps(layout: Layout, pipeline: PipelineConfig, zero: int = 0,
                  config: GPTConfig = LAYOUT_CONFIG
                  ) -> tuple[str, list[float], dict[str, torch.Tensor]]:
    """In a rank: its device, the losses of ``STEPS`` PTD-P steps of ``LAYOUT_CONFIG``'s GPT
    split as said, and the whole parameters its stage holds (ZeRO-3 gathers them)."""
    _exact_fp32()
    grid = ParallelGrid(layout, embedding_ranks=pipeline.stages(layout.pp).ends)
    trainer = PTDP(config, grid, PTDPOptions(lr=LR, clip=CLIP, eps=EPS), pipeline=pipeline,
                   zero=zero)
    mine = slice(grid.dp_rank * LAYOUT_BATCH // layout.dp,
                 (grid.dp_rank + 1) * LAYOUT_BATCH // layout.dp)
    losses = [trainer.train_step(ids[mine], labels[mine], LR).loss
              for ids, labels in _batches(config, LAYOUT_BATCH)]
    with trainer.gathered():
        params = {name: value.cpu() for chunk in trainer.chunks
                  for name, value in chunk.full_state_dict().items()}
    return grid.device.type, losses, params


def _wire_under_bf16() -> tuple[str, dict[str, set]]:
    """In a rank of two: (dtype, bytes per value) of every collective of a tp = 2 block (with
    and without sequence parallelism) and of every message of a pp = 2 pipeline, under bf16
    autocast on this rank's device."""
    from megatron_edu.model.transformer import Block
    from megatron_edu.pipeline.engine import Batch, build_chunks, run_schedule
    from megatron_edu.pipeline.schedules import make_schedule
    from megatron_edu.tensor_parallel.init import init_parameters

    b, s = 2, 8
    grid = ParallelGrid(Layout(tp=2))
    wire = {}
    for sp in (False, True):
        config = tiny_config(sequence_parallel=sp)
        block = Block(config, grid.tp_group)
        init_parameters(block, config.seed, grid.tp_group, grid.device)
        x = torch.randn(b, s // 2 if sp else s, config.hidden, device=grid.device,
                        requires_grad=True)
        with comm.record() as log:
            with torch.autocast(grid.device.type, dtype=torch.bfloat16):
                y = block(x)
            y.sum().backward()
        wire["tp-sp" if sp else "tp"] = {(e.dtype, e.bytes / (b * s * config.hidden))
                                         for e in log.events}
    grid = ParallelGrid(Layout(pp=2))
    ids, labels = (t.to(grid.device) for t in _batches()[0])
    with torch.autocast(grid.device.type, dtype=torch.bfloat16), comm.record() as log:
        run_schedule(make_schedule("1f1b", 2, 2), build_chunks(CONFIG, grid), grid,
                     Batch(ids, labels))
    mb = GLOBAL_BATCH // 2
    wire["pp"] = {(e.dtype, e.bytes / (mb * CONFIG.seq_len * CONFIG.hidden))
                  for e in log.select("send")}
    return grid.device.type, wire


def _factorisations(world: int) -> list[Layout]:
    """Every tp·cp·pp·dp = ``world``."""
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    return [Layout(tp, pp, world // (tp * cp * pp), cp)
            for tp, cp, pp in itertools.product(sizes, repeat=3) if world % (tp * cp * pp) == 0]


def _name(layout: Layout) -> str:
    return f"tp{layout.tp}-cp{layout.cp}-pp{layout.pp}-dp{layout.dp}"


TWO_MICROBATCHES = PipelineConfig(num_microbatches=2)
NAMED = {  # name -> (world size, function, arguments)
    "tp2-sp": (2, _layout_steps, (Layout(tp=2), TWO_MICROBATCHES, 0,
                                  dataclasses.replace(LAYOUT_CONFIG, sequence_parallel=True))),
    "cp2": (2, _layout_steps, (Layout(cp=2), TWO_MICROBATCHES)),
    "zero1-dp2": (2, _layout_steps, (Layout(dp=2), TWO_MICROBATCHES, 1)),
    "zero3-dp2": (2, _layout_steps, (Layout(dp=2), TWO_MICROBATCHES, 3)),
    "pp2-1f1b": (2, _layout_steps, (Layout(pp=2), TWO_MICROBATCHES)),
    "pp2-zb-h1": (2, _layout_steps, (Layout(pp=2), PipelineConfig("zb-h1",
                                                                   num_microbatches=2))),
}
EVERY_LAYOUT = {_name(layout): (world, _layout_steps, (layout, TWO_MICROBATCHES))
                for world in WORLDS for layout in _factorisations(world)}
MULTI_GPU = Launches({**NAMED, **EVERY_LAYOUT, "wire": (2, _wire_under_bf16, ())})


def _on_gpus(device: str, world: int) -> None:
    _on_device_only(device, "tests/test_ptdp.py, test_tensor_parallel.py and "
                    "test_pipeline_engine.py")
    if torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs, this machine has "
                    f"{torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def layout_serial(device):
    _on_gpus(device, 2)
    return run(_serial, 1, LAYOUT_CONFIG, LAYOUT_BATCH, backend="gloo")[0]


def _check_equal_to_serial(serial, out) -> None:
    """Every rank ran on a GPU, reports the serial losses and holds the serial weights; the
    ranks together hold all of them."""
    serial_losses, serial_params = serial
    held = set()
    for on, losses, params in out:
        assert on == "cuda"
        assert losses == pytest.approx(serial_losses, abs=TOL["cuda"])
        torch.testing.assert_close(params, {n: serial_params[n] for n in params},
                                   atol=TOL["cuda"], rtol=0)
        held |= params.keys()
    assert held == serial_params.keys()


@pytest.mark.parametrize("name", list(NAMED))
def test_each_technique_on_two_gpus_takes_the_serial_steps(device, layout_serial, name):
    """tp = 2 with sequence parallelism, cp = 2 (ring attention), ZeRO-1 and ZeRO-3 at dp = 2,
    pp = 2 under 1F1B and under ZB-H1 (the backward split into B and W), on NCCL."""
    _on_gpus(device, NAMED[name][0])
    _check_equal_to_serial(layout_serial, MULTI_GPU[name])


@pytest.mark.parametrize("name", list(EVERY_LAYOUT))
def test_every_layout_that_fits_the_gpus_takes_the_serial_steps(device, layout_serial, name):
    _on_gpus(device, EVERY_LAYOUT[name][0])
    _check_equal_to_serial(layout_serial, MULTI_GPU[name])


def test_under_bf16_autocast_activations_travel_in_2_bytes_a_value(device):
    """Megatron-LM's bytes on NCCL: a tensor-parallel layer's all-reduces (or, under sequence
    parallelism, its all-gathers and reduce-scatters) and the messages between pipeline
    stages carry bf16 values, 2 bytes each — not the fp32 of a layer norm's output or of the
    residual stream."""
    _on_gpus(device, 2)
    for on, wire in MULTI_GPU["wire"]:
        assert on == "cuda"
        assert wire == {"tp": {(torch.bfloat16, 2.0)}, "tp-sp": {(torch.bfloat16, 2.0)},
                        "pp": {(torch.bfloat16, 2.0)}}
