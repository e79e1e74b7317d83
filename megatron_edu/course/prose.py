"""How much each notebook asks a learner to read: words of prose and words a sentence.

    python -m megatron_edu.course.prose [NOTEBOOKS]      # the table, one row per notebook

The course keeps each notebook to one idea in plain words: at most ``MAX_WORDS`` words of prose
and sentences of at most ``MAX_SENTENCE`` words on average (``tests/test_course_prose.py``).

Prose is what the markdown cells say. Code blocks, display math, tables and images are not
prose: they are read differently, and a table of numbers is not a long sentence. A word is a run
of letters or digits, joined by an apostrophe, a hyphen or a dot ("1F1B", "column-then-row",
"1909.08053"); inline code counts as the words it holds. A sentence ends at ".", "!" or "?"
before a space, at a paragraph's end, and at each list item or heading, which are read as
sentences of their own; "e.g." and "et al." end nothing.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_WORDS", "MAX_SENTENCE", "Prose", "prose_of", "measure", "table"]

MAX_WORDS = 2000
MAX_SENTENCE = 25

_NOT_PROSE = [re.compile(p, flags) for p, flags in (
    (r"```.*?```", re.S),                 # code blocks
    (r"\$\$.*?\$\$", re.S),               # display math
    (r"^[ \t]*\|.*$", re.M),              # table rows
    (r"<img[^>]*>|!\[[^\]]*\]\([^)]*\)", 0),  # images
    (r"\]\([^)]*\)", 0),                   # link targets (the link's text stays)
)]
_ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|et al|etc|cf|vs|Fig|Eq|Sec|approx)\.", re.I)
_WORD = re.compile(r"[A-Za-z0-9]+(?:['’.\-][A-Za-z0-9]+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'”*_]*\s+|\n\s*\n|\n(?=\s*(?:[-*+] |\d+\. |#))")


@dataclass(frozen=True)
class Prose:
    """One notebook's prose: its words and its sentences."""

    name: str
    words: int
    sentences: int

    @property
    def per_sentence(self) -> float:
        return self.words / max(self.sentences, 1)

    @property
    def within(self) -> bool:
        return self.words <= MAX_WORDS and self.per_sentence <= MAX_SENTENCE


def prose_of(markdown: str) -> str:
    """A markdown cell's prose: the cell less its code blocks, display math, tables and images."""
    for pattern in _NOT_PROSE:
        markdown = pattern.sub(" ", markdown)
    return _ABBREVIATIONS.sub(lambda m: m[1], markdown)


def measure(path: Path) -> Prose:
    """The words and sentences of a notebook's markdown cells."""
    cells = json.loads(path.read_text())["cells"]
    text = "\n\n".join(prose_of("".join(c["source"])) for c in cells
                         if c["cell_type"] == "markdown")
    sentences = [s for s in _SENTENCE_END.split(text) if _WORD.search(s)]
    return Prose(path.name, len(_WORD.findall(text)), len(sentences))


def table(folder: Path) -> str:
    """Every numbered notebook's words, sentences and words a sentence, flagged when over."""
    rows = [f"{'notebook':<52} {'words':>6} {'sentences':>9} {'a sentence':>10}"]
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        p = measure(path)
        flag = "" if p.within else "   over"
        rows.append(f"{p.name:<52} {p.words:>6} {p.sentences:>9} {p.per_sentence:>10.1f}{flag}")
    rows.append(f"bounds: at most {MAX_WORDS} words, {MAX_SENTENCE} words a sentence on average")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "notebooks")))
