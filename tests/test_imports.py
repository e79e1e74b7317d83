"""The package's modules import each other without a cycle: each can be read (and loaded) after
the ones it imports, none halfway through another.

The graph, read from the source with ``ast`` (no module is executed):

* a node per module of ``megatron_edu``; a package is its ``__init__.py``;
* ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import x`` (or its relative spelling) is
  an edge to the package or module ``a.b`` — its ``__init__`` runs — and, when ``a.b.x`` is a
  module, to ``a.b.x`` too;
* every import counts, at the top of a file or inside a function (a deferred import that closes
  a cycle is still a cycle);
* Python's own loading of a module's parent packages is not an edge: a package ``__init__`` may
  import its submodules, as long as none of them imports that ``__init__`` back (``from
  megatron_edu.model import fused`` inside ``megatron_edu/model/`` would: it names the package).
"""

import ast
import graphlib
from pathlib import Path

import megatron_edu

ROOT = Path(megatron_edu.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # from . import x, from ..a import b
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def test_the_import_graph_of_the_package_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "megatron_edu.model.gpt" in graph["megatron_edu.model"]      # the edges are read
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"import cycle: {' → '.join(error.args[1])}") from None
