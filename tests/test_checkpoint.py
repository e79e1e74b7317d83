"""Checkpoint loading that scales: each rank reads only the slices its new layout holds, and gets
the values of the whole-tensor path (every shard joined, trimmed, cut again). Saving that scales:
only a rank that writes a file copies it to the host; ``keep_last`` bounds the checkpoints kept;
a background save writes the same files from its host copy while training goes on. Saving that
tells the truth: a failed write names the folder and its cause, and leaves the previous
checkpoint; non-finite weights are never written."""

import errno
import filecmp
import json
import shutil
import threading
import traceback
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import Launches, batch, world_of_one

from megatron_edu import checkpoint
from megatron_edu.checkpoint import MOMENTS, load_full_model_state
from megatron_edu.grid import Layout, ParallelGrid
from megatron_edu.launch import run
from megatron_edu.model import GPTConfig
from megatron_edu.model.transformer import WORD_EMBEDDING
from megatron_edu.ptdp import PTDP, PTDPOptions
from megatron_edu.tensor_parallel.init import shard

# vocab 200 is padded to 256 rows at tp 1 and 2, to 512 at tp 4: padding on every layout; 2 kv
# heads for 4 query heads: at tp 4 each kv head is held by 2 ranks (saved twice, read once)
CONFIG = GPTConfig(vocab_size=200, seq_len=8, num_layers=4, hidden=32, num_heads=4,
                   num_kv_heads=2, dropout=0.0)
KINDS = ("param", *MOMENTS)


def _trainer(tp, pp, dp=1, zero=0):
    return PTDP(CONFIG, ParallelGrid(Layout(tp, pp, dp)), PTDPOptions(lr=1e-2), zero=zero)


