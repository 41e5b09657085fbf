"""Libra's OpenAI-compatible endpoint for `task.agent`: `POST /v1/chat/completions` and
`/v1/completions` (and `GET /v1/models`), served by the scheduler on loopback. Each trajectory's agent gets its own key; a call
with it is that trajectory's next turn, answered when the turn's tokens come back. The key dies
with the trajectory. A request the endpoint cannot honour gets an OpenAI-style 4xx naming the
field, and changes nothing. Bound beyond loopback, the keys would cross the network: there it
serves HTTPS with the scheduler's certificate, and will not start without one (`endpoint_tls`)."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
import ssl
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.logging import get_logger
from services.common.tls import TlsFiles, is_loopback
from services.scheduler.agents import AgentOutcome
from services.scheduler.chat_api import (
    ApiError,
    ChatRequest,
    chat_chunk,
    completion_chunks,
    completion_id,
    parse_completion,
    parse_request,
    streamed_content,
    text_chunk,
    text_completion_chunks,
)

Chunks = Callable[[dict[str, Any], bool, str | None], list[dict[str, Any]]]
"""A completion as the server-sent events of a stream (after what went out as it generated)."""

MAX_BODY_BYTES = 8 << 20
"""A request body larger than this is refused (413)."""
ENDED_KEYS_KEPT = 100_000
"""Keys of ended trajectories remembered, so that a late call hears `trajectory_ended` (410)."""


class EndpointInsecure(ValueError):
    """The endpoint would carry trajectories' keys in the clear beyond this host."""


@dataclass(frozen=True)
class EndpointTls:
    """How the endpoint is served beyond loopback: its server context, and the stack's CA that
    agents verify it with (None: the certificate is one their default trust store accepts)."""

    context: ssl.SSLContext
    ca_file: str | None


def endpoint_tls(host: str, tls: TlsFiles | None) -> EndpointTls | None:
    """None on loopback (no other machine reaches it); elsewhere HTTPS with the scheduler's
    certificate (`LIBRA_TLS_CERT_FILE`, `LIBRA_TLS_KEY_FILE`), and without one EndpointInsecure."""
    if is_loopback(host):
        return None
    if tls is None or (context := tls.server_ssl()) is None:
        raise EndpointInsecure(
            f"the agent endpoint would listen on {host} (LIBRA_SCHEDULER_AGENT_HOST), beyond this host, "
            "and carry each trajectory's key in the clear: give the scheduler a certificate "
            "(LIBRA_TLS_CERT_FILE and LIBRA_TLS_KEY_FILE; `libra credentials DIR --tls` makes them) or "
            "leave it on loopback"
        )
    return EndpointTls(context, tls.ca_file)


def trust_bundle(ca_file: str, directory: Path) -> Path:
    """The default CA bundle plus the stack's CA, in one file: what an agent's clients (httpx, so the
    `openai` client; requests; Python's ssl) read from `SSL_CERT_FILE` / `REQUESTS_CA_BUNDLE`, so
    that they verify the endpoint and every public server as before, with no change to the agent."""
    import certifi

    out = directory / "ca-bundle.pem"
    out.write_text(Path(certifi.where()).read_text() + "\n" + Path(ca_file).read_text())
    return out


@dataclass
class Call:
    """One chat-completions call, waiting for its turn."""

    request: ChatRequest
    answer: asyncio.Future[tuple[int, dict[str, Any]]]
    created: int = field(default_factory=lambda: int(time.time()))
    rid: str = ""
    """Its completion's id (set when its trajectory takes it as a turn)."""
    shown: str = ""
    """With `stream`: what of the turn's content is already sure, as it generates (`show`)."""
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    def show(self, text: str) -> None:
        """The turn's content is sure to begin with `text` (more than before: it only grows)."""
        if len(text) > len(self.shown) and text.startswith(self.shown):
            self.shown = text
            self.moved.set()

    def reply(self, status: int, body: dict[str, Any]) -> None:
        if not self.answer.done():
            self.answer.set_result((status, body))

    def refuse(self, err: ApiError) -> None:
        self.reply(err.status, err.body())


@dataclass
class Ended:
    """The agent's run returned (or failed)."""

    outcome: AgentOutcome


