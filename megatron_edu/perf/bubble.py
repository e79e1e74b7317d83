"""The papers' pipeline bubbles as formulas, to set beside what ``pipeline.simulate`` plays.

References: Narayanan et al. 2021, arXiv 2104.04473 §2.2.1 (t_pb / t_id = (p − 1)/m for GPipe and
1F1B) and §2.2.2 ((p − 1)/(v·m) interleaved); Qi et al. 2023, arXiv 2401.10241 §2.3, Table 2 (the
bubble sizes of 1F1B, ZB-H1 and ZB-H2 in t_F, t_B and t_W). Exact ``Fraction``s, as the simulator's
times are, so the two are compared with ``==``.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["bubble_formula", "bubble_size_formula", "BUBBLE_SIZE_WEIGHTS"]


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """The paper's bubble fraction: (p − 1)/m (§2.2.1), or (p − 1)/(v·m) interleaved (§2.2.2)."""
    return Fraction(p - 1, (v if name == "interleaved" else 1) * m)


# 2401.10241 §2.3, Table 2: bubble size = (p − 1)·(t_F + t_B + k·t_W), k per schedule
BUBBLE_SIZE_WEIGHTS = {"1f1b": 1, "zb-h1": -1, "zb-h2": -2}


def bubble_size_formula(name: str, p: int, forward_time, backward_time, weight_time) -> Fraction:
    """2401.10241 §2.3, Table 2: the bubble size of 1F1B (p − 1)(t_F + t_B + t_W), of ZB-H1
    (p − 1)(t_F + t_B − t_W) and of ZB-H2 (p − 1)(t_F + t_B − 2·t_W). The handcrafted schedules
    assume t_W ≤ t_F (§2.3: t_W < t_F < t_B for a transformer layer); ZB-H2 needs m ≥ 2p − 1."""
    if name not in BUBBLE_SIZE_WEIGHTS:
        raise ValueError(f"2401.10241 states the bubble size of {sorted(BUBBLE_SIZE_WEIGHTS)}, "
                         f"not of {name!r}")
    t_f, t_b, t_w = (Fraction(t) for t in (forward_time, backward_time, weight_time))
    return (p - 1) * (t_f + t_b + BUBBLE_SIZE_WEIGHTS[name] * t_w)
