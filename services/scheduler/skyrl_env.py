"""skyrl-gym's environments as a `task.environment`, unchanged (the `environments` extra).

Rows in SkyRL's dataset format drive it: `prompt` (chat messages), `env_class` (a registered
skyrl-gym environment: `gsm8k`, `gsm8k_multi_turn`, `text2sql`, `search`, ...), `reward_spec`
(`ground_truth`, ...) and `extra_info`, as SkyRL's own preprocessing scripts write them. The
environment's `init` makes the prompt, each turn is its `step`, its observations are what the model
sees next, and the trajectory's reward is the sum of its steps' rewards.

    task:
      dataset: {path: gsm8k.parquet, prompt_key: prompt, answer_key: reward_spec}
      environment: services.scheduler.skyrl_env:SkyRLGym
"""

from __future__ import annotations

import importlib
from typing import Any


class SkyRLGym:
    def __init__(self) -> None:
        try:
            self.gym = importlib.import_module("skyrl_gym")
        except ImportError as e:
            raise ImportError(
                f"skyrl-gym is not installed ({e}): pip install 'libra[environments]'"
            ) from None
        self.env: Any = None
        self.reward = 0.0

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        env_id = sample.get("env_class")
        if not isinstance(env_id, str):
            raise ValueError("the row has no env_class (the skyrl-gym environment that plays it)")
        extras = {
            "reward_spec": sample.get("reward_spec") or {},
            "extra_info": sample.get("extra_info") or {},
            **({"max_turns": sample["max_turns"]} if "max_turns" in sample else {}),
        }
        self.env = self.gym.make(env_id, env_config=sample.get("env_config") or {}, extras=extras)
        prompt, _ = self.env.init(list(sample.get("prompt") or []))
        self.reward = 0.0
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]

    def step(self, response: str) -> dict[str, Any]:
        out = self.env.step(response)
        self.reward += float(out["reward"] or 0.0)
        if out["done"]:
            self.env.close()
            return {"done": True, "reward": self.reward}
        text = "\n".join(str(m.get("content", "")) for m in out["observations"] or [])
        return {"observation": text or "(continue)"}
