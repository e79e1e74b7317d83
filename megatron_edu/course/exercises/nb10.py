"""Checkers for notebook 10 (activation memory, recomputation, sequence parallelism).

10.1 ★    the activation bytes of one transformer layer (2205.05198 Table 2)

10.1 is checked in this process against ``megatron_edu.perf.activation_bytes_per_layer`` over a
grid of shapes, tensor-parallel sizes and modes. Typical wrong answers — the 10·s·b·h not divided
by t under sequence parallelism, selective recomputation dropping the 34 term instead of the
5·a·s/h one, elements instead of bytes, t missing from the attention term — are named.
"""

from __future__ import annotations

import itertools

from megatron_edu.course.exercises.checking import Hint, exercise
from megatron_edu.model import GPTConfig
from megatron_edu.perf import activation_bytes_per_layer

__all__ = ["CASES"]  # the checkers register themselves (``@exercise``)

CASES = [(s, b, h, a, t) for s, b, h, a in [(128, 2, 128, 8), (2048, 1, 12288, 96)]
         for t in (1, 2, 4, 8)]


def _reference(s: int, b: int, h: int, a: int, t: int, sp: bool, selective: bool) -> int:
    """The package's per-layer activation bytes (fp16) for that shape and mode."""
    config = GPTConfig(vocab_size=512, seq_len=s, num_layers=1, hidden=h, num_heads=a,
                       recompute="selective" if selective else "none", sequence_parallel=sp)
    return activation_bytes_per_layer(config, b, tp=t, bytes_per_value=2)


def _hint(s, b, h, a, t, sp, selective, got) -> None:
    """Raise the hint naming the mistake that gives ``got``, if it is a known one."""
    sbh, core = s * b * h, 5 * a * s * s * b
    want = _reference(s, b, h, a, t, sp, selective)
    if abs(got - want / 2) < 1:
        raise Hint("the answer is half the bytes: you counted elements; Table 2 is in bytes "
                   "(fp16 activations: 2 bytes each, the dropout masks 1)")
    if sp and abs(got - (10 * sbh + 24 * sbh / t + (0 if selective else core / t))) < 1:
        raise Hint("with sequence parallelism the 10·s·b·h (layer norms, dropouts, their inputs) "
                   "is split t ways too: sbh·34/t")
    if selective and abs(got - (want + core / t - (10 + 24 / t if not sp else 34 / t) * sbh)) < 1:
        raise Hint("selective recomputation drops the attention core's 5·a·s/h term, not the 34: "
                   "it keeps 34·s·b·h (÷ t as the mode splits it)")
    if not selective and t > 1 and abs(got - (want - core / t + core)) < 1:
        raise Hint("the 5·a·s/h term is not divided by t: tensor parallelism splits the heads, so "
                   "each rank keeps 5·a·s²·b/t")


@exercise("10.1", "the activation bytes of one transformer layer",
          reference=(activation_bytes_per_layer,))
def check_layer_bytes(fn) -> str:
    """fn(s, b, h, a, t, sequence_parallel, selective) against perf.memory over a grid."""
    for (s, b, h, a, t), sp, selective in itertools.product(CASES, (False, True), (False, True)):
        got = fn(s, b, h, a, t, sp, selective)
        want = _reference(s, b, h, a, t, sp, selective)
        if abs(got - want) > 1e-6 * want:
            _hint(s, b, h, a, t, sp, selective, got)
            raise Hint(f"s={s}, b={b}, h={h}, a={a}, t={t}, sequence_parallel={sp}, "
                       f"selective={selective}: {got:,.0f} bytes, expected {want:,} — see "
                       "2205.05198 Table 2")
    return (f"Table 2's bytes match perf.memory for {len(CASES) * 4} cases "
            "(t = 1…8, with and without sequence parallelism and selective recomputation).")


