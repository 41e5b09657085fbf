"""Typed errors that a boundary turns into an ErrorInfo reply or event."""

from __future__ import annotations


class LibraError(Exception):
    code = "internal"


class MalformedMessage(LibraError):
    """The bytes are not the protobuf message the subject carries."""

    code = "malformed"


class ForgedSender(LibraError):
    """A message on a worker's own subject names another worker (or kind) as its sender."""

    code = "forged_sender"


class InvalidMessage(LibraError):
    """The message decoded but breaks a contract rule (missing id, bad value)."""

    code = "invalid"


class StaleToken(LibraError):
    """The sender's fencing token is no longer current."""

    code = "stale_token"


class CredentialsRefused(LibraError):
    """The server (NATS, Redis) refused this process's credentials."""

    code = "unauthenticated"


class DurableStateLost(LibraError):
    """What the job's durable record points at is gone (a checkpoint volume lost or not mounted)."""

    code = "state_lost"


class UserCodeBroken(LibraError):
    """The job's own code (its reward, its environment) fails on every call: the job cannot
    make progress, so it ends failed with the error instead of replacing groups forever."""

    code = "user_code"


class FencedOut(LibraError):
    """This worker's role lease is no longer its own (it was paused or cut off past the lease and a
    standby took the role): nothing it holds is the job's any more. Its job starts over in the same
    process, as a standby (`services/common/control.py`)."""

    code = "fenced_out"


class Unavailable(LibraError):
    code = "unavailable"


def require(condition: bool, message: str) -> None:
    """Raises InvalidMessage unless `condition` holds; used to validate decoded messages."""
    if not condition:
        raise InvalidMessage(message)
