"""BERT (1909.08053 §5.3): the GPT's blocks with bidirectional attention, a padding mask, token
types, masked-LM and sentence-order heads; both layer-norm placements of Figure 7; its data."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TOL, assert_two_stages_chain_into_serial, max_diff

from megatron_edu.data import default_corpus, train_tokenizer
from megatron_edu.data.bert import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    mask_tokens,
    sentence_pairs,
    split_sentences,
)
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import BERT, GPT, BertConfig, GPTConfig, build_model, config_from_dict
from megatron_edu.model.bert import token_types
from megatron_edu.model.transformer import Attention
from megatron_edu.tensor_parallel.init import init_parameters
from megatron_edu.tensor_parallel.layers import serial_group
from megatron_edu.train import main


def bert_config(**overrides) -> BertConfig:
    """2 layers, hidden 32, 4 heads, vocabulary 100 (padded to 128·tp), sequences up to 16."""
    fields = dict(vocab_size=100, seq_len=16, num_layers=2, hidden=32, num_heads=4,
                  dropout=0.0, seed=7)
    return BertConfig(**{**fields, **overrides})


def bert_batch(b: int = 2, s: int = 16, padded: bool = True, seed: int = 0):
    """[CLS] a [SEP] b [SEP] [PAD]…, a few tokens masked (labels), the order label at [CLS]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (b, s), generator=gen)
    ids[:, 0], ids[:, 6] = CLS_ID, SEP_ID
    end = [s - 1 - (3 * i if padded else 0) for i in range(b)]      # sequence i: 3i pads
    labels = torch.full((b, s), -100)
    for i in range(b):
        ids[i, end[i]] = SEP_ID
        ids[i, end[i] + 1:] = PAD_ID
        labels[i, [2, 8]] = ids[i, [2, 8]]
        ids[i, [2, 8]] = MASK_ID
        labels[i, 0] = i % 2
    return ids, labels


# --- the model ---------------------------------------------------------------------------------

def test_build_model_picks_the_model_from_the_config_type():
    assert type(build_model(bert_config())) is BERT
    assert type(build_model(GPTConfig(**_gpt_fields()))) is GPT
    stage = build_model(bert_config(), layers=range(1, 2), first=False)
    assert (type(stage), list(stage.blocks), stage.first, stage.last) == (BERT, ["1"], False, True)
    with pytest.raises(TypeError, match="a GPT is built from a GPTConfig, not a BertConfig"):
        GPT(bert_config())                 # no longer a BERT in disguise: a loud refusal


def _gpt_fields():
    return {k: v for k, v in dataclasses.asdict(bert_config()).items()
            if k not in ("type_vocab_size", "pad_id", "sep_id", "model", "causal")}


def test_parameters_match_the_config_formula():
    assert BERT(bert_config()).num_parameters() == bert_config().num_parameters()


def test_token_types_are_0_through_the_first_sep_then_1():
    ids = torch.tensor([[CLS_ID, 9, 9, SEP_ID, 8, SEP_ID, PAD_ID]])
    assert token_types(ids, SEP_ID).tolist() == [[0, 0, 0, 0, 1, 1, 1]]


def test_loss_is_the_mean_over_masked_tokens_and_order_labels():
    model = BERT(bert_config())
    ids, labels = bert_batch()
    out = model(ids)
    mlm_labels = labels.clone()
    mlm_labels[:, 0] = -100
    mlm = F.cross_entropy(out.mlm_logits[..., :100].transpose(1, 2), mlm_labels,
                          ignore_index=-100, reduction="sum")
    order = F.cross_entropy(out.order_logits, labels[:, 0], reduction="sum")
    expected = (mlm + order) / (2 * 2 + 2)                # 2 masked tokens + 1 order label each
    assert abs(model(ids, labels).item() - expected.item()) < TOL


