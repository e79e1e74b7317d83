"""Memory per GPU: weights, gradients, optimizer states and activations of a tp × pp × dp layout.

References
- Korthikanti et al. 2022, arXiv 2205.05198 §4: activations saved per transformer layer,
  s·b·h·(34 + 5·a·s/h) bytes with 16-bit values and 1-byte dropout masks; with tensor
  parallelism s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallelism s·b·h/t·(34 + 5·a·s/h);
  selective recomputation drops the 5·a·s/h term; full recomputation keeps the 2·s·b·h input.
- Narayanan et al. 2021, arXiv 2104.04473 §2.2: how many microbatches each pipeline schedule
  keeps in flight (GPipe m, 1F1B p - rank, interleaved: Megatron's warm-up count + 1).
- Rajbhandari et al. 2019, ZeRO (arXiv 1910.02054) §3: 2 + 2 + 12 = 16 bytes per parameter in
  mixed precision; stage 1 (Megatron's distributed optimizer) shards the optimizer over dp.

Bytes are exact integers; `str(estimate)` reads in GiB.
"""

from dataclasses import dataclass, field
from functools import partial

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A GPT in the papers' letters: l layers, h hidden, a heads, V vocabulary, s sequence."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int

    @classmethod
    def from_config(cls, config, tp: int = 1) -> "ModelShape":
        """From a `megatron_edu.model.GPTConfig`, its vocabulary padded as it would be at `tp`."""
        return cls(config.num_layers, config.hidden, config.num_heads, config.padded_vocab(tp),
                   config.seq_len)


@dataclass(frozen=True)
class Layout:
    """How one model replica is split (tp, pp), replicated (dp) and scheduled."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatch: int = 1  # b, sequences per microbatch
    schedule: str = "1f1b"  # one of SCHEDULES
    chunks: int = 1  # v, model chunks per pipeline rank (interleaved schedule only)
    recompute: str = "full"  # one of RECOMPUTE; 2104.04473 trains with full recomputation
    sequence_parallel: bool = False  # 2205.05198 §4.2.2

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def num_microbatches(self, global_batch: int) -> int:
        """m, microbatches per pipeline per iteration: B / (dp·b)."""
        return global_batch // (self.dp * self.microbatch)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for each copy the training keeps, and per saved activation value."""

    weights: int
    grads: int
    master: int  # the optimizer's fp32 copy of the weights (0 when the weights are fp32)
    adam: int  # Adam's two moments
    activation: int  # dropout masks are 1 byte whatever this is


