"""Every collective the package uses, in one place that can count them (``record()``).

Plain collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send``,
``recv``, ``batch_isend_irecv``, ...) wrap ``torch.distributed``, take a ``CommGroup`` and note
each call; all-gathers and reduce-scatters move one contiguous buffer (a data-parallel bucket:
in place), as Megatron-LM and FSDP2. The papers' autograd operators (1909.08053 §3, Figure 3):
``f``, identity forward and all-reduce backward (``f_param`` on a weight several ranks hold), and
its conjugate ``g``, all-reduce forward and identity backward; ``gather``/``scatter`` (last
dimension) and ``all_gather_seq``/``reduce_scatter_seq`` (sequence) are conjugate pairs too. On a
group of size 1 every operation is the identity and records nothing: a parallel layer at size 1
*is* the serial layer.

``record(timing.TimedLog(clock))`` also notes when each call was made and done, for the timelines
of notebooks 06 and 13 (``timing.py``): no algorithm calls a timer. Bytes are the full buffer's
(nccl-tests' convention): an all-reduce of a [b, s, h] fp32 tensor is 4·b·s·h, an all-gather
counts its output, a reduce-scatter its input; ``CommEvent.wire_bytes`` is what one rank sends
with a ring, 2(t−1)/t of that for an all-reduce, (t−1)/t for the others.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommGroup", "CommEvent", "CommLog", "record", "world",
    "all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "broadcast", "barrier",
    "send", "isend", "recv", "irecv", "P2POp", "batch_isend_irecv", "all_to_all",
    "f", "f_param", "g", "all_to_all_rows", "gather", "scatter", "all_gather_seq",
    "reduce_scatter_seq", "compute_dtype",
]


# --- groups --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommGroup:
    """A named set of global ranks and its process group (None when it has one member)."""

    name: str
    ranks: tuple[int, ...]
    pg: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    blocks: dict[int, CommGroup] = field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)

    def __deepcopy__(self, memo: dict) -> CommGroup:
        return self  # immutable, and a process group cannot be copied: models stay deep-copyable

    @property
    def rank(self) -> int:
        """This process's index in the group (0 in a group of one, torch.distributed or not)."""
        return 0 if self.size == 1 else self.ranks.index(dist.get_rank())

    def block(self, r: int) -> CommGroup:
        """The r consecutive ranks of this group that this rank is one of (a kv head's holders
        when tp exceeds the kv heads): one of the ``blocks`` ``ParallelGrid`` made with it, as
        making a group is a collective of all ranks, which a layer cannot call."""
        if r == 1:
            return CommGroup(self.name, (self.ranks[self.rank],))
        return self if r == self.size else self.blocks[r]


def world() -> CommGroup:
    """All ranks (the default process group)."""
    n = dist.get_world_size()
    return CommGroup("world", tuple(range(n)), dist.group.WORLD if n > 1 else None)


# --- the recorder --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommEvent:
    """One collective or point-to-point call, as a ``record()`` block notes it."""

    op: str          # all_reduce | all_gather | reduce_scatter | broadcast | send | recv
    group: str       # tp | pp | dp | embedding | mp | world | p2p
    group_size: int
    bytes: int       # full buffer size (see the module docstring)
    label: str = ""  # who called: "f backward", "g forward", "dp grads", ...
    _: KW_ONLY
    peer: int | None = None   # send/recv: the global rank at the other end
    batch: int | None = None  # send/recv issued together by one batch_isend_irecv: its number
    dtype: torch.dtype | None = None  # of the tensor sent
    tag: int | None = None    # the caller's number for it (a bucket's index)

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends with a ring algorithm (send/recv: the message itself)."""
        t = self.group_size
        if self.op == "all_reduce":
            return 2 * (t - 1) / t * self.bytes
        if self.op in ("all_gather", "reduce_scatter", "broadcast"):
            return (t - 1) / t * self.bytes
        return float(self.bytes)


@dataclass
class CommLog:
    """The calls made while a ``record()`` block was active, on this rank."""

    events: list[CommEvent] = field(default_factory=list)

    def add(self, event: CommEvent, work: dist.Work | None) -> dist.Work | None:
        """Note a call just made; return its work (``timing.TimedLog`` may hand back its own)."""
        self.events.append(event)
        return work

    def select(self, op: str | None = None, group: str | None = None,
               label: str | None = None) -> list[CommEvent]:
        """The events of this op, group and label (None: any)."""
        return [e for e in self.events
                if (op is None or e.op == op) and (group is None or e.group == group)
                and (label is None or e.label == label)]

    def count(self, op: str | None = None, group: str | None = None,
              label: str | None = None) -> int:
        """How many events ``select`` finds."""
        return len(self.select(op, group, label))

    def total_bytes(self, op: str | None = None, group: str | None = None,
                    label: str | None = None) -> int:
        """The bytes of the events ``select`` finds."""
        return sum(e.bytes for e in self.select(op, group, label))

    def summary(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(op, group, label) -> (calls, bytes), in order of first appearance."""
        keys = dict.fromkeys((e.op, e.group, e.label) for e in self.events)
        return {k: (self.count(*k), self.total_bytes(*k)) for k in keys}

    def table(self) -> str:
        """``summary`` as a printable table."""
        rows = [f"{'op':<15}{'group':<11}{'label':<22}{'calls':>6}{'bytes':>12}"]
        for (op, group, label), (n, b) in self.summary().items():
            rows.append(f"{op:<15}{group:<11}{label:<22}{n:>6}{b:>12,}")
        return "\n".join(rows)


