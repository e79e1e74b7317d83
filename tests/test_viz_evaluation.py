"""The evaluation pictures of notebook 14: what a BPE piece is within the text, and the per-token
losses drawn with the two means of their sum."""

import matplotlib.pyplot as plt
import numpy as np

from megatron_edu.course.viz.evaluation import (
    SPACE,
    WORD_REST,
    WORD_START,
    draw_token_losses,
    piece_kinds,
)


def test_a_piece_begins_a_word_after_whitespace_and_continues_it_otherwise():
    pieces = ["\n", "Return", " l", "ist", ".", " ", "If", "\n\n", "=", "=", " n", "e"]
    assert piece_kinds(pieces).tolist() == [SPACE, WORD_START, WORD_START, WORD_REST, WORD_REST,
                                            SPACE, WORD_START, SPACE, WORD_START, WORD_REST,
                                            WORD_START, WORD_REST]


def test_the_text_s_first_piece_begins_a_word():
    assert piece_kinds(["Lists", " ="]).tolist() == [WORD_START, WORD_START]


def test_the_picture_draws_every_token_and_both_means():
    losses = np.array([3.0, 1.0, 0.5, 2.5, 1.0])          # targets 1 … 5 of N = 6 tokens
    kinds = np.array([WORD_START, WORD_REST, WORD_REST, WORD_START, SPACE])
    fig = draw_token_losses(losses, kinds, words=3)
    ax = fig.axes[0]
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == sorted(losses.tolist())
    means = sorted(line.get_ydata()[0] for line in ax.get_lines())
    assert np.allclose(means, [8.0 / 5, 8.0 / 2])          # L / (N − 1), L / (W − 1)
    assert "N − 1 = 5 tokens" in ax.get_title() and "W − 1 = 2 words" in ax.get_title()
    plt.close(fig)
