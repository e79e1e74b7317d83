"""Each collective and each autograd operator against its definition, for 1, 2 and 4 ranks."""

import pytest
import torch
from helpers import Launches

from megatron_edu import comm
from megatron_edu.tensor_parallel.layers import serial_group

WORLD_SIZES = [1, 2, 4]


def _rank_tensor(shape=(2, 4)):
    """A different, known tensor on every rank: rank r holds base + 100·r."""
    r = comm.world().rank
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 100 * r


def _all_values(n):
    return [torch.arange(8, dtype=torch.float32).view(2, 4) + 100 * r for r in range(n)]


def _collectives():
    group = comm.world()
    x, seq = _rank_tensor(), _rank_tensor((2, 2 * group.size, 3))   # seq: [b, s, h]
    flat, mine = x.flatten(), slice(8 * group.rank, 8 * group.rank + 8)
    bucket = torch.cat([flat] * group.size)          # this rank's chunk of it: its own x
    return {
        "all_reduce": comm.all_reduce(x, group),
        "all_gather": comm.all_gather(x, group, dim=-1),
        "all_gather0": comm.all_gather(x, group, dim=0),
        "reduce_scatter": comm.reduce_scatter(torch.cat([x] * group.size, dim=-1), group),
        "all_gather_seq": comm.all_gather(seq, group, dim=1),
        "reduce_scatter_seq": comm.reduce_scatter(seq, group, dim=1),
        "all_gather_in_place": comm.all_gather(bucket[mine], group, 0, out=bucket).clone(),
        "reduce_scatter_out": comm.reduce_scatter(bucket, group, 0, out=torch.empty(8)),
        "broadcast": comm.broadcast(x.clone(), src=0, group=group),
        "input_unchanged": (x, seq),
    }


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_collectives_match_their_definitions(n):
    """Along any dimension (the sequence's, 1, of [b, s, h] too), and into a given buffer: a
    bucket gathered in place (each rank's chunk its own x), then reduce-scattered into another."""
    values = _all_values(n)
    total = sum(values)
    seqs = [torch.arange(12.0 * n).view(2, 2 * n, 3) + 100 * r for r in range(n)]
    for rank, out in enumerate(LAUNCHES[f"collectives-{n}"]):
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["all_gather"], torch.cat(values, dim=-1))
        assert torch.equal(out["all_gather0"], torch.cat(values, dim=0))
        assert torch.equal(out["reduce_scatter"], total)  # rank r's slice of cat([Σx]*n) is Σx
        assert torch.equal(out["all_gather_seq"], torch.cat(seqs, dim=1))
        assert torch.equal(out["reduce_scatter_seq"], sum(seqs).chunk(n, dim=1)[rank])
        assert torch.equal(out["all_gather_in_place"], torch.cat(values).flatten())
        assert torch.equal(out["reduce_scatter_out"], n * values[rank].flatten())  # Σ of n gathered
        assert torch.equal(out["broadcast"], values[0])
        assert torch.equal(out["input_unchanged"][0], values[rank])
        assert torch.equal(out["input_unchanged"][1], seqs[rank])


def _ring():
    group = comm.world()
    r, n = group.rank, group.size
    x = torch.full((3,), float(r))
    buf = torch.empty(3)
    pending = comm.isend(x, (r + 1) % n)
    comm.irecv(buf, (r - 1) % n).wait()
    pending[0].wait()
    blocking = torch.empty(3)
    if r == 0:
        comm.send(x + 10, 1)
    elif r == 1:
        comm.recv(blocking, 0)
    return buf, blocking


@pytest.mark.parametrize("n", [2, 4])
def test_point_to_point_moves_tensors_between_neighbours(n):
    out = LAUNCHES[f"ring-{n}"]
    for r in range(n):
        assert torch.equal(out[r][0], torch.full((3,), float((r - 1) % n)))
    assert torch.equal(out[1][1], torch.full((3,), 10.0))


_OPERATORS = {
    "f": comm.f, "g": comm.g, "gather": comm.gather, "scatter": comm.scatter,
    # along the last dimension here, so every operator works on the same [2, 4] tensors
    "all_gather_seq": lambda x, group: comm.all_gather_seq(x, group, dim=-1),
    "reduce_scatter_seq": lambda x, group: comm.reduce_scatter_seq(x, group, dim=-1),
}