# A plain list, not a ContextVar: collectives on autograd's backward threads are counted too.
_active_logs: list[CommLog] = []


@contextmanager
def record(log: CommLog | None = None) -> Iterator[CommLog]:
    """Record every collective this rank makes inside the block into ``log`` (a new CommLog)."""
    log = log or CommLog()
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def _note(op: str, group: CommGroup | str, x: torch.Tensor, label: str,
          work: dist.Work | None = None, peer: int | None = None,
          batch: int | None = None, tag: int | None = None) -> dist.Work | None:
    """Note the call just made with each active log; return its work."""
    name, size = (group.name, group.size) if isinstance(group, CommGroup) else (group, 2)
    event = CommEvent(op, name, size, x.numel() * x.element_size(), label or op,
                      peer=peer, batch=batch, dtype=x.dtype, tag=tag)
    for log in _active_logs:
        work = log.add(event, work)
    return work


# --- plain collectives ---------------------------------------------------------------------------
class _Done:
    """The work handle of a collective on a group of one: done already."""

    def wait(self) -> bool:
        return True


DONE = _Done()


def _alone_is_identity(collective: Callable) -> Callable:
    """On a group of one, ``collective(x, group, …)`` is ``x``, copied into ``out`` if given (torch
    skips a copy onto itself); (DONE, it) under ``async_op``."""
    @functools.wraps(collective)
    def call(x: torch.Tensor, group: CommGroup, *args, **kwargs):
        if group.size > 1:
            return collective(x, group, *args, **kwargs)
        x = x if kwargs.get("out") is None else kwargs["out"].copy_(x.detach())
        return (DONE, x) if kwargs.get("async_op") else x
    return call


def _alone_does_nothing(collective: Callable) -> Callable:
    """On a group of one, the in-place ``collective(x, group, …)`` does nothing: ``DONE``."""
    @functools.wraps(collective)
    def call(x: torch.Tensor, group: CommGroup, *args, **kwargs):
        return collective(x, group, *args, **kwargs) if group.size > 1 else DONE
    return call


@_alone_does_nothing
def all_reduce_(x: torch.Tensor, group: CommGroup, label: str = "", *, async_op: bool = False,
                tag: int | None = None) -> dist.Work | None:
    """Sum ``x`` in place over the group (``async_op``: returns the work handle to wait on)."""
    work = dist.all_reduce(x, group=group.pg, async_op=async_op)
    return _note("all_reduce", group, x, label, work, tag=tag)


@_alone_is_identity
def all_reduce(x: torch.Tensor, group: CommGroup, label: str = "") -> torch.Tensor:
    """A new tensor: the sum of ``x`` over the group (a copy: ``x`` may be the caller's)."""
    y = x.clone(memory_format=torch.contiguous_format)
    all_reduce_(y, group, label)
    return y


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@_alone_is_identity
def all_gather(x: torch.Tensor, group: CommGroup, dim: int = -1, label: str = "", *,
               out: torch.Tensor | None = None, async_op: bool = False, tag: int | None = None
               ) -> torch.Tensor | tuple[dist.Work, torch.Tensor]:
    """Every rank's ``x`` in group order along ``dim`` (``async_op``: (work, it), done on wait).
    One all-gather into one buffer along its first dimension, ``dim`` moved there (a copy of ``x``
    unless it is the first: Megatron-LM keeps the sequence first, [s, b, h]): ``out`` if given, of
    which ``x`` may be this rank's chunk (in place: a ZeRO bucket), else a new one. NCCL: one
    ``ncclAllGather`` into it, as Megatron-LM and FSDP2; gloo: an all-gather into its chunks."""
    x = x.detach().movedim(dim, 0).contiguous()      # each rank's part one block; no autograd
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:])) if out is None else out
    work = _note("all_gather", group, out, label,
                 _all_gather_single(out, x, group=group.pg, async_op=async_op), tag=tag)
    return (work, out.movedim(0, dim)) if async_op else out.movedim(0, dim)


