"""A model named by its Hugging Face id is taken from the local Hugging Face cache (this machine
cannot download): a cache entry made here, in the hub's own layout, loads; an absent one is a clear
error naming the cache path; a source that is neither is refused with a hint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.models import load_tokenizer, resolve_model_dir, vocabulary_size
from services.common.runconfig import ModelConfig

pytestmark = pytest.mark.integration


def test_a_cached_model_is_found_by_its_id(
    tiny_model: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(resolve_model_dir(tiny_model), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = ModelConfig(source="acme/tiny-chat")
    assert resolve_model_dir(cfg) == snapshot
    assert vocabulary_size(cfg) == vocabulary_size(tiny_model)
    assert load_tokenizer(cfg).encode("2+2") == load_tokenizer(tiny_model).encode("2+2")


def test_an_id_not_in_the_cache_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(
        SystemExit, match=r"not in the local Hugging Face cache .*hf/hub/models--Qwen--Qwen2.5-0.5B"
    ):
        resolve_model_dir(ModelConfig(source="Qwen/Qwen2.5-0.5B"))


def test_a_source_that_is_neither_is_refused_with_a_hint() -> None:
    with pytest.raises(ValidationError, match="did you mean 'smollm2'"):
        ModelConfig(source="smolm2")
    with pytest.raises(ValidationError, match="Hugging Face model id"):
        ModelConfig(source="Qwen/Qwen2.5/extra")
