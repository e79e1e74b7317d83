"""The memory calculator of notebooks 10 and 13: each control moves the part of memory it should,
by the factor the papers give, and a layout that cannot split the model is named, not drawn."""

import matplotlib.pyplot as plt
import pytest

from megatron_edu.course.viz.memory import MemoryChoice, calculate, draw_memory_calculator
from megatron_edu.model import GPTConfig

GPT3 = GPTConfig(vocab_size=51200, seq_len=2048, num_layers=96, hidden=12288, num_heads=96)
BATCH = 1536


def test_the_activation_controls_move_the_activations_only():
    base = calculate(GPT3, MemoryChoice(tp=8, pp=12, dp=16), BATCH)
    sp = calculate(GPT3, MemoryChoice(tp=8, pp=12, dp=16, sequence_parallel=True), BATCH)
    both = calculate(GPT3, MemoryChoice(tp=8, pp=12, dp=16, sequence_parallel=True,
                                        recompute="selective"), BATCH)
    full = calculate(GPT3, MemoryChoice(tp=8, pp=12, dp=16, recompute="full"), BATCH)
    for other in (sp, both, full):
        assert (other.weights, other.grads, other.optimizer) == (
            base.weights, base.grads, base.optimizer)
    assert full.activations < both.activations < sp.activations < base.activations


def test_the_zero_stages_shard_their_parts_over_dp():
    plain = calculate(GPT3, MemoryChoice(tp=8, dp=16), BATCH)
    stages = [calculate(GPT3, MemoryChoice(tp=8, dp=16, zero=z), BATCH) for z in (1, 2, 3)]
    assert stages[0].optimizer == pytest.approx(plain.optimizer / 16, rel=1e-6)
    assert stages[0].grads == plain.grads and stages[1].grads == pytest.approx(plain.grads / 16,
                                                                               rel=1e-6)
    assert stages[2].weights == pytest.approx(plain.weights / 16, rel=1e-6)
    assert all(s.activations == plain.activations for s in stages)


def test_a_layout_that_cannot_split_is_named_and_left_out(capsys):
    with pytest.raises(ValueError, match="dp = 7"):
        calculate(GPT3, MemoryChoice(dp=7), BATCH)
    fig = draw_memory_calculator(GPT3, [MemoryChoice(tp=8, pp=12), MemoryChoice(tp=8, pp=7)],
                                 BATCH, capacity=80 * 2**30)
    assert len(fig.axes[0].get_xticklabels()) == 1
    assert "cannot split: t8 p7 d1" in capsys.readouterr().out
    plt.close(fig)