def _autograd(op_name):
    x = _rank_tensor().requires_grad_()
    y = _OPERATORS[op_name](x, comm.world())
    weight = _rank_tensor(y.shape) * 0.01  # a different upstream gradient on each rank
    (y * weight).sum().backward()
    return y.detach(), x.grad, weight


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_f_is_identity_forward_and_all_reduce_backward(n):
    xs = _all_values(n)
    for rank, (y, grad, _) in enumerate(LAUNCHES[f"f-{n}"]):
        assert torch.equal(y, xs[rank])
        assert torch.allclose(grad, sum(x * 0.01 for x in xs))  # Σ of every rank's upstream grad


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_g_is_all_reduce_forward_and_identity_backward(n):
    xs = _all_values(n)
    for y, grad, w in LAUNCHES[f"g-{n}"]:
        assert torch.equal(y, sum(xs))
        assert torch.equal(grad, w)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gather_concatenates_forward_and_keeps_own_slice_backward(n):
    xs = _all_values(n)
    for rank, (y, grad, w) in enumerate(LAUNCHES[f"gather-{n}"]):
        assert torch.equal(y, torch.cat(xs, -1))
        assert torch.equal(grad, w.chunk(n, -1)[rank])


@pytest.mark.parametrize("n", [1, 2])  # 4 columns split into 1 or 2
def test_scatter_keeps_own_slice_forward_and_gathers_backward(n):
    out = LAUNCHES[f"scatter-{n}"]
    for rank, (y, grad, _) in enumerate(out):
        assert torch.equal(y, _all_values(n)[rank].chunk(n, -1)[rank])
        assert torch.equal(grad, torch.cat([w for _, _, w in out], -1))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_seq_reduce_scatters_the_gradient(n):
    xs = _all_values(n)
    out = LAUNCHES[f"all_gather_seq-{n}"]
    total_upstream = sum(w for _, _, w in out)
    for rank, (y, grad, _) in enumerate(out):
        assert torch.equal(y, torch.cat(xs, -1))
        assert torch.allclose(grad, total_upstream.chunk(n, -1)[rank])


@pytest.mark.parametrize("n", [1, 2])
def test_reduce_scatter_seq_sums_forward_and_gathers_backward(n):
    xs = _all_values(n)
    out = LAUNCHES[f"reduce_scatter_seq-{n}"]
    for rank, (y, grad, _) in enumerate(out):
        assert torch.equal(y, sum(xs).chunk(n, -1)[rank])
        assert torch.equal(grad, torch.cat([w for _, _, w in out], -1))


def _recorded():
    group = comm.world()
    x = torch.zeros(4, 8)  # 128 bytes
    with comm.record() as log:
        comm.all_reduce(x, group, label="grads")
        comm.all_gather(x, group)
        comm.reduce_scatter(x, group)
        y = comm.g(comm.f(x.requires_grad_(), group), group)
        y.sum().backward()
    return log


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_recorder_counts_calls_and_bytes(n):
    log = LAUNCHES[f"recorded-{n}"][0]
    if n == 1:
        assert log.events == []  # a group of one communicates nothing
        return
    assert log.count() == 5
    assert log.count("all_reduce") == 3
    assert log.total_bytes("all_reduce", label="grads") == 128
    assert log.total_bytes("all_gather") == 128 * n  # the gathered output
    assert log.total_bytes("reduce_scatter") == 128  # the reduced input
    assert [e.label for e in log.select("all_reduce")] == ["grads", "g forward", "f backward"]
    ring = log.select(label="grads")[0].wire_bytes
    assert ring == pytest.approx(2 * (n - 1) / n * 128)


def _outside_a_record_block():
    with comm.record() as log:
        pass
    comm.all_reduce(torch.ones(1), comm.world())
    return log.count()


def test_nothing_is_recorded_outside_a_record_block():
    assert LAUNCHES["outside-a-record-block"] == [0, 0]


def test_a_group_of_one_is_rank_0_without_torch_distributed():
    assert serial_group().rank == comm.CommGroup("pp", (5,)).rank == 0


# --- the runs above: one launch per world size --------------------------------------------------

LAUNCHES = Launches({  # name -> (world size, function, arguments)
    **{f"collectives-{n}": (n, _collectives, ()) for n in WORLD_SIZES},
    **{f"ring-{n}": (n, _ring, ()) for n in (2, 4)},
    **{f"{op}-{n}": (n, _autograd, (op,)) for op in ("f", "g", "gather", "all_gather_seq")
       for n in WORLD_SIZES},
    **{f"{op}-{n}": (n, _autograd, (op,)) for op in ("scatter", "reduce_scatter_seq")
       for n in (1, 2)},   # 4 columns split into 1 or 2
    **{f"recorded-{n}": (n, _recorded, ()) for n in WORLD_SIZES},
    "outside-a-record-block": (2, _outside_a_record_block, ()),
})
