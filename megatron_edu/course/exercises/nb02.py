"""Checkers for notebook 02 (tensor-parallel self-attention, 1909.08053 §3, Figure 3b).

02.1 ★★   Hugging Face's fused ``c_attn`` ([h, 3h], q | k | v) into this package's per-head
          layout ([3h, h]: head 0's q, k, v rows, then head 1's, …), so that a contiguous cut
          gives each tensor-parallel rank whole heads
02.2 ★★★  attention on this rank's heads: slice the qkv and output weights, attend, g

02.1 reads each row of the learner's tensor back as "the key of head 1, dim 0" (every entry of
the test matrix is distinct) and says which row is where it should not be; once right, the layout
runs on 2 ranks in the package's ``Attention`` against Hugging Face's computation done whole.
02.2 runs on 2 ranks against the package's serial ``Attention`` and recognises the typical
mistakes (no causal mask, q | k | v read from the per-head shard, 1/√h for 1/√h_d, a partial sum
never summed, another rank's heads) by computing them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_edu import comm, hf
from megatron_edu.course.exercises.checking import Hint, close, exercise, on_ranks
from megatron_edu.course.exercises.nb01 import (
    _NO_AUTOGRAD,
    _backward,
    _counts_hint,
    _same,
    _tensor,
    _used,
)
from megatron_edu.model.attention import Attention, EagerCore

__all__ = ["TP", "TIMEOUT"]  # the checkers register themselves (``@exercise``)

TP = 2
TIMEOUT = 30.0
_QKV = ("query", "key", "value")


def _config(hidden: int, heads: int):
    from megatron_edu.model import GPTConfig

    return GPTConfig(vocab_size=8, seq_len=8, num_layers=1, hidden=hidden, num_heads=heads,
                     dropout=0.0)


def _hf_attention(x: torch.Tensor, c_attn: torch.Tensor, proj: torch.Tensor,
                  heads: int) -> torch.Tensor:
    """Hugging Face's GPT-2 attention (no biases), whole: x·c_attn split q | k | v, heads inside
    each block, causal attention, heads merged, then the output projection ([out, in] here)."""
    b, s, h = x.shape
    q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2)
               for t in (x @ c_attn).split(h, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(b, s, h), proj)


# --- 02.1 the per-head qkv layout ----------------------------------------------------------------

_H, _HEADS = 8, 4  # head size h_d = 2


def _c_attn() -> torch.Tensor:
    """[h, 3h] with every entry distinct: column j of c_attn is output j of the fused qkv."""
    return torch.arange(_H * 3 * _H, dtype=torch.float32).view(_H, 3 * _H)


def _hf_column(j: int) -> str:
    """What output column j of c_attn is: q | k | v blocks of h, heads contiguous inside."""
    d = _H // _HEADS
    return f"the {_QKV[j // _H]} of head {(j % _H) // d}, dim {j % d}"


def _per_head_row(i: int) -> str:
    """What row i of the per-head layout must be: [heads, 3, h_d]."""
    d = _H // _HEADS
    return f"the {_QKV[(i % (3 * d)) // d]} of head {i // (3 * d)}, dim {i % d}"


def _layout_hint(got: torch.Tensor, c_attn: torch.Tensor) -> str:
    """Read each row of ``got`` back as a column of c_attn and name the first misplaced one."""
    columns = c_attn.t()
    if got.shape == c_attn.shape:
        return (f"your tensor is [h, 3h] = {list(got.shape)}, Hugging Face's own shape: its "
                f"Conv1D stores weights [in, out], this package (nn.Linear) [out, in] = "
                f"[3h, h] — transpose it as well as regrouping the rows")
    if got.shape != columns.shape:
        return (f"your tensor has shape {list(got.shape)}; the fused qkv weight is [3h, h] = "
                f"{list(columns.shape)}")
    found = []
    for i, row in enumerate(got.detach().float()):
        match = (columns == row).all(dim=1).nonzero().flatten().tolist()
        if not match:
            return (f"row {i} of your tensor is not a column of c_attn: the rows of the [3h, h] "
                    f"weight are c_attn's columns — transpose first (c_attn.t()); reshaping "
                    f"[h, 3h] into [3h, h] is not a transpose")
        found.append(match[0])
    if found == list(range(3 * _H)):
        return (f"the rows are still in Hugging Face's q | k | v order: cut into t = {TP} "
                f"contiguous blocks, rank 0 would hold every head's query and half the keys, "
                f"rank 1 the other keys and every value — no rank a whole head. Group them "
                f"per head: view the [3h, h] as [3, heads, h_d, h] and swap the first two dims")
    expected = _expected_columns()
    i = next(i for i, (a, b) in enumerate(zip(found, expected, strict=True)) if a != b)
    return (f"row {i} of your tensor is {_hf_column(found[i])}; it should be {_per_head_row(i)} "
            f"— the per-head layout is [heads, 3, h_d] rows: head 0's h_d query rows, its h_d "
            f"key rows, its h_d value rows, then head 1's, …")


def _expected_columns() -> list[int]:
    d = _H // _HEADS
    return [(i % (3 * d)) // d * _H + (i // (3 * d)) * d + i % d for i in range(3 * _H)]


def _run_whole_heads(qkv: torch.Tensor, proj: torch.Tensor, x: torch.Tensor):
    """The package's Attention on this tp rank, loaded with its contiguous cut of ``qkv``."""
    from megatron_edu.tensor_parallel import init_parameters

    group = comm.world()  # the 2 ranks as the tensor-parallel group
    attention = Attention(_config(_H, _HEADS), group)
    init_parameters(attention, 0, group)  # real tensors, then these weights copied in
    rows, cols = 3 * _H // TP, _H // TP
    with torch.no_grad():
        attention.qkv.weight.copy_(qkv[group.rank * rows:(group.rank + 1) * rows])
        attention.proj.weight.copy_(proj[:, group.rank * cols:(group.rank + 1) * cols])
        attention.qkv.bias.zero_()
        attention.proj.bias.zero_()
        return attention(x)


