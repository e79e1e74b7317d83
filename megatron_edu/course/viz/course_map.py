"""The course map: which notebook needs which, read from the notebooks themselves.

Every notebook opens with a "**Before this** — notebooks 04 (…) and 08 (…); …" line.
``prerequisites`` reads those lines, ``draw_course_map`` draws the notebooks as boxes in columns
by depth (the longest chain of prerequisites before each) with an arrow from each notebook to
those that need it directly (implied arrows left out: 00 → 03 goes through 01 and 02). The map
cannot drift from the notebooks: it is drawn from what they say. Nor can a line miss what its
notebook uses: ``imported_from`` finds, for each notebook, the earlier notebooks that first
imported a package name it imports, and ``tests/test_viz_course_map.py`` holds every "Before
this" line to reach them.

    python -m megatron_edu.course.viz.course_map notebooks docs/images/course_map.png
"""

from __future__ import annotations

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt

__all__ = ["needs", "prerequisites", "imported_from", "titles", "reachable", "direct", "depths",
           "draw_course_map"]

_BEFORE = re.compile(r"\*\*Before this\*\*\s*—\s*(.*?)(?:\n\n|$)", re.S)
# "04", "01–03" — not the 01 of "exercise 01.2", nor a section "§3"
_NUMBERS = re.compile(r"(?<![\d.§])(\d\d)(?:\s*[–-]\s*(\d\d))?(?![\d.])")


def needs(line: str) -> set[int]:
    """The notebooks a "Before this" line names: every NN and NN–MM in it; none if it begins
    "no other notebook" (its parenthesis then only points at related reading)."""
    if line.startswith("no other notebook"):
        return set()
    found: set[int] = set()
    for first, last in _NUMBERS.findall(line):
        found.update(range(int(first), int(last or first) + 1))
    return found


def _notebooks(folder: Path) -> list[tuple[int, dict]]:
    return [(int(path.name[:2]), json.loads(path.read_text()))
            for path in sorted(folder.glob("[0-9][0-9]_*.ipynb"))]


def prerequisites(folder: Path | str) -> dict[int, set[int]]:
    """Notebook number → the notebooks its "Before this" line names. A ValueError for a notebook
    without one, or naming itself or a later notebook's number that does not exist."""
    books = _notebooks(Path(folder))
    numbers = {n for n, _ in books}
    out = {}
    for n, nb in books:
        text = "\n\n".join("".join(c["source"]) for c in nb["cells"][:3]
                           if c["cell_type"] == "markdown")
        match = _BEFORE.search(text)
        if match is None:
            raise ValueError(f"notebook {n:02d} has no '**Before this** — …' line")
        out[n] = needs(match.group(1))
        if n in out[n] or not out[n] <= numbers:
            raise ValueError(f"notebook {n:02d} needs {sorted(out[n])}: itself, or a notebook "
                             f"that is not in {folder}")
    return out


def _imports(notebook: dict) -> set[str]:
    """The package's names a notebook imports ("megatron_edu.model.GPT"); the course's own
    helpers (checkers, pictures) are not what a notebook teaches, and are left out."""
    names = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                           if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_edu"):
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if not name.startswith("megatron_edu.course")}


def imported_from(folder: Path | str) -> dict[int, set[int]]:
    """Notebook number → the earlier notebooks that first imported a name it imports: what its
    "Before this" line must reach."""
    first: dict[str, int] = {}
    out = {}
    for n, nb in _notebooks(Path(folder)):
        names = _imports(nb)
        out[n] = {first[name] for name in names if name in first}
        first.update({name: n for name in names if name not in first})
    return out


def titles(folder: Path | str) -> dict[int, str]:
    """Notebook number → its title ("# 07 — 3D parallelism: …" gives "3D parallelism")."""
    out = {}
    for n, nb in _notebooks(Path(folder)):
        first = "".join(nb["cells"][0]["source"]).splitlines()[0]
        title = first.split("—", 1)[-1].strip()
        out[n] = re.split(r"[:(]", title)[0].strip()
    return out


def depths(prereqs: dict[int, set[int]]) -> dict[int, int]:
    """The longest chain of prerequisites before each notebook (0: needs none)."""
    out: dict[int, int] = {}

    def depth(n: int, path: tuple[int, ...] = ()) -> int:
        if n in path:
            raise ValueError(f"the prerequisites go round in a circle: {path + (n,)}")
        if n not in out:
            out[n] = 1 + max((depth(m, path + (n,)) for m in prereqs[n]), default=-1)
        return out[n]

    for n in prereqs:
        depth(n)
    return out


def reachable(prereqs: dict[int, set[int]], n: int) -> set[int]:
    """Every notebook that notebook ``n`` builds on, directly or through a chain."""
    seen, todo = set(), list(prereqs[n])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(prereqs[m])
    return seen


def direct(prereqs: dict[int, set[int]]) -> set[tuple[int, int]]:
    """The arrows (before, after) that no longer chain of prerequisites implies."""
    return {(m, n) for n in prereqs for m in prereqs[n]
            if not any(m in reachable(prereqs, k) for k in prereqs[n] if k != m)}


def draw_course_map(prereqs: dict[int, set[int]], names: dict[int, str]):
    """The notebooks in columns by depth, an arrow for each direct prerequisite."""
    depth, arrows = depths(prereqs), direct(prereqs)
    columns: dict[int, list[int]] = {}
    for n in sorted(prereqs):
        columns.setdefault(depth[n], []).append(n)
    rows = max(len(c) for c in columns.values())
    where: dict[int, tuple[int, float]] = {}
    for d in sorted(columns):             # each column ordered by where its arrows come from
        def height(n: int) -> float:
            ys = [where[m][1] for m, k in arrows if k == n]
            return -sum(ys) / len(ys) if ys else n
        column = sorted(columns[d], key=height)
        where.update({n: (d, rows - 1 - i - (rows - len(column)) / 2)
                      for i, n in enumerate(column)})
    fig, ax = plt.subplots(figsize=(1.45 * len(columns) + 0.4, 0.95 * rows + 0.7))
    w, h = 1.7, 0.72
    for before, after in sorted(arrows):
        (x0, y0), (x1, y1) = where[before], where[after]
        ax.annotate("", xy=(x1 * 2 - w / 2, y1), xytext=(x0 * 2 + w / 2, y0),
                    arrowprops=dict(arrowstyle="->", color="0.5", lw=0.8, shrinkA=0, shrinkB=1,
                                    connectionstyle="arc3,rad=0.06"), zorder=0)
    for n, (x, y) in where.items():
        ax.add_patch(plt.Rectangle((x * 2 - w / 2, y - h / 2), w, h, facecolor="#e8eef7",
                                   edgecolor="0.35", lw=0.8))
        label = textwrap.fill(f"{n:02d} {names.get(n, '')}", 19, max_lines=3, placeholder=" …")
        ax.text(x * 2, y, label, ha="center", va="center", fontsize=7.5)
    ax.set(xlim=(-1, 2 * len(columns) - 1), ylim=(-0.55, rows - 0.45))
    ax.set_title("The course map: an arrow from a notebook to each that builds on it directly "
                 "(from the notebooks' 'Before this')", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_edu.course.viz.course_map NOTEBOOKS OUT.png"""
    folder, out = (argv if argv is not None else sys.argv[1:]) or ["notebooks",
                                                                  "docs/images/course_map.png"]
    fig = draw_course_map(prerequisites(folder), titles(folder))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
