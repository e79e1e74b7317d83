"""The papers' reported figures, shipped as csv in ``docs/papers/``, read into numbers and models.

2104.04473_table1.csv                 Narayanan et al. 2021, Table 1: the weak-scaling GPTs, 1.7B
                                      to 1T parameters, and their measured throughput
1909.08053_configs.csv                Shoeybi et al. 2019, Tables 1–2: the model sizes
megatron_core_activation_bytes.csv    megatron-core's own transformer layer: the bytes it saves
                                      for backward, by recomputation and sequence parallelism

Each file starts with '#' lines: where the numbers come from, then the column names.
"""

from __future__ import annotations

import csv
from pathlib import Path

from megatron_edu.model.config import GPTConfig

__all__ = ["PAPERS_DIR", "read_paper_table", "table1_config", "megatron_core_activation_bytes"]

PAPERS_DIR = Path(__file__).resolve().parents[2] / "docs" / "papers"  # in a source checkout

TABLE1_VOCAB, TABLE1_SEQ_LEN = 51200, 2048  # 2104.04473 §5.1


def read_paper_table(path: str | Path) -> list[dict[str, float | str]]:
    """Rows of a docs/papers csv (a path, or a file name in ``PAPERS_DIR``), numbers as floats;
    the column names are its last '#' line before the data."""
    path = Path(path)
    if not path.exists() and path.parent == Path():
        path = PAPERS_DIR / path
    lines = path.read_text().splitlines()
    header = [x for x in lines if x.startswith("#")][-1].lstrip("# ").split(",")
    rows = csv.DictReader([x for x in lines if not x.startswith("#")], fieldnames=header)
    return [{k: _number(v) for k, v in row.items()} for row in rows]


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def table1_config(row: dict[str, float | str]) -> GPTConfig:
    """A 2104.04473 Table 1 row as a model: vocabulary 51,200, sequence 2048, trained with full
    activation recomputation (§5.1)."""
    return GPTConfig(vocab_size=TABLE1_VOCAB, seq_len=TABLE1_SEQ_LEN,
                     num_layers=int(row["layers"]), hidden=int(row["hidden"]),
                     num_heads=int(row["heads"]), recompute="full")


def megatron_core_activation_bytes(
    path: str | Path = "megatron_core_activation_bytes.csv",
) -> dict[tuple[str, bool], int]:
    """Bytes megatron-core's transformer layer saves for backward per tensor rank, keyed
    (recompute, sequence_parallel); the csv's header says which layer and how it was measured."""
    return {(str(row["recompute"]), row["sequence_parallel"] == "on"): int(row["bytes"])
            for row in read_paper_table(path)}