FP32 = Precision(weights=4, grads=4, master=0, adam=8, activation=4)
MIXED = Precision(weights=2, grads=2, master=4, adam=8, activation=2)  # 16 bytes/param
MIXED_FP32_GRADS = Precision(weights=2, grads=4, master=4, adam=8, activation=2)  # 18 bytes/param


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds at its peak."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "total", self.weights + self.grads + self.optimizer + self.activations
        )

    def __str__(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations")
        terms = " + ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)
        return f"{terms} = {self.total / GIB:.2f} GiB"


def layout_error(model: ModelShape, layout: Layout, global_batch: int) -> str | None:
    """Why `layout` cannot split `model` at this batch, or None (checked once, at the edge)."""
    t, p, v, b = layout.tp, layout.pp, layout.chunks, layout.microbatch
    sizes = {"tp": t, "pp": p, "dp": layout.dp, "microbatch": b, "chunks": v}
    if min(sizes.values()) < 1:
        return f"sizes must be positive, got {sizes}"
    m = layout.num_microbatches(global_batch)
    rules = [
        (layout.schedule in SCHEDULES, f"schedule {layout.schedule!r} not in {SCHEDULES}"),
        (layout.recompute in RECOMPUTE, f"recompute {layout.recompute!r} not in {RECOMPUTE}"),
        (model.hidden % model.heads == 0, f"heads {model.heads} do not divide hidden"),
        (model.heads % t == 0, f"tp {t} does not divide heads {model.heads}"),
        (model.vocab % t == 0, f"tp {t} does not divide vocabulary {model.vocab}"),
        (not layout.sequence_parallel or model.seq_len % t == 0, f"tp {t} does not divide s"),
        (model.layers % (p * v) == 0, f"pp·v = {p}·{v} does not divide {model.layers} layers"),
        (global_batch % (layout.dp * b) == 0, f"dp·b = {layout.dp}·{b} does not divide B"),
        ((v > 1) == (layout.schedule == "interleaved"), "chunks v > 1 iff interleaved"),
        (layout.schedule != "interleaved" or m % p == 0, f"interleaved needs m={m} % p={p} == 0"),
    ]
    return next((reason for ok, reason in rules if not ok), None)


def parameters_per_rank(model: ModelShape, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters held by one GPU of pipeline stage `stage` (Megatron's layout, 1909.08053 §3).

    Per layer: the QKV and MLP-in matrices are column-parallel (weights and biases split by tp),
    the projection and MLP-out matrices row-parallel (weights split, biases replicated); the two
    layer norms are replicated: (12h² + 7h)/t + 6h. The word embedding is vocabulary-parallel
    (V·h/t) on the first stage and its tied copy on the last; positions (s·h) on the first stage,
    the final layer norm (2h) on the last.
    """
    h, vocab_shard = model.hidden, model.vocab * model.hidden // tp
    per_layer = (12 * h * h + 7 * h) // tp + 6 * h
    params = model.layers // pp * per_layer
    if stage == 0:
        params += vocab_shard + model.seq_len * h
    if stage == pp - 1:
        params += 2 * h + (vocab_shard if pp > 1 else 0)
    return params


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd keeps for the backward pass (2205.05198 §4.1)."""

    what: str
    count: int  # how many units of `unit`
    unit: str  # "sbh", "as2b" (attention scores) or "sbV" (logits)
    split: str  # "tp": split over tensor ranks; "seq": split only under sequence parallelism
    dtype: str  # "value" (activation bytes), "mask" (1 byte), "fp32" (4 bytes)
    kept_with: tuple[str, ...] = RECOMPUTE  # recompute modes under which it stays saved
    needs_dropout: bool = False


_KEPT_UNLESS_FULL = ("none", "selective")
_ATTENTION_CORE = ("none",)  # selective recomputation recomputes softmax and dropout

_LAYER = (  # one transformer layer; 16-bit: 10·sbh replicated + 24·sbh/t + 5·as²b/t
    _Saved("layer norm 1 input (= layer input)", 1, "sbh", "seq", "value"),
    _Saved("QKV input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL),
    _Saved("Q and K", 2, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("softmax output", 1, "as2b", "tp", "value", _ATTENTION_CORE),
    _Saved("attention dropout mask", 1, "as2b", "tp", "mask", _ATTENTION_CORE, True),
    _Saved("attention dropout output", 1, "as2b", "tp", "value", _ATTENTION_CORE, True),
    _Saved("V", 1, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("projection input", 1, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("projection dropout mask", 1, "sbh", "seq", "mask", _KEPT_UNLESS_FULL, True),
    _Saved("layer norm 2 input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL),
    _Saved("MLP input", 1, "sbh", "seq", "value", _KEPT_UNLESS_FULL),
    _Saved("GeLU input", 4, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("MLP output layer input", 4, "sbh", "tp", "value", _KEPT_UNLESS_FULL),
    _Saved("MLP dropout mask", 1, "sbh", "seq", "mask", _KEPT_UNLESS_FULL, True),
)
_EMBEDDING = (_Saved("embedding dropout mask", 1, "sbh", "seq", "mask", needs_dropout=True),)
_OUTPUT = (  # 2205.05198 §4.3: 4·sbh/t·(1 + V/h) with sequence parallelism
    _Saved("final layer norm input", 1, "sbh", "seq", "value"),
    _Saved("output layer input", 1, "sbh", "seq", "value"),
    _Saved("logits for the cross entropy", 1, "sbV", "tp", "fp32"),
)


def _saved_bytes(
    table: tuple[_Saved, ...],
    model: ModelShape,
    microbatch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    bytes_per_value: int,
    dropout: bool,
) -> int:
    s, b, h, a = model.seq_len, microbatch, model.hidden, model.heads
    units = {"sbh": s * b * h, "as2b": a * s * s * b, "sbV": s * b * model.vocab}
    dtype_bytes = {"value": bytes_per_value, "mask": 1, "fp32": 4}
    total = 0
    for x in table:
        if recompute not in x.kept_with or (x.needs_dropout and not dropout):
            continue
        shards = tp if x.split == "tp" or sequence_parallel else 1
        total += x.count * units[x.unit] // shards * dtype_bytes[x.dtype]
    return total


def activation_bytes_per_layer(
    model: ModelShape,
    microbatch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_value: int = 2,
    dropout: bool = True,
) -> int:
    """Bytes one transformer layer saves for its backward, per tensor rank (2205.05198 §4)."""
    args = (model, microbatch, tp, sequence_parallel, recompute, bytes_per_value, dropout)
    return _saved_bytes(_LAYER, *args)


def output_layer_activation_bytes(
    model: ModelShape,
    microbatch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per_value: int = 2,
) -> int:
    """Final layer norm, output layer and fp32 logits (never recomputed; 2205.05198 §4.3)."""
    args = (model, microbatch, tp, sequence_parallel, "none", bytes_per_value, False)
    return _saved_bytes(_OUTPUT, *args)


def embedding_activation_bytes(
    model: ModelShape, microbatch: int, *, tp: int = 1, sequence_parallel: bool = False
) -> int:
    """The embedding's dropout mask (2205.05198 §4.3); the lookup itself saves only indices."""
    return _saved_bytes(_EMBEDDING, model, microbatch, tp, sequence_parallel, "none", 1, True)


def forwards_in_flight(
    schedule: str, pp: int, num_microbatches: int, stage: int = 0, chunks: int = 1
) -> list[int]:
    """Forward passes whose activations a pipeline rank holds at its peak, per model chunk.

    GPipe runs all m forwards first (2104.04473 §2.2.1). 1F1B warms up with p - rank - 1
    forwards, then alternates one forward and one backward: p - rank in flight (§2.2.1).
    Interleaved (§2.2.2) warms up with (p - rank - 1)·2 + (v - 1)·p chunk-forwards (Megatron's
    count), running groups of p microbatches through chunk 0, then chunk 1, ...; + 1 in the
    steady state. Each chunk holds 1/v of the rank's layers, so rank 0 holds p + (p - 1)/v
    stages' worth, a little more than 1F1B's p.
    """
    p, m, v = pp, num_microbatches, chunks
    if schedule == "gpipe":
        return [m]
    if schedule == "1f1b":
        return [min(p - stage, m)]
    peak = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    held = [0] * v
    for k in range(peak):
        held[(k // p) % v] += 1
    return held


def activation_bytes_per_rank(
    model: ModelShape,
    layout: Layout,
    global_batch: int,
    stage: int = 0,
    *,
    bytes_per_value: int = 2,
    dropout: bool = True,
) -> int:
    """Activations a GPU of pipeline stage `stage` holds at its peak."""
    b, t, sp = layout.microbatch, layout.tp, layout.sequence_parallel
    held = forwards_in_flight(
        layout.schedule, layout.pp, layout.num_microbatches(global_batch), stage, layout.chunks
    )
    layers_per_chunk = model.layers // (layout.pp * layout.chunks)

    per_layer = partial(activation_bytes_per_layer, model, b, tp=t, sequence_parallel=sp,
                        bytes_per_value=bytes_per_value, dropout=dropout)
    kept = sum(held) * layers_per_chunk * per_layer(recompute=layout.recompute)
    # while one layer runs its backward, what recomputation rebuilt for it is alive too
    kept += per_layer(recompute="none") - per_layer(recompute=layout.recompute)
    if stage == 0 and dropout:
        kept += held[0] * embedding_activation_bytes(model, b, tp=t, sequence_parallel=sp)
    if stage == layout.pp - 1:
        out = output_layer_activation_bytes(
            model, b, tp=t, sequence_parallel=sp, bytes_per_value=bytes_per_value
        )
        kept += held[-1] * out
    return kept


def memory_per_rank(
    model: ModelShape,
    layout: Layout,
    global_batch: int,
    *,
    precision: Precision = MIXED,
    zero1: bool = False,
    dropout: bool = True,
    stage: int | None = None,
) -> MemoryEstimate:
    """Peak bytes on one GPU of `stage`; by default the fuller of the first and last stages.

    Middle stages never hold more than the first: the same layers, no embedding, fewer
    microbatches in flight. ZeRO-1 shards the master weights and Adam's moments over dp.
    """
    error = layout_error(model, layout, global_batch)
    if error:
        raise ValueError(error)
    if stage is None:
        stages = {0, layout.pp - 1}
        estimates = [memory_per_rank(model, layout, global_batch, precision=precision,
                                     zero1=zero1, dropout=dropout, stage=st) for st in stages]
        return max(estimates, key=lambda e: e.total)
    params = parameters_per_rank(model, layout.tp, layout.pp, stage)
    optimizer = params * (precision.master + precision.adam)
    if zero1:
        optimizer = -(-optimizer // layout.dp)  # ceil: the last shard may be padded
    activations = activation_bytes_per_rank(
        model, layout, global_batch, stage, bytes_per_value=precision.activation, dropout=dropout
    )
    return MemoryEstimate(params * precision.weights, params * precision.grads, optimizer,
                          activations)
