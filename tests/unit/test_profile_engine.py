"""`python -m tools.profile_engine`: the hf engine's step times per batch size and draft width,
on a real (tiny, random) model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.profile_engine import main, profile


def test_every_batch_and_width_is_timed_with_its_body() -> None:
    got = profile("tiny-random", batches=(1, 3), widths=(0, 2), steps=2)
    assert [(r["batch"], r["width"], r["query_tokens"]) for r in got["rows"]] == [
        (1, 0, 1),
        (1, 2, 3),
        (3, 0, 3),
        (3, 2, 9),
    ]
    assert all(r["body_ms"] > 0 and r["step_ms"] > 0 for r in got["rows"])
    assert got["model"] == "tiny-random" and got["steps"] == 2 and got["prompt_tokens"] > 0


def test_the_profile_is_written_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tools.profile_engine as pe

    monkeypatch.setattr(pe, "BATCHES", (1,))
    monkeypatch.setattr(pe, "WIDTHS", (1,))
    monkeypatch.setattr(pe, "STEPS", 2)
    out = tmp_path / "p" / "profile.json"
    assert main(["--model", "tiny-random", "--out", str(out)]) == 0
    assert [r["width"] for r in json.loads(out.read_text())["rows"]] == [1]
