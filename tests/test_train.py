"""The training script end to end: learning, exact resume, resharding, safe checkpoints."""

import json
import shutil

import pytest
import torch

from megatron_edu import checkpoint
from megatron_edu.checkpoint import CheckpointError, read_metadata
from megatron_edu.launch import RankError, run
from megatron_edu.perf import training_flops
from megatron_edu.train import _data, main, parse_args, train, validate

TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32",
        "--vocab-size", "512", "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3",
        "--warmup", "2", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _train(out, cache, *extra):
    argv = [*TINY, "--out", str(out), "--cache-dir", str(cache), *extra]
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_loss_decreases_and_everything_is_written(tmp_path, cache):
    records = _train(tmp_path, cache, "--nproc", "2", "--tp", "2", "--steps", "12",
                     "--eval-interval", "6", "--save-interval", "6")
    losses = _losses(records)
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.5
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    steps = [r for r in records if "loss" in r]
    assert all(0 < r["mfu"] == r["hfu"] for r in steps)  # no recomputation: the same FLOPs
    assert (tmp_path / "loss.png").exists()
    assert read_metadata(tmp_path)["step"] == 12


def test_with_recompute_hfu_counts_the_recomputed_forward(tmp_path, cache):
    records = _train(tmp_path, cache, "--nproc", "1", "--steps", "2", "--recompute")
    shape = (8, 32, 4, 64, 512)  # TINY's global batch, sequence, layers, hidden, vocabulary
    ratio = training_flops(*shape, recompute=True) / training_flops(*shape, recompute=False)
    assert 1.25 < ratio < 4 / 3  # 4 forwards instead of 3, the logit layer not recomputed
    for r in (r for r in records if "loss" in r):
        assert r["hfu"] == pytest.approx(r["mfu"] * ratio, rel=1e-12)


@pytest.mark.parametrize(("value", "peak"), [("989", 989.0), ("measured", "measured")])
def test_peak_tflops_is_a_number_or_measured(value, peak):
    assert parse_args(["--peak-tflops", value]).peak_tflops == peak
    assert parse_args([]).peak_tflops is None  # the datasheet's on a known GPU, else measured


@pytest.mark.parametrize("value", ["0", "-5", "fast"])
def test_a_bad_peak_tflops_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--peak-tflops", value])
    assert "expected TFLOP/s > 0 or 'measured'" in capsys.readouterr().err


def _train_with_an_overflow_at_step_2(args, plan):
    from megatron_edu.ptdp import PTDP

    clip = PTDP._clip
    PTDP._clip = lambda self: float("inf") if self.iteration == 1 else clip(self)
    return train(args, plan)


def test_a_non_finite_step_is_skipped_and_counted_in_the_log(tmp_path, cache):
    args = parse_args([*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "2",
                       "--dp", "2", "--steps", "4", "--eval-interval", "4"])
    plan = validate(args)
    _data(args, plan.config)
    run(_train_with_an_overflow_at_step_2, 2, args, plan)
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert [(r["skipped"], r["skipped_steps"]) for r in steps] == [
        (False, 0), (True, 1), (False, 1), (False, 1)]
    assert steps[1]["grad_norm"] is None and steps[2]["grad_norm"] > 0


def test_resume_continues_bit_for_bit(tmp_path, cache):
    whole = _losses(_train(tmp_path / "a", cache, "--nproc", "2", "--pp", "2", "--steps", "6",
                           "--save-interval", "3", "--dropout", "0.1"))
    _train(tmp_path / "b", cache, "--nproc", "2", "--pp", "2", "--steps", "6",
           "--save-interval", "3", "--dropout", "0.1")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000006")   # as if stopped after 3
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_000003")
    resumed = _losses(_train(tmp_path / "b", cache, "--nproc", "2", "--pp", "2", "--steps", "6",
                             "--save-interval", "3", "--dropout", "0.1", "--resume"))
    assert resumed == whole  # exactly: same floats, not approximately


def test_a_checkpoint_reshards_to_other_layouts(tmp_path, cache):
    steps = ["--steps", "4", "--save-interval", "3", "--eval-interval", "100"]
    whole = _losses(_train(tmp_path / "tp2pp2", cache, "--nproc", "4", "--tp", "2", "--pp", "2",
                           *steps))
    saved = tmp_path / "tp2pp2" / "checkpoints" / "step_000003"
    for layout in (["--tp", "1", "--pp", "4"], ["--tp", "4", "--pp", "1"],
                   ["--tp", "1", "--pp", "2", "--schedule", "zb-v"]):   # V placement, dp = 2
        resumed = _losses(_train(tmp_path / "_".join(layout), cache, "--nproc", "4", *layout,
                                 *steps, "--resume", str(saved)))
        assert resumed[4] == pytest.approx(whole[4], abs=1e-5)


