"""OpenEnv environments as a `task.environment`, unchanged: an `openenv.core` `Environment` class run
in the environment workers, or an OpenEnv server already running (its container, `uvicorn
app:app`), reached over its WebSocket session protocol (`GenericEnvClient`).

    task:
      environment: services.scheduler.openenv_env:OpenEnv
      environment_args: {env: my_game:GuessEnvironment}     # in-process, with task.plugin_paths
      # environment_args: {url: http://10.0.0.7:8000}        # or a running server

Each trajectory is one episode: `reset` (seeded by the row's `seed`, else by its prompt id, so a
GRPO group plays the same episode) gives the prompt, the observation's text as the user's message
(after the row's `system`, if any); each turn is a `step` whose action is the model's text in the
action's `action_field` (default `message`); the observation's text is what the model sees next,
and the trajectory's reward is the sum of its steps' rewards when an observation says `done`. An
observation's text is its `observation_field`, else its one text field, else its fields as JSON.
An episode cut short (`task.max_turns`, the context) is scored by `task.reward`, else 0.
"""

from __future__ import annotations

import importlib
import json
import typing
import zlib
from typing import Any

from services.scheduler.plugin_worker import resolve

_RESERVED = ("reward", "done", "metadata")


def _load(ref: str, what: str) -> Any:
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {ref!r} is not module:Class")
    return resolve(ref)


def _openenv() -> Any:
    try:
        return importlib.import_module("openenv.core")
    except ImportError as e:
        raise ImportError(
            f"OpenEnv is not installed ({e}): pip install --no-deps openenv==0.10.0 && pip install fastmcp==4.2.3"
        ) from None


def _action_class(env_cls: type) -> type:
    """The Action type an `Environment[Action, Observation, State]` subclass declares."""
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    raise ValueError(f"{env_cls.__name__} does not declare its Action type: give environment_args.action")


class OpenEnv:
    """One episode of an OpenEnv environment (the `environment_args` are this constructor's)."""

    def __init__(
        self,
        env: str | None = None,
        url: str | None = None,
        action: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        env_args: dict[str, Any] | None = None,
        reset_args: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """`env`: an Environment class (`module:Class`) to run here, or `url`: a running server;
        `action`: its Action class (`module:Class`; default: the one the Environment declares);
        `env_args`: the Environment's constructor arguments; `reset_args`: more arguments of
        every `reset`; `timeout_s`: a server's answer to one call."""
        if (env is None) == (url is None):
            raise ValueError("OpenEnv takes one of environment_args.env (a class) or .url (a server)")
        self.field, self.text_field = action_field, observation_field
        self.reset_args = dict(reset_args or {})
        self.reward = 0.0
        self.client: Any = None
        self.env: Any = None
        core = _openenv()
        if url is not None:
            self.client = core.GenericEnvClient(base_url=url, message_timeout_s=timeout_s).sync()
            return
        env_cls = _load(str(env), "environment_args.env")
        self.action_cls = _load(action, "environment_args.action") if action else _action_class(env_cls)
        self.env = env_cls(**(env_args or {}))

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        seed = sample.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            seed = zlib.crc32(str(sample.get("prompt_id", json.dumps(sample, sort_keys=True))).encode())
        self.reward = 0.0
        if self.client is not None:
            obs, _, _ = self._result(self.client.reset(seed=seed, **self.reset_args))
        else:
            obs = self.env.reset(seed=seed, **self.reset_args).model_dump()
        system = sample.get("system")
        head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        return [*head, {"role": "user", "content": self._text(obs)}]

    def step(self, response: str) -> dict[str, Any]:
        if self.client is not None:
            obs, reward, done = self._result(self.client.step({self.field: response}))
        else:
            out = self.env.step(self.action_cls(**{self.field: response}))
            obs, reward, done = out.model_dump(), out.reward, out.done
        self.reward += float(reward or 0.0)
        if done:
            self.close()
            return {"done": True, "reward": self.reward}
        return {"observation": self._text(obs) or "(continue)"}

    def close(self) -> None:
        """Ends the episode's session (a server's WebSocket) or the environment."""
        target, self.client, self.env = self.client or self.env, None, None
        closer = getattr(target, "close", None)
        if closer is not None:
            closer()

    @staticmethod
    def _result(result: Any) -> tuple[dict[str, Any], Any, bool]:
        return dict(result.observation or {}), result.reward, bool(result.done)

    def _text(self, obs: dict[str, Any]) -> str:
        fields = {k: v for k, v in obs.items() if k not in _RESERVED}
        if self.text_field is not None:
            if self.text_field not in fields:
                raise ValueError(f"the observation has no field {self.text_field!r}: it has {sorted(fields)}")
            return str(fields[self.text_field])
        texts = [v for v in fields.values() if isinstance(v, str)]
        return texts[0] if len(texts) == 1 else json.dumps(fields, default=str)
