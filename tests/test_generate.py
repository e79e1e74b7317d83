"""Generation: the KV cache changes nothing but the cost; the text is the same at every layout;
sampling is reproducible from its seed; bad requests are refused before any work."""

import math
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import TOL, Launches, poisoned_checkpoint, tiny_config

from megatron_edu import comm
from megatron_edu import generate as generate_module
from megatron_edu.checkpoint import export_hf, load_full_model_state, save_checkpoint
from megatron_edu.data import PRETRAINED_CHECKPOINT, train_tokenizer
from megatron_edu.generate import NonFiniteLogits, Sampling, generate, main, sample
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPT, BertConfig, Llama, LlamaConfig
from megatron_edu.model.transformer import KVCache
from megatron_edu.pipeline.engine import build_chunks
from megatron_edu.pipeline.schedules import stage_map
from megatron_edu.ptdp import PTDP, PTDPOptions

PROMPT = [5, 17, 42]
NEW = 12
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95, seed=3)


def gen_config(**overrides):
    """4 layers (so pp=2 with 2 chunks each fits) and weights large enough that the next token
    depends on the context: a tiny model at GPT-2's init_std repeats one token for ever."""
    return tiny_config(num_layers=4, init_std=0.5, **overrides)


@torch.no_grad()
def cached_vs_full(logits, ids, prefill, vocab=100):
    """Largest |difference| between the logits of a full forward and those of a prefill of
    ``prefill`` tokens followed by 1-token steps, relative to the largest |logit| (fp32
    rounding: ~1e-7). ``logits(ids, cache)`` runs the model."""
    full = logits(ids, None)[..., :vocab]
    cache = KVCache()
    steps = [logits(ids[:, :prefill], cache)]
    steps += [logits(ids[:, t:t + 1], cache) for t in range(prefill, ids.shape[1])]
    diff = (torch.cat(steps, dim=1)[..., :vocab] - full).abs().max()
    return (diff / full.abs().max()).item()