def _save_twice_crashing_the_second_time(out):
    """In a rank: a complete checkpoint at step 1, then a save at step 2 that dies mid-write."""
    from megatron_edu.grid import ParallelGrid
    from megatron_edu.model import GPTConfig
    from megatron_edu.ptdp import PTDP, PTDPOptions

    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=32, num_heads=4)
    trainer = PTDP(config, ParallelGrid(), PTDPOptions())
    checkpoint.save_checkpoint(out, 1, trainer)
    real_save = torch.save

    def save_then_die(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        raise OSError("disk full (simulated)")

    checkpoint.torch.save = save_then_die
    try:
        checkpoint.save_checkpoint(out, 2, trainer)
    finally:
        checkpoint.torch.save = real_save


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankError, match="disk full"):
        run(_save_twice_crashing_the_second_time, 1, tmp_path)
    assert read_metadata(tmp_path)["step"] == 1      # latest still names the complete one
    assert (tmp_path / "checkpoints" / "step_000002.tmp").exists()  # half-written, ignored


def test_a_corrupt_checkpoint_is_named(tmp_path, cache, capsys):
    _train(tmp_path, cache, "--nproc", "1", "--steps", "1")
    shard = tmp_path / "checkpoints" / "step_000001" / "model_tp0_pp0.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model_tp0_pp0.pt has .* bytes"):
        read_metadata(tmp_path)
    shard.write_bytes(b"x" * len(data))          # right size, wrong content: found on loading
    argv = [*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "1",
            "--steps", "2", "--resume"]
    assert main(argv) == 1
    assert "corrupt checkpoint file" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc", "4", "--tp", "3"], r"4 ranks do not divide into tp·pp = 3·1"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--dp", "2"], r"2·2·2 = 8 ranks, but the world"),
    (["--tp", "3"], r"num_heads = 4 is not divisible by the tensor-parallel size tp = 3"),
    (["--pp", "3", "--nproc", "3"], r"num_layers = 4 is not divisible by pp·chunks"),
    (["--nproc", "2", "--global-batch", "6"], r"global batch 6 is not divisible by dp·micro"),
    (["--chunks", "2"], r"the 1f1b schedule has one model chunk per rank; got v=2"),
    (["--schedule", "zb-v", "--chunks", "3"], r"the zb-v schedule has two model chunks per rank; "
                                              r"got v=3"),
    (["--schedule", "interleaved"], r"the interleaved schedule needs its number of chunks"),
    (["--schedule", "interleaved", "--chunks", "2"], r"2 model chunks per rank need a pipeline "
                                                     r"\(pp ≥ 2\)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2",
      "--global-batch", "6"], r"multiple of num_stages; got num_microbatches=3, num_stages=2"),
    (["--data", "/no/such/file.txt"], r"--data /no/such/file.txt: no such file"),
    (["--resume", "/no/such/run"], r"no checkpoint at /no/such/run"),
    (["--steps", "0"], r"--steps must be at least 1"),
])
def test_bad_arguments_fail_before_any_rank_starts(argv, message):
    args = parse_args([*TINY, *argv])
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        validate(args)


def test_a_checkpoint_exports_to_hugging_face(tmp_path, cache):
    transformers = pytest.importorskip("transformers")
    from megatron_edu.checkpoint import load_full_model_state
    from megatron_edu.model import GPT, GPTConfig

    _train(tmp_path, cache, "--nproc", "2", "--tp", "2", "--steps", "2")
    checkpoint.main(["export-hf", str(tmp_path), str(tmp_path / "hf")])
    ours = GPT(GPTConfig(**read_metadata(tmp_path)["config"]))
    ours.load_full_state_dict(load_full_model_state(tmp_path))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[..., :512], atol=1e-4, rtol=0)
    assert (tmp_path / "hf" / "tokenizer.model").exists()


def test_resuming_another_model_fails_before_launch(tmp_path, cache):
    _train(tmp_path, cache, "--nproc", "1", "--steps", "1")
    args = parse_args([*TINY, "--hidden", "32", "--resume", str(tmp_path)])
    with pytest.raises(CheckpointError, match="hidden 64 in the checkpoint vs 32 here"):
        validate(args)


def test_evaluate_gives_the_same_perplexity_on_any_layout(tmp_path, cache, capsys):
    from megatron_edu import evaluate

    _train(tmp_path, cache, "--nproc", "1", "--steps", "2")
    capsys.readouterr()
    printed = []
    for layout in (["--nproc", "1"], ["--nproc", "4", "--tp", "2", "--pp", "2"]):
        assert evaluate.main(["--checkpoint", str(tmp_path), "--cache-dir", str(cache),
                              "--batches", "2", *layout]) == 0
        printed.append(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed[0].startswith("step 2: validation loss")
    loss = [float(line.split("loss ")[1].split(",")[0]) for line in printed]
    assert loss[0] == pytest.approx(loss[1], abs=1e-3)


def test_evaluate_checks_its_arguments_before_launch(tmp_path):
    from megatron_edu import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["--checkpoint", str(tmp_path), "--nproc", "3", "--tp", "2"])
    with pytest.raises(SystemExit):
        evaluate.main(["--checkpoint", str(tmp_path / "missing")])