def test_padding_is_kept_out_changing_padded_tokens_changes_nothing():
    model = BERT(bert_config()).eval()
    ids, _ = bert_batch()
    keep = ids != PAD_ID
    other = torch.where(keep, ids, torch.randint(4, 100, ids.shape))   # padding → random ids
    a, b = model(ids, attention_mask=keep), model(other, attention_mask=keep)
    vocab = slice(0, 100)                                  # the padded vocabulary is −inf
    assert (a.mlm_logits - b.mlm_logits)[keep][:, vocab].abs().max() < TOL
    assert (a.order_logits - b.order_logits).abs().max() < TOL
    leaked = model(other).mlm_logits                       # without the mask: it leaks in
    assert (a.mlm_logits - leaked)[keep][:, vocab].abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_attention_kernel_applies_the_padding_mask_as_the_unfused_core(causal):
    """(The fused block's other kernels compile for seconds; the attention kernel is SDPA.)"""
    x = torch.randn(2, 16, 32)
    mask = bert_batch()[0] != PAD_ID
    outs = []
    for fused in (False, True):
        config = GPTConfig(**{**_gpt_fields(), "fused": fused, "causal": causal})
        attention = Attention(config, serial_group())
        init_parameters(attention, 7, serial_group())
        outs.append(attention(x, mask=mask)[mask])
    assert (outs[0] - outs[1]).abs().max() < TOL


def test_attention_is_bidirectional_the_first_position_sees_the_last():
    model = BERT(bert_config()).eval()
    ids, _ = bert_batch(padded=False)
    other = ids.clone()
    other[:, -2] = 50
    first = [model(x).mlm_logits[:, 0, :100] for x in (ids, other)]
    assert (first[0] - first[1]).abs().max() > 1e-4


def test_the_original_placement_is_post_ln_bert_figure_7a():
    """Block 0's ln1 normalises the embeddings; then LN(x + attn(x)), LN(x + mlp(x)) per layer."""
    config = bert_config(ln_placement="original", num_layers=3)
    model = BERT(config).eval()
    ids, _ = bert_batch(padded=False)
    blocks = list(model.blocks.values())
    x = model.embedding(ids, extra=model.token_type(token_types(ids, SEP_ID)))
    x = blocks[0].ln1(x)
    for i, block in enumerate(blocks):
        a = block.ln2(x + block.attn(x))
        x = (blocks[i + 1].ln1 if i + 1 < len(blocks) else model.ln_f)(a + block.mlp(a))
    hidden = BERT(config, last=False)(ids)                 # the blocks' output, before ln_f
    assert (model.ln_f(hidden) - x).abs().max() < TOL


