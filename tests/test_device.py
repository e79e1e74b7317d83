"""The same tests on CPUs (gloo) and on GPUs (NCCL): ``pytest tests/test_device.py --device cuda``
(``make gpu-check`` runs them so); the default ``--device cpu`` runs them on gloo.

Each checks the device against the serial model on the CPU, the one serial truth
(docs/principles.md, principle 1): a GPT's forward and backward, bf16 autocast against fp32,
PTD-P training steps at world size 1 and over a two-stage pipeline (1F1B, interleaved) on two
devices. Then what only a
GPU runs differently, on one device: dropout masks computed there (the CPU's, bit for bit; one
microbatch or four, the same masks), the compiled fused kernels, fused attention and selective
and full recomputation with dropout on, fp16 loss scaling skipping an overflow and recovering.
TF32 is off, so a GPU's fp32 matmuls are fp32.
"""

import pytest
import torch
from helpers import batch, tiny_config

from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.optim import build_param_groups
from megatron_edu.pipeline import PipelineConfig
from megatron_edu.ptdp import PTDP, PTDPOptions

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


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, CONFIG.seq_len + 1),
                        generator=g)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _serial() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(build_param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95),
                                  eps=EPS)
    losses = []
    for ids, labels in _batches():
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

def _on_device_only(device: str) -> None:
    if device == "cpu":
        pytest.skip("covered on the CPU by tests/test_memory_techniques.py and test_ptdp.py")


def _loss_and_grads(model: GPT, ids, labels, keys) -> tuple[torch.Tensor, dict]:
    """Σ of the summed token losses over the slices ``keys`` names, and the gradients."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(ids[list(key.samples)], labels[list(key.samples)], dropout_key=key,
                     loss_reduction="sum") for key in keys)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_dropout_masks_on_the_device_do_not_depend_on_the_microbatches(device):
    """The same four samples in one microbatch or in four: the same masks, the same gradients."""
    from megatron_edu.tensor_parallel import DropoutKey

    config = tiny_config(dropout=0.1)
    model = GPT(config).to(device).train()
    ids, labels = (t.to(device) for t in batch(config, b=4))
    whole = _loss_and_grads(model, ids, labels, [DropoutKey(3, (0, 1, 2, 3))])
    split = _loss_and_grads(model, ids, labels, [DropoutKey(3, (i,)) for i in range(4)])
    torch.testing.assert_close(split, whole, atol=TOL[device], rtol=TOL[device])  # sums of 32


def test_dropout_masks_on_the_device_are_the_cpus_bit_for_bit(device):
    """Integer hashes, no generator: the same masks on any device (a sequence part too)."""
    _on_device_only(device)
    from megatron_edu.tensor_parallel import Dropout, DropoutKey

    key, x = DropoutKey(3, (5, 9, 2)), torch.ones(3, 64, 4, 33)
    for dropout in (Dropout(0.1, 7, 2, "attention probs", parts=((1, 2),)),
                    Dropout(0.5, 7, 2, "mlp output", parts=((1, 2),))):
        assert torch.equal(dropout.keep(key, x.to(device)).cpu(), dropout.keep(key, x))


@pytest.mark.parametrize(("change", "dropout"), [(dict(fused=True, attention="fused"), 0.0),
                                                 (dict(fused=True), 0.1),
                                                 (dict(recompute="selective"), 0.1),
                                                 (dict(recompute="full"), 0.1)],
                         ids=["fused", "fused-dropout", "selective", "full"])
def test_fused_kernels_and_recomputation_on_the_device_equal_the_plain_model(device, change,
                                                                             dropout):
    """The compiled kernels (Triton on a GPU) and the fused attention core (flash attention)
    give the plain model's values; with dropout on, the fused bias kernels and the recomputed
    forward its masks too."""
    _on_device_only(device)
    import dataclasses

    from megatron_edu.tensor_parallel import DropoutKey

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