def _save(out, tp, pp, dp, zero):
    """In a rank: one optimizer step (so that there are moments), then a checkpoint; its folder,
    the bytes this rank copied to the host and the tensor bytes of the files it wrote."""
    trainer = _trainer(tp, pp, dp, zero)
    ids = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    mine = slice(trainer.grid.dp_rank * 4 // dp, (trainer.grid.dp_rank + 1) * 4 // dp)
    trainer.train_step(ids[mine, :-1], ids[mine, 1:], 1e-2)
    copied, written = [], []
    on_cpu, save = checkpoint._on_cpu, torch.save
    with mock.patch.object(checkpoint, "_on_cpu", lambda t: copied.append(t) or on_cpu(t)), \
            mock.patch.object(torch, "save", lambda obj, f: written.append(obj) or save(obj, f)):
        folder = checkpoint.save_checkpoint(out, 1, trainer)
    return folder, _bytes(copied), _bytes(written)


def _bytes(obj) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return sum(map(_bytes, values))


def _whole_path(path):
    """The loader this one replaced, as the oracle: every shard file read whole, the tp shards
    joined along tp_dim (one copy of each replicated part), the vocabulary trimmed; by kind,
    then name."""
    meta = json.loads((path / "meta.json").read_text())
    layout = meta["layout"]
    whole = {kind: {} for kind in KINDS}
    for stage in range(layout["pp"]):
        files = [torch.load(path / f"model_tp{t}_pp{stage}.pt") for t in range(layout["tp"])]
        if layout["zero"]:     # the moments: every dp rank's pieces of each shard, in place
            for t, f in enumerate(files):
                f["moments"] = {name: {k: torch.zeros_like(p) for k in MOMENTS}
                                for name, p in f["params"].items()}
                for d in range(layout["dp"]):
                    pieces = torch.load(path / f"optim_tp{t}_pp{stage}_dp{d}.pt")["pieces"]
                    for name, held in pieces.items():
                        for offset, moments in held:
                            for k, v in moments.items():
                                f["moments"][name][k].view(-1)[offset:offset + v.numel()] = v
        for name, d in files[0]["tp_dim"].items():
            for kind in KINDS:
                shards = [f["params"][name] if kind == "param" else f["moments"][name][kind]
                          for f in files[::files[0]["tp_replicas"][name]]]
                joined = shards[0] if d is None else torch.cat(shards, dim=d)
                whole[kind][name] = joined[:CONFIG.vocab_size] if name == WORD_EMBEDDING else joined
    return whole


def _cut(whole, name, p, group):
    if name == WORD_EMBEDDING:
        whole = F.pad(whole, (0, 0, 0, CONFIG.padded_vocab(group.size) - whole.shape[0]))
    return shard(whole, p.tp_dim, group, p.tp_replicas)


def _held(name, p, tp_rank):
    """Elements of this rank's shard that are not vocabulary padding."""
    if name != WORD_EMBEDDING:
        return p.numel()
    rows = p.shape[0]
    return p.shape[1] * len(range(tp_rank * rows, min((tp_rank + 1) * rows, CONFIG.vocab_size)))


def _load(path, tp, pp, dp, zero):
    """In a rank: load into a trainer whose weights are NaN; what it read, what differs from
    the whole-tensor path, and what it holds (ZeRO-3: gathered to be read and written).
    ``path``: the checkpoint, or the run folder that holds it."""
    path = checkpoint.resolve_checkpoint(path)
    trainer = _trainer(tp, pp, dp, zero)
    with torch.no_grad(), trainer.gathered():
        for p in trainer.parameters():
            p.fill_(float("nan"))
    with checkpoint._record_reads() as reads:
        checkpoint.load_checkpoint(path, trainer)
    states = trainer.optimizer.param_states() if zero else trainer.optimizer.state
    whole, group = _whole_path(path), trainer.grid.tp_group
    wrong, held = [], {}
    with trainer.gathered():
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                held[name] = _held(name, p, group.rank)
                got = {"param": p, **{k: states[p][k] for k in MOMENTS}}
                wrong += [(name, kind) for kind in KINDS
                          if not torch.equal(got[kind], _cut(whole[kind][name], name, p, group))]
                wrong += [(name, "step")] if float(states[p]["step"]) != 1.0 else []
    return {"reads": reads, "wrong": wrong, "held": held,
            "coords": (trainer.grid.tp_rank, trainer.grid.pp_rank)}


TP2PP2 = (2, 2, 1, 0)
RELOADS = [  # (saved layout, the layout that loads it); a layout is (tp, pp, dp, ZeRO stage)
    (TP2PP2, (1, 4, 1, 0)),
    (TP2PP2, (4, 1, 1, 0)),
    (TP2PP2, (1, 1, 1, 0)),
    ((1, 4, 1, 0), TP2PP2),
    ((4, 1, 1, 0), (1, 2, 2, 1)),
    ((4, 1, 1, 0), (2, 1, 2, 1)),           # replicated kv heads read by the ranks that split them
    ((2, 1, 2, 1), (4, 1, 1, 0)),
    ((1, 1, 1, 0), TP2PP2),
    ((1, 1, 4, 3), (2, 1, 2, 1)),           # ZeRO-3 at dp = 4 read as ZeRO-1 at dp = 2
    ((2, 1, 2, 1), (2, 1, 2, 3)),
]


def _ranks(layout):
    tp, pp, dp, _ = layout
    return tp * pp * dp


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """saved(layout) -> checkpoint folder; loaded(saved layout, new layout) -> rank results.
    Each layout is saved once and each pair loaded once: every save of one world size in one
    launch, then every load of one world size in another."""
    root = tmp_path_factory.mktemp("checkpoints")
    pairs = [(TP2PP2, TP2PP2), *RELOADS]
    folders = {layout: root / "_".join(map(str, layout)) for pair in pairs for layout in pair}
    saves = Launches({layout: (_ranks(layout), _save, (folder, *layout))
                      for layout, folder in folders.items()})
    loads = Launches({(source, target): (_ranks(target), _load, (folders[source], *target))
                      for source, target in pairs})

    def saved(layout, ranks=False):
        return saves[layout] if ranks else saves[layout][0][0]

    def loaded(source, target):
        for layout in folders:                   # every checkpoint a load may read is written
            saved(layout)
        return loads[source, target]

    return saved, loaded


def _read(result):
    """Elements read by (name, kind), summed over the slices."""
    total = Counter()
    for r in result["reads"]:
        total[r.name, r.kind] += r.numel
    return total


def _needed(result):
    """Elements by (name, kind) that the rank's shards hold outside the vocabulary padding."""
    return Counter({(name, kind): n for name, n in result["held"].items() for kind in KINDS
                    if n})


def test_a_rank_of_the_same_layout_reads_exactly_its_own_file(layouts):
    _, loaded = layouts
    for result in loaded(TP2PP2, TP2PP2):
        tp_rank, pp_rank = result["coords"]
        assert {r.file for r in result["reads"]} == {f"model_tp{tp_rank}_pp{pp_rank}.pt"}
        assert _read(result) == _needed(result)


def test_a_stage_of_another_pipeline_reads_only_its_names(layouts):
    _, loaded = layouts
    for result in loaded(TP2PP2, (1, 4, 1, 0)):
        stage = result["coords"][1]             # its layers are in saved stage stage // 2
        assert {r.name for r in result["reads"]} == set(result["held"])
        assert {r.file for r in result["reads"]} == {                 # the embedding included
            f"model_tp0_pp{stage // 2}.pt", f"model_tp1_pp{stage // 2}.pt"}
        assert _read(result) == _needed(result)          # tp 1: both saved halves, once


def test_a_tp4_rank_reads_only_its_quarter_of_each_split_tensor(layouts):
    _, loaded = layouts
    results = loaded(TP2PP2, (4, 1, 1, 0))
    for result in results:
        tp_rank = result["coords"][0]           # its quarter lies in saved half tp_rank // 2
        assert {r.file for r in result["reads"] if r.name != WORD_EMBEDDING} == {
            f"model_tp{tp_rank // 2}_pp0.pt", f"model_tp{tp_rank // 2}_pp1.pt"}
        assert _read(result) == _needed(result)
    q, kv = "blocks.0.attn.qkv.q_weight", "blocks.0.attn.qkv.kv_weight"
    assert _read(results[0])[q, "param"] == CONFIG.hidden ** 2 // 4        # a quarter
    assert _read(results[0])[kv, "param"] == CONFIG.hidden ** 2 // 2       # its kv head, a half
    # the vocabulary is padded per layout: 256 rows saved at tp 2 (128 a shard), 512 at tp 4
    # (128 a rank): rank 1's rows [128, 200) are in saved shard 1; ranks 2 and 3 hold padding
    spans = [[(r.file, r.span) for r in result["reads"]
              if (r.name, r.kind) == (WORD_EMBEDDING, "param")] for result in results]
    assert spans == [[("model_tp0_pp0.pt", (0, 128))], [("model_tp1_pp0.pt", (128, 200))], [], []]


@pytest.mark.parametrize(("source", "target"), RELOADS)
def test_loaded_values_equal_the_whole_tensor_path(layouts, source, target):
    _, loaded = layouts
    results = loaded(source, target)
    assert [result["wrong"] for result in results] == [[]] * len(results)


def test_under_zero1_each_dp_rank_saves_its_own_shard_of_the_moments(layouts):
    """Nothing gathers the whole optimizer state: the model file holds no moments, and the dp
    ranks' files hold each moment element once, half each at dp = 2."""
    saved, _ = layouts
    path = saved((2, 1, 2, 1))
    for t in range(2):
        model = torch.load(path / f"model_tp{t}_pp0.pt")
        assert model["moments"] == {} and model["adam_step"] == 1.0
        held = [sum(v["exp_avg"].numel() for pieces in torch.load(
            path / f"optim_tp{t}_pp0_dp{d}.pt")["pieces"].values() for _, v in pieces)
            for d in range(2)]
        assert sum(held) == sum(p.numel() for p in model["params"].values())
        assert abs(held[0] - held[1]) <= 0.1 * sum(held)


def test_only_a_rank_that_writes_a_file_copies_it_to_the_host(layouts):
    """dp rank 0 of each place copies its model file; its dp peers copy only the ZeRO-1 (or
    ZeRO-3) pieces of the moments they write — before, every rank copied the whole shard."""
    saved, _ = layouts
    for layout in ((2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 3), TP2PP2):
        ranks = saved(layout, ranks=True)
        assert [copied for _, copied, _ in ranks] == [written for _, _, written in ranks], layout
    ranks = saved((1, 1, 4, 3), ranks=True)                   # ZeRO-3 at dp = 4
    model = _bytes(torch.load(ranks[0][0] / "model_tp0_pp0.pt")["params"])
    assert ranks[0][1] > model and all(copied < model for _, copied, _ in ranks[1:])


def _save_untrained_then_load(out):
    """In a rank: a checkpoint saved before the first step (no moments) loads too."""
    saved, trainer = _trainer(1, 1), _trainer(1, 1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.fill_(float("nan"))
    checkpoint.load_checkpoint(checkpoint.save_checkpoint(out, 0, saved), trainer)
    return (all(map(torch.equal, saved.parameters(), trainer.parameters())),
            trainer.optimizer.state)


def test_a_checkpoint_saved_before_the_first_step_loads_without_moments(tmp_path):
    assert run(_save_untrained_then_load, 1, tmp_path) == [(True, {})]


def test_load_full_model_state_is_the_whole_tensor_path(layouts):
    saved, _ = layouts
    for layout in (TP2PP2, (4, 1, 1, 0)):
        full, expected = load_full_model_state(saved(layout)), _whole_path(saved(layout))["param"]
        assert full.keys() == expected.keys()
        assert all(torch.equal(full[name], expected[name]) for name in full)


def test_a_checkpoint_without_the_index_still_loads(layouts, tmp_path):
    saved, _ = layouts
    old = tmp_path / "old"
    shutil.copytree(saved(TP2PP2), old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["index"], meta["adam_step"]                  # as format 1 wrote it at first
    (old / "meta.json").write_text(json.dumps(meta))
    assert [result["wrong"] for result in run(_load, 4, old, 1, 4, 1, 0)] == [[]] * 4


# --- saving tells the truth ----------------------------------------------------------------------

def _tiny_trainer():
    return PTDP(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=32, num_heads=4),
                ParallelGrid(), PTDPOptions())


@pytest.mark.parametrize(("failure", "cause"), [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
    (RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4160 vs 4054"),
     "a write failed, most likely the disk is full"),
], ids=["ENOSPC", "zip-writer"])
def test_a_failed_write_names_the_folder_and_leaves_the_previous_checkpoint(
        tmp_path, monkeypatch, failure, cause):
    def write_half_then_fail(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"half a shard")
        raise failure

    with world_of_one(tmp_path / "store"):
        trainer = _tiny_trainer()
        checkpoint.save_checkpoint(tmp_path, 1, trainer)
        monkeypatch.setattr(torch, "save", write_half_then_fail)
        with pytest.raises(checkpoint.CheckpointError) as raised:
            checkpoint.save_checkpoint(tmp_path, 2, trainer)
    assert str(raised.value).startswith(
        f"cannot write checkpoint step_000002 in {tmp_path / 'checkpoints'}: {cause}")
    assert str(raised.value).endswith(
        "(rank 0); the previous checkpoint step_000001 is intact and latest still names it")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest", "step_000001"]                              # the half-written one removed
    assert checkpoint.read_metadata(tmp_path)["step"] == 1


def _trained_tiny_trainer():
    trainer = _tiny_trainer()
    trainer.train_step(*batch(trainer.config, s=8), 1e-2)        # moments to save
    return trainer


def test_a_background_save_writes_its_host_copy_while_training_goes_on(tmp_path, monkeypatch):
    """The same files, byte for byte, as a save at once; written by the writer's thread from
    the values at the save (the weights change meanwhile), published only when it is done,
    and waited for."""
    release, threads, save = threading.Event(), [], torch.save

    def held_back(obj, path):
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        save(obj, path)

    with world_of_one(tmp_path / "store"):
        trainer = _trained_tiny_trainer()
        checkpoint.save_checkpoint(tmp_path / "now", 1, trainer, {"sampler": [1, 2]})
        writer = checkpoint.BackgroundWriter()
        monkeypatch.setattr(torch, "save", held_back)
        final = checkpoint.save_checkpoint(tmp_path / "later", 1, trainer, {"sampler": [1, 2]},
                                           writer=writer)
        with torch.no_grad():
            for p in trainer.parameters():                    # training goes on
                p.add_(1.0)
        assert not final.exists()                             # not published yet
        release.set()
        writer.wait()
    assert threads == ["checkpoint writer"]
    now = tmp_path / "now" / "checkpoints" / "step_000001"
    names = sorted(p.name for p in now.iterdir())
    assert names == sorted(p.name for p in final.iterdir())
    assert filecmp.cmpfiles(now, final, names, shallow=False)[0] == names
    assert (final.parent / "latest").read_text() == final.name


def test_a_background_save_that_fails_raises_at_the_wait(tmp_path, monkeypatch):
    """A write failure: the same one-line CheckpointError as a save at once, the previous
    checkpoint left; anything else: the error itself, with its traceback from the thread."""
    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    def bug(obj, path):
        raise ValueError("a bug in the writer")

    with world_of_one(tmp_path / "store"):
        trainer, writer = _tiny_trainer(), checkpoint.BackgroundWriter()
        checkpoint.save_checkpoint(tmp_path, 1, trainer, writer=writer)
        writer.wait()
        monkeypatch.setattr(torch, "save", full_disk)
        checkpoint.save_checkpoint(tmp_path, 2, trainer, writer=writer)
        with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint "
                           "step_000002 .*: no space left on the device .* the previous "
                           "checkpoint step_000001 is intact"):
            writer.wait()
        monkeypatch.setattr(torch, "save", bug)
        checkpoint.save_checkpoint(tmp_path, 3, trainer, writer=writer)
        with pytest.raises(ValueError, match="a bug in the writer") as raised:
            checkpoint.save_checkpoint(tmp_path, 4, trainer, writer=writer)  # waits first
    assert "bug" in [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest", "step_000001", "step_000003.tmp"]     # a bug's leftovers, removed on retry


def test_keep_last_deletes_the_oldest_but_never_the_one_just_written(tmp_path):
    root = tmp_path / "checkpoints"
    with world_of_one(tmp_path / "store"):
        trainer = _tiny_trainer()
        for step in (1, 2, 3):
            checkpoint.save_checkpoint(tmp_path, step, trainer, keep_last=2)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
        checkpoint.save_checkpoint(tmp_path, 9, trainer)     # a run that went further, then
        (root / "step_000005.deleted").mkdir()                # a deletion cut short by a crash
        checkpoint.save_checkpoint(tmp_path, 4, trainer, keep_last=1)   # resumed at step 3
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000009"]
    assert checkpoint.read_metadata(tmp_path)["step"] == 4


def test_non_finite_weights_are_never_saved(tmp_path):
    with world_of_one(tmp_path / "store"):
        trainer = _tiny_trainer()
        checkpoint.save_checkpoint(tmp_path, 1, trainer)
        with torch.no_grad():
            trainer.parameters()[0].view(-1)[0] = float("nan")
        with pytest.raises(checkpoint.NonFiniteError, match="checkpoint step_000002 not written: "
                           "the weights or the optimizer state hold NaN or inf"):
            checkpoint.save_checkpoint(tmp_path, 2, trainer)
    assert not (tmp_path / "checkpoints" / "step_000002.tmp").exists()
    assert checkpoint.read_metadata(tmp_path)["step"] == 1


def test_export_hf_refuses_a_file_or_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    assert checkpoint.main(["export-hf", str(tmp_path), str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'file'} is a file: export-hf writes "
                                       f"a folder (give a new or an empty one)\n")
    assert checkpoint.main(["export-hf", str(tmp_path), str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'full'} is not empty (1 entry): give a new or an empty folder, "
        f"or pass --force to write into it\n")
    assert checkpoint.main(["export-hf", str(tmp_path / "run"), str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.startswith(f"error: no checkpoint at {tmp_path / 'run'}")
    assert not (tmp_path / "new").exists()