@dataclass
class AgentSession:
    """One trajectory's side of the endpoint: the calls its agent makes, one at a time, and what the
    conversation was when Libra last answered (a call must repeat it to continue it)."""

    trajectory_id: str
    key: str
    events: asyncio.Queue[Call | Ended] = field(default_factory=asyncio.Queue)
    pending: Call | None = None
    """The call made and not yet answered (one at a time)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The last call's messages and Libra's reply to it, in normal form."""
    tools: list[dict[str, Any]] | None = None
    completions: bool = False
    """Its calls are (text) completions, not chat completions."""
    text: str | None = None
    """Completions with text prompts: the prompt and the completions returned so far."""
    context: list[int] = field(default_factory=list)
    """The trajectory's tokens when Libra last answered: the context it sampled from and what
    it sampled (a token-id prompt must begin with them to continue it)."""
    ended: bool = False

    def submit(self, request: ChatRequest) -> asyncio.Future[tuple[int, dict[str, Any]]]:
        if self.ended:
            raise ApiError(410, "trajectory_ended", "this trajectory has ended; its key is no longer valid")
        if self.pending is not None:
            raise ApiError(
                409, "call_in_progress", "a trajectory's calls are one at a time: await the last one"
            )
        self.pending = Call(request, asyncio.get_running_loop().create_future())
        self.events.put_nowait(self.pending)
        return self.pending.answer

    async def next_event(self) -> Call | Ended:
        return await self.events.get()

    def answer(self, status: int, body: dict[str, Any]) -> None:
        if self.pending is not None:
            self.pending.reply(status, body)
            self.pending = None

    def refuse(self, err: ApiError) -> None:
        """The pending call is refused; the agent may call again."""
        if self.pending is not None:
            self.pending.refuse(err)
            self.pending = None

    def close(self) -> None:
        """The trajectory ended: calls waiting get `trajectory_ended`."""
        self.ended = True
        gone = ApiError(410, "trajectory_ended", "the trajectory ended before this call was answered")
        if self.pending is not None:
            self.pending.refuse(gone)
            self.pending = None


DIVERGED = (
    "the turn's tokens differ from those this stream sent as it generated (its engine failed and "
    "the turn was sampled again): what went out cannot be taken back, so the stream ends here"
)


async def _event_stream(request: web.Request) -> web.StreamResponse:
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    return stream


async def _send(stream: web.StreamResponse, events: list[dict[str, Any]], done: bool = False) -> bool:
    """Writes server-sent events (and `[DONE]` after them); False if the client has gone."""
    try:
        for event in events:
            await stream.write(f"data: {json.dumps(event)}\n\n".encode())
        if done:
            await stream.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        return False
    return True


