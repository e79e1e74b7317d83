"""``python -m bench``: every benchmark (see bench/run_all.py and bench/README.md)."""

from bench.run_all import main

main()