def test_the_placements_differ_and_both_train():
    ids, labels = bert_batch(b=4)
    losses = {}
    for placement in ("original", "rearranged"):
        model = BERT(bert_config(ln_placement=placement))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[placement] = []
        for _ in range(8):
            loss = model(ids, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[placement].append(loss.item())
    assert losses["original"][0] != losses["rearranged"][0]
    assert all(curve[-1] < curve[0] - 0.5 for curve in losses.values())


def test_pipeline_stages_chain_into_the_serial_bert():
    config = bert_config()
    ids, labels = bert_batch(padded=False)
    assert_two_stages_chain_into_serial(config, ids, labels)


def test_a_padded_batch_on_a_first_stage_that_is_not_the_last_is_refused():
    with pytest.raises(ValueError, match="a padded batch cannot cross pipeline stages"):
        BERT(bert_config(), last=False)(bert_batch()[0])


def test_bert_refuses_sequence_parallelism_before_building():
    with pytest.raises(ValueError, match="BERT runs without sequence parallelism"):
        bert_config(sequence_parallel=True).validate(tp=2)


def test_a_checkpoints_config_dict_gives_back_the_bert_config():
    config = bert_config(ln_placement="original")
    assert config_from_dict(json.loads(json.dumps(vars(config)))) == config


# --- tensor parallel equals serial ------------------------------------------------------------

def _bert_tp_vs_serial():
    grid = ParallelGrid(tp=dist.get_world_size())
    config = bert_config(ln_placement="original")
    ids, labels = bert_batch()                            # padded: the mask under tp too
    serial, parallel = BERT(config), BERT(config, grid)
    loss = parallel(ids, labels)
    loss.backward()
    serial_loss = serial(ids, labels)
    serial_loss.backward()
    return {"loss": abs(loss.item() - serial_loss.item()),
            "grads": max_diff(parallel.full_state_dict(grads=True),
                              serial.full_state_dict(grads=True)),
            "names": sorted(parallel.full_state_dict(grads=True)),
            "params": (parallel.num_parameters(), config.num_parameters(grid.tp))}


def test_bert_at_tp2_equals_serial_loss_and_every_gradient():
    results = run(_bert_tp_vs_serial, 2)
    assert all(r["loss"] < TOL and r["grads"] < TOL for r in results)
    assert all(model == formula for model, formula in (r["params"] for r in results))
    assert {"token_type.weight", "mlm.bias", "order.pooler.weight"} <= set(results[0]["names"])


# --- the data ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    documents = default_corpus()[:40]
    tokenizer = train_tokenizer(documents, 512, tmp_path_factory.mktemp("cache"))
    return documents, tokenizer


def test_sentences_keep_their_whitespace_and_rebuild_the_document():
    text = "First one. Second one!  Third?\n\nA new paragraph\nstill going."
    assert split_sentences(text) == ["First one. ", "Second one!  ", "Third?\n\n",
                                     "A new paragraph\nstill going."]


def test_samples_are_full_length_cls_a_sep_b_sep_without_padding(small):
    ids, orders = sentence_pairs(*small, seq_len=32, seed=0)
    assert ids.shape[1] == 32 and len(ids) > 100
    assert (ids[:, 0] == CLS_ID).all() and (ids[:, -1] == SEP_ID).all()
    assert ((ids == SEP_ID).sum(1) == 2).all() and not (ids == PAD_ID).any()
    assert abs(orders.mean() - 0.5) < 0.1


def test_a_pair_in_order_is_contiguous_text_and_a_swapped_one_contiguous_once_unswapped(small):
    documents, tokenizer = small
    ids, orders = sentence_pairs(documents, tokenizer, seq_len=32, seed=0)
    corpus = "\x00".join(documents)
    for row, swapped in list(zip(ids, orders, strict=True))[:40]:
        sep = int(np.flatnonzero(row == SEP_ID)[0])
        first, second = row[1:sep].tolist(), row[sep + 1:-1].tolist()
        a, b = (second, first) if swapped else (first, second)
        assert tokenizer.decode(a + b) in corpus


def test_masking_chooses_15_percent_then_80_10_10():
    rng = np.random.default_rng(0)
    ids = np.concatenate([[CLS_ID], np.arange(4, 204), [SEP_ID], np.arange(300, 399), [SEP_ID]])
    chosen = masked = randomised = kept = 0
    for _ in range(400):
        out, labels = mask_tokens(ids, 1000, rng)
        picked = labels != -100
        assert not np.isin(ids[picked], SPECIAL_IDS).any()          # specials never chosen
        assert (labels[picked] == ids[picked]).all() and (out[~picked] == ids[~picked]).all()
        chosen += picked.sum()
        masked += (out[picked] == MASK_ID).sum()
        kept += (out[picked] == ids[picked]).sum()
        randomised += ((out[picked] != MASK_ID) & (out[picked] != ids[picked])).sum()
    assert chosen == 400 * round(0.15 * 299)                       # 15 % of the 299 candidates
    assert abs(masked / chosen - 0.8) < 0.02
    assert abs(randomised / chosen - 0.1) < 0.02 and abs(kept / chosen - 0.1) < 0.02


# --- the training script ----------------------------------------------------------------------

BERT_TINY = ["--model", "bert", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len",
             "32", "--vocab-size", "512", "--global-batch", "8", "--micro-batch", "2",
             "--warmup", "1", "--eval-batches", "1", "--no-progress"]


def test_train_bert_at_tp2_then_resume_at_pp2(tmp_path):
    common = [*BERT_TINY, "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
              "--ln-placement", "original", "--eval-interval", "3", "--save-interval", "3"]
    assert main([*common, "--nproc", "2", "--tp", "2", "--steps", "3"]) == 0
    assert main([*common, "--nproc", "2", "--pp", "2", "--steps", "5", "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    meta = json.loads((tmp_path / "checkpoints" / "step_000005" / "meta.json").read_text())
    assert meta["config"]["model"] == "bert" and meta["config"]["ln_placement"] == "original"


# --- the finding's experiment ------------------------------------------------------------------

def test_the_layer_norm_experiment_trains_both_placements_and_ships_its_curves(tmp_path):
    from megatron_edu.course.ln_placement import SETTINGS, load_curves, smooth, train_curve

    small = dict(num_layers=2, hidden=32, num_heads=4, seq_len=32, vocab_size=512, batch=2)
    for placement in ("original", "rearranged"):
        losses = train_curve(placement, 3, cache_dir=tmp_path, **small)["loss"]
        assert len(losses) == 3 and all(v is not None and 0 < v < 20 for v in losses)
    shipped = load_curves()
    assert shipped["settings"] == SETTINGS               # the curves are of the stated settings
    assert {p: len(c) for p, c in shipped["curves"].items()} == {
        "original": SETTINGS["steps"], "rearranged": SETTINGS["steps"]}
    assert smooth([1.0, None, 3.0], window=2) == [1.0, 1.0, 3.0]
