"""PTD-P with a zero-bubble schedule (2401.10241): W, not B, accumulates the weights' gradients,
so the data-parallel all-reduces, the tied embedding's sum and clipping see the same gradients —
the serial model's optimizer steps, as with 1F1B."""

import pytest
from test_ptdp import STEPS, _check_equal_to_serial, _options, _ptdp, serial  # noqa: F401

from megatron_edu.launch import run


@pytest.mark.parametrize(("tp", "pp", "dp", "overrides"), [
    (1, 2, 2, dict(schedule="zb-h1", num_microbatches=4)),
    (2, 2, 1, dict(schedule="zb-h2", num_microbatches=4)),
    (1, 2, 2, dict(schedule="zb-h1", zero1=True, bucket_mb=0.01)),
], ids=["zb-h1-dp2", "zb-h2-tp2", "zb-h1-zero1-buckets"])
def test_zero_bubble_schedules_take_the_serial_steps(serial, tp, pp, dp, overrides):  # noqa: F811
    out = run(_ptdp, tp * pp * dp, tp, pp, dp, _options(**overrides))
    _check_equal_to_serial(serial, out)


def test_dp_gradients_are_all_reduced_once_per_step_after_the_last_w():
    # grad_sync wraps each W; the chunk's last W launches the bucket's all-reduce
    out = run(_ptdp, 4, 1, 2, 2, _options(schedule="zb-h1", num_microbatches=4, bucket_mb=1e6))
    for *_, log in out:
        assert log.count("all_reduce", group="dp", label="dp grads") == STEPS  # one bucket