class AgentEndpoint:
    def __init__(
        self,
        host: str,
        port: int,
        model: str,
        max_context_tokens: int,
        vocab_size: int = 1 << 31,
        tls: TlsFiles | None = None,
    ):
        """`vocab_size`: token ids a completions prompt may hold; `tls`: the scheduler's
        certificate, served beyond loopback (EndpointInsecure there without one)."""
        self.host, self.port, self.model = host, port, model
        self.tls = endpoint_tls(host, tls)
        self._trust_dir: Path | None = None
        self.agent_env: dict[str, str] = {}
        """What an agent run's environment adds so that its clients verify the endpoint (HTTPS)."""
        self.max_context_tokens, self.vocab_size = max_context_tokens, vocab_size
        self.sessions: dict[str, AgentSession] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.runner: web.AppRunner | None = None
        self.log = get_logger(component="agent_endpoint")
        self.refused: dict[str, int] = {}
        """Refused calls by error code, for the report."""

    @property
    def base_url(self) -> str:
        if self.tls is None:
            return f"http://{self.host}:{self.port}/v1"
        # bound to every address: agents beside the scheduler reach it by a name its certificate has
        host = "localhost" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"https://{host}:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.create_server((self.host, self.port))  # port 0: the kernel picks a free one
        self.port = sock.getsockname()[1]
        context = self.tls.context if self.tls is not None else None
        if self.tls is not None and self.tls.ca_file is not None:
            self._trust_dir = Path(tempfile.mkdtemp(prefix="libra-agent-trust-"))
            bundle = str(trust_bundle(self.tls.ca_file, self._trust_dir))
            self.agent_env = {"SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle}
        await web.SockSite(self.runner, sock, ssl_context=context).start()
        self.log.info("agent_endpoint_ready", base_url=self.base_url, tls=context is not None)

    async def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self._trust_dir is not None:
            shutil.rmtree(self._trust_dir, ignore_errors=True)

    def open(self, trajectory_id: str) -> AgentSession:
        session = AgentSession(trajectory_id, "lk-" + secrets.token_urlsafe(24))
        self.sessions[session.key] = session
        return session

    def drop(self, session: AgentSession) -> None:
        session.close()
        self.sessions.pop(session.key, None)
        self.ended[session.key] = None
        while len(self.ended) > ENDED_KEYS_KEPT:
            self.ended.popitem(last=False)

    def _session(self, request: web.Request) -> AgentSession:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        session = self.sessions.get(key)
        if session is not None:
            return session
        if key in self.ended:
            raise ApiError(410, "trajectory_ended", "this trajectory has ended; its key is no longer valid")
        raise ApiError(401, "invalid_api_key", "unknown key: each trajectory's agent gets its own (api_key)")

    def _refused(self, err: ApiError) -> web.Response:
        self.refused[err.code] = self.refused.get(err.code, 0) + 1
        self.log.warning("agent_call_refused", code=err.code, param=err.param, reason=err.message)
        return web.json_response(err.body(), status=err.status)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(
            request, lambda body: parse_request(body, self.max_context_tokens), completion_chunks
        )

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        def parse(body: Any) -> ChatRequest:
            return parse_completion(body, self.max_context_tokens, self.vocab_size)

        return await self._call(request, parse, text_completion_chunks)

    async def _call(
        self,
        request: web.Request,
        parse: Callable[[Any], ChatRequest],
        chunks: Chunks,
    ) -> web.StreamResponse:
        """One call: checked, handed to its trajectory, answered when its turn is (as JSON, or as
        server-sent events)."""
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, "request_too_large", f"the body exceeds {MAX_BODY_BYTES} bytes") from None
            except ValueError as err:
                raise ApiError(400, "invalid_json", f"the body is not JSON: {err}") from None
            call = parse(body)
            answer = session.submit(call)
            pending = session.pending
        except ApiError as err:
            return self._refused(err)
        stream, sent = (None, "") if pending is None else await self._as_generated(request, pending)
        status, out = await answer
        if status >= 400:
            self.refused[out["error"]["code"]] = self.refused.get(out["error"]["code"], 0) + 1
        if stream is None:
            if status >= 400 or not call.stream:
                return web.json_response(out, status=status)
            stream = await _event_stream(request)
            events = chunks(out, call.include_usage, None)
        elif status >= 400:
            events = [out]  # refused after its first tokens went out: the error ends the stream
        elif not streamed_content(out).startswith(sent):
            self.log.warning("streamed_turn_diverged", sent=len(sent))
            events = [ApiError(500, "stream_diverged", DIVERGED).body()]
        else:
            events = chunks(out, call.include_usage, sent)
        if await _send(stream, events, done=True):
            await stream.write_eof()
        return stream

    async def _as_generated(
        self, request: web.Request, pending: Call
    ) -> tuple[web.StreamResponse | None, str]:
        """A streamed call's content as its turn generates it (what is sure of it: `Call.show`),
        until the turn is answered: the stream opened (None: nothing went out, and a refusal can
        still be a 4xx), and what went out."""
        stream: web.StreamResponse | None = None
        sent = ""
        ask = pending.request
        if not ask.stream:
            return None, ""
        while not pending.answer.done():
            moved: asyncio.Future[Any] = asyncio.ensure_future(pending.moved.wait())
            waits: set[asyncio.Future[Any]] = {pending.answer, moved}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            moved.cancel()
            pending.moved.clear()
            new = pending.shown[len(sent) :]
            if not new or pending.answer.done():
                continue
            chat = ask.prompt is None
            head = {
                "id": completion_id(pending.rid, chat),
                "object": "text_completion",  # (a chat chunk names its own)
                "created": pending.created,
                "model": ask.model or self.model,
            }
            if chat:
                events = [chat_chunk(head, {"content": new})]
                if stream is None:
                    events.insert(0, chat_chunk(head, {"role": "assistant", "content": ""}))
            else:
                events = [text_chunk(head, new)]
            if stream is None:
                stream = await _event_stream(request)
            if not await _send(stream, events):
                break  # the agent went away: its turn goes on, and ends the trajectory's way
            sent = pending.shown
        return stream, sent

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as err:
            return self._refused(err)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "libra"}]}
        )