def greedy_without_cache(model, prompt, n):
    """The reference: the argmax of a full forward over the whole text, token by token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def model():
    return GPT(gen_config()).eval()


def ids(b=2, s=12):
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(0))


# --- the KV cache, serial ------------------------------------------------------------------------

def test_cached_decoding_gives_the_full_forwards_logits_at_every_step(model):
    assert cached_vs_full(lambda x, cache: model(x, cache=cache), ids(), prefill=5) < TOL


def test_a_llamas_cache_turns_each_new_key_by_its_position_and_keeps_its_kv_heads():
    """Rotary positions continue after the cached ones; the cache holds the 2 kv heads, each
    serving 2 query heads (grouped-query attention), not 4."""
    llama = Llama(LlamaConfig(vocab_size=100, seq_len=16, num_layers=2, hidden=32, num_heads=4,
                              num_kv_heads=2, init_std=0.5)).eval()
    assert cached_vs_full(lambda x, cache: llama(x, cache=cache), ids(), prefill=5) < TOL
    cache = KVCache()
    with torch.no_grad():
        llama(ids(s=3), cache=cache)
    assert tuple(cache.layers["1"].k.shape) == (2, 2, 3, 8)


@torch.no_grad()
def test_the_cache_holds_keys_and_values_per_head_and_position(model):
    cache = KVCache()
    model(ids(s=6), cache=cache)
    model(ids(s=1), cache=cache)
    c = model.config
    assert tuple(cache.layers["3"].v.shape) == (2, c.num_heads, 7, c.head_dim)


@torch.no_grad()
def test_a_cached_sequence_longer_than_seq_len_is_refused(model):
    cache = KVCache()
    model(ids(s=16), cache=cache)
    with pytest.raises(ValueError, match="17 tokens is longer than seq_len = 16"):
        model(ids(s=1), cache=cache)


# --- generating, serial --------------------------------------------------------------------------

def test_greedy_generation_equals_the_argmax_of_full_forwards(model):
    assert generate(model, None, PROMPT, NEW, greedy=True) == greedy_without_cache(model, PROMPT,
                                                                                   NEW)


def test_a_seed_reproduces_its_sample(model):
    assert generate(model, None, PROMPT, NEW, **SAMPLED) == generate(model, None, PROMPT, NEW,
                                                                     **SAMPLED)


def test_another_seed_gives_another_sample(model):
    assert generate(model, None, PROMPT, NEW, seed=1) != generate(model, None, PROMPT, NEW, seed=2)


def test_top_k_of_one_is_greedy(model):
    assert generate(model, None, PROMPT, NEW, top_k=1) == generate(model, None, PROMPT, NEW,
                                                                   greedy=True)


def test_a_tiny_top_p_is_greedy(model):
    assert generate(model, None, PROMPT, NEW, top_p=1e-6) == generate(model, None, PROMPT, NEW,
                                                                      greedy=True)


def test_generation_stops_at_the_end_of_text_token(model):
    greedy = generate(model, None, PROMPT, NEW, greedy=True)
    eos = greedy[2]
    assert generate(model, None, PROMPT, NEW, greedy=True, eos_id=eos) == greedy[
        : greedy.index(eos) + 1]


def test_generation_runs_without_dropout_and_leaves_the_training_mode_as_it_was():
    with_dropout = GPT(gen_config(dropout=0.5)).train()
    tokens = generate(with_dropout, None, PROMPT, NEW, greedy=True)
    assert (tokens, with_dropout.training) == (generate(GPT(gen_config()), None, PROMPT, NEW,
                                                        greedy=True), True)


def test_top_k_samples_only_the_k_most_likely_tokens():
    logits = torch.arange(10.0)
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(logits, Sampling(temperature=5.0, top_k=3), gen) for _ in range(200)}
    assert drawn == {7, 8, 9}


def test_top_p_samples_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # 0.5 + 0.3 reach 0.6, 0.5 alone does not
    gen = torch.Generator().manual_seed(0)
    drawn = {sample(logits, Sampling(top_p=0.6), gen) for _ in range(200)}
    assert drawn == {0, 1}


# --- refused before any work ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
    (dict(top_k=0), "top_k must be an integer ≥ 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_arguments_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, None, PROMPT, NEW, **kwargs)


@pytest.mark.parametrize("prompt, new, message", [
    ([], NEW, "the prompt is empty"),
    (PROMPT, 0, "max_new_tokens must be an integer ≥ 1"),
    ([[1, 2]], NEW, r"one prompt at a time.*\(1, 2\)"),
    ([1, 100], NEW, r"prompt ids must be in 0..99, got 1..100"),
])
def test_bad_prompts_are_refused(model, prompt, new, message):
    with pytest.raises(ValueError, match=message):
        generate(model, None, prompt, new)


def test_a_prompt_and_new_tokens_longer_than_seq_len_are_refused(model):
    with pytest.raises(ValueError, match=r"3 tokens \+ 14 new tokens = 17 is longer than "
                                         r"seq_len = 16"):
        generate(model, None, PROMPT, 14)


def test_a_pipeline_stage_alone_without_a_grid_is_refused():
    with pytest.raises(ValueError, match="pass one whole model"):
        generate(GPT(gen_config(), layers=range(2), last=False), None, PROMPT, NEW)


# --- tensor parallel: the cache on head-split attention -------------------------------------------

def _tensor_parallel_cache():
    grid = ParallelGrid(tp=dist.get_world_size())
    model = GPT(gen_config(), grid).eval()

    def gathered(x, cache):   # the whole vocabulary [b, s, V_padded] from the tp shards
        return comm.all_gather(model(x, cache=cache), grid.tp_group)

    return cached_vs_full(gathered, ids(), prefill=5)


def test_cached_decoding_under_tp2_gives_the_full_forwards_logits():
    assert max(LAUNCHES["tp2-cache"]) < TOL


# --- every layout of 4 ranks generates the serial text --------------------------------------------

# tp, pp, dp, schedule (ZB-V: rank 0 holds the first and the last stage), chunks
LAYOUTS = [(1, 1, 4, "1f1b", 1), (2, 1, 2, "1f1b", 1), (1, 2, 2, "1f1b", 1), (2, 2, 1, "1f1b", 1),
           (1, 2, 2, "interleaved", 2), (1, 2, 2, "zb-v", 2), (2, 2, 1, "zb-v", 2)]


def _generate_at_every_layout():
    out = {}
    for tp, pp, dp, schedule, v in LAYOUTS:
        grid, stages = ParallelGrid(Layout(tp, pp, dp)), stage_map(schedule, pp, v)
        chunks = build_chunks(gen_config(), grid, stages)
        out[tp, pp, dp, schedule] = (generate(chunks, grid, PROMPT, NEW, stages=stages,
                                              greedy=True),
                                     generate(chunks, grid, PROMPT, NEW, stages=stages, **SAMPLED))
    with torch.no_grad():                     # position 7's embedding NaN, on the first stage
        for chunk in chunks:
            if chunk.first:
                chunk.embedding.position.weight[7] = float("nan")
    try:
        generate(chunks, grid, PROMPT, NEW, stages=stages, greedy=True)
    except NonFiniteLogits as err:
        return out, str(err)
    return out, None


@pytest.fixture(scope="module")
def layouts():
    return run(_generate_at_every_layout, 4)


def test_greedy_text_is_the_serial_text_at_every_layout_on_every_rank(layouts, model):
    serial = generate(model, None, PROMPT, NEW, greedy=True)
    assert all(greedy == serial for rank, _ in layouts for greedy, _ in rank.values())


def test_sampled_text_is_the_serial_text_at_every_layout_on_every_rank(layouts, model):
    serial = generate(model, None, PROMPT, NEW, **SAMPLED)
    assert all(sampled == serial for rank, _ in layouts for _, sampled in rank.values())


def test_non_finite_logits_stop_every_rank_with_the_same_message(layouts):
    """tp = 2 × pp = 2 under ZB-V: the sampler finds the NaN, every rank raises."""
    assert [poisoned for _, poisoned in layouts] == [
        "the model's logits are not finite (NaN) at position 7: the checkpoint holds "
        "non-finite weights?"] * 4


def _chunks_without_their_stage_map():
    grid = ParallelGrid(pp=2)
    chunks = build_chunks(gen_config(), grid, stage_map("interleaved", 2, 2))
    try:
        generate(chunks, grid, PROMPT, NEW)
    except ValueError as err:
        return str(err)
    return None


LAUNCHES = Launches({"tp2-cache": (2, _tensor_parallel_cache, ()),   # one launch of 2 ranks
                    "no-stage-map": (2, _chunks_without_their_stage_map, ())})


def test_interleaved_chunks_need_the_stage_map_they_were_built_on():
    messages = LAUNCHES["no-stage-map"]
    assert messages == ["2 chunks on this rank, but the stage map places 1 per rank (StageMap("
                        "p=2, v=1, kind='interleaved')): pass generate the stage map that "
                        "build_chunks(config, grid, stages) built them on"] * 2


# --- the command line -----------------------------------------------------------------------------

def _save_moved_weights(out_dir, config):
    """A checkpoint whose weights are not the initial ones (so loading them must matter)."""
    trainer = PTDP(config, ParallelGrid(), PTDPOptions())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    save_checkpoint(out_dir, 0, trainer)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run folder with a checkpoint, and a tokenizer of the model's vocabulary."""
    tmp = tmp_path_factory.mktemp("generate")
    text = "\n".join(f"the quick brown fox {i} jumps over the lazy dog {7 * i}" for i in range(200))
    tokenizer = train_tokenizer(text, 300, tmp)
    config = gen_config(vocab_size=tokenizer.vocab_size, seq_len=32)
    run(_save_moved_weights, 1, tmp / "run", config)
    return tmp / "run", tokenizer, config


