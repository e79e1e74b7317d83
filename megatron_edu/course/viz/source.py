"""Read the code: a notebook shows the package's own implementation beside what it just ran.

``show_source(comm.f, comm._F)`` prints each object's source under a header naming its file, so a
learner reads the real code next to its test — not a simplified copy that could drift from it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

__all__ = ["show_source"]

_PACKAGE = Path(__file__).resolve().parents[2]  # megatron_edu/


def show_source(*objects: object) -> None:
    """Print the source of each function, class or method, headed by its file and name."""
    for i, obj in enumerate(objects):
        obj = inspect.unwrap(obj)  # a decorated function (@torch.no_grad()): the original
        path = Path(inspect.getsourcefile(obj)).resolve()
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
        where = path.relative_to(_PACKAGE.parent) if path.is_relative_to(_PACKAGE) else path.name
        print(("\n" if i else "") + f"# {where}: {name}")
        print(inspect.getsource(obj).rstrip())
