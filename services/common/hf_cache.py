"""The local Hugging Face hub cache, read as huggingface_hub lays it out; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(
        Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def repo_dir(repo_id: str, kind: Literal["model", "dataset"]) -> Path:
    """Where the cache keeps `repo_id` (present or not)."""
    return hf_cache_dir() / f"{kind}s--{repo_id.replace('/', '--')}"


def snapshot(repo_id: str, kind: Literal["model", "dataset"], marker: str = "") -> Path | None:
    """The cached snapshot of `repo_id`: its `refs/main`, else the newest snapshot (holding `marker`
    where given); None when the cache has none."""
    repo = repo_dir(repo_id, kind)
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    candidates = [snapshots / ref.read_text().strip()] if ref.is_file() else []
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if snap.is_dir() and (not marker or (snap / marker).is_file()):
            return snap
    return None