def cli(checkpoint, *flags):
    run_dir, tokenizer, _ = checkpoint
    main(["--checkpoint", str(run_dir), "--tokenizer", str(tokenizer.path), "--prompt",
          "the quick", "--max-new-tokens", "6", *flags])


def test_the_command_prints_the_prompt_and_its_continuation_at_tp2_pp2(checkpoint, capsys):
    run_dir, tokenizer, config = checkpoint
    cli(checkpoint, "--greedy", "--nproc", "4", "--tp", "2", "--pp", "2")
    saved = GPT(config)
    saved.load_full_state_dict(load_full_model_state(run_dir))
    tokens = generate(saved, None, tokenizer.encode("the quick"), 6, greedy=True,
                      eos_id=tokenizer.eos_id)
    assert capsys.readouterr().out == "the quick" + tokenizer.decode(tokens) + "\n"


def test_a_hugging_face_folder_continues_the_prompt_as_its_checkpoint(checkpoint, tmp_path,
                                                                     capsys):
    """``--hf``: the checkpoint exported (weights, and its tokenizer.model copied in), then
    continued at tp 2 from the folder: the checkpoint's greedy text."""
    run_dir, tokenizer, _ = checkpoint
    export_hf(run_dir, tmp_path / "hf")
    shutil.copyfile(tokenizer.path, tmp_path / "hf" / "tokenizer.model")
    flags = ["--prompt", "the quick", "--max-new-tokens", "6", "--greedy"]
    cli(checkpoint, *flags[4:])
    assert main(["--hf", str(tmp_path / "hf"), *flags, "--nproc", "2", "--tp", "2"]) == 0
    ours, theirs = capsys.readouterr().out.strip().splitlines()
    assert theirs == ours