@exercise("02.1", "Hugging Face's c_attn in the per-head qkv layout",
          reference=(hf._qkv_from_hf,),
          marks=(r"\[3,heads,[^\]]*,h\]", r"reshape\(3,heads", r"view\(3,heads",
                 r"\.transpose\(0,1\)\.reshape\(3\*h"))
def _per_head_qkv(fn) -> str:
    c_attn = _c_attn()
    got = fn(c_attn.clone(), _HEADS)
    if not isinstance(got, torch.Tensor):
        raise Hint(f"per_head_qkv should return a tensor, got {type(got).__name__}")
    expected = torch.stack([c_attn[:, j] for j in _expected_columns()])
    if not torch.equal(got.detach().float(), expected):
        raise Hint(_layout_hint(got, c_attn))
    # Right on the index matrix; now real weights through the package's Attention on 2 ranks.
    c_attn, proj = _tensor(41, _H, 3 * _H), _tensor(42, _H, _H)
    x = _tensor(43, 2, 5, _H)
    qkv = fn(c_attn.clone(), _HEADS).detach()
    outs = on_ranks(TP, _run_whole_heads, qkv, proj, x, timeout=TIMEOUT)
    reference = _hf_attention(x, c_attn, proj, _HEADS)
    for rank, out in enumerate(outs):
        close(out, reference, f"attention on rank {rank} with your layout", atol=1e-5)
    per_rank = _HEADS // TP
    heads = "; ".join(f"rank {r}: heads {r * per_rank}–{(r + 1) * per_rank - 1}"
                      for r in range(TP))
    return (f"the rows are grouped per head ([heads, 3, h_d]), as megatron_edu/hf.py does; cut in "
            f"{TP}, each rank holds whole heads with their q, k and v ({heads}), and the "
            f"package's Attention on {TP} ranks equals Hugging Face's attention computed whole")


