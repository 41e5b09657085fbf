"""docs/config.md is generated from the run-config models: it must match them, and every field
must say what it does."""

from __future__ import annotations

from services.common.runconfig import RunConfig
from tools.config_doc import OUT, _models, render


def test_the_config_reference_matches_the_models() -> None:
    assert OUT.read_text() == render(), "docs/config.md is stale: run `make docs`"


def test_every_config_field_is_documented() -> None:
    missing = [
        f"{path or '.'}:{name}"
        for path, m in _models(RunConfig)
        for name, f in m.model_fields.items()
        if not f.description
    ]
    assert not missing, f"fields without a docstring: {missing}"
