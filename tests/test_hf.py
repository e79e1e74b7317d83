"""Hugging Face GPT-2 in and out: the same logits as ``GPT2LMHeadModel``, serial and under tp.

The outside reference (minGPT's idea): a randomly initialised tiny GPT2LMHeadModel, saved with
``save_pretrained`` — nothing is downloaded.
"""

import json

import pytest
import torch
import torch.distributed as dist

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.hf import config_from_hf, load_hf_gpt2, save_hf_gpt2
from megatron_edu.launch import run

transformers = pytest.importorskip("transformers")

VOCAB, TOL = 100, 1e-4


def _hf_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gpt2")
    model = _hf_model()
    model.save_pretrained(path)
    return path, _hf_logits(model, IDS)


def _load_serial_and_tp2(path, out):
    """Each rank: the serial model's logits, the tp=2 model's gathered logits; save tp=2 back."""
    grid = ParallelGrid(tp=2)
    serial = load_hf_gpt2(path, dropout=0.0).eval()
    parallel = load_hf_gpt2(path, grid, dropout=0.0).eval()
    with torch.no_grad():
        gathered = comm.all_gather(parallel(IDS), grid.tp_group)[..., :VOCAB]
        serial_logits = serial(IDS)[..., :VOCAB]
    save_hf_gpt2(parallel, out)
    dist.barrier()  # tp rank 0 has finished writing
    return serial_logits, gathered


@pytest.fixture(scope="module")
def loaded(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported_tp2")
    return run(_load_serial_and_tp2, 2, hf_dir[0], out), out


def test_serial_logits_equal_hugging_face(hf_dir, loaded):
    assert all((serial - hf_dir[1]).abs().max() < TOL for serial, _ in loaded[0])


def test_tp2_logits_equal_hugging_face(hf_dir, loaded):
    assert all((parallel - hf_dir[1]).abs().max() < TOL for _, parallel in loaded[0])


def test_tp2_export_loads_in_hugging_face_with_the_same_logits(hf_dir, loaded):
    exported = transformers.GPT2LMHeadModel.from_pretrained(loaded[1]).eval()
    assert (_hf_logits(exported, IDS) - hf_dir[1]).abs().max() < TOL


def test_serial_export_round_trips_through_hugging_face(hf_dir, tmp_path):
    save_hf_gpt2(load_hf_gpt2(hf_dir[0]), tmp_path)
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert (_hf_logits(exported, IDS) - hf_dir[1]).abs().max() < TOL


def test_a_pytorch_model_bin_checkpoint_loads_too(hf_dir, tmp_path):
    torch.save(_hf_model().state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((hf_dir[0] / "config.json").read_text())
    with torch.no_grad():
        logits = load_hf_gpt2(tmp_path).eval()(IDS)[..., :VOCAB]
    assert (logits - hf_dir[1]).abs().max() < TOL


def test_an_unsupported_activation_is_refused_by_name(hf_dir):
    config = json.loads((hf_dir[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="'activation_function': 'relu'"):
        config_from_hf({**config, "activation_function": "relu"})
