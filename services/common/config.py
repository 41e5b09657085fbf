"""Settings shared by every service, and the loader that turns a bad value into one clear message."""

from __future__ import annotations

import difflib
import os
import re
import socket
import ssl
import sys
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.credentials import NatsAuth
from services.common.ownership import OwnershipStore
from services.common.tls import TlsFiles
from services.common.weight_signing import HeaderSigner, HeaderVerifier

S = TypeVar("S", bound=BaseSettings)

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""A run id or worker id: a token of the subjects and keys it scopes."""


class CommonSettings(BaseSettings):
    """Where the stack is and how to report; read from LIBRA_* variables."""

    model_config = SettingsConfigDict(env_prefix="LIBRA_", extra="ignore", use_attribute_docstrings=True)

    run_id: str = Field("local", pattern=ID_PATTERN)
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
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics on this port (0: any free port, logged); unset: no metrics server."""
    metrics_addr: str = "127.0.0.1"
    """Address the metrics server binds (loopback by default; 0.0.0.0 for a scraper on another host)."""
    trace_dir: str | None = None
    """A job pinned by LIBRA_CONFIG writes its spans to TRACE_DIR/<run_id>/<worker_id>.jsonl
    (OTLP/JSON lines; `libra trace` reads them). Jobs submitted by `libra run` name their own."""
    otlp_endpoint: str | None = None
    """OTLP gRPC endpoint (e.g. http://jaeger:4317; https:// is TLS, verified with tls_ca_file or
    the system's roots); unset keeps spans in-process only."""
    worker_id: str | None = Field(None, pattern=ID_PATTERN)
    """Stable id of this process; defaults to the one its credentials name (a stack with an
    identity per worker), else <service>-<hostname>-<pid>. It is the last token of the subjects it
    speaks on, so letters, digits, `-` and `_` only."""
    identity_worker: str | None = None
    """The worker the credentials are for, in a stack with an identity per worker (the secrets
    directory's `libra_identity_worker`); such a worker runs only under that id."""
    nats_user: str | None = None
    """NATS user (the stack's credentials name one per service); unset connects without auth."""
    nats_password: SecretStr | None = None
    """NATS password of `nats_user`."""
    insecure: bool = False
    """Run without credentials (NATS, Redis and WeightSync unauthenticated), for a development
    stack only; `--insecure` sets it too. Without it a service that finds no credentials refuses
    to start, rather than silently joining a stack with no authentication."""
    redis_user: str | None = None
    """Redis ACL user (the stack's credentials name one per service, allowed only its own keys);
    unset authenticates as Redis's default user."""
    redis_password: SecretStr | None = None
    """Password of `redis_user`; unset connects without one."""
    weight_sync_token: SecretStr | None = None
    """Bearer token of the WeightSync gRPC service (distinct from the trainer's fencing token);
    engines refuse calls without it when set."""
    weight_sync_signing_key: SecretStr | None = None
    """A trainer's Ed25519 key that signs every weight push it sends (services/common/weight_signing.py)."""
    weight_sync_trainers: str | None = None
    """An engine's JSON map of trainer identities to their public keys: when set, it takes only
    pushes one of them signed."""

    tls_ca_file: str | None = None
    """CA bundle that verifies NATS, Redis (rediss:// URLs) and WeightSync servers; set it to use TLS
    between machines (docs/security.md)."""
    tls_cert_file: str | None = None
    """This process's certificate: engines serve WeightSync with it; clients present it where a
    server asks for one (mutual TLS)."""
    tls_key_file: str | None = None
    """Private key of `tls_cert_file`."""

    @model_validator(mode="after")
    def _check_tls(self) -> CommonSettings:
        self.tls()  # files exist, cert and key together
        return self

    def tls(self) -> TlsFiles | None:
        if not (self.tls_ca_file or self.tls_cert_file):
            return None
        return TlsFiles(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)

    def nats_tls(self) -> ssl.SSLContext | None:
        tls = self.tls()
        return tls.client_ssl() if tls is not None else None

    def nats_auth(self) -> NatsAuth | None:
        if self.nats_user is None or self.nats_password is None:
            return None
        return NatsAuth(self.nats_user, self.nats_password.get_secret_value())

    def require_credentials(self) -> None:
        """Exits (code 2) when this service has no NATS credentials and was not told `insecure`:
        a secrets mount that went missing must not turn into an unauthenticated service."""
        if self.insecure or self.nats_auth() is not None:
            return
        raise ConfigFileError(
            "no credentials: set LIBRA_SECRETS_DIR to this service's directory of the stack's "
            "credentials (`libra credentials DIR` writes them; `libra up` does it for you), or "
            "start with --insecure (LIBRA_INSECURE=1) to run without authentication (development only)"
        )

    def resolve_worker_id(self, service: str) -> str:
        """This process's worker id, checked against its credentials (exit code 2 on a mismatch):
        credentials of another kind, or of another worker, would have every message refused."""
        worker_id = self.worker_id or self.identity_worker or _default_worker_id(service)
        if self.nats_user is None:
            return worker_id
        if not _is_kind(self.nats_user, service):
            raise ConfigFileError(
                f"LIBRA_SECRETS_DIR holds the credentials of {self.nats_user!r}, not of a {service}: "
                f"mount this worker's own directory of the stack's credentials"
            )
        if self.identity_worker is not None and worker_id != self.identity_worker:
            raise ConfigFileError(
                f"worker id {worker_id!r} runs with the credentials of worker {self.identity_worker!r}: "
                "unset LIBRA_WORKER_ID or mount this worker's own credentials"
            )
        if not _is_kind(worker_id, service):
            raise ConfigFileError(
                f"worker id {worker_id!r} of a {service} must be {service} or {service}-<name>"
            )
        return worker_id

    def redis_secret(self) -> str | None:
        return self.redis_password.get_secret_value() if self.redis_password else None

    def ownership_store(self) -> OwnershipStore:
        """This service's Redis for the job's run, as its own ACL user (over TLS when configured)."""
        return OwnershipStore.from_url(
            self.redis_url, self.run_id, self.redis_secret(), self.tls(), username=self.redis_user
        )

    def grpc_token(self) -> str | None:
        return self.weight_sync_token.get_secret_value() if self.weight_sync_token else None

    def weight_signer(self) -> HeaderSigner | None:
        """What a trainer signs its pushes with; None only in a stack without WeightSync
        credentials. Credentials without the key are an error (exit 2): every push would be refused."""
        key = self.weight_sync_signing_key
        if key is None:
            if self.weight_sync_token is not None:
                raise ConfigFileError(_OLD_CREDENTIALS.format(name="libra_weight_sync_signing_key"))
            return None
        try:
            return HeaderSigner(key.get_secret_value())
        except ValueError as err:
            raise ConfigFileError(f"libra_weight_sync_signing_key: {err}") from None

    def weight_verifier(self) -> HeaderVerifier | None:
        """What an engine checks pushes with; None only in a stack without WeightSync credentials.
        Credentials without the trainers' keys, or a bad key map, are an error (exit 2): such an
        engine would take a push from anyone holding the bearer token."""
        if not self.weight_sync_trainers:
            if self.weight_sync_token is not None:
                raise ConfigFileError(_OLD_CREDENTIALS.format(name="libra_weight_sync_trainers"))
            return None
        try:
            return HeaderVerifier.from_json(self.weight_sync_trainers)
        except ValueError as err:
            raise ConfigFileError(f"libra_weight_sync_trainers: {err}") from None


