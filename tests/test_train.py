"""The training script end to end: learning, exact resume, resharding, safe checkpoints; what
it refuses before any rank starts, and a diverging run's clean stop."""

import json
import math
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import world_of_one

from megatron_edu import checkpoint
from megatron_edu import train as train_module
from megatron_edu.checkpoint import CheckpointError, checkpoint_bytes, read_metadata
from megatron_edu.launch import RankError, run
from megatron_edu.perf import training_flops
from megatron_edu.ptdp import StepResult
from megatron_edu.train import _data, main, model_config, parse_args, train, validate

TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32",
        "--vocab-size", "512", "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3",
        "--warmup", "2", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def cache(data_cache):
    return data_cache


def _train(out, cache, *extra):
    argv = [*TINY, "--out", str(out), "--cache-dir", str(cache), *extra]
    assert main(argv) == 0
    assert not (out / ".lock").exists()                  # released at the end
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _losses_records(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, cache):
    """A run folder of 2 steps on one rank, its checkpoint at step 2: read by the tests below, a
    test that writes to it works on a copy (``_copy``)."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    _train(out, cache, "--nproc", "1", "--steps", "2")
    return out


def _copy(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / run_dir.name)


def test_loss_decreases_and_everything_is_written(tmp_path, cache):
    """Flags from a --config file, the command line overriding it; the run's record (run.json)
    and a profiler trace of step 2 naming its tensor-parallel all-reduces, beside the log."""
    config = tmp_path / "run.toml"
    config.write_text('steps = 5\neval-interval = 6\nsave_interval = 6\n')
    records = _train(tmp_path / "run", cache, "--nproc", "2", "--tp", "2", "--steps", "12",
                     "--config", str(config), "--profile", "2:3")
    tmp_path = tmp_path / "run"
    run = json.loads((tmp_path / "run.json").read_text())
    assert (run["args"]["steps"], run["args"]["eval_interval"]) == (12, 6)
    assert run["layout"] == {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "ep": 1} and run["torch"]
    trace = json.loads((tmp_path / "profile_rank0.json").read_text())["traceEvents"]
    assert any(e.get("name") == "c10d::allreduce_" for e in trace)
    assert not list(tmp_path.glob("*memory.pickle"))     # a CPU keeps no allocator history
    losses = _losses(records)
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.5
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    steps = [r for r in records if "loss" in r]
    assert all(0 < r["mfu"] == r["hfu"] for r in steps)  # no recomputation: the same FLOPs
    assert (tmp_path / "loss.png").exists()
    assert read_metadata(tmp_path)["step"] == 12
    written = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "step_000012").iterdir())
    plan = validate(parse_args([*TINY, "--nproc", "2", "--tp", "2"]))
    assert checkpoint_bytes(plan.config, plan.parallelism) == pytest.approx(written, rel=0.1)


def test_with_dropout_tensor_parallel_runs_take_the_serial_runs_steps(tmp_path, cache):
    """Dropout 0.1: tp = 2, alone and with cp = 2, gives the serial run's losses — each tp rank
    draws its heads' part of the serial attention masks (with ZeRO-3 and pp: the MoE run below,
    and tests/test_ptdp.py)."""
    steps = ["--steps", "2", "--eval-interval", "100", "--save-interval", "100",
             "--dropout", "0.1"]
    serial = _losses(_train(tmp_path / "serial", cache, "--nproc", "1", *steps))
    for layout in (["--nproc", "2"], ["--nproc", "4", "--cp", "2"]):
        losses = _losses(_train(tmp_path / "_".join(layout), cache, "--tp", "2", *layout, *steps))
        assert losses == pytest.approx(serial, abs=1e-5), layout


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


def _train_with_an_overflow_at_step_2(args, plan):
    from megatron_edu.ptdp import PTDP

    clip = PTDP._clip
    PTDP._clip = lambda self: torch.tensor(math.inf) if self.iteration == 1 else clip(self)
    return train(args, plan)


def test_a_non_finite_step_is_skipped_and_counted_in_the_log(tmp_path, cache):
    args = parse_args([*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "2",
                       "--dp", "2", "--steps", "4", "--eval-interval", "4"])
    plan = validate(args)
    _data(args, plan.config)
    run(_train_with_an_overflow_at_step_2, 2, args, plan)
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert [(r["skipped"], r["skipped_steps"], r.get("reason")) for r in steps] == [
        (False, 0, None), (True, 1, "non-finite gradient norm"), (False, 1, None), (False, 1, None)]
    assert steps[1]["grad_norm"] is None and steps[2]["grad_norm"] > 0


def test_resume_continues_bit_for_bit(tmp_path, cache):
    whole = _losses(_train(tmp_path / "a", cache, "--nproc", "2", "--pp", "2", "--steps", "6",
                           "--save-interval", "3", "--dropout", "0.1"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
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


def test_a_llama_trains_reshards_and_exports_to_hugging_face(tmp_path, cache, capsys):
    """``--model llama`` (4 heads sharing 2 kv heads, SwiGLU, rotary positions, an untied
    output layer) at tp 2 × pp 2 with ZeRO-1, resumed at tp 4 (each kv head on 2 ranks) and at
    cp 2 × dp 2: the same next loss, and its first losses fall; then exported
    (``_exported_llama_equals_the_checkpoint``)."""
    steps = ["--model", "llama", "--kv-heads", "2", "--steps", "4", "--save-interval", "3",
             "--eval-interval", "100"]
    whole = _losses(_train(tmp_path / "tp2pp2", cache, "--nproc", "4", "--tp", "2", "--pp", "2",
                           "--zero1", *steps))
    assert whole[4] < whole[1]
    saved = tmp_path / "tp2pp2" / "checkpoints" / "step_000003"
    assert read_metadata(saved)["config"]["model"] == "llama"
    for layout in (["--tp", "4"], ["--cp", "2", "--dp", "2"]):
        resumed = _losses(_train(tmp_path / "_".join(layout), cache, "--nproc", "4", *layout,
                                 *steps, "--resume", str(saved)))
        assert resumed[4] == pytest.approx(whole[4], abs=1e-5), layout
    _exported_llama_equals_the_checkpoint(saved, tmp_path, capsys)


def _exported_llama_equals_the_checkpoint(saved, tmp_path, capsys):
    """export-hf writes a folder LlamaForCausalLM loads with the same logits, and evaluate
    --hf on it (at tp 2) gives the checkpoint's perplexity."""
    transformers = pytest.importorskip("transformers")
    from megatron_edu import evaluate
    from megatron_edu.checkpoint import load_full_model_state
    from megatron_edu.model import Llama, config_from_dict

    assert checkpoint.main(["export-hf", str(saved), str(tmp_path / "hf")]) == 0
    ours = Llama(config_from_dict(read_metadata(saved)["config"]))
    ours.load_full_state_dict(load_full_model_state(saved))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[..., :512], atol=1e-4, rtol=0)
    (tmp_path / "wiki.test.tokens").write_text(" = Python = \n Python is a high @-@ level , "
                                               "general @-@ purpose language . \n" * 3)
    args = ["--task", "wikitext103", "--data", str(tmp_path), "--stride", "8", "--seq-len", "32"]
    perplexity = []
    for source in (["--checkpoint", str(saved)], ["--hf", str(tmp_path / "hf"), "--nproc", "2",
                                                  "--tp", "2"]):
        assert evaluate.main([*args, *source]) == 0
        perplexity.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert perplexity[1]["word_perplexity"] == pytest.approx(perplexity[0]["word_perplexity"],
                                                             rel=1e-4)
    _exported_tokenizer_is_the_runs(saved, tmp_path / "hf", transformers)


