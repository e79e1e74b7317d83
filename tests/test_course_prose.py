"""One idea per notebook, in plain words: every notebook's prose within the course's bounds
(``megatron_edu/course/prose.py``), and the counting itself on text whose counts are known."""

from pathlib import Path

from megatron_edu.course.prose import MAX_SENTENCE, MAX_WORDS, measure, prose_of, table

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_every_notebook_is_within_the_words_and_the_words_a_sentence(capsys):
    with capsys.disabled():
        print("\n" + table(NOTEBOOKS))
    measured = [measure(path) for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))]
    assert len(measured) >= 20 and all(p.words > 500 for p in measured)   # prose was found
    over = [p for p in measured if p.words > MAX_WORDS or p.per_sentence > MAX_SENTENCE]
    assert over == [], f"over {MAX_WORDS} words or {MAX_SENTENCE} words a sentence: {over}"


def _notebook(tmp_path: Path, *markdown: str) -> Path:
    import json

    cells = [{"cell_type": "markdown", "metadata": {}, "source": [m]} for m in markdown]
    cells.append({"cell_type": "code", "metadata": {}, "source": ["x = 1  # not prose at all"],
                  "outputs": [], "execution_count": None})
    path = tmp_path / "00_x.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_words_and_sentences_are_counted_as_a_reader_meets_them(tmp_path):
    path = _notebook(
        tmp_path,
        "# 00 — Title\n\nThe 1F1B schedule, e.g. Figure 4, keeps p − r microbatches (§2.2.1). "
        "It is column-then-row!\n\n- one item\n- another item here",
        "Code and tables are not prose:\n\n```python\nprint('many words in a code block')\n```\n\n"
        "| a | table | row |\n|---|---|---|\n\n$$x = y + z$$\n\n![a figure](images/fig.png)")
    counted = measure(path)
    # "00 Title" / "The 1F1B schedule e.g Figure 4 keeps p r microbatches 2.2.1" / "It is
    # column-then-row" / "one item" / "another item here" / "Code and tables are not prose"
    assert (counted.words, counted.sentences) == (2 + 11 + 3 + 2 + 3 + 6, 6)
    assert counted.per_sentence == 27 / 6


def test_code_math_tables_and_link_targets_are_not_prose():
    assert prose_of("```\nlots of code\n```").split() == []
    assert prose_of("| a | b |").split() == []
    assert prose_of("see [the paper](https://arxiv.org/abs/2104.04473)").split() == [
        "see", "[the", "paper"]
    assert prose_of("![Figure 3](images/fig.png)").split() == []
