"""Initialisation: every tp layout holds the serial model's numbers, each rank drawing only about
its own shard (docs/principles.md: "Nothing whole on one rank at
scale"); vocabulary padding is zero.

One launch per tp ∈ {1, 2, 3, 4}; the tests below read one claim each from it. At tp = 3 the
model is 48 wide: 48 qkv rows per rank, so shard edges fall inside the 64-row blocks.
"""

from contextlib import contextmanager

import pytest
import torch
from helpers import max_diff, tiny_config

from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import BERT, GPT, BertConfig
from megatron_edu.model.transformer import MLP, Attention, Block, Embedding
from megatron_edu.tensor_parallel.init import BLOCK, blocks, init_parameters
from megatron_edu.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    serial_group,
)


def _config(tp):
    return tiny_config(hidden=48, num_heads=3) if tp == 3 else tiny_config()


def _aligned_config(tp):
    """Widths that are multiples of 64·tp, as real models' are: shard edges on block edges."""
    return tiny_config(hidden=BLOCK * tp, num_heads=tp, num_layers=1)


@contextmanager
def _counting_normals():
    """Count every number drawn by ``Tensor.normal_`` inside the block."""
    drawn, original = [], torch.Tensor.normal_

    def counting(self, *args, **kwargs):
        drawn.append(self.numel())
        return original(self, *args, **kwargs)

    torch.Tensor.normal_ = counting
    try:
        yield drawn
    finally:
        torch.Tensor.normal_ = original


def _build(config, grid):
    """The model, and how many numbers its initialisation draws on this rank (run again under a
    counter: PyTorch's own default init of ``nn.Embedding``, overwritten, is not ours)."""
    model = GPT(config, grid)
    with _counting_normals() as drawn:
        init_parameters(model, config.seed, model.tp_group)
    return model, sum(drawn)


def _own_numbers(model):
    """The random numbers this rank holds: its normal-initialised slices, less padding rows."""
    word = model.embedding.word
    padding_rows = word.vocab_end - max(word.vocab_start, min(word.vocab_end,
                                                              model.config.vocab_size))
    held = sum(p.numel() for p in model.parameters() if p.init.std is not None)
    return held - padding_rows * model.config.hidden


def _edge_blocks(model):
    """The numbers of two blocks (one per edge of the slice) of each split random parameter."""
    return sum(2 * BLOCK * p.numel() // p.shape[p.tp_dim] for p in model.parameters()
               if p.init.std is not None and p.tp_dim is not None)


def _on_rank(tp):
    grid = ParallelGrid(tp=tp)
    model, drawn = _build(_config(tp), grid)
    aligned, aligned_drawn = _build(_aligned_config(tp), grid)
    word = model.embedding.word
    padding = word.weight[max(0, model.config.vocab_size - word.vocab_start):]
    return {"state": model.full_state_dict(), "drawn": drawn, "own": _own_numbers(model),
            "bound": _own_numbers(model) + _edge_blocks(model), "aligned_drawn": aligned_drawn,
            "aligned_own": _own_numbers(aligned), "padding_rows": padding.shape[0],
            "padding_max": padding.abs().max().item() if padding.numel() else 0.0}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda tp: f"tp{tp}")
def tp_run(request):
    return request.param, run(_on_rank, request.param, request.param)


def test_gathered_parameters_equal_the_serial_models_exactly(tp_run):
    tp, ranks = tp_run
    serial = GPT(_config(tp)).full_state_dict()
    assert all(max_diff(r["state"], serial) == 0.0 for r in ranks)


def test_each_rank_draws_at_most_its_shard_and_one_block_per_edge(tp_run):
    assert all(r["own"] <= r["drawn"] <= r["bound"] for r in tp_run[1])


def test_with_widths_on_block_edges_each_rank_draws_exactly_its_shard(tp_run):
    assert all(r["aligned_drawn"] == r["aligned_own"] for r in tp_run[1])


def test_vocabulary_padding_rows_are_zero(tp_run):
    tp, ranks = tp_run
    assert sum(r["padding_rows"] for r in ranks) == _config(tp).padded_vocab(tp) - 100
    assert all(r["padding_max"] == 0.0 for r in ranks)


@pytest.mark.parametrize("lo, hi, expected", [(0, 64, range(0, 1)), (48, 96, range(0, 2)),
                                              (96, 144, range(1, 3)), (144, 192, range(0))])
def test_blocks_meeting_a_slice_of_144_rows(lo, hi, expected):
    assert blocks(144, lo, hi) == expected


# Numbers drawn before layers were built on the meta device (the same seeds, so the same values:
# the shipped checkpoints and the notebooks' outputs depend on them).
RECORDED = {
    "embedding.word.weight": [-0.01660051755607128, 0.009707573801279068, 0.027163095772266388],
    "embedding.position.weight": [-0.034591495990753174, 0.005728240590542555,
                                  -0.0021151676774024963],
    "blocks.1.attn.qkv.weight": [-0.014075042679905891, 0.018780771642923355,
                                 -0.01634366065263748],
    "blocks.0.mlp.proj.weight": [-0.005623131059110165, -0.01853654906153679,
                                 -0.017746375873684883],
    "token_type.weight": [-0.011628490872681141, -0.014299889095127583, 0.03183013200759888],
    "mlm.dense.weight": [-0.003459762781858444, -0.021772906184196472, 0.024615691974759102],
    "order.classifier.weight": [0.011702083051204681, 0.0022675988730043173,
                                -0.005221269093453884],
}


def test_initialisation_draws_the_numbers_recorded_before():
    fields = dict(vocab_size=100, seq_len=16, num_layers=2, hidden=32, num_heads=4, seed=7)
    state = {**GPT(tiny_config()).full_state_dict(), **BERT(BertConfig(**fields)).full_state_dict()}
    assert {name: state[name].flatten()[:3].tolist() for name in RECORDED} == RECORDED


def test_a_layer_used_before_init_parameters_raises_and_init_makes_it_real():
    config, group = tiny_config(), serial_group()
    x, ids = torch.randn(2, 8, config.hidden), torch.zeros(2, 8, dtype=torch.long)
    layers = [(ColumnParallelLinear(32, 64, group), x), (RowParallelLinear(32, 32, group), x),
              (VocabParallelEmbedding(100, 32, group), ids), (Embedding(config, group), ids),
              (Attention(config, group), x), (MLP(config, group), x), (Block(config, group), x)]
    for layer, inputs in layers:
        assert all(p.is_meta for p in layer.parameters())        # shapes only: no memory
        with pytest.raises(RuntimeError, match="not initialised.*Call init_parameters"):
            layer(inputs)
        init_parameters(layer, config.seed, group)
        assert torch.isfinite(layer(inputs)).all()
        assert all(p.device.type == "cpu" and hasattr(p, "tp_dim") for p in layer.parameters())
