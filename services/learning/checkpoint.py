"""Atomic trainer checkpoints: model, optimizer, weight version, step and the trained trajectory ids.

A checkpoint is one file `step_<n>-e<epoch>.pt`, written to a temporary name, fsynced and renamed,
so a crash leaves either the previous checkpoint or the new one, never a torn file. The epoch is the
writer's fencing token: a trainer that lost its lease (paused, partitioned) and writes step n anyway
cannot overwrite the step n its successor committed. The trained ids travel with the weights they
produced: after a restart the trainer skips exactly what its weights already saw.

Every committed step is durable (engines may serve its weights, and the ledger says what it
trained), but only every `training.checkpoint_every`-th (and the last) is *full*, with the
optimizer state; the others (`step_<n>-e<epoch>-weights.pt`) hold the weights and the bookkeeping
alone, a third of a full one under Adam. A trainer resuming from those takes the optimizer state
of the newest full checkpoint before them (moments a few steps old), or a fresh one if none is left.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d{8})(?:-e(\d+))?(-weights)?\.pt$")


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    trained_ids: set[str] = field(default_factory=set)


def checkpoint_dir(template: str, run_id: str) -> Path:
    return Path(template.format(run_id=run_id))


def _key(path: Path) -> tuple[int, int] | None:
    """(step, epoch) of a checkpoint file, None for anything else."""
    m = _NAME.match(path.name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def checkpoints(directory: Path) -> list[Path]:
    """Every checkpoint, oldest step first (and, within a step, lowest epoch first)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _key(p)), key=lambda p: _key(p) or (0, 0))


def latest(directory: Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def is_full(path: Path) -> bool:
    """Whether a checkpoint holds the optimizer state too (its name says so)."""
    m = _NAME.match(path.name)
    return m is not None and m.group(3) is None


def optimizer_source(directory: Path, step: int) -> Path | None:
    """The full checkpoint whose optimizer state a trainer resuming at `step` takes: the newest at or
    before it (None: none is left)."""
    full = [p for p in checkpoints(directory) if is_full(p) and step_of(p) <= step]
    return full[-1] if full else None


def step_of(path: Path) -> int:
    key = _key(path)
    if key is None:
        raise ValueError(f"{path} is not a checkpoint")
    return key[0]


def newer_than(directory: Path, step: int) -> list[Path]:
    """Checkpoints of steps after `step`."""
    return [p for p in checkpoints(directory) if step_of(p) > step]


RECENT = 2
"""A writer's newest checkpoints always kept, whatever they hold: only its newest can be
uncommitted (the next is written after the commit), so the last committed one always survives."""


def save(
    directory: Path,
    state: TrainerState,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any] | None,
    keep: int = 2,
    epoch: int = 0,
) -> Path:
    """Writes `step_<n>-e<epoch>.pt` (full) or, without `optimizer_state`, `...-weights.pt`
    atomically, then prunes: of this epoch's checkpoints all but its `RECENT` newest and the `keep`
    newest full ones (of any epoch: where a resume finds its optimizer state), and, once `RECENT` of
    its own are there, any other epoch's older than the oldest of those. A stale writer lags, so it
    never prunes what its successor wrote since."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = "" if optimizer_state is not None else "-weights"
    final = directory / f"step_{state.step:08d}-e{epoch}{suffix}.pt"
    tmp = final.with_name(final.name + ".tmp")
    payload = {
        "step": state.step,
        "version": state.version,
        "trained_ids": sorted(state.trained_ids),
        "model": model_state,
        "optimizer": optimizer_state,
    }
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    every = checkpoints(directory)
    own = [p for p in every if (_key(p) or (0, 0))[1] == epoch]
    recent = own[-RECENT:]
    kept = set(recent) | set([p for p in every if is_full(p)][-keep:])
    for p in every:
        if p not in kept and (p in own or (len(recent) >= RECENT and step_of(p) < step_of(recent[0]))):
            p.unlink(missing_ok=True)
    return final


def save_policy(model: Any, tokenizer: Any, out: Path, meta: dict[str, Any], adapter: Any = None) -> Path:
    """The policy in Hugging Face format (safetensors, config, tokenizer, and libra.json with
    `meta`), written beside `out` and renamed into place, replacing what was there; with
    `adapter` (a peft model) its LoRA adapter too, in `out/adapter`."""
    import json
    import shutil

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if adapter is not None:
        adapter.save_pretrained(tmp / "adapter")
    (tmp / "libra.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's payload: `model` and `optimizer` state dicts (the optimizer's keyed by
    parameter index, as `Optimizer.state_dict` makes it), step, version and trained ids."""
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def state_of(payload: dict[str, Any]) -> TrainerState:
    return TrainerState(
        step=int(payload["step"]), version=int(payload["version"]), trained_ids=set(payload["trained_ids"])
    )


def read_resumable(path: Path) -> tuple[dict[str, Any], Path | None]:
    """A checkpoint's payload with the optimizer state to resume with: its own (full), else that of
    the newest full checkpoint before it (`optimizer` None when none is left), and where that came
    from."""
    payload = read(path)
    if payload.get("optimizer") is not None:
        return payload, path
    source = optimizer_source(path.parent, step_of(path))
    if source is not None:
        payload["optimizer"] = read(source)["optimizer"]
    return payload, source


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An `Optimizer.state_dict` (parameters by index) with parameters by name, as
    torch.distributed.checkpoint's full optimizer state dict has them; `names` are the model's
    parameters in the optimizer's order."""
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_name`: the format checkpoints keep."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }
