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


# --- the core reads on its own -----------------------------------------------------------------

CORE = ("launch", "grid", "comm", "context_parallel", "expert_parallel", "tensor_parallel", "model",
        "pipeline", "data_parallel", "optim", "ptdp", "timing")
ALIASES = {"megatron_edu.model.hf"}  # kept for its callers: Hugging Face I/O is megatron_edu.hf


def _in_core(module: str) -> bool:
    """The package's root (a docstring, importing nothing) or one of the core's modules."""
    return module == "megatron_edu" or module.split(".")[1] in CORE


def test_the_core_imports_nothing_outside_it():
    """The parallelism (launch … ptdp) never reaches into the course, perf or the end-to-end
    run: a learner reading it meets nothing else."""
    modules = _modules()
    outside = {f"{name} → {dep}" for name, path in modules.items()
               if _in_core(name) and name not in ALIASES
               for dep in _imports(name, path, modules) if not _in_core(dep)}
    assert not outside, sorted(outside)


# --- nothing silently chooses where a stage lives ---------------------------------------------

def _functions() -> list[tuple[str, ast.FunctionDef]]:
    return [(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}", node)
            for path in ROOT.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_function_takes_a_placement():
    """Where a chunk lives is the schedule's StageMap; no function takes it as an argument
    (a defaulted string once silently picked the wrong placement)."""
    takes = [where for where, node in _functions()
             for arg in [*node.args.args, *node.args.kwonlyargs] if arg.arg == "placement"]
    assert not takes, takes


# --- every public name says what it is --------------------------------------------------------

def _public(tree: ast.Module) -> list[ast.AST]:
    return [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)
            and not node.name.startswith("_")]


def test_every_module_has_a_docstring_and_an_all():
    missing = [str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")
               if not ast.get_docstring(tree := ast.parse(path.read_text()))
               or (_public(tree) and not any(isinstance(n, ast.Assign) and any(
                   isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
                   for n in tree.body))]
    assert not missing, missing


def test_every_public_function_class_and_forward_has_a_docstring():
    missing = []
    for path in ROOT.rglob("*.py"):
        for node in _public(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"
            if not ast.get_docstring(node):
                missing.append(where)
            if isinstance(node, ast.ClassDef):
                missing += [f"{where}.forward" for item in node.body
                            if isinstance(item, ast.FunctionDef) and item.name == "forward"
                            and not ast.get_docstring(item)]
    assert not missing, missing
