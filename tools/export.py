"""The trained policy in Hugging Face format: a trainer checkpoint's weights in the run's model
architecture, with its tokenizer, loadable by `transformers.AutoModelForCausalLM.from_pretrained`
(`runs/<id>/final` when a job completes; `libra export RUN` for an earlier run). A LoRA run's
policy is the merged model, with its adapter in `adapter/` (loadable by peft on the base model)."""

from __future__ import annotations

from pathlib import Path

from services.common.runconfig import RunConfig
from services.learning.checkpoint import save_policy


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
    adapter = None
    if cfg.training.lora is not None and cfg.training.backend != "emulated":
        from services.learning.lora import merged_state, wrap

        adapter = wrap(load_model(cfg.model), cfg.training.lora)
    try:
        (adapter or model).load_state_dict(payload["model"])
        if adapter is not None:
            model.load_state_dict(merged_state(adapter))
    except (KeyError, RuntimeError) as e:
        raise ExportError(f"{checkpoint} does not fit model {cfg.model.source}: {e}") from None
    meta = {
        "run_id": run_id,
        "step": int(payload["step"]),
        "weight_version": int(payload["version"]),
        "checkpoint": str(checkpoint),
        "model_source": cfg.model.source,
    }
    return save_policy(model, load_tokenizer(cfg.model), out, meta, adapter=adapter)
