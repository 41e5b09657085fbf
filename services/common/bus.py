"""A small typed NATS/JetStream bus: protobuf in, protobuf out, trace context in headers.

Every handler runs behind one boundary: a message that does not decode, or that a handler rejects
with a LibraError, is logged, reported on the run's `errors` subject, and dropped; the subscription
keeps serving. Durable consumers ack only after the handler succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import context as otel_context

from services.common import subjects
from services.common.contracts import ev
from services.common.credentials import NatsAuth, inbox_prefix
from services.common.errors import CredentialsRefused, ForgedSender, LibraError, MalformedMessage
from services.common.logging import get_logger
from services.common.streams import FEED_ACK_WAIT_S, ConsumerSpec
from services.common.tasks import cancel_and_wait, retried
from services.common.tracing import extract_context, inject_headers

M = TypeVar("M", bound=Message)
T = TypeVar("T")

ERROR_HEADER = "Libra-Error"
"""On a reply: the handler refused the request; the body is an ErrorEvent (its code here too)."""


class Refused(LibraError):
    """The service asked refused the request (its typed error)."""

    code = "refused"


@dataclass
class Envelope:
    """What a handler gets besides the message: where it came from and its trace context."""

    subject: str
    headers: dict[str, str]
    context: otel_context.Context
    reply: str | None
    raw: Msg


Handler = Callable[[Any, Envelope], Awaitable[Message | None]]


async def connect_nats(
    url: str,
    name: str,
    auth: NatsAuth | None = None,
    tls: ssl.SSLContext | None = None,
    reconnected: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connects for good: waits for a NATS that is not up yet and reconnects forever (a restarting
    NATS comes back), with the stack's user and password when it has credentials (and then replies
    come to that user's own inbox prefix, which no other identity may read). Credentials the
    server refuses are a configuration error at once, not a silent retry loop. `reconnected` is
    called each time the connection is back, its subscriptions in place again."""
    log = get_logger(component="bus")
    refused = asyncio.Event()

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=str(e))
        # a TLS handshake that fails (a certificate not trusted, or none where the server wants
        # one) is configuration, like a refused password: it will not pass on a retry
        if "authorization violation" in str(e).lower() or isinstance(e, ssl.SSLError):
            refused.set()

    creds: dict[str, Any] = (
        {"user": auth.user, "password": auth.password, "inbox_prefix": inbox_prefix(auth.user)}
        if auth
        else {}
    )
    if tls is not None:
        creds["tls"] = tls
    if reconnected is not None:
        creds["reconnected_cb"] = reconnected
    connecting = asyncio.ensure_future(
        nats.connect(
            url,
            name=name,
            connect_timeout=5,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            **creds,
        )
    )
    refusal = asyncio.ensure_future(refused.wait())
    await asyncio.wait({connecting, refusal}, return_when=asyncio.FIRST_COMPLETED)
    refusal.cancel()
    if connecting.done():
        return connecting.result()
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    who = f"user {auth.user!r}" if auth else "a client without credentials"
    raise CredentialsRefused(
        f"NATS at {url} refused {who}, or the TLS handshake failed: set LIBRA_SECRETS_DIR "
        "(or LIBRA_NATS_USER/LIBRA_NATS_PASSWORD) to this stack's credentials, LIBRA_TLS_CA_FILE to "
        "the CA that signed the server's certificate and, where the server asks for one, "
        "LIBRA_TLS_CERT_FILE/LIBRA_TLS_KEY_FILE to a certificate of the stack's CA"
    )


def _kind(suffix: str) -> str:
    """A subject's kind: its first two parts (`turn.request.<engine>` -> `turn.request`)."""
    return ".".join(suffix.split(".", 2)[:2])


def decode(msg_type: type[M], data: bytes) -> M:
    try:
        out = msg_type()
        out.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise MalformedMessage(f"not a {msg_type.DESCRIPTOR.full_name}: {err}") from None
    return out


_CLAIMS = {"worker_id": 1, "engine_id": 1, "kind": 0, "service": 0}
"""Fields in which a message names its sender: the worker id (token 1 of the speaker) or kind (0)."""


def said_by(subject: str, msg: Message) -> None:
    """Checks that `msg`, received on the spoken `subject`, names only its speaker as its sender
    (an empty name is filled in from the subject); raises ForgedSender otherwise. The one statement
    about another worker: the trainer refusing that worker's join to its group (hybrid.state)."""
    speaker = subjects.speaker(subject)
    for name, token in _CLAIMS.items():
        if name not in msg.DESCRIPTOR.fields_by_name:
            continue
        claimed = getattr(msg, name)
        if not claimed:
            setattr(msg, name, speaker[token])
        elif claimed != speaker[token] and not _may_speak_for_another(subject, msg, speaker[0]):
            raise ForgedSender(f"{speaker[0]} {speaker[1]} sent a message whose {name} is {claimed!r}")


def _may_speak_for_another(subject: str, msg: Message, kind: str) -> bool:
    return (
        kind == "trainer"
        and isinstance(msg, ev.HybridState)
        and msg.state == "refused"
        and f".{subjects.HYBRID_STATE}." in subject
    )