_OLD_CREDENTIALS = (
    "LIBRA_SECRETS_DIR has a WeightSync token but no {name}: these credentials predate signed "
    "weight pushes; run `libra credentials DIR` again (it keeps the other secrets) and restart"
)


def _is_kind(name: str, service: str) -> bool:
    return name == service or name.startswith(service + "-")


def _default_worker_id(service: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())
    return f"{service}-{host}"[:50] + f"-{os.getpid()}"


class ConfigFileError(SystemExit):
    """A configuration problem reported as one message on stderr, exit code 2, no traceback."""

    def __init__(self, message: str):
        print(message, file=sys.stderr)
        self.message = message
        super().__init__(2)


class SettingsError(ConfigFileError):
    """Exit with a readable list of what is wrong in the settings (exit code 2)."""

    def __init__(self, where: str, err: ValidationError, model: type[BaseModel] | None = None):
        lines = [f"invalid configuration in {where}:"]
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "(root)"
            line = f"  {loc}: {e['msg']} (got {e.get('input')!r})"
            if e["type"] == "extra_forbidden" and model is not None:
                line += did_you_mean(model, e["loc"])
            lines.append(line)
        super().__init__("\n".join(lines))


SYNONYMS = {
    # what verl, TRL, OpenRLHF and friends call Libra's fields (the hint applies where the field exists)
    "learning_rate": "lr",
    "actor_lr": "lr",
    "max_steps": "steps",
    "total_training_steps": "steps",
    "num_steps": "steps",
    "num_generations": "group_size",
    "n_samples_per_prompt": "group_size",
    "rollout_n": "group_size",
    "n": "group_size",
    "max_completion_length": "max_new_tokens",
    "max_response_length": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "max_prompt_length": "max_context_tokens",
    "beta": "kl_coef",
    "kl_loss_coef": "kl_coef",
    "init_kl_coef": "kl_coef",
    "clip_ratio": "clip_eps",
    "epsilon": "clip_eps",
    "eps_clip": "clip_eps",
    "per_device_train_batch_size": "micro_batch",
    "ppo_micro_batch_size": "micro_batch",
    "micro_batch_size": "micro_batch",
    "num_rollout_workers": "engines",
    "num_engines": "engines",
    "tp": "tensor_parallel",
    "tensor_parallel_size": "tensor_parallel",
    "model_name_or_path": "source",
    "model_name": "source",
}
"""Field names users bring from other RL frameworks -> Libra's, for the did-you-mean hint."""


def did_you_mean(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """` — did you mean 'lr'?` for an unknown field at `loc`, with the fields of its section."""
    for part in loc[:-1]:
        if isinstance(part, int):  # an element of a list section
            continue
        field = model.model_fields.get(part)
        inner = [a for a in _flatten(field.annotation if field else None) if _is_model(a)]
        if not inner:
            return ""
        model = inner[0]
    known = list(model.model_fields)
    synonym = SYNONYMS.get(str(loc[-1]))
    close = [synonym] if synonym in known else difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f" — {hint}known: {', '.join(known)}"


def _flatten(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    return [x for a in args for x in _flatten(a)] if args else [annotation]


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Builds `cls` from the environment, and from the files in LIBRA_SECRETS_DIR (one file per
    setting, named like its variable, as Kubernetes and compose mount secrets); a bad value exits
    with a clear message, never a traceback."""
    secrets_dir = os.environ.get("LIBRA_SECRETS_DIR")
    if secrets_dir:
        if not Path(secrets_dir).is_dir():
            raise ConfigFileError(f"LIBRA_SECRETS_DIR={secrets_dir} is not a directory")
        overrides.setdefault("_secrets_dir", secrets_dir)
    try:
        return cls(**overrides)
    except ValidationError as err:
        raise SettingsError(
            cls.__name__ + f" (env prefix {cls.model_config.get('env_prefix')})", err
        ) from None