def _exported_tokenizer_is_the_runs(saved, folder, transformers):
    """AutoTokenizer reads the export's tokenizer.json (no sentencepiece, no conversion) and
    gives the run's ids, whose special ids config.json carries; pipeline() generates with it."""
    from megatron_edu.data.corpus import default_corpus
    from megatron_edu.data.tokenizer import Tokenizer

    ours = Tokenizer.load(read_metadata(saved)["tokenizer"])
    theirs = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "The cat  sat.\n\tOn the mat — naïve 日本 ✓\n" + "\n".join(default_corpus()[:20])
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (
        ours.bos_id, ours.eos_id, ours.pad_id)
    generate = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    out = generate("The", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert out.startswith("The") and len(out) > len("The")


def test_a_context_parallel_run_resumes_at_other_cp(tmp_path, cache):
    """cp = 2 (each sequence split zig-zag over 2 ranks, attention as a ring; ZeRO-1 sharding
    the optimizer over the two cp ranks), resumed at cp = 1 without ZeRO-1 and at cp = 4 with
    it: the same next loss — a checkpoint does not depend on cp."""
    steps = ["--steps", "4", "--save-interval", "3", "--eval-interval", "100", "--dropout", "0.1"]
    whole = _losses(_train(tmp_path / "cp2", cache, "--nproc", "2", "--cp", "2", "--zero1",
                           *steps))
    saved = tmp_path / "cp2" / "checkpoints" / "step_000003"
    assert {f.name for f in saved.glob("optim_*")} == {"optim_tp0_pp0_dp0.pt",
                                                       "optim_tp0_pp0_dp1.pt"}
    for cp, zero1 in (("1", []), ("4", ["--zero1"])):
        resumed = _losses(_train(tmp_path / f"cp{cp}", cache, "--nproc", cp, "--cp", cp, *zero1,
                                 *steps, "--resume", str(saved)))
        assert resumed[4] == pytest.approx(whole[4], abs=1e-5)


def test_a_mixture_of_experts_takes_the_serial_steps_through_the_cli_and_resumes_at_another_ep(
        tmp_path, cache):
    """The Llama with 8 experts (2 a token), a gated shared expert, the auxiliary and z-losses,
    DeepSeek-V3's sigmoid router with its expert bias, a capacity of 1 and dropout: at tp 2 + SP
    × ep 2 (ZeRO-3) the serial run's losses, and its routing log per layer and expert; saved
    there, it resumes at dp 4 × ep 4 (ZeRO-1) with the serial next loss (ep 2 × pp 2 under ZB-H1
    takes the serial steps in tests/test_moe.py).
    The checkpoint keeps each expert by its global id: experts_tp{t}_pp{p}_ep{e}.pt."""
    moe = ["--model", "llama", "--moe-experts", "8", "--moe-topk", "2", "--moe-shared-experts",
           "1", "--moe-shared-gate", "--moe-z-loss", "1e-3", "--moe-router", "sigmoid",
           "--moe-bias-rate", "1e-2", "--moe-capacity", "1", "--dropout", "0.1", "--steps", "4",
           "--save-interval", "3", "--eval-interval", "100"]
    serial = _train(tmp_path / "serial", cache, "--nproc", "1", *moe)
    split = _train(tmp_path / "ep2", cache, "--nproc", "4", "--tp", "2", "--ep", "2",
                   "--sequence-parallel", "--zero", "3", *moe)
    for a, b in zip([r for r in serial if "loss" in r], [r for r in split if "loss" in r],
                    strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
        assert b["moe_load"] == a["moe_load"]
        assert [sum(layer) for layer in a["moe_load"]] == [8 * 32 * 2] * 4
    saved = tmp_path / "ep2" / "checkpoints" / "step_000003"
    assert {f.name for f in saved.glob("experts_*")} == {
        f"experts_tp{t}_pp0_ep{e}.pt" for t in (0, 1) for e in (0, 1)}
    resumed = _losses(_train(tmp_path / "ep4", cache, "--nproc", "4", "--dp", "4", "--ep", "4",
                             "--zero1", *moe, "--resume", str(saved)))
    assert resumed[4] == pytest.approx(_losses(serial)[4], abs=1e-4)


def test_a_zero3_run_resumes_as_zero1_at_another_dp(tmp_path, cache):
    """ZeRO-3 at dp = 4 (every block gathered for its forward and its backward, each rank
    saving its pieces of the weights' moments; evaluation and the closing sample gather for
    forwards alone) resumed as ZeRO-1 at dp = 2: the same next loss — the stage and the dp size
    are how a step is run, not what a checkpoint holds."""
    steps = ["--steps", "4", "--save-interval", "3", "--eval-interval", "100", "--dropout", "0.1"]
    records = _train(tmp_path / "zero3", cache, "--nproc", "4", "--zero", "3", *steps,
                     "--eval-interval", "2", "--sample-tokens", "4")   # forwards without backward
    assert any("val_loss" in r for r in records)
    whole = _losses(records)
    saved = tmp_path / "zero3" / "checkpoints" / "step_000003"
    assert len(list(saved.glob("optim_*"))) == 4
    resumed = _losses(_train(tmp_path / "zero1", cache, "--nproc", "2", "--zero1", *steps,
                             "--resume", str(saved)))
    assert resumed[4] == pytest.approx(whole[4], abs=1e-5)


def test_a_corrupt_checkpoint_is_named(two_steps, tmp_path, cache, capsys):
    run_dir = _copy(two_steps, tmp_path)
    shard = run_dir / "checkpoints" / "step_000002" / "model_tp0_pp0.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model_tp0_pp0.pt has .* bytes"):
        read_metadata(run_dir)
    shard.write_bytes(b"x" * len(data))          # right size, wrong content: found on loading
    argv = [*TINY, "--out", str(run_dir), "--cache-dir", str(cache), "--nproc", "1",
            "--steps", "3", "--resume"]
    assert main(argv) == 1
    assert "corrupt checkpoint file" in capsys.readouterr().err


def _no_launch(*args, **kwargs):
    raise AssertionError("a rank was launched")


def _a_rank_fails(*args, **kwargs):
    raise RankError("rank 0 raised: boom")


@pytest.mark.parametrize(("argv", "message"), [
    # each number on its own, as it is read (megatron_edu.cli)
    (["--micro-batch", "0"], "--micro-batch must be a positive integer, got 0"),
    (["--global-batch", "0"], "--global-batch must be a positive integer, got 0"),
    (["--nproc", "0"], "--nproc must be a positive integer, got 0"),
    (["--tp", "0"], "--tp must be a positive integer, got 0"),
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--steps", "2.5"], "--steps must be an integer, got '2.5'"),
    (["--warmup", "-1"], "--warmup must be a non-negative integer, got -1"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--clip", "nan"], "--clip must be a finite number ≥ 0, got nan"),
    (["--dropout", "1"], "--dropout must be a number in [0, 1), got 1"),
    (["--collective-timeout", "0"], "--collective-timeout must be a finite number > 0, got 0"),
    (["--peak-tflops", "fast"], "--peak-tflops must be TFLOP/s > 0 or 'measured', got fast"),
    (["--backend", "bogus"], "--backend must be one of auto, gloo, nccl, got 'bogus'"),
    (["--lr"], "--lr: expected one argument"),
    # numbers together, the data, the checkpoint (train.validate, grid.Layout)
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 must be at most --lr 0.1"),
    (["--nproc", "4", "--tp", "3"], "4 ranks do not divide into tp·pp = 3·1"),
    (["--cp", "0"], "--cp must be a positive integer, got 0"),
    (["--nproc", "4", "--cp", "3"], "4 ranks do not divide into tp·cp·pp = 1·3·1"),
    (["--nproc", "2", "--cp", "2", "--seq-len", "30"], "2·cp = 4 chunks: seq_len = 30 is not "
                                                        "divisible by 4"),
    (["--nproc", "4", "--tp", "2", "--cp", "2", "--sequence-parallel", "--seq-len", "12"],
     "each into tp = 2 parts by sequence parallelism: seq_len = 12 is not divisible by 8"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--dp", "2"], "2·2·2 = 8 ranks, but the world"),
    (["--zero", "4"], "--zero must be one of 0, 1, 2, 3, got 4"),
    (["--nproc", "2", "--pp", "2", "--zero", "3"], "ZeRO-3 reduce-scatters the gradients in "
                                                   "every backward pass"),
    (["--tp", "3"], "num_heads = 4 is not divisible by the tensor-parallel size tp = 3"),
    (["--pp", "3", "--nproc", "3"], "num_layers = 4 is not divisible by pp·chunks"),
    (["--nproc", "2", "--global-batch", "6"], "global batch 6 is not divisible by dp·micro"),
    (["--chunks", "2"], "the 1f1b schedule has one model chunk per rank; got v=2"),
    (["--nproc", "2", "--tp", "2", "--async-tp", "--schedule", "zb-h1"],
     "async_tp computes dX and dW in one node: zb-h1's B/W split would run it"),
    (["--init-from-hf", "/nowhere"], "--init-from-hf /nowhere holds no config.json"),
    (["--config", "/nowhere.toml"], "--config /nowhere.toml: no such file"),
    (["--profile", "3:2"], "--profile must be START:END with 1 ≤ START < END, got 3:2"),
    (["--init-from-hf", "/nowhere", "--resume"], "--init-from-hf starts a run from a Hugging "
                                                 "Face folder's weights, --resume continues"),
    (["--schedule", "zb-v", "--chunks", "3"], "the zb-v schedule has two model chunks per rank; "
                                              "got v=3"),
    (["--schedule", "interleaved"], "the interleaved schedule needs its number of chunks"),
    (["--schedule", "interleaved", "--chunks", "2"], "2 model chunks per rank need a pipeline "
                                                     "(pp ≥ 2)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2",
      "--global-batch", "6"], "multiple of num_stages; got num_microbatches=3, num_stages=2"),
    (["--data", "/no/such/file.txt"], "--data /no/such/file.txt: no such file"),
    (["--tokenizer", "/no/tokenizer.json"], "tokenizer model not found: /no/tokenizer.json"),
    (["--init-from-hf", "/nowhere", "--tokenizer", "byte-bpe"], "--init-from-hf reads the "
                                                                "folder's own tokenizer"),
    (["--resume", "/no/such/run"], "no checkpoint at /no/such/run"),
    (["--global-batch", "100000", "--micro-batch", "1"], "--global-batch 100000 is larger than "
                                                         "the training data: it holds "),
])
def test_a_bad_argument_is_one_line_before_any_rank_starts(argv, message, tmp_path, cache,
                                                           capsys, monkeypatch):
    monkeypatch.setattr(train_module, "run", _no_launch)
    assert main([*TINY, "--out", str(tmp_path / "run"), "--cache-dir", str(cache), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_a_config_file_naming_no_flag_is_one_line(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("stepz = 3\n")
    assert main(["--config", str(tmp_path / "run.toml")]) == 2
    assert capsys.readouterr().err == f"error: --config {tmp_path / 'run.toml'}: no flag --stepz\n"


def test_a_yaml_config_file_sets_flags_the_command_line_overrides(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text("steps: 7\nglobal-batch: 16\nsequence_parallel: true\n")
    args = parse_args(["--config", str(tmp_path / "run.yaml"), "--steps", "9"])
    assert (args.steps, args.global_batch, args.sequence_parallel) == (9, 16, True)


def test_a_jsonl_corpus_without_its_text_field_is_one_line_before_any_rank_starts(
        tmp_path, cache, capsys, monkeypatch):
    monkeypatch.setattr(train_module, "run", _no_launch)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"body": "a document"}\n')
    assert main([*TINY, "--out", str(tmp_path / "run"), "--cache-dir", str(cache),
                 "--data", str(corpus)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corpus.jsonl:1 has no text in field 'text'" in err, err
    assert "--text-field" in err


def test_an_output_folder_that_cannot_be_written_is_refused(tmp_path, cache, capsys,
                                                            monkeypatch):
    monkeypatch.setattr(train_module, "run", _no_launch)
    (tmp_path / "file").write_text("x")
    base = [*TINY, "--cache-dir", str(cache), "--out"]
    assert main([*base, str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'file'} is a file, not a folder\n"
    assert main([*base, str(tmp_path / "file" / "run")]) == 2
    assert capsys.readouterr().err == (f"error: cannot create the output folder "
                                       f"{tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a "
                                       f"file (Not a directory)\n")


def test_a_folder_in_use_or_too_small_is_refused_and_the_lock_always_released(
        tmp_path, cache, capsys, monkeypatch):
    from megatron_edu.run_folder import LOCK, acquire_lock, release_lock

    argv = [*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "1"]
    monkeypatch.setattr(train_module, "run", _no_launch)
    acquire_lock(tmp_path)                                   # another run holds the folder
    assert main(argv) == 2
    assert f"error: {tmp_path} is in use by another run: pid " in capsys.readouterr().err
    release_lock(tmp_path)

    plan = validate(parse_args(argv))
    need = checkpoint_bytes(plan.config, plan.parallelism)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: not enough disk space in {tmp_path}: one checkpoint (weights and AdamW state) "
        f"takes about {need / 1e6:.1f} MB, 1.0 kB are free\n")
    assert not (tmp_path / LOCK).exists()                 # released after a refusal

    monkeypatch.undo()
    monkeypatch.setattr(train_module, "run", _a_rank_fails)
    assert main(argv) == 1
    assert capsys.readouterr().err == "error: training failed on rank 0 raised: boom\n"
    assert not (tmp_path / LOCK).exists()                 # released after a failure


def test_bad_steps_in_a_row_are_counted_and_fp16_settling_is_not(tmp_path):
    from megatron_edu.grid import ParallelGrid
    from megatron_edu.train import _Streak

    nan, inf = math.nan, math.inf
    with world_of_one(tmp_path / "store"):
        grid = ParallelGrid()
        streak = _Streak(False, grid)
        assert [(streak.update(i + 1, r), streak.count) for i, r in enumerate([
            StepResult(2.0, 1.0), StepResult(nan, inf, True), StepResult(3.0, inf, True),
            StepResult(2.0, 1.0)])] == [
            (None, 0), ("non-finite loss", 1), ("non-finite gradient norm", 2), (None, 0)]
        streak = _Streak(True, grid)                  # fp16: the scale halves on each skip
        assert [(streak.update(i + 1, r), streak.count) for i, r in enumerate([
            StepResult(2.0, inf, True, 65536.0), StepResult(2.0, 1.0, False, 32768.0),
            StepResult(2.0, inf, True, 1.0), StepResult(nan, inf, True, 0.5)])] == [
            ("non-finite gradient norm", 0), (None, 0), ("non-finite gradient norm", 1),
            ("non-finite loss", 2)]


def test_a_diverging_run_stops_on_every_rank_and_keeps_the_last_good_checkpoint(
        two_steps, tmp_path, cache, capsys):
    tmp_path = _copy(two_steps, tmp_path)                       # a good checkpoint at step 2
    # resumed at pp = 2 with an absurd learning rate: step 3 (good weights) still has a finite
    # loss, and is saved; its update breaks the weights: from step 4 the loss is NaN
    argv = [*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "2", "--pp", "2",
            "--lr", "1e6", "--steps", "10", "--save-interval", "1", "--max-bad-steps", "2",
            "--resume"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    root = tmp_path / "checkpoints"
    assert err == (f"error: the loss is NaN since step 4 (2 steps in a row); the learning rate "
                   f"--lr 1e+06 is likely too high; last good checkpoint: {root / 'step_000002'} "
                   f"(step_000003, saved just before step 4, holds the weights that diverged: "
                   f"renamed step_000003.diverged)\n")
    assert out == ""                                      # no sample, no report
    assert (root / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002",
                                                       "step_000003.diverged"]
    assert all(t.isfinite().all() for t in checkpoint.load_full_model_state(tmp_path).values())
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("reason")) for r in records if "loss" in r] == [
        (1, None), (2, None), (3, None), (4, "non-finite loss"), (5, "non-finite loss")]
    assert not (tmp_path / ".lock").exists()


def test_a_checkpoint_exports_to_hugging_face(tmp_path, cache):
    transformers = pytest.importorskip("transformers")
    from megatron_edu.checkpoint import load_full_model_state
    from megatron_edu.model import GPT, GPTConfig

    _train(tmp_path, cache, "--nproc", "2", "--tp", "2", "--steps", "2")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")     # a non-empty folder: --force
    assert checkpoint.main(["export-hf", str(tmp_path), str(tmp_path / "hf"), "--force"]) == 0
    ours = GPT(GPTConfig(**read_metadata(tmp_path)["config"]))
    ours.load_full_state_dict(load_full_model_state(tmp_path))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[..., :512], atol=1e-4, rtol=0)
    assert (tmp_path / "hf" / "tokenizer.model").exists()
    # and back: a run started from the folder, at pp 2, holds the exported weights (a step of
    # lr 1e-9 moves nothing), so its validation loss is the run's it was exported from
    val = [r["val_loss"] for r in _train(tmp_path / "again", cache, "--init-from-hf",
                                         str(tmp_path / "hf"), "--nproc", "2", "--pp", "2",
                                         "--steps", "1", "--lr", "1e-9", "--min-lr", "0",
                                         "--warmup", "0") if "val_loss" in r]
    exported = [r["val_loss"] for r in _losses_records(tmp_path) if "val_loss" in r][-1]
    assert val == [pytest.approx(exported, abs=1e-5)]


def test_resuming_another_model_fails_before_launch(two_steps):
    args = parse_args([*TINY, "--hidden", "32", "--resume", str(two_steps)])
    with pytest.raises(CheckpointError, match="hidden 64 in the checkpoint vs 32 here"):
        validate(args)


def test_evaluate_gives_the_same_perplexity_on_any_layout(two_steps, cache, capsys):
    from megatron_edu import evaluate

    printed = []
    for layout in (["--nproc", "1"], ["--nproc", "4", "--tp", "2", "--pp", "2"]):
        assert evaluate.main(["--checkpoint", str(two_steps), "--cache-dir", str(cache),
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


@pytest.mark.parametrize(("flag", "connections"), [([], None), (["--async-tp"], "1")])
def test_async_tp_starts_its_ranks_with_one_cuda_connection(flag, connections, tmp_path, cache,
                                                             monkeypatch):
    """megatron-core's rule for overlapping dX's all-reduce with dW: CUDA_DEVICE_MAX_CONNECTIONS=1
    in every rank's environment before its CUDA context exists (inherited from the launcher)."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    seen = []

    def ranks(*args, **kwargs):
        seen.append(train_module.os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return [{"error": "not started"}]

    monkeypatch.setattr(train_module, "run", ranks)
    assert main([*TINY, "--nproc", "2", "--tp", "2", *flag, "--out", str(tmp_path),
                 "--cache-dir", str(cache)]) == 1
    assert seen == [connections]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank0_of_a_job(argv, env, log):
    """In a process of its own: the run as torchrun starts its rank 0 in SLURM job ``env``."""
    import os

    fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    torch.set_num_threads(1)
    main(argv)


def test_a_job_killed_hard_and_requeued_on_another_node_resumes_in_its_folder(
        tmp_path, cache, capsys, monkeypatch):
    """SLURM's requeue (issue 32): a run killed with SIGKILL leaves its lock; the job starts
    again with the same SLURM_JOB_ID on another node (here: the lock's host rewritten) and
    --resume. It takes the lock over with a line, resumes from the latest checkpoint, and the
    log runs on without a gap or a repeat; --keep-last 2 leaves two checkpoints, the last one
    written in the background (--async-save) and published before the run ends. Another job is
    still refused. (The killed run starts from the launcher's forkserver: torch is loaded.)"""
    import time

    from megatron_edu.launch import _context

    out, log = tmp_path / "run", tmp_path / "killed.log"
    argv = [*TINY, "--out", str(out), "--cache-dir", str(cache), "--eval-interval", "1000",
            "--peak-tflops", "1"]
    env = {"SLURM_JOB_ID": "4242", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    killed = _context().Process(target=_rank0_of_a_job, args=(
        [*argv, "--steps", "1000", "--save-interval", "1"], env, str(log)))
    killed.start()
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").exists():
            assert killed.is_alive() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
    finally:
        killed.kill()                                            # SIGKILL: no clean-up at all
        killed.join()
    lock = json.loads((out / ".lock").read_text())
    assert (lock["pid"], lock["job"]) == (killed.pid, "4242")
    (out / ".lock").write_text(json.dumps({**lock, "host": "another-node"}))
    done = read_metadata(out)["step"]
    resume = [*argv, "--nproc", "1", "--steps", str(done + 2), "--save-interval", "1",
              "--keep-last", "2", "--async-save", "--resume"]

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert main(resume) == 2
    assert (f"error: {out} is in use by another run: pid {killed.pid} on host another-node, "
            f"job 4242, since ") in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert main(resume) == 0
    assert (f"warning: taking over the lock of {out} left by this job 4242 before it was "
            f"requeued or restarted: pid {killed.pid} on host another-node, job 4242, since "
            ) in capsys.readouterr().err
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, done + 3))
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", f"step_{done + 1:06d}", f"step_{done + 2:06d}"]
    assert read_metadata(out)["step"] == done + 2
    assert not (out / ".lock").exists()


@pytest.mark.parametrize(("signum", "raised"), [("SIGTERM", SystemExit),
                                                ("SIGINT", KeyboardInterrupt)])
def test_sigterm_and_sigint_end_the_run_through_its_exit_and_release_the_lock(
        signum, raised, tmp_path, cache, monkeypatch):
    """SLURM's SIGTERM (preemption, the end of --time) and Ctrl-C while the ranks run: the lock
    goes, the exit status is 128 + 15, and the previous SIGTERM handler comes back."""
    import signal

    from megatron_edu.run_folder import LOCK

    monkeypatch.setattr(train_module, "run",
                        lambda *args, **kwargs: signal.raise_signal(getattr(signal, signum)))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised) as stopped:
        main([*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--nproc", "1"])
    assert not (tmp_path / LOCK).exists()
    assert signal.getsignal(signal.SIGTERM) is before
    if raised is SystemExit:
        assert stopped.value.code == 128 + signal.SIGTERM


def test_an_async_save_is_published_before_the_run_goes_on_to_its_end(tmp_path, cache,
                                                                     monkeypatch):
    """In this process (a world of one): the last save, held back in its thread, is published
    before the run draws its curve and reports (``_finish``). An error in the background:
    tests/test_checkpoint.py."""
    import threading
    import time

    args = parse_args([*TINY, "--out", str(tmp_path), "--cache-dir", str(cache), "--steps", "1",
                       "--global-batch", "2", "--eval-batches", "1", "--async-save",
                       "--peak-tflops", "1"])
    plan = validate(args)
    events, save = [], torch.save

    def slow(obj, path):
        time.sleep(0.2)
        save(obj, path)
        events.append(threading.current_thread().name)

    monkeypatch.setattr(train_module, "_finish", lambda *args: events.append("end") or {})
    monkeypatch.setattr(torch, "save", slow)
    with world_of_one(tmp_path / "store"):
        train(args, plan)
    assert events == ["checkpoint writer", "end"]
    assert read_metadata(tmp_path)["step"] == 1


@pytest.mark.filterwarnings("ignore:CUDA is not available")   # the profiler's, on this CPU
def test_on_a_gpu_the_profiled_steps_record_a_cuda_memory_snapshot(tmp_path, monkeypatch):
    """What --profile does on CUDA, checked on the CPU with the allocator's two functions
    recorded: history on when the trace starts, the snapshot dumped beside the trace and
    history off when it stops — once, whatever step the run ends at."""
    from megatron_edu import tools

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda p: calls.append(("dump", p)))
    profiler = tools.StepProfiler((2, 3), tmp_path / "profile_rank0.json", torch.device("cuda"))
    assert isinstance(profiler.memory, tools.CudaMemorySnapshot)   # chosen by the device
    for step in (1, 2, 3, 4):
        profiler.at(step)
    profiler.close()
    assert calls == [("record", {"max_entries": 100_000}),
                     ("dump", str(tmp_path / "profile_rank0_memory.pickle")),
                     ("record", {"enabled": None})]
    assert (tmp_path / "profile_rank0.json").exists()


def test_a_byte_level_bpe_run_carries_its_tokenizer_json_which_a_later_run_starts_from(
        tmp_path, cache):
    """--tokenizer byte-bpe (GPT-2's kind, trained on the corpus) at tp 2: the checkpoint holds
    the tokenizer.json, generate reads it, the export loads in AutoTokenizer with the same ids;
    a run given that file as --tokenizer takes the model's vocabulary from it, --vocab-size
    notwithstanding."""
    from megatron_edu import generate
    from megatron_edu.data.tokenizer import Tokenizer

    steps = ["--nproc", "2", "--tp", "2", "--steps", "2", "--save-interval", "2"]
    _train(tmp_path / "bpe", cache, *steps, "--tokenizer", "byte-bpe", "--vocab-size", "700")
    saved = tmp_path / "bpe" / "checkpoints" / "step_000002"
    meta = read_metadata(saved)
    assert (meta["tokenizer"], meta["config"]["vocab_size"]) == (str(saved / "tokenizer.json"),
                                                                700)
    ours = Tokenizer.load(saved)
    assert generate.main(["--checkpoint", str(saved), "--prompt", "The ", "--max-new-tokens",
                          "4", "--greedy"]) == 0
    _train(tmp_path / "again", cache, *steps, "--tokenizer", str(saved / "tokenizer.json"),
           "--vocab-size", "4096")
    assert read_metadata(tmp_path / "again")["config"]["vocab_size"] == ours.vocab_size
    transformers = pytest.importorskip("transformers")
    assert checkpoint.main(["export-hf", str(saved), str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = "The cat  sat.\n\tOn the mat — naïve 日本 ✓"
    assert theirs(text)["input_ids"] == ours.encode(text) and ours.decode(ours.encode(text)) == text


def test_tensorboard_scalars_are_the_logs_records(tmp_path, cache, monkeypatch, capsys):
    """--tensorboard: each step's numbers as TensorBoard scalars, read back by tensorboard's own
    reader equal to log.jsonl's; without the package, one line before anything starts."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _train(tmp_path / "run", cache, "--nproc", "2", "--pp", "2", "--steps", "3",
                     "--tensorboard")
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "max_memory_gib"):
        logged = [(r["step"], r[key]) for r in records if key in r]
        assert [(e.step, e.value) for e in board.Scalars(key)] == [
            (step, pytest.approx(value, rel=1e-6)) for step, value in logged], key
    assert all(r["max_memory_gib"] > 0 for r in records if "loss" in r)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main([*TINY, "--out", str(tmp_path / "none"), "--tensorboard"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --tensorboard needs the optional tensorboard package: pip install tensorboard")


def test_a_hugging_face_dataset_saved_to_disk_trains(tmp_path, cache):
    datasets = pytest.importorskip("datasets")
    from megatron_edu.data.corpus import default_corpus

    datasets.Dataset.from_dict({"text": default_corpus()[:60]}).save_to_disk(tmp_path / "data")
    records = _train(tmp_path / "run", cache, "--nproc", "1", "--steps", "2",
                     "--data", str(tmp_path / "data"))
    assert len(_losses(records)) == 2 and all(math.isfinite(x) for x in _losses(records).values())


def test_the_ranks_never_read_the_corpus_the_launcher_prepared(tmp_path, cache, monkeypatch):
    """The checking process builds the tokenizer and the token file once and hands them to the
    ranks as memory maps: with the text deleted before launch, the run still trains."""
    from megatron_edu.data.corpus import default_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(default_corpus()[:60]))
    launch = train_module._launch

    def without_the_text(*args):
        corpus.unlink()
        return launch(*args)

    monkeypatch.setattr(train_module, "_launch", without_the_text)
    records = _train(tmp_path / "run", cache, "--nproc", "2", "--dp", "2", "--steps", "2",
                     "--data", str(corpus))
    assert not corpus.exists() and len(_losses(records)) == 2


def test_a_run_from_a_hugging_face_gpt2_starts_at_transformers_loss(tmp_path, cache):
    """A GPT2LMHeadModel built here, saved with a byte-level tokenizer.json beside it (no
    sentencepiece anywhere): train --init-from-hf at tp 2, whose first step's loss is
    transformers' on that step's batch."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import torch.nn.functional as F

    from megatron_edu.data import BatchSampler, prepare_data
    from megatron_edu.data.corpus import default_corpus

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(default_corpus()[:60]))
    folder = tmp_path / "gpt2"
    folder.mkdir()
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train([str(text)], vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=400, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
    gpt2.save_pretrained(folder)
    records = _train(tmp_path / "run", cache, "--init-from-hf", str(folder), "--data", str(text),
                     "--nproc", "2", "--tp", "2", "--steps", "1")
    _, train_set, _ = prepare_data(str(text), 400, 32, cache, tokenizer_path=folder)
    seed = parse_args(TINY).seed
    inputs, labels = train_set.batch(next(BatchSampler(len(train_set), 8, seed=seed)))
    with torch.no_grad():
        theirs = F.cross_entropy(gpt2(inputs).logits.flatten(0, 1), labels.flatten())
    assert _losses(records)[1] == pytest.approx(theirs.item(), rel=1e-5)


def test_moe_flags_replace_the_preset_s_and_need_experts():
    """Each --moe-* flag given replaces the preset's (no flag is dropped for want of
    --moe-experts); experts given to a dense preset balance at 0.01; flags that describe experts
    on a model without any are refused in one line, naming them."""
    def config(*argv):
        return model_config(parse_args(["--model", "llama", "--attention", "eager", *argv]))
    assert config("--preset", "llama-moe-tiny", "--moe-aux-loss", "0").moe_aux_loss == 0.0
    assert config("--preset", "llama-moe-tiny").moe_aux_loss == 0.01
    assert config("--moe-experts", "8", "--moe-capacity", "1.5").moe_capacity == 1.5
    assert config("--moe-experts", "8").moe_aux_loss == 0.01
    with pytest.raises(ValueError, match="--moe-topk/--moe-shared-gate describe experts, and "
                                         "tiny has none"):
        config("--moe-topk", "4", "--moe-shared-gate")