@pytest.fixture(scope="module")
def bert_checkpoint(tmp_path_factory):
    """A BERT's checkpoint: something generate cannot continue text with."""
    out = tmp_path_factory.mktemp("bert") / "run"
    run(_save_moved_weights, 1, out, BertConfig(vocab_size=100, seq_len=16, num_layers=2,
                                                hidden=32, num_heads=4))
    return out


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "3", "--tp", "2"], r"--nproc 3 ≠ tp·pp = 2·1 = 2"),
    (["--nproc", "0"], "--nproc must be a positive integer, got 0"),
    (["--tp", "-1"], "--tp must be a positive integer, got -1"),
    (["--pp", "1.5"], "--pp must be an integer, got '1.5'"),
    (["--temperature", "0"], r"--temperature must be a finite number > 0, got 0"),
    (["--temperature", "nan"], r"--temperature must be a finite number > 0, got nan"),
    (["--temperature", "inf"], r"--temperature must be a finite number > 0, got inf"),
    (["--top-k", "0"], "--top-k must be a positive integer, got 0"),
    (["--top-p", "2"], r"--top-p must be a number in \(0, 1\], got 2"),
    (["--top-p", "0"], r"--top-p must be a number in \(0, 1\], got 0"),
    (["--seed", "-1"], r"--seed must be an integer in 0 … 2\*\*64 − 1, got -1"),
    (["--step", "-2"], "--step must be a non-negative integer, got -2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--max-new-tokens", "40"], r"--max-new-tokens 40: .*\+ 40 new tokens = .* is longer than "
                                 r"seq_len = 32"),
    (["--prompt", ""], "--prompt '' encodes to no tokens"),
    (["--nproc", "3", "--tp", "3"], "num_heads = 4 is not divisible .* tp = 3"),
    (["--nproc", "8", "--pp", "8"], "num_layers = 4 is not divisible by pp·chunks = 8·1"),
    (["--step", "5"], "no checkpoint of step 5"),
    (["bert"], r"--checkpoint .* holds a BertConfig with bidirectional attention: generate "
               r"continues text with a left-to-right GPT"),
])
def test_the_command_refuses_bad_arguments_in_one_line_before_launching(
        checkpoint, bert_checkpoint, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(generate_module, "run", lambda *a, **k: pytest.fail("ranks launched"))
    if flags == ["bert"]:
        flags = ["--checkpoint", str(bert_checkpoint)]
    with pytest.raises(SystemExit) as exit_:
        cli(checkpoint, *flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err


def test_the_command_refuses_a_checkpoint_whose_logits_are_not_finite(tmp_path, capsys):
    poisoned = poisoned_checkpoint(PRETRAINED_CHECKPOINT, tmp_path / "poisoned", position=12)
    assert main(["--checkpoint", str(poisoned), "--prompt", "Return", "--max-new-tokens",
                 "20"]) == 1
    assert capsys.readouterr().err == ("error: the model's logits are not finite (NaN) at "
                                       "position 12: the checkpoint holds non-finite weights?\n")


def test_sampling_refuses_logits_that_are_not_finite():
    logits = torch.tensor([0.0, float("inf"), 1.0])
    with pytest.raises(NonFiniteLogits, match=r"not finite \(inf\)"):
        sample(logits, Sampling(greedy=True), torch.Generator())


def test_minus_infinity_rules_a_token_out_unless_it_rules_out_all():
    gen = torch.Generator().manual_seed(0)
    assert sample(torch.tensor([-math.inf, 0.0, -math.inf]), Sampling(), gen) == 1
    with pytest.raises(NonFiniteLogits):
        sample(torch.full((3,), -math.inf), Sampling(), gen)
