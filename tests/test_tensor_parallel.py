"""Tensor-parallel layers (1909.08053 §3) against plain PyTorch on the gathered weights.

Each launch at tp ∈ {1, 2, 4} runs every layer once; the tests below read one claim each from it.
"""

import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TOL, Launches, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_edu import comm
from megatron_edu.grid import ParallelGrid
from megatron_edu.model import GPT, LlamaConfig
from megatron_edu.model.transformer import Block
from megatron_edu.tensor_parallel import (
    ColumnParallelLinear,
    Dropout,
    DropoutKey,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full,
    init_parameters,
    random,
    shard,
    vocab_parallel_cross_entropy,
)
from megatron_edu.tensor_parallel.random import keep_mask, mask_seed
from megatron_edu.tensor_parallel.sequence_parallel import STYLES

B, S, H, FFN, VOCAB, PADDED = 2, 5, 8, 16, 100, 128
CE_VOCAB = 60  # < 128/2: at tp = 2 and 4 some ranks hold nothing but padding


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _leaf(t):
    return t.clone().requires_grad_(True)


def _grad_diff(param, ref_grad, group):
    return (gather_full(param.grad, param.tp_dim, group) - ref_grad).abs().max().item()


def _column(group):
    layer = ColumnParallelLinear(H, FFN, group)
    init_parameters(layer, seed=1, group=group)
    w, b = _leaf(gather_full(layer.weight, 0, group)), _leaf(gather_full(layer.bias, 0, group))
    x, x_ref, r = _leaf(_rand(B, S, H, seed=2)), _leaf(_rand(B, S, H, seed=2)), _rand(FFN, seed=3)
    with comm.record() as log:
        y = comm.gather(layer(x), group)          # the slices gathered: the whole Y
        (y * r).sum().backward()
    y_ref = F.linear(x_ref, w, b)
    (y_ref * r).sum().backward()
    diffs = [(y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item(),
             _grad_diff(layer.weight, w.grad, group), _grad_diff(layer.bias, b.grad, group)]
    return max(diffs), log.summary()


def _row(group):
    layer = RowParallelLinear(FFN, H, group)
    init_parameters(layer, seed=1, group=group)
    with torch.no_grad():
        layer.bias.normal_(generator=torch.Generator().manual_seed(4))  # same on every rank
    w, b = _leaf(gather_full(layer.weight, 1, group)), _leaf(layer.bias.detach())
    x_full, r = _leaf(_rand(B, S, FFN, seed=2)), _rand(H, seed=3)
    x = _leaf(shard(x_full.detach(), -1, group))                   # this rank's input slice
    with comm.record() as log:
        y = layer(x)
        (y * r).sum().backward()
    y_ref = F.linear(x_full, w, b)
    (y_ref * r).sum().backward()
    diffs = [(y - y_ref).abs().max().item(),
             (x.grad - shard(x_full.grad, -1, group)).abs().max().item(),
             _grad_diff(layer.weight, w.grad, group), _grad_diff(layer.bias, b.grad, group)]
    return max(diffs), log.summary()


def _mlp(group):
    """Figure 3a: column, GeLU on each slice, row."""
    fc, proj = ColumnParallelLinear(H, FFN, group), RowParallelLinear(FFN, H, group)
    init_parameters(fc, seed=1, group=group)
    init_parameters(proj, seed=2, group=group)
    x = _leaf(_rand(B, S, H, seed=2))
    with comm.record() as log:
        proj(F.gelu(fc(x))).sum().backward()
    return log.summary()


def _embedding(group):
    layer = VocabParallelEmbedding(VOCAB, H, group, padded_vocab=PADDED)
    init_parameters(layer, seed=1, group=group)
    w = _leaf(gather_full(layer.weight, 0, group))
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))
    r = _rand(H, seed=3)
    with comm.record() as log:
        y = layer(ids)
        (y * r).sum().backward()
    y_ref = F.embedding(ids, w)
    (y_ref * r).sum().backward()
    diff = max((y - y_ref).abs().max().item(), _grad_diff(layer.weight, w.grad, group))
    padding_is_zero = bool((w[VOCAB:] == 0).all())
    return diff, padding_is_zero, log.summary()


