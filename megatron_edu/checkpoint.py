"""Checkpoints that survive crashes and change of layout.

A checkpoint is a folder ``OUT/checkpoints/step_000100/`` holding

* ``model_tp{t}_pp{p}.pt`` — written by data-parallel rank 0 of each (tp, pp) position: that
  rank's parameter shards and their AdamW moments, by parameter name, with the dimension each is
  split along (``tp_dim``). Under ZeRO-1 the moments are first assembled over dp.
* ``rng_rank{r}.pt`` — every rank's random-number state (torch and the dropout streams), so a
  resumed run on the same layout continues bit for bit.
* ``tokenizer.model`` — the sentencepiece model the run trained with, so that the folder
  stands on its own (generation, export).
* ``meta.json`` — written last: step, model config, layout, training state (data sampler
  position, ...), and the size of every file above, checked on load.

**Atomic.** Ranks write into ``step_000100.tmp/``; after a barrier rank 0 writes ``meta.json``,
renames the folder in one step and then points ``OUT/checkpoints/latest`` at it (also by rename).
A crash at any moment leaves the previous checkpoint and ``latest`` as they were.

**Reshardable.** A checkpoint stores shards, but a reader can rebuild every tensor whole
(concatenate the tp shards along ``tp_dim``, trim the vocabulary padding) and cut it again for
any other tp × pp × dp — so a run saved at tp=2, pp=2 resumes at tp=1, pp=4 (2104.04473 trains
at one layout; a learner tries several).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_edu.model import GPTConfig
from megatron_edu.model.gpt import WORD_EMBEDDING
from megatron_edu.ptdp import PTDP
from megatron_edu.tensor_parallel.init import shard

__all__ = ["save_checkpoint", "load_checkpoint", "read_metadata", "load_full_model_state",
           "resolve_checkpoint", "check_model", "export_hf", "CheckpointError"]

FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
TOKENIZER = "tokenizer.model"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


# --- saving --------------------------------------------------------------------------------------

def save_checkpoint(out_dir: str | Path, step: int, trainer: PTDP,
                    state: dict[str, Any] | None = None, tokenizer: Path | None = None) -> Path:
    """Save ``trainer`` after ``step`` optimizer steps (a collective: every rank calls it).

    ``state``: anything else a resumed run needs (the data sampler's position, ...), JSON-able.
    ``tokenizer``: a sentencepiece model, copied in so that the checkpoint stands on its own.
    """
    root = Path(out_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    staging = root / f"step_{step:06d}.tmp"
    grid = trainer.grid
    if grid.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # the leftovers of a crashed save
        staging.mkdir(parents=True)
    dist.barrier()
    shards = _local_shards(trainer)                  # collective over tp (and dp for ZeRO-1)
    if grid.dp_rank == 0:
        torch.save(shards, staging / f"model_tp{grid.tp_rank}_pp{grid.pp_rank}.pt")
    torch.save(_rng_state(trainer), staging / f"rng_rank{grid.rank}.pt")
    dist.barrier()
    if grid.rank == 0:
        if tokenizer is not None:
            shutil.copyfile(tokenizer, staging / TOKENIZER)
        meta = {"format": FORMAT, "step": step, "config": vars(trainer.config),
                "layout": {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp,
                           "num_chunks": trainer.options.num_chunks},
                "state": state or {},
                "tokenizer": TOKENIZER if tokenizer is not None else None,
                "files": {f.name: f.stat().st_size for f in sorted(staging.iterdir())}}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():                          # saving the same step again
            shutil.rmtree(final)
        os.replace(staging, final)
        _write_atomically(root / "latest", final.name)
    dist.barrier()
    return final


def _local_shards(trainer: PTDP) -> dict[str, Any]:
    """This rank's parameter shards and moments by name (vocabulary padding included)."""
    if trainer.options.zero1:
        by_param = trainer.optimizer.param_states()
    else:
        by_param = {p: trainer.optimizer.state.get(p, {}) for p in trainer.parameters()}
    params, moments, tp_dims, steps = {}, {}, {}, []
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            params[name] = p.detach().clone()
            tp_dims[name] = p.tp_dim
            state = by_param.get(p, {})
            if state:
                moments[name] = {k: state[k].detach().clone() for k in MOMENTS}
                steps.append(float(state["step"]))
    return {"params": params, "moments": moments, "tp_dim": tp_dims,
            "adam_step": max(steps, default=0.0)}


def _rng_state(trainer: PTDP) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(),
             "trackers": [chunk.rng.get_states() for chunk in trainer.chunks]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- finding and checking ------------------------------------------------------------------------

def resolve_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """A checkpoint folder from itself, a run's output folder, or its ``checkpoints/`` folder:
    the latest one there, or the one of ``step``."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if step is not None:
            if (candidate / f"step_{step:06d}" / "meta.json").exists():
                return candidate / f"step_{step:06d}"
            continue
        if (candidate / "meta.json").exists():
            return candidate
        if (candidate / "latest").exists():
            return candidate / (candidate / "latest").read_text().strip()
    if step is not None:
        raise CheckpointError(f"no checkpoint of step {step} in {path}")
    raise CheckpointError(f"no checkpoint at {path}: expected a folder with meta.json, or a run "
                          f"folder whose checkpoints/latest names one")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, after checking that every file it lists is complete."""
    path = resolve_checkpoint(path)
    meta_file = path / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"corrupt checkpoint: cannot read {meta_file}: {err}") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: format {meta.get('format')!r}, this code reads "
                              f"format {FORMAT}")
    for name, size in meta["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"incomplete checkpoint: {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"corrupt checkpoint: {file} has {file.stat().st_size} bytes, "
                                  f"{size} were written")
    meta["path"] = str(path)
    if meta["tokenizer"] is not None:
        meta["tokenizer"] = str(path / meta["tokenizer"])
    return meta


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or overwritten file: name it
        raise CheckpointError(f"corrupt checkpoint file {file}: {err}") from err


# --- loading: whole tensors, then this rank's cut ------------------------------------------

def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter whole (tp shards joined, vocabulary padding trimmed), by name."""
    full, _ = _load_full(read_metadata(path))
    return full


def _load_full(meta: dict[str, Any]):
    """(parameters, moments) whole, by name, from every shard file of the checkpoint."""
    layout, path = meta["layout"], Path(meta["path"])
    vocab = meta["config"]["vocab_size"]
    params: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for pp_rank in range(layout["pp"]):
        files = [_load(path / f"model_tp{t}_pp{pp_rank}.pt") for t in range(layout["tp"])]
        for name, tp_dim in files[0]["tp_dim"].items():
            params[name] = _join(name, [f["params"][name] for f in files], tp_dim, vocab)
            if name in files[0]["moments"]:
                moments[name] = {k: _join(name, [f["moments"][name][k] for f in files], tp_dim,
                                          vocab) for k in MOMENTS}
    return params, (moments, files[0]["adam_step"])


def _join(name: str, shards: list[torch.Tensor], tp_dim: int | None, vocab: int) -> torch.Tensor:
    whole = shards[0] if tp_dim is None else torch.cat(shards, dim=tp_dim)
    return whole[:vocab] if name == WORD_EMBEDDING else whole


def load_checkpoint(path: str | Path, trainer: PTDP) -> dict[str, Any]:
    """Load a checkpoint into ``trainer`` (any layout); return its metadata (step, state).

    Same layout: also every rank's random state, so the run continues bit for bit. Another
    layout: weights and moments are cut anew; dropout streams start afresh (documented).
    """
    meta = read_metadata(path)
    check_model(meta, trainer.config)
    params, (moments, adam_step) = _load_full(meta)
    by_param: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for chunk in trainer.chunks:
            chunk.load_full_state_dict(params)
            for name, p in chunk.named_parameters():
                if name in moments:
                    by_param[p] = {k: _cut(moments[name][k], name, p, trainer)
                                   for k in MOMENTS}
                    by_param[p]["step"] = torch.tensor(adam_step)
    _load_optimizer(trainer, by_param)
    if _same_layout(meta, trainer):
        _load_rng(_load(Path(meta["path"]) / f"rng_rank{trainer.grid.rank}.pt"), trainer)
    return meta


def _cut(full: torch.Tensor, name: str, p: torch.nn.Parameter, trainer: PTDP) -> torch.Tensor:
    """This rank's slice of a whole tensor shaped like parameter ``name``."""
    group = trainer.grid.tp_group
    if name == WORD_EMBEDDING:
        full = F.pad(full, (0, 0, 0, trainer.config.padded_vocab(group.size) - full.shape[0]))
    return shard(full.to(p.device, p.dtype), p.tp_dim, group).clone()


def _load_optimizer(trainer: PTDP, by_param: dict) -> None:
    if not by_param:
        return                                   # saved before the first step
    if trainer.options.zero1:
        trainer.optimizer.load_param_states(by_param)
    else:
        for p, state in by_param.items():
            trainer.optimizer.state[p] = state


def _load_rng(state: dict[str, Any], trainer: PTDP) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for chunk, tracker_state in zip(trainer.chunks, state["trackers"], strict=True):
        chunk.rng.set_states(tracker_state)


def _same_layout(meta: dict[str, Any], trainer: PTDP) -> bool:
    grid = trainer.grid
    return meta["layout"] == {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp,
                              "num_chunks": trainer.options.num_chunks}


def check_model(meta: dict[str, Any], config: GPTConfig) -> None:
    """Raise a CheckpointError naming every size in which the checkpoint's model differs."""
    saved = GPTConfig(**meta["config"])
    shape = ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "ffn_hidden")
    diff = {k: (getattr(saved, k), getattr(config, k)) for k in shape
            if getattr(saved, k) != getattr(config, k)}
    if diff:
        raise CheckpointError(f"checkpoint {meta['path']} holds another model: " + ", ".join(
            f"{k} {a} in the checkpoint vs {b} here" for k, (a, b) in diff.items()))



# --- export --------------------------------------------------------------------------------------

def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a checkpoint (any layout) as a Hugging Face GPT-2 directory, tokenizer included."""
    from megatron_edu.model import GPT
    from megatron_edu.model.hf import save_hf_gpt2

    meta = read_metadata(checkpoint)
    model = GPT(GPTConfig(**meta["config"]))
    model.load_full_state_dict(load_full_model_state(checkpoint))
    out_dir = Path(out_dir)
    save_hf_gpt2(model, out_dir)
    if meta["tokenizer"] is not None:
        shutil.copyfile(meta["tokenizer"], out_dir / TOKENIZER)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_edu.checkpoint export-hf RUN_OR_CHECKPOINT OUT_DIR"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_edu.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export-hf", help="write a Hugging Face GPT-2 directory")
    export.add_argument("checkpoint", help="a run folder (its latest checkpoint) or a checkpoint")
    export.add_argument("out", help="the directory to write")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {export_hf(args.checkpoint, args.out)}")
    except CheckpointError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