class Bus:
    def __init__(self, nc: NATS, run_id: str, service: str, worker_id: str):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.run_id = run_id
        self.service = service
        self.worker_id = worker_id
        self.log = get_logger(component="bus")
        self._tasks: set[asyncio.Task[None]] = set()
        self.rejected = 0
        self.published = 0
        """Core-NATS messages this bus published (replies included)."""
        self.received = 0
        """Messages handed to this bus's subscription handlers."""
        self.bytes_out: Counter[str] = Counter()
        """Payload bytes published, by kind of subject (its first two parts: `turn.request`)."""
        self.bytes_in: Counter[str] = Counter()
        """Payload bytes handed to subscription handlers, by the kind of subject subscribed."""
        self.reconnects = 0
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        run_id: str,
        service: str,
        worker_id: str,
        auth: NatsAuth | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> Bus:
        made: list[Bus] = []

        async def reconnected() -> None:
            if made:
                made[0].reconnected()

        nc = await connect_nats(url, f"{service}:{worker_id}", auth, tls, reconnected)
        made.append(cls(nc, run_id, service, worker_id))
        return made[0]

    def on_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Runs `hook` (in the background) each time the connection to NATS is back. What core
        NATS carried while it was away is gone: a hook reads again what it follows, from the
        last-value stream that keeps it (a plan published in the gap, say)."""
        self._on_reconnect.append(hook)

    def reconnected(self) -> None:
        self.reconnects += 1
        self.log.info("nats_reconnected", reconnects=self.reconnects, hooks=len(self._on_reconnect))
        for hook in self._on_reconnect:
            self.spawn(hook())

    def subject(self, *parts: str) -> str:
        return subjects.subject(self.run_id, *parts)

    def outgoing(self, suffix: str) -> str:
        """The subject a message for `suffix` goes out on: a spoken one names this worker."""
        if suffix in subjects.SPOKEN:
            suffix = subjects.spoken(suffix, self.service, self.worker_id)
        return self.subject(suffix)

    async def publish(
        self, suffix: str, msg: Message, *, ctx: otel_context.Context | None = None, reply: str = ""
    ) -> None:
        data = msg.SerializeToString()
        await self.nc.publish(self.outgoing(suffix), data, reply=reply, headers=inject_headers(ctx))
        self.published += 1
        self.bytes_out[_kind(suffix)] += len(data)

    async def request(self, suffix: str, msg: Message, resp_type: type[M], timeout: float = 5.0) -> M:
        """Asks and decodes the answer; a refusal (the handler's typed error, sent as an ErrorEvent
        marked by the `Libra-Error` header) raises `Refused` unless `resp_type` is ErrorEvent."""
        resp = await self.nc.request(
            self.subject(suffix), msg.SerializeToString(), timeout=timeout, headers=inject_headers()
        )
        if (resp.headers or {}).get(ERROR_HEADER) and resp_type is not ev.ErrorEvent:
            err = decode(ev.ErrorEvent, resp.data).error
            raise Refused(f"{err.code}: {err.message}")
        return decode(resp_type, resp.data)

    async def subscribe(self, suffix: str, msg_type: type[M], handler: Handler, *, queue: str = "") -> Any:
        """Subscribes a handler; if it returns a message and the sender asked for a reply, it is sent.
        On a spoken subject it hears every worker, and only what each says for itself."""
        spoken = suffix in subjects.SPOKEN
        subj = self.subject(f"{suffix}.*.*" if spoken else suffix)
        kind = _kind(suffix)

        async def on_msg(raw: Msg) -> None:
            self.received += 1
            self.bytes_in[kind] += len(raw.data)
            out = await self._dispatch(raw, msg_type, handler, spoken)
            if raw.reply and out is not None:
                refused = isinstance(out, ev.ErrorEvent) and out.error.code
                headers = {ERROR_HEADER: out.error.code} if refused else None
                await self.nc.publish(raw.reply, out.SerializeToString(), headers=headers)
                self.published += 1

        sub = await self.nc.subscribe(subj, queue=queue, cb=on_msg)
        await self.nc.flush()  # the server knows the subscription before we report it ready
        return sub

    async def _dispatch(
        self, raw: Msg, msg_type: type[M], handler: Handler, spoken: bool = False
    ) -> Message | None:
        headers = dict(raw.headers or {})
        try:
            msg = decode(msg_type, raw.data)
            if spoken:
                said_by(raw.subject, msg)
            env = Envelope(raw.subject, headers, extract_context(headers), raw.reply or None, raw)
            return await handler(msg, env)
        except LibraError as err:
            await self.report_error(raw.subject, err.code, str(err))
            if raw.reply:
                return ev.ErrorEvent(
                    service=self.service,
                    worker_id=self.worker_id,
                    subject=raw.subject,
                    error=ev.ErrorInfo(code=err.code, message=str(err)),
                )
        except Exception as err:  # the boundary: a handler bug must not kill the subscription
            self.log.exception("handler_failed", subject=raw.subject)
            await self.report_error(raw.subject, "internal", f"{type(err).__name__}: {err}")
        return None

    async def report_error(self, subject: str, code: str, message: str) -> None:
        self.rejected += 1
        self.log.warning("message_rejected", subject=subject, code=code, reason=message)
        with contextlib.suppress(Exception):
            err = ev.ErrorEvent(
                service=self.service,
                worker_id=self.worker_id,
                subject=subject,
                error=ev.ErrorInfo(code=code, message=message[:500]),
            )
            await self.nc.publish(self.outgoing(subjects.ERRORS), err.SerializeToString())

    # --- JetStream -------------------------------------------------------------------------

    async def bind_stream(self, what: str) -> str:
        """The run's stream `what` (services/common/streams.py), once it exists: only the control
        identity creates streams, so a service started before `libra run` provisioned them waits."""
        name = subjects.stream_name(self.run_id, what)
        await self._until_there(lambda: self.js.stream_info(name), stream=name)
        return name

    async def _until_there(self, info: Callable[[], Awaitable[T]], **what: str) -> T:
        """`info()` once it answers: what it asks about is not there yet, or NATS is away."""
        hint = "`libra run` (the control identity) creates a run's streams and consumers"
        answer = await retried(
            info, self.log, "waiting_for_provisioning", warn_every=10, fields={**what, "hint": hint}
        )
        assert answer is not None  # (no stop: only an answer ends the wait)
        return answer

    async def publish_durable(
        self, suffix: str, msg: Message, *, msg_id: str, ctx: otel_context.Context | None = None
    ) -> None:
        """Publishes to a stream and waits for the server's ack; `msg_id` de-duplicates resends."""
        headers = inject_headers(ctx)
        headers["Nats-Msg-Id"] = msg_id
        await self.js.publish(self.subject(suffix), msg.SerializeToString(), headers=headers, timeout=10)

    async def publish_durable_until_stored(
        self, suffix: str, msg: Message, *, msg_id: str, ctx: otel_context.Context | None = None
    ) -> None:
        """`publish_durable`, retried with a backoff of 0.5 s per attempt (at most 5 s) until JetStream
        has stored it: for what must never be lost (completed trajectories, group outcomes)."""
        # JetStream away (NATS restarting): the msg id makes resends safe
        await retried(
            lambda: self.publish_durable(suffix, msg, msg_id=msg_id, ctx=ctx),
            self.log,
            "publish_retry",
            fields={"subject": suffix, "msg_id": msg_id},
        )

    async def bind_consumer(self, spec: ConsumerSpec) -> tuple[Any, float]:
        """Pulls from the run's durable consumer `spec` once the control identity created it;
        returns the subscription and the consumer's ack wait (seconds)."""
        stream = await self.bind_stream(spec.stream)
        info = await self._until_there(
            lambda: self.js.consumer_info(stream, spec.durable), stream=stream, consumer=spec.durable
        )
        psub = await self.js.pull_subscribe_bind(durable=spec.durable, stream=stream)
        return psub, float(info.config.ack_wait or FEED_ACK_WAIT_S)

    async def fetch(self, psub: Any, msg_type: type[M], batch: int, timeout: float) -> list[tuple[M, Msg]]:
        """Fetches up to `batch` messages; malformed ones are reported and terminated (never redelivered)."""
        try:
            raws = await psub.fetch(batch, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        out: list[tuple[M, Msg]] = []
        for raw in raws:
            try:
                out.append((decode(msg_type, raw.data), raw))
            except MalformedMessage as err:
                await self.report_error(raw.subject, err.code, str(err))
                await raw.term()
        return out

    async def last_message(self, suffix: str, what: str, msg_type: type[M]) -> M | None:
        """The last message on `suffix` in the run's last-value stream `what` (a direct get by
        subject: NATS users may be granted exactly the subjects they read)."""
        stream = subjects.stream_name(self.run_id, what)
        try:
            raw = await self.js.get_last_msg(stream, self.subject(suffix), direct=True)
        except nats.js.errors.NotFoundError:
            return None
        try:
            return decode(msg_type, raw.data or b"")
        except MalformedMessage as err:  # a garbage "last message" must not stop a service from starting
            await self.report_error(raw.subject or "", err.code, str(err))
            return None

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Runs a background task tied to the bus lifetime; failures are logged, not swallowed."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("background_task_failed", error=repr(t.exception()))

        task.add_done_callback(done)
        return task

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await close_nats(self.nc)


async def close_nats(nc: NATS) -> None:
    """Flushes what was published (acks included) and closes the connection.

    Not `drain()`: draining a pull subscription waits for messages nobody will fetch, and when a
    timeout then cancels it, nats-py leaves a cancelled gather whose exception is never retrieved.
    What a handler had not finished is redelivered (durable) or re-sent (watchdogs) anyway.
    """
    if nc.is_closed:
        return
    with contextlib.suppress(Exception):
        await nc.flush(timeout=2)
    with contextlib.suppress(Exception):
        await nc.close()