def _cross_entropy(group, scale=1.0, padding_value=None):
    """Per-token losses and logit gradients against F.cross_entropy on the gathered logits."""
    full = _rand(B, S, PADDED, seed=6) * scale
    if padding_value is not None:
        full[..., CE_VOCAB:] = padding_value                      # padded ids must never count
    target = torch.randint(0, CE_VOCAB, (B, S), generator=torch.Generator().manual_seed(7))
    target[0, 0] = -100                                         # ignored, as in F.cross_entropy
    r = _rand(B, S, seed=8)
    local = _leaf(shard(full, -1, group))
    with comm.record() as log:
        loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=CE_VOCAB)
        (loss * r).sum().backward()
    ref_logits = _leaf(full[..., :CE_VOCAB])
    ref = F.cross_entropy(ref_logits.transpose(1, 2), target, reduction="none")
    (ref * r).sum().backward()
    ref_grad = F.pad(ref_logits.grad, (0, PADDED - CE_VOCAB))    # padded ids: zero gradient
    diff = max((loss - ref).abs().max().item(),
               (local.grad - shard(ref_grad, -1, group)).abs().max().item())
    return diff, bool(torch.isfinite(loss).all()), log.summary()


def _check_layers():
    group = ParallelGrid(tp=dist.get_world_size()).tp_group
    return {"column": _column(group), "row": _row(group), "mlp": _mlp(group),
            "embedding": _embedding(group), "ce": _cross_entropy(group),
            "ce_large": _cross_entropy(group, scale=1e4),
            "ce_padding": _cross_entropy(group, padding_value=1e4)}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def layers(request):
    return request.param, LAUNCHES[f"layers-tp{request.param}"]


def _events(tp, *counts):
    """The comm.record() summary expected at tp (nothing at all at tp=1)."""
    return {} if tp == 1 else {key: (n, nbytes) for key, n, nbytes in counts}


def test_column_parallel_linear_matches_serial_output_and_gradients(layers):
    tp, results = layers
    assert all(r["column"][0] < TOL for r in results)


def test_column_parallel_communicates_f_backward_and_the_output_gather(layers):
    tp, results = layers
    expected = _events(tp, (("all_gather", "tp", "gather forward"), 1, 4 * B * S * FFN),
                       (("all_reduce", "tp", "f backward"), 1, 4 * B * S * H))
    assert all(r["column"][1] == expected for r in results)


def test_row_parallel_linear_matches_serial_output_and_gradients(layers):
    tp, results = layers
    assert all(r["row"][0] < TOL for r in results)


def test_row_parallel_communicates_one_g_forward(layers):
    tp, results = layers
    expected = _events(tp, (("all_reduce", "tp", "g forward"), 1, 4 * B * S * H))
    assert all(r["row"][1] == expected for r in results)


def test_mlp_column_then_row_is_one_all_reduce_forward_and_one_backward(layers):
    tp, results = layers
    expected = _events(tp, (("all_reduce", "tp", "g forward"), 1, 4 * B * S * H),
                       (("all_reduce", "tp", "f backward"), 1, 4 * B * S * H))
    assert all(r["mlp"] == expected for r in results)


def test_vocab_parallel_embedding_matches_serial_lookup_and_gradient(layers):
    tp, results = layers
    assert all(r["embedding"][0] < TOL for r in results)


def test_vocab_padding_rows_start_at_zero(layers):
    tp, results = layers
    assert all(r["embedding"][1] for r in results)


def test_vocab_parallel_embedding_all_reduces_once_forward_only(layers):
    tp, results = layers
    expected = _events(tp, (("all_reduce", "tp", "g forward"), 1, 4 * B * S * H))
    assert all(r["embedding"][2] == expected for r in results)


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_on_gathered_logits(layers):
    tp, results = layers
    assert all(r["ce"][0] < TOL for r in results)


def test_vocab_parallel_cross_entropy_is_stable_for_large_logits(layers):
    tp, results = layers
    assert all(r["ce_large"][1] and r["ce_large"][0] < 1e-2 for r in results)  # |z| ~ 1e4


def test_padded_vocabulary_entries_never_count_even_when_largest(layers):
    tp, results = layers
    assert all(r["ce_padding"][0] < TOL for r in results)


