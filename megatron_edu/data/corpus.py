"""The text the end-to-end GPT learns from, available offline wherever Python runs.

The papers train on large web corpora (1909.08053 §4.1: Wikipedia, CC-Stories, RealNews,
OpenWebText; deduplicated, 174 GB). A laptop without internet has none of that, but every Python
installation carries a few MB of English written for people: the docstrings of its standard
library and the language reference topics behind `help()` (`pydoc_data.topics`). That is the
default corpus here, extracted once from CPython 3.11.7 (with `ast`: nothing is imported) and
shipped in the package as `default_corpus.txt.gz` (600 KB), so that every machine — whatever its
Python version — trains on the same documents, the same tokenizer and the same numbers. The text is
the Python Software Foundation's, under the PSF License Agreement
(`default_corpus.LICENSE.txt`, next to it). `write_default_corpus()` rebuilds the file from the
running Python.

Other sources, same shape (a list of documents, strings):
- `load_text_files(paths)`: local `.txt` files (one document per file) and `.jsonl` files (one
  document per line: its `text_field`, "text" by default, as most corpora on disk keep it), or
  folders of them;
- `load_wikitext103(split)`: WikiText-103 (Merity et al. 2016, arXiv 1609.07843, the corpus of
  1909.08053 §5.1's perplexity evaluation) through the optional `datasets` package, online only.

`load_corpus(source)` is the front door: "default", "wikitext103", or paths.
The cache helpers used by the whole `data` package (tokenizers, token files) live here too.
"""

from __future__ import annotations

import ast
import gc
import gzip
import hashlib
import json
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["resolve_cache_dir", "write_atomically", "documents_sha256", "default_corpus",
           "write_default_corpus", "stdlib_docstrings", "pydoc_topics", "load_text_files",
           "load_wikitext103", "load_corpus"]

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "megatron_edu"
DEFAULT_CORPUS_PATH = Path(__file__).with_name("default_corpus.txt.gz")
DEFAULT_CORPUS_SHA256 = (  # documents_sha256 of the shipped corpus: the same on every machine
    "e832f7179fad494a30cb5cc15a7b938212f1b0575bffae601eb708fd82166162"
)
_SEPARATOR = "\n\x1e\n"  # between documents; `_clean` splits lines at \x1e, so none holds one

# Tests and IDLE duplicate the library's own text; `encodings` holds ~100 generated codec
# modules with one boilerplate docstring each; `pydoc_data` is added below as clean topics.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
    | {"encodings", "pydoc_data"}
)
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_WIKITEXT_HINT = (
    "Offline, train on local text instead: --data PATH (a .txt or .jsonl file, or a folder of "
    "them), or keep the built-in default corpus."
)


# ---------------------------------------------------------------------------------------------
# The cache: one folder, files written atomically so that concurrent ranks never read half a file
# ---------------------------------------------------------------------------------------------


def resolve_cache_dir(cache_dir: str | Path | None) -> Path:
    """The cache folder to use: `cache_dir` if given, else ~/.cache/megatron_edu."""
    return Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a private temporary file, then rename it to `path` in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def documents_sha256(documents: Sequence[str]) -> str:
    """A fingerprint of a corpus: equal documents in equal order give the same hex digest."""
    digest = hashlib.sha256()
    for document in documents:
        data = document.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))  # length prefix: no two corpora collide
        digest.update(data)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# The default corpus: standard-library docstrings + Python reference topics
# ---------------------------------------------------------------------------------------------


def default_corpus(cache_dir: str | Path | None = None) -> list[str]:
    """The built-in corpus as a list of documents: Python's docs, read from the shipped file.

    The same documents on every machine and Python version (their `documents_sha256` is
    `DEFAULT_CORPUS_SHA256`). Reading takes a few hundredths of a second, so nothing is cached;
    `cache_dir` is accepted, like every data function's, and unused.
    """
    text = gzip.decompress(DEFAULT_CORPUS_PATH.read_bytes()).decode("utf-8")
    return text.split(_SEPARATOR)