# --- 02.2 attention on this rank's heads ---------------------------------------------------------

_H2, _HEADS2 = 16, 4  # head size h_d = 4; 2 heads per rank at t = 2


def _attention_data():
    """x [b, s, h], qkv.weight [3h, h] (per head), proj.weight [h, h], an upstream gradient."""
    return (_tensor(51, 2, 5, _H2), 0.3 * _tensor(52, 3 * _H2, _H2),
            0.3 * _tensor(53, _H2, _H2), _tensor(54, 2, 5, _H2))


def _run_parallel_attention(fn):
    group = comm.world()
    x, qkv, proj, upstream = _attention_data()
    x, qkv, proj = (t.clone().requires_grad_() for t in (x, qkv, proj))
    with comm.record() as forward:
        out = fn(x, qkv, proj, _HEADS2, group)
    if not isinstance(out, torch.Tensor) or out.shape != upstream.shape:
        return out, None, [None, None], forward.count("all_reduce"), 0, False
    with comm.record() as backward:
        no_rule = _backward((out * upstream).sum())
    return (out.detach(), x.grad, [qkv.grad, proj.grad], forward.count("all_reduce"),
            backward.count("all_reduce"), no_rule)


def _reference_attention():
    """The package's serial Attention (biases zero) with these weights: output and gradients."""
    from megatron_edu.tensor_parallel import init_parameters, serial_group

    x, qkv, proj, upstream = _attention_data()
    attention = Attention(_config(_H2, _HEADS2), serial_group())
    init_parameters(attention, 0, serial_group())  # real tensors, then these weights copied in
    with torch.no_grad():
        attention.qkv.weight.copy_(qkv)
        attention.proj.weight.copy_(proj)
        attention.qkv.bias.zero_()
        attention.proj.bias.zero_()
    x = x.clone().requires_grad_()
    out = attention(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, [attention.qkv.weight.grad, attention.proj.weight.grad]


def _heads_partial(rank: int, causal: bool = True, split: str = "per head",
                   scale: float | None = None) -> torch.Tensor:
    """Rank ``rank``'s partial output (before g), computed one way or a typical wrong way."""
    x, qkv, proj, _ = _attention_data()
    b, s, h = x.shape
    n, d = _HEADS2 // TP, h // _HEADS2
    mine = F.linear(x, qkv[rank * 3 * n * d:(rank + 1) * 3 * n * d])  # [b, s, 3·n·d]
    if split == "per head":
        q, k, v = mine.view(b, s, n, 3, d).permute(3, 0, 2, 1, 4).unbind(0)
    else:  # q | k | v blocks, as if the shard were in Hugging Face's order
        q, k, v = mine.view(b, s, 3, n, d).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    y = y.transpose(1, 2).reshape(b, s, n * d)
    return F.linear(y, proj[:, rank * n * d:(rank + 1) * n * d])


def _attention_output_hint(rank: int, out: torch.Tensor) -> None:
    h = _H2
    d = h // _HEADS2
    if _same(out, _heads_partial(rank), atol=1e-4):
        raise Hint(f"rank {rank} returned the partial output of its own heads: the output "
                   f"projection is row-parallel — sum the ranks' partial products with comm.g")
    mistakes = {
        "the causal mask is missing: token i may attend only to tokens 0…i "
        "(is_causal=True)": dict(causal=False),
        "you read q, k and v of the shard as three blocks (q | k | v), but this package's "
        "layout is per head: view the shard's 3h/t outputs as [heads/t, 3, h_d] — "
        "qkv.view(b, s, heads/t, 3, h_d)": dict(split="blocks"),
        f"the scores are scaled by 1/√h = 1/√{h}: attention scales by 1/√h_d, h_d = h/heads "
        f"= {d} the head size": dict(scale=h ** -0.5),
        "the scores are not scaled: attention divides them by √h_d, h_d the head size":
            dict(scale=1.0),
    }
    for words, how in mistakes.items():
        if _same(out, sum(_heads_partial(r, **how) for r in range(TP)), atol=1e-4):
            raise Hint(words)


_SPLITS = {"qkv.weight": (0, 3 * _H2 // TP), "proj.weight": (1, _H2 // TP)}  # dim, size per rank


def _attention_slices_hint(rank: int, grads: list) -> None:
    for (name, (dim, size)), grad in zip(_SPLITS.items(), grads, strict=True):
        if not isinstance(grad, torch.Tensor):
            continue
        used = _used(grad, dim)
        if used and used != list(range(rank * size, (rank + 1) * size)):
            kind = "rows" if dim == 0 else "columns"
            raise Hint(f"rank {rank} computed with {kind} {used[0]}…{used[-1]} of {name}; rank "
                       f"i holds heads i·heads/t … — {kind} i·{size} … (i+1)·{size} − 1 of it, "
                       f"here {rank * size}…{(rank + 1) * size - 1} (i = group.rank)")


def _rank_grads(rank: int, serial: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for (dim, size), ref in zip(_SPLITS.values(), serial, strict=True):
        expected = torch.zeros_like(ref)
        cut = (slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)
        expected[cut] = ref[cut]
        out.append(expected)
    return out


@exercise("02.2", "attention on this rank's heads",
          # Attention.forward is the answer too, but its last line, ``self.proj(y, add_bias)``,
          # is MLP.forward's as well (shown in notebook 01): its own lines are marks instead
          reference=(EagerCore.forward,),
          marks=(r"permute\(3,0,2,1,4\)", r"\.view\(b,s,n,3,", r"group\.rank\*3\*n\*d",
                 r"proj_weight\[:,(group\.rank|columns)",
                 r"qkv\.view\(b,s,self\.local_groups,n\+2,self\.head_dim\)",
                 r"qkv\.permute\(2,3,0,1,4\)\.split", r"y\.transpose\(1,2\)\.reshape\(b,s,"))
def _parallel_attention(fn) -> str:
    results = on_ranks(TP, _run_parallel_attention, fn, timeout=TIMEOUT)
    out_ref, x_grad_ref, grads_ref = _reference_attention()
    for rank, result in enumerate(results):
        _attention_slices_hint(rank, result[2])
    for rank, (out, x_grad, grads, forward, backward, no_rule) in enumerate(results):
        if isinstance(out, torch.Tensor) and out.shape == out_ref.shape:
            _attention_output_hint(rank, out)
        close(out, out_ref, f"rank {rank}'s output", atol=1e-4)
        if no_rule:
            raise Hint(_NO_AUTOGRAD)
        if not _same(x_grad, x_grad_ref, atol=1e-4) and backward == 0:
            raise Hint(f"x.grad on rank {rank} is only the part that flowed through its own "
                       f"heads: pass x through comm.f before the qkv projection, whose backward "
                       f"all-reduces the gradient")
        close(x_grad, x_grad_ref, f"x.grad on rank {rank}", atol=1e-4)
        for name, grad, expected in zip(_SPLITS, grads, _rank_grads(rank, grads_ref),
                                        strict=True):
            close(grad, expected, f"{name}.grad on rank {rank}", atol=1e-4)
        _counts_hint(rank, forward, backward, (1, 1), "attention split by heads (Figure 3b)")
    n = _HEADS2 // TP
    return (f"on {TP} ranks rank i computed heads {n}i…{n}i+{n - 1} from its rows of qkv and "
            f"columns of proj; output and gradients equal the package's serial Attention; 1 "
            f"all-reduce forward (g), 1 backward (f) — with the MLP's, the 2 + 2 per layer of §3")
