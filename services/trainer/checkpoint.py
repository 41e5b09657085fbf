"""Atomic trainer checkpoints: model, optimizer, weight version, step and the trained trajectory ids.

A checkpoint is one file `step_<n>.pt`, written to a temporary name, fsynced and renamed, so a crash
leaves either the previous checkpoint or the new one, never a torn file. The trained ids travel with
the weights they produced: after a restart the trainer skips exactly what its weights already saw.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d{8})\.pt$")


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    trained_ids: set[str] = field(default_factory=set)


def checkpoint_dir(template: str, run_id: str) -> Path:
    return Path(template.format(run_id=run_id))


def latest(directory: Path) -> Path | None:
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def newer_than(directory: Path, step: int) -> list[Path]:
    """Checkpoints of steps after `step`."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if (m := _NAME.match(p.name)) and int(m.group(1)) > step)


def save(directory: Path, state: TrainerState, model: torch.nn.Module, optimizer: Any, keep: int = 2) -> Path:
    """Writes `step_<n>.pt` atomically and prunes all but the newest `keep` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{state.step:08d}.pt"
    tmp = final.with_name(final.name + ".tmp")
    payload = {
        "step": state.step,
        "version": state.version,
        "trained_ids": sorted(state.trained_ids),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
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
    olds = sorted(p for p in directory.iterdir() if _NAME.match(p.name))
    for p in olds[: max(len(olds) - keep, 0)]:
        p.unlink(missing_ok=True)
    return final


def restore(path: Path, model: torch.nn.Module, optimizer: Any) -> TrainerState:
    """Loads a checkpoint into `model` and `optimizer` in place and returns the bookkeeping."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    return TrainerState(
        step=int(payload["step"]), version=int(payload["version"]), trained_ids=set(payload["trained_ids"])
    )