def write_default_corpus(path: str | Path = DEFAULT_CORPUS_PATH) -> list[str]:
    """Extract the corpus from the running Python and write it to `path` (gzip, no timestamp,
    so the same documents give the same bytes); return the documents."""
    documents = stdlib_docstrings() + pydoc_topics()
    if any(_SEPARATOR.strip("\n") in document for document in documents):
        raise ValueError("a document holds the separator \\x1e")  # `_clean` makes it impossible
    data = gzip.compress(_SEPARATOR.join(documents).encode("utf-8"), compresslevel=9, mtime=0)
    write_atomically(Path(path), lambda tmp: tmp.write_bytes(data))
    return documents


def stdlib_docstrings(stdlib: str | Path | None = None) -> list[str]:
    """One document per standard-library module: its module, class and function docstrings."""
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    documents = []
    with _garbage_collector_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. SyntaxWarning on old escapes: stderr in notebooks
        for path in _python_files(root):
            try:
                tree = ast.parse(path.read_bytes(), filename=str(path))
            except (SyntaxError, ValueError):  # a file for another Python version, or bad bytes
                continue
            docstrings = [_clean(doc) for doc in _docstrings(tree)]
            if docstrings:
                documents.append("\n\n".join(docstrings))
    return documents


@contextmanager
def _garbage_collector_paused() -> Iterator[None]:
    """Halves the build time (3.2 s -> 1.6 s here, with torch loaded).

    Each syntax tree is ~10^5 new objects, which sets off the cyclic collector over the whole
    heap again and again; trees hold no reference cycles, so reference counting frees them.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _python_files(root: Path) -> Iterator[Path]:
    """Every .py file under `root` outside the skipped folders, in a sorted, stable order."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in _SKIP_DIRS)
        yield from (Path(folder) / name for name in sorted(files) if name.endswith(".py"))


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of `node` and of the statements nested in it, in source order.

    Only statements are descended into (not every expression, as `ast.walk` would): three
    times faster, and docstrings only ever sit on modules, classes and functions.
    """
    if isinstance(node, _DOCUMENTED):
        docstring = ast.get_docstring(node, clean=True)
        if docstring:
            yield docstring
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.stmt, ast.excepthandler)):
            yield from _docstrings(child)


def _clean(text: str) -> str:
    """Tabs to spaces, no trailing spaces, at most one blank line in a row, no outer blanks."""
    lines = [line.rstrip() for line in text.expandtabs(4).splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def pydoc_topics() -> list[str]:
    """The language reference topics that `help("if")` shows, one document each, sorted by key."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some slimmed-down Python builds drop pydoc_data
        return []
    return [_clean(topics[key]) for key in sorted(topics)]


# ---------------------------------------------------------------------------------------------
# Other sources: local text files and WikiText-103
# ---------------------------------------------------------------------------------------------


