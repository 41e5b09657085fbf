"""Settings shared by every service, and the loader that turns a bad value into one clear message."""

from __future__ import annotations

import sys
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)


class CommonSettings(BaseSettings):
    """Where the stack is and how to report; read from LIBRA_* variables."""

    model_config = SettingsConfigDict(env_prefix="LIBRA_", extra="ignore", use_attribute_docstrings=True)

    run_id: str = Field("local", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Run scope of every NATS subject and Redis key (letters, digits, '-', '_')."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL for worker ownership."""
    config: str | None = None
    """Path of the YAML run config (model, task, buckets, budgets)."""
    log_format: Literal["json", "console"] = "json"
    """json for services, console for a terminal."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum log level."""
    otlp_endpoint: str | None = None
    """OTLP gRPC endpoint (e.g. http://jaeger:4317); unset keeps spans in-process only."""
    worker_id: str | None = None
    """Stable id of this process; defaults to <service>-<hostname>-<pid>."""


class ConfigFileError(SystemExit):
    """A configuration problem reported as one message on stderr, exit code 2, no traceback."""

    def __init__(self, message: str):
        print(message, file=sys.stderr)
        self.message = message
        super().__init__(2)


class SettingsError(ConfigFileError):
    """Exit with a readable list of what is wrong in the settings (exit code 2)."""

    def __init__(self, where: str, err: ValidationError):
        lines = [f"invalid configuration in {where}:"]
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "(root)"
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
        super().__init__("\n".join(lines))


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Builds `cls` from the environment; a bad value exits with a clear message, never a traceback."""
    try:
        return cls(**overrides)
    except ValidationError as err:
        raise SettingsError(
            cls.__name__ + f" (env prefix {cls.model_config.get('env_prefix')})", err
        ) from None