def test_vocab_parallel_cross_entropy_exchanges_three_numbers_per_token_forward_only(layers):
    tp, results = layers
    expected = _events(tp, (("all_gather", "tp", "ce max"), 1, 4 * B * S * tp),
                       (("all_reduce", "tp", "ce target logit"), 1, 4 * B * S),
                       (("all_reduce", "tp", "ce sum-exp"), 1, 4 * B * S))
    assert all(r["ce"][2] == expected for r in results)


# --- under autocast, the compute dtype on the wire; the overlapped column backward -----------

WIRE_S = 8  # the sequence of the block below (split in two under sequence parallelism)


def _block_on_the_wire(group, sp, llama=False):
    """(group, op, label, dtype, bytes) of every collective of one block, forward and backward,
    under CPU bf16 autocast (``llama``: 4 heads sharing 2 kv heads, SwiGLU, RMSNorm)."""
    config = tiny_config(sequence_parallel=sp)
    if llama:
        config = LlamaConfig(**{k: getattr(config, k) for k in (
            "vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "sequence_parallel")},
            num_kv_heads=2, ffn_hidden=96)
    block = Block(config, group)
    init_parameters(block, config.seed, group)
    x = _rand(B, WIRE_S // 2 if sp else WIRE_S, config.hidden, seed=2).requires_grad_()
    with comm.record() as log:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(x)
        y.sum().backward()
    return [(e.group, e.op, e.label, e.dtype, e.bytes) for e in log.events]


def _overlap_step(config, grid, overlap, bf16):
    """Loss, this rank's gradients and the collectives of one GPT step, dropout on."""
    model = GPT(dataclasses.replace(config, async_tp=overlap), grid)
    assert all(type(layer.style) is STYLES[config.sequence_parallel, overlap]
               for layer in model.modules() if isinstance(layer, ColumnParallelLinear))
    ids = torch.randint(0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    with comm.record() as log:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids[:, :-1], ids[:, 1:], dropout_key=DropoutKey(3, (0, 1, 2, 3)))
        loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters()}, log.summary()


def _wire_and_overlap():
    grid = ParallelGrid(tp=2)
    wire = {sp: _block_on_the_wire(grid.tp_group, sp) for sp in (False, True)}
    wire |= {("llama", sp): _block_on_the_wire(grid.tp_group, sp, True) for sp in (False, True)}
    same = {}
    for sp in (False, True):
        for bf16 in (False, True):
            config = tiny_config(dropout=0.1, sequence_parallel=sp)
            (loss, grads, calls), (loss_async, grads_async, calls_async) = (
                _overlap_step(config, grid, overlap, bf16) for overlap in (False, True))
            same[sp, bf16] = (torch.equal(loss, loss_async), calls == calls_async,
                              [n for n in grads if not torch.equal(grads[n], grads_async[n])])
    return wire, same


@pytest.fixture(scope="module")
def wire_and_overlap():
    return LAUNCHES["wire-and-overlap"]


PER_LAYER = {  # (op, label) -> calls of one block, forward and backward, at tp = 2
    False: {("all_reduce", "g forward"): 2, ("all_reduce", "f backward"): 2},
    True: {("all_gather", "all_gather_seq forward"): 2,
           ("reduce_scatter", "reduce_scatter_seq forward"): 2,
           ("all_gather", "all_gather_seq regather"): 2,
           ("reduce_scatter", "all_gather_seq backward"): 2,
           ("all_gather", "reduce_scatter_seq backward"): 2}}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence-parallel"])
@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_under_autocast_a_layer_sends_activations_and_gradients_in_bf16(wire_and_overlap, sp,
                                                                        block):
    """Megatron-LM's bytes: b·s·h values of 2 bytes per all-reduce (and per all-gather's output,
    per reduce-scatter's input) — not the fp32 of a layer norm's output or of its gradient. A
    Llama block's are the same (``attention.Attention``): its kv heads and SwiGLU change the
    matmuls, not what crosses tp."""
    bsh_bf16 = B * WIRE_S * tiny_config().hidden * 2
    for wire, _ in wire_and_overlap:
        calls = wire[sp] if block == "gpt" else wire["llama", sp]
        assert Counter((op, label) for _, op, label, _, _ in calls) == PER_LAYER[sp]
        assert {(dtype, nbytes) for *_, dtype, nbytes in calls} == {(torch.bfloat16, bsh_bf16)}


def test_a_kv_head_held_by_two_ranks_sums_its_copies_gradients_in_fp32():
    """tp = 4 over 2 kv heads, under bf16 autocast: tp's activations cross in bf16 as at tp = 2,
    and one more all-reduce, over the 2 holders of a kv head (``tp/2``), sums the gradient of
    its copies (2·d·h values) in fp32, as data parallelism sums gradients."""
    h = tiny_config().hidden
    for calls in LAUNCHES["kv-copies"]:
        assert Counter((op, label) for g, op, label, _, _ in calls if g == "tp") == PER_LAYER[False]
        assert [c for c in calls if c[0] != "tp"] == [
            ("tp/2", "all_reduce", "f backward", torch.float32, 2 * (h // 4) * h * 4)]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence-parallel"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_async_tp_gives_the_same_loss_gradients_and_collectives_bit_for_bit(wire_and_overlap, sp,
                                                                            bf16):
    for _, same in wire_and_overlap:
        assert same[sp, bf16] == (True, True, [])


# --- dropout masks (1909.08053 Appendix B.2), seeded by what they are for ----------------------

KEY = DropoutKey(step=4, samples=(7, 8))


def _mask(key=KEY, layer=3, parts=((0, 1),), rows=2, shape=(64,)):
    return Dropout(0.5, seed=5, layer=layer, site="mlp output", parts=parts).train()(
        torch.ones(rows, *shape), key) != 0


def _check_dropout():
    """Outside the regions every tp rank draws the whole mask; inside, its part of the heads:
    rank r of t the r-th of t parts of dim 1 (here t = 2 parts of 4 heads × 16)."""
    group = ParallelGrid(tp=2).tp_group
    torch.manual_seed(123)
    expected_default = torch.rand(3)
    torch.manual_seed(123)
    replicated = _mask(shape=(8, 16))
    split = _mask(parts=((group.rank, group.size),), shape=(4, 16))
    untouched = torch.equal(torch.rand(3), expected_default)
    gathered = [comm.all_gather(m.float()[None], group, dim=0) for m in (replicated, split)]
    return {"replicated_equal": torch.equal(gathered[0][0], gathered[0][1]),
            "split_equal": torch.equal(gathered[1][0], gathered[1][1]),
            "split_is_the_whole": torch.equal(torch.cat(list(gathered[1]), 1), replicated.float()),
            "default_untouched": untouched}


LAUNCHES = Launches({  # name -> (world size, function, arguments): one launch per world size
    **{f"layers-tp{tp}": (tp, _check_layers, ()) for tp in (1, 2, 4)},
    "wire-and-overlap": (2, _wire_and_overlap, ()),
    "kv-copies": (4, lambda: _block_on_the_wire(ParallelGrid(tp=4).tp_group, False, True), ()),
    "dropout": (2, _check_dropout, ()),
})


@pytest.fixture(scope="module")
def dropout():
    return LAUNCHES["dropout"]


def test_dropout_outside_split_regions_is_the_same_on_every_tp_rank(dropout):
    assert all(r["replicated_equal"] for r in dropout)


def test_dropout_inside_split_regions_differs_between_tp_ranks(dropout):
    assert not any(r["split_equal"] for r in dropout)


def test_the_tp_ranks_heads_masks_are_the_serial_mask(dropout):
    """1909.08053 App. B.2 wants different masks for different heads: here they are different
    elements of the one serial mask, so any tp draws the serial model's masks."""
    assert all(r["split_is_the_whole"] for r in dropout)


def test_dropout_leaves_the_default_generator_untouched(dropout):
    assert all(r["default_untouched"] for r in dropout)


def test_a_samples_mask_does_not_depend_on_the_batch_it_came_in():
    alone = _mask(DropoutKey(step=4, samples=(8,)), rows=1)
    assert torch.equal(_mask()[1:], alone)  # sample 8: second in one batch, first in another
    assert torch.equal(_mask(), _mask())     # reproducible from the key


# --- the masks are a hash: the formula, its statistics, one kernel chain per batch --------------

M32 = 2**32 - 1


def _fmix32(x):  # MurmurHash3's finaliser, on Python's unbounded integers
    x ^= x >> 16
    x = x * 0x85EBCA6B & M32
    x ^= x >> 13
    x = x * 0xC2B2AE35 & M32
    return x ^ x >> 16


def test_a_mask_is_the_formula_computed_element_by_element():
    p, shape, key = 0.3, (2, 6, 40), DropoutKey(step=4, samples=(7, 8))
    mask = Dropout(p, seed=5, layer=3, site="mlp output").keep(key, torch.ones(shape))
    elements = [(row, j) for row in range(2) for j in (0, 1, 2, 17, 100, 239)]
    for row, j in elements:
        k = mask_seed(5, 4, key.samples[row], 3, "mlp output")
        expected = _fmix32(_fmix32(j ^ k & M32) ^ k >> 32) >= round(p * 2**32)
        assert bool(mask[row].flatten()[j]) == expected, (row, j)


@pytest.mark.parametrize("parts", [2, 4])
def test_a_sequence_parallel_rank_computes_exactly_its_slice_of_the_whole_mask(parts):
    whole = _mask(rows=2, shape=(8, 12))
    for part in range(parts):
        mine = Dropout(0.5, seed=5, layer=3, site="mlp output", parts=((part, parts),))
        assert torch.equal(mine.keep(KEY, torch.ones(2, 8 // parts, 12)),
                           whole.chunk(parts, dim=1)[part])


N = 1 << 20                   # elements per mask: a standard deviation of ~0.05 % at p = 0.3


@functools.cache
def _big(p=0.3, key=KEY, layer=3, site="mlp output", rows=2):
    return Dropout(p, seed=5, layer=layer, site=site).keep(
        key, torch.empty(rows, N, dtype=torch.bool)).float()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_a_mask_keeps_one_minus_p_of_the_elements(p):
    kept = _big(p, key=DropoutKey.first(4), rows=4).mean().item()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / (4 * N)) ** 0.5


@pytest.mark.parametrize("other", [dict(key=DropoutKey(5, (7, 8))), dict(layer=4),
                                   dict(site="attention output"),
                                   dict(key=DropoutKey(4, (9, 10)))],
                         ids=["step", "layer", "site", "sample"])
def test_masks_of_another_step_layer_site_or_sample_are_independent(other):
    p = 0.3                    # independent masks agree on p² + (1 − p)² of the elements
    agree = (_big(p, **other) == _big(p)).float().mean().item()
    expected = p * p + (1 - p) ** 2
    assert abs(agree - expected) < 4 * (expected * (1 - expected) / (2 * N)) ** 0.5


@pytest.mark.parametrize("lag", [1, 2, 64, 4096])
def test_neighbouring_elements_of_a_mask_are_uncorrelated(lag):
    m = _big()
    a, b = m[:, :-lag] - m.mean(), m[:, lag:] - m.mean()
    assert abs((a * b).mean().item() / m.var().item()) < 4 / (2 * N) ** 0.5


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_batch_mask_is_one_chain_of_kernels_whatever_the_batch():
    dropout = Dropout(0.1, seed=5, layer=3, site="mlp output")
    counts = {}
    for b in (1, 8):
        x, key = torch.ones(b, 16, 32), DropoutKey.first(b)
        with _Ops() as log:
            dropout.keep(key, x)
        counts[b] = log.ops
    assert counts[1] == counts[8] and len(counts[8]) < 30   # 24 kernels, 4 views


def test_the_gpus_compiled_mask_is_one_kernel_with_the_chains_bits():
    """What a GPU runs for keep_mask and for keep_at (context parallelism's blocks of the
    scores), compiled for the CPU: one kernel, the chain's bits."""
    from torch._inductor import metrics

    for b, start, n in [(2, 0, 3000), (3, 777, 40000)]:  # a sample; a part, on the CPU in 4 blocks
        keys = torch.randint(0, 2**32, (b, 2), generator=torch.Generator().manual_seed(b))
        metrics.reset()
        compiled = random._keep_kernel()(keys, torch.arange(start, start + n), 0.1)
        assert metrics.generated_kernel_count == 1
        assert torch.equal(compiled, keep_mask(keys, start, n, 0.1))
        scattered = torch.randint(0, 2**32, (n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(random._keep_kernel()(keys, scattered, 0.1),
                           random._keep(keys, scattered, 0.1))


def test_dropout_in_training_needs_a_key_for_its_rows():
    with pytest.raises(ValueError, match="needs a DropoutKey naming the 3 samples"):
        Dropout(0.1, seed=0, layer=0, site="x").train()(torch.ones(3, 4), KEY)