def load_text_files(paths: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """Documents from UTF-8 files: a .jsonl file's lines (each a JSON object, its ``text_field``
    the document), any other file whole; a folder stands for every .txt and .jsonl file below
    it, sorted, unless it is a Hugging Face dataset (``save_to_disk``'s folder), or ``hf:NAME``
    one on the hub (``_hf_dataset``). A ValueError names the file (and line, or row) of
    anything that is not text to train on."""
    if not paths:
        raise ValueError("no text files given: pass at least one .txt or .jsonl file or folder")
    return [document for path in paths for document in _documents(path, text_field)]


def _documents(path: str | Path, text_field: str) -> list[str]:
    if str(path).startswith("hf:") or any((Path(path) / name).is_file() for name in SAVED):
        return _hf_dataset(str(path), text_field)
    return [document for file in _text_files(Path(path))
            for document in _read_documents(file, text_field)]


SAVED = ("state.json", "dataset_dict.json")  # a Dataset's, a DatasetDict's save_to_disk folder


def _hf_dataset(source: str, text_field: str) -> list[str]:
    """The ``text_field`` column of a Hugging Face dataset — a folder ``save_to_disk`` wrote, or
    ``hf:NAME`` loaded from the hub — of its train split when it holds several; every row text."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--data {source} is a Hugging Face dataset: reading it needs the "
                         f"optional datasets package (pip install datasets)") from None
    try:
        data = (datasets.load_dataset(source[3:], split="train") if source.startswith("hf:")
                else datasets.load_from_disk(source))
    except Exception as error:  # datasets raises many types: network, hub, file system, ...
        raise ValueError(f"--data {source}: cannot load the dataset ({error})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"--data {source} holds the splits {sorted(data)}, none called train")
        data = data["train"]
    if text_field not in data.column_names:
        raise ValueError(f"--data {source} has no column {text_field!r} (its columns: "
                         f"{', '.join(data.column_names)}): name the text with --text-field")
    texts = data[text_field]
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)
                or not text.strip()), None)
    if bad is not None:
        raise ValueError(f"--data {source}: row {bad}'s {text_field!r} is "
                         f"{'empty' if isinstance(texts[bad], str) else 'not text'}")
    return list(texts)


def _text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"text data not found: {path}")
    if not path.is_dir():
        return [path]
    files = sorted(file for file in path.rglob("*") if file.suffix in (".txt", ".jsonl")
                   and file.is_file())
    if not files:
        raise ValueError(f"{path} is a folder with no .txt or .jsonl files in it")
    return files


def _read_documents(file: Path, text_field: str) -> list[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        reason = f"{error.reason} at byte {error.start}"
        raise ValueError(f"{file} is not UTF-8 text ({reason})") from None
    if not text.strip():
        raise ValueError(f"{file} is empty: it holds no text to train on")
    if file.suffix != ".jsonl":
        return [text]
    return [_field(file, i, line, text_field)
            for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def _field(file: Path, number: int, line: str, text_field: str) -> str:
    """The document of one JSON line: its ``text_field``, a non-empty string."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}:{number} is not JSON ({error.msg}): each line of a .jsonl "
                         f"file is one object") from None
    value = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(value, str) or not value.strip():
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{file}:{number} has no text in field {text_field!r} (its fields: "
                         f"{fields}): name the field with --text-field")
    return value


def load_wikitext103(split: str = "train", cache_dir: str | Path | None = None) -> list[str]:
    """WikiText-103 (raw), one document per Wikipedia article; needs `datasets` and internet.

    Any failure becomes one RuntimeError that says what is missing and what to do instead.
    """
    try:
        import datasets
    except ImportError:
        raise RuntimeError(
            "WikiText-103 needs the optional `datasets` package (pip install datasets) and "
            f"internet access the first time. {_WIKITEXT_HINT}"
        ) from None
    hf_cache = resolve_cache_dir(cache_dir) / "huggingface"
    try:
        rows = datasets.load_dataset(
            "Salesforce/wikitext", "wikitext-103-raw-v1", split=split, cache_dir=str(hf_cache)
        )["text"]
    except Exception as error:  # `datasets` raises many types: network, hub, file system, ...
        raise RuntimeError(
            f"could not load WikiText-103 split {split!r} ({type(error).__name__}: {error}). "
            f"Is this machine online? {_WIKITEXT_HINT}"
        ) from None
    return wikitext_articles(rows)


def wikitext_articles(lines: Sequence[str]) -> list[str]:
    """Group WikiText lines into articles: each starts at a top-level ` = Title = ` heading."""
    articles: list[list[str]] = []
    for line in lines:
        if re.fullmatch(r" = [^=].* = \n?", line) or not articles:
            articles.append([])
        articles[-1].append(line)
    return [text for text in ("".join(article).strip() for article in articles) if text]


def load_corpus(
    source: str | Path | Sequence[str | Path] = "default", cache_dir: str | Path | None = None,
    text_field: str = "text",
) -> list[str]:
    """Documents from `source`: "default" (built in), "wikitext103", or .txt/.jsonl file and
    folder paths (`text_field`: the .jsonl lines' field holding the text)."""
    if source == "default":
        return default_corpus(cache_dir)
    if source == "wikitext103":
        return load_wikitext103("train", cache_dir)
    paths = [source] if isinstance(source, (str, Path)) else list(source)
    return load_text_files(paths, text_field)

