"""The trained policy in Hugging Face format: a trainer checkpoint's weights in the run's model
architecture, with its tokenizer, loadable by `transformers.AutoModelForCausalLM.from_pretrained`
(`runs/<id>/final` when a job completes; `libra export RUN` for an earlier run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from services.common.runconfig import RunConfig


class ExportError(RuntimeError):
    """No policy to export: the checkpoint is missing or does not fit the run's model."""


def export_policy(cfg: RunConfig, checkpoint: Path, out: Path, run_id: str = "") -> Path:
    """Writes the checkpoint's model to `out` (safetensors, config, generation config, tokenizer and
    libra.json naming the run, step and weight version), replacing what was there."""
    import torch

    from services.common.models import load_model, load_tokenizer

    if not checkpoint.is_file():
        raise ExportError(f"no checkpoint at {checkpoint or '(none recorded)'}")
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = load_model(cfg.model)
    try:
        model.load_state_dict(payload["model"])
    except (KeyError, RuntimeError) as e:
        raise ExportError(f"{checkpoint} does not fit model {cfg.model.source}: {e}") from None
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    load_tokenizer(cfg.model).save_pretrained(tmp)
    meta = {
        "run_id": run_id,
        "step": int(payload["step"]),
        "weight_version": int(payload["version"]),
        "checkpoint": str(checkpoint),
        "model_source": cfg.model.source,
    }
    (tmp / "libra.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
