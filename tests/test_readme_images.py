"""What a visitor sees before installing: the README's pictures exist; `make lab`'s kernel is the
notebooks' kernel. (The pictures are taken by `make screenshots`; `make test-browser` runs the
notebooks in a browser. This file needs neither.)"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9]*.ipynb"))


def _readme_images() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)", text) + re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"",
                                                                      text)


def test_the_readme_shows_pictures_of_the_notebooks():
    assert any(src.startswith("docs/images/") for src in _readme_images())


@pytest.mark.parametrize("src", _readme_images())
def test_every_picture_the_readme_shows_exists_and_is_small(src):
    path = ROOT / src
    assert path.is_file(), f"README.md shows {src}, which does not exist (make screenshots)"
    if src.endswith(".png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{src} is not a PNG"
        assert path.stat().st_size <= 100_000, f"{src}: {path.stat().st_size} bytes, over 100 KB"


def _make_lab_kernel() -> str:
    makefile = (ROOT / "Makefile").read_text()
    (name,) = re.findall(r"ipykernel install --sys-prefix --name (\S+)", makefile)
    assert re.search(r"^lab: kernel\b", makefile, re.M), "make lab must install the kernel"
    return name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_each_notebook_asks_for_the_kernel_make_lab_installs(path):
    spec = json.loads(path.read_text())["metadata"]["kernelspec"]
    assert spec["name"] == _make_lab_kernel(), f"{path.name}: kernelspec {spec}"