@_alone_is_identity
def reduce_scatter(x: torch.Tensor, group: CommGroup, dim: int = -1, label: str = "", *,
                   out: torch.Tensor | None = None, async_op: bool = False, tag: int | None = None
                   ) -> torch.Tensor | tuple[dist.Work, torch.Tensor]:
    """Sum ``x`` over the group; keep this rank's 1/size slice on ``dim`` — into ``out`` if given,
    which may be that slice of ``x`` (in place: Megatron-LM's gradient buckets). As ``all_gather``:
    NCCL, one ``ncclReduceScatter``; gloo all-reduces a copy of ``x``, then copies the slice when
    waited — the same sum, twice the traffic (recorded as the reduce-scatter it stands for)."""
    _split(x, group.size, dim)                       # a clear error if dim does not divide
    x = x.detach().movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:])) if out is None else out
    work = _note("reduce_scatter", group, x, label,
                 _reduce_scatter_single(out, x, group=group.pg, async_op=async_op), tag=tag)
    return (work, out.movedim(0, dim)) if async_op else out.movedim(0, dim)


def broadcast(x: torch.Tensor, src: int, group: CommGroup, label: str = "") -> torch.Tensor:
    """Every rank gets global rank ``src``'s ``x`` (in place; returned for convenience)."""
    if group.size > 1:
        dist.broadcast(x, src=src, group=group.pg)
        _note("broadcast", group, x, label)
    return x


Splits = list[int] | torch.Tensor


@_alone_is_identity
def all_to_all(x: torch.Tensor, group: CommGroup, send: Splits, receive: Splits,
               label: str = "") -> torch.Tensor:
    """Rows of x cut by ``send`` (counts, in group order) go one part to each rank; the rows
    received, ``receive[r]`` from rank r, in group order. One ``all_to_all_single`` (the list form
    fails on gloo with uneven shapes); counts on the device are read to the host here, as NCCL
    needs them (a group of one reads nothing). Recorded bytes: the rows this rank sends, its own
    part included."""
    send, receive = (s.tolist() if isinstance(s, torch.Tensor) else s for s in (send, receive))
    x = x.detach().contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, receive, send, group=group.pg)
    _note("all_to_all", group, x, label)
    return out


def barrier(group: CommGroup) -> None:
    """Wait until every rank of the group is here (not recorded: it moves no data)."""
    if group.size > 1:
        dist.barrier(group=group.pg)


def send(x: torch.Tensor, dst: int, label: str = "") -> None:
    """Send ``x`` to global rank ``dst`` (blocking)."""
    dist.send(x.contiguous(), dst)
    _note("send", "p2p", x, label, peer=dst)


def isend(x: torch.Tensor, dst: int, label: str = "",
          channel: dist.ProcessGroup | None = None) -> tuple[dist.Work, torch.Tensor]:
    """Start sending ``x`` to ``dst`` (on ``channel`` if given); keep (work, x) until waited."""
    x = x.contiguous()
    return _note("send", "p2p", x, label, dist.isend(x, dst, group=channel), peer=dst), x


def recv(x: torch.Tensor, src: int, label: str = "",
         channel: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into the buffer ``x`` (its shape and dtype say what to expect)."""
    dist.recv(x, src, group=channel)
    _note("recv", "p2p", x, label, peer=src)
    return x


def irecv(x: torch.Tensor, src: int, label: str = "",
          channel: dist.ProcessGroup | None = None) -> dist.Work:
    """Start receiving into the buffer ``x``; it is filled once the returned work is waited."""
    return _note("recv", "p2p", x, label, dist.irecv(x, src, group=channel), peer=src)


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a batch: ``tensor`` goes to (or arrives from) global rank ``peer``."""

    op: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    label: str = ""


_batch_numbers = itertools.count()


def batch_isend_irecv(ops: list[P2POp], group: CommGroup) -> list[dist.Work]:
    """Start sends and receives as one batch (on NCCL one group call, as Megatron-LM's pipeline)."""
    batch = next(_batch_numbers)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend if o.op == "send" else dist.irecv, o.tensor, o.peer, group.pg)
        for o in ops])
    return [_note(o.op, "p2p", o.tensor, o.label, work, peer=o.peer, batch=batch)
            for o, work in zip(ops, works, strict=True)]


