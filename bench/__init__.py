"""Benchmarks of megatron-edu against plain PyTorch and PyTorch's own TP/PP (see README.md).

Not tests: each measures a ratio side by side in one run and appends it to results.jsonl.
"""
