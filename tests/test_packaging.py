"""The package installs what it needs, and the repository stands on its own."""

import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the package itself needs 3.10

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def _pyproject_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        names |= {_name(r) for r in extra}
    return names


def _environment_pip_names() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    entries = [line.strip()[2:] for line in lines[start + 1:] if line.startswith("      - ")]
    return {_name(e) for e in entries if not e.startswith("-e")}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    assert _environment_pip_names() == _pyproject_names()


def test_environment_yml_installs_the_package_itself():
    assert "      - -e ." in (ROOT / "environment.yml").read_text().splitlines()


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_no_tracked_file_names_a_path_outside_the_repository():
    """The repository stands alone: a relative path in any tracked file ("../x/y") resolves,
    from that file's folder, to somewhere inside it — a user has nothing beside their clone."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    outside = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file():
            continue
        for found in re.finditer(r"(?:\.\./)+[\w.-]+", path.read_text(errors="ignore")):
            if not (path.parent / found[0]).resolve().is_relative_to(ROOT):
                outside.append(f"{name}: {found[0]}")
    assert outside == []