def _split(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} in {n} equal parts")
    return x.chunk(n, dim=dim)


# --- the papers' autograd operators --------------------------------------------------------------
def compute_dtype(device: str, otherwise: torch.dtype) -> torch.dtype:
    """The dtype activations travel in: autocast's compute dtype where it is on for ``device``
    (bf16: Megatron-LM's 2 bytes an element across tp and pp), else ``otherwise``."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else otherwise


class _F(torch.autograd.Function):
    """f (1909.08053 §3, Figure 3): identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):  # autocast: x in its compute dtype (the gradient too, on the wire)
        ctx.group = group
        return x.to(compute_dtype(x.device.type, x.dtype))

    @staticmethod
    def backward(ctx, grad):  # a copy: autograd may hand the same gradient to another branch
        return all_reduce(grad, ctx.group, "f backward"), None


class _FParam(_F):
    """f on a parameter several ranks hold: the identity in its own dtype, so that its copies'
    gradients are summed in fp32, as data parallelism sums gradients (not in the compute dtype)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)


class _G(torch.autograd.Function):
    """g (1909.08053 §3, Figure 3): all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group, "g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    """All-gather along ``dim`` forward. Backward keeps this rank's slice of the gradient, or,
    with ``reduce`` (every rank used the whole tensor: sequence parallelism), reduce-scatters it."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce, label):
        ctx.group, ctx.dim, ctx.reduce, ctx.label = group, dim, reduce, label
        return all_gather(x, group, dim, f"{label} forward")

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            grad = reduce_scatter(grad, ctx.group, ctx.dim, f"{ctx.label} backward")
        else:
            grad = _split(grad, ctx.group.size, ctx.dim)[ctx.group.rank].contiguous()
        return grad, None, None, None, None


class _Split(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward (or reduce-scatter with ``reduce=True``);
    backward all-gathers the gradient. The conjugate of ``_AllGather``."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        if reduce:
            return reduce_scatter(x, group, dim, f"{label} forward")
        return _split(x, group.size, dim)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim, f"{ctx.label} backward"), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all`` forward; backward sends each gradient row back where its row came from."""

    @staticmethod
    def forward(ctx, x, group, send, receive, label):
        ctx.group, ctx.send, ctx.receive, ctx.label = group, send, receive, label
        return all_to_all(x, group, send, receive, f"{label} forward")

    @staticmethod
    def backward(ctx, grad):
        back = all_to_all(grad, ctx.group, ctx.receive, ctx.send, f"{ctx.label} backward")
        return back, None, None, None, None


def _conjugate(op: type[torch.autograd.Function], x: torch.Tensor, group: CommGroup,
               *args) -> torch.Tensor:
    """``op`` applied across ``group`` — on a group of one the identity, no autograd node."""
    return op.apply(x, group, *args) if group.size > 1 else x


def f(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Copy to the tensor-parallel region: identity forward, all-reduce backward."""
    return _conjugate(_F, x, group)


def f_param(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """f on a parameter each rank of ``group`` holds a copy of: its gradients summed backward."""
    return _conjugate(_FParam, x, group)


def g(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Reduce from the tensor-parallel region: all-reduce forward, identity backward."""
    return _conjugate(_G, x, group)


def gather(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Gather the last dimension from the tensor-parallel region (backward: keep own slice)."""
    return _conjugate(_AllGather, x, group, -1, False, "gather")


def scatter(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Scatter the last dimension into the tensor-parallel region (backward: all-gather)."""
    return _conjugate(_Split, x, group, -1, False, "scatter")


def all_gather_seq(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's g: all-gather the sequence forward, reduce-scatter backward."""
    return _conjugate(_AllGather, x, group, dim, True, "all_gather_seq")


def reduce_scatter_seq(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's g-bar: reduce-scatter the sequence forward, all-gather backward."""
    return _conjugate(_Split, x, group, dim, True, "reduce_scatter_seq")


def all_to_all_rows(x: torch.Tensor, group: CommGroup, send: Splits, receive: Splits,
                    label: str = "all_to_all") -> torch.Tensor:
    """``all_to_all`` with autograd (the experts' dispatch and its return: expert_parallel.py)."""
    return _conjugate(_AllToAll, x, group, send, receive, label)
