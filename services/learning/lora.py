"""LoRA (training.lora) with the peft library: the trainer wraps the policy so that only the low-rank
adapters train, and whatever leaves the trainer — a weight push, a policy export — is the merged
model W + (alpha / rank) B A under the plain model's names, so engines and exports never see peft."""

from __future__ import annotations

from typing import Any

import torch

from services.common.runconfig import LoraConfig

ADAPTER = "default"


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """The model with an adapter on every targeted linear layer (B starts at zero: the wrapped
    model computes exactly what the plain one does until it trains)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets), lora_dropout=0.0, bias="none"
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:  # no module of the model matches the targets
        raise ValueError(f"training.lora.targets {cfg.targets}: {err}") from None


@torch.no_grad()
def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter's delta added to the weight it adapts."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {
        f"{name}.weight": module.get_delta_weight(ADAPTER)  # type: ignore[attr-defined]
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = value + deltas[plain].to(value.dtype) if plain in deltas else value
    return out


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")
