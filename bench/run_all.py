"""Run every benchmark, one after the other, and print a summary table.

    python -m bench                          # (a)-(e), (g)-(j) on this machine's CPU, ~7 minutes
    python bench/run_all.py                  # the same
    python -m bench --only a e               # a subset
    python -m bench --device cuda --dtype bf16   # (a), (e), (g) (a 350M GPT), (j) on one GPU

Each benchmark also appends its records to bench/results.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (  # noqa: E402
    bubble,
    fused,
    mfu,
    moe,
    overhead,
    pp_pipelining,
    ring_attention,
    tp_dtensor,
    zero3_fsdp,
)

# these take --device/--dtype/--threads:
SINGLE_PROCESS = {"a": overhead, "e": mfu, "g": fused, "j": moe}
# gloo, several processes:
CPU_ONLY = {"b": tp_dtensor, "c": pp_pipelining, "d": bubble, "h": ring_attention,
            "i": zero3_fsdp}
MET = {True: "yes", False: "NO", None: "-"}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted({**SINGLE_PROCESS, **CPU_ONLY}),
                        default=sorted({**SINGLE_PROCESS, **CPU_ONLY}))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", default="1")
    args = parser.parse_args(argv)
    device_args = ["--device", args.device, "--dtype", args.dtype, "--threads", args.threads]
    records = []
    for key in args.only:
        if key in CPU_ONLY and args.device != "cpu":
            print(f"({key}) skipped: a multi-process CPU (gloo) benchmark")
            continue
        result = (SINGLE_PROCESS[key].main(device_args) if key in SINGLE_PROCESS
                  else CPU_ONLY[key].main([]))
        records += result if isinstance(result, list) else [result]
        print()
    print_summary(records)
    return records


def print_summary(records: list[dict]) -> None:
    print(f"{'benchmark':<28}{'metric':<32}{'median':>8}  {'middle half':<17}{'target':<25}met")
    for r in records:
        half = f"{r['q25']:.3f}–{r['q75']:.3f}"
        print(f"{r['bench']:<28}{r['metric']:<32}{r['median']:>8.3f}  {half:<17}"
              f"{r['target']:<25}{MET[r['met']]}")


if __name__ == "__main__":
    main()
