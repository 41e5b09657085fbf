"""The OpenAI-compatible endpoint on a real loopback server, called with the `openai` client, and the
agent processes that run a user's agent: what a bad call, a stranger's key, a late call, a body too
large, an agent that raises, hangs, lies or dies each get — a typed answer, nothing else changed."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from services.common.pki import Authority
from services.common.tls import TlsFiles
from services.scheduler.agents import AgentPool, CommandAgents, check_agent, reward_of
from services.scheduler.chat_api import (
    ApiError,
    assistant_message,
    completion_body,
    text_completion_body,
    with_choices,
)
from services.scheduler.endpoint import MAX_BODY_BYTES, AgentEndpoint, AgentSession, Call, EndpointInsecure
from services.scheduler.plugins import PluginFailure, PluginLoadError

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


async def _answer_calls(session: AgentSession, replies: int) -> list[Call]:
    """The episode's side, reduced to answering each call with a fixed completion."""
    calls = []
    for i in range(replies):
        event = await session.next_event()
        assert isinstance(event, Call)
        calls.append(event)
        if event.request.prompt is not None:
            body = text_completion_body(
                str(i), "m", 0, f"answer {i}", "length", (3, 2), ["a", "b"], [-1.0, -2.0], None
            )
        else:  # `n` choices: "answer i", then "answer i.1", ...
            choices = [
                assistant_message(f"answer {i}" + (f".{k}" if k else ""), []) for k in range(event.request.n)
            ]
            body = with_choices(
                [completion_body(str(i), "m", 0, r, "stop", (3, 2), None, None, None) for r in choices]
            )
        session.answer(200, body)
    return calls


@pytest.fixture
async def endpoint() -> Any:
    ep = AgentEndpoint("127.0.0.1", 0, "tiny", max_context_tokens=512, vocab_size=1000)
    await ep.start()
    yield ep
    await ep.close()


def _client(ep: AgentEndpoint, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ep.base_url, api_key=key, max_retries=0, timeout=30)


async def test_a_call_is_answered_with_the_sessions_turn(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-1")
    episode = asyncio.create_task(_answer_calls(session, 1))
    out = await _client(endpoint, session.key).chat.completions.create(
        model="any", messages=USER, max_tokens=5, temperature=0.5, stop=["END"]
    )
    assert (
        out.choices[0].message.content == "answer 0" and out.usage is not None and out.usage.total_tokens == 5
    )
    (call,) = await episode
    assert (call.request.max_tokens, call.request.temperature, call.request.stop) == (5, 0.5, ["END"])
    models = await _client(endpoint, session.key).models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_a_streamed_call_reads_as_the_whole_completion(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-s")
    episode = asyncio.create_task(_answer_calls(session, 1))
    stream = await _client(endpoint, session.key).chat.completions.create(
        model="any", messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    await episode
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "answer 0"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5


async def test_a_call_with_n_reads_its_choices_plain_and_streamed(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-n")
    episode = asyncio.create_task(_answer_calls(session, 2))
    client = _client(endpoint, session.key)
    out = await client.chat.completions.create(model="any", messages=USER, n=2)
    assert [(c.index, c.message.content) for c in out.choices] == [(0, "answer 0"), (1, "answer 0.1")]
    stream = await client.chat.completions.create(model="any", messages=USER, n=2, stream=True)
    parts: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert parts == {0: "answer 1", 1: "answer 1.1"}
    calls = await episode
    assert [c.request.n for c in calls] == [2, 2]


async def test_a_streamed_call_reads_its_turn_as_it_generates(endpoint: AgentEndpoint) -> None:
    """The content goes out while the turn is still generating (the episode shows what is sure of
    it), and the rest when it is answered; a turn refused, or answered with other tokens than
    those streamed, ends its stream with a typed error."""
    for ending in ("answered", "refused", "diverged"):
        session = endpoint.open(f"traj-live-{ending}")
        client = _client(endpoint, session.key)
        calls: asyncio.Queue[Call] = asyncio.Queue()

        async def episode(session: AgentSession = session, calls: asyncio.Queue[Call] = calls) -> None:
            event = await session.next_event()
            assert isinstance(event, Call)
            event.rid = "live-1"
            event.show("Hel")
            calls.put_nowait(event)

        watcher = asyncio.create_task(episode())
        stream = await client.chat.completions.create(
            model="any", messages=USER, stream=True, stream_options={"include_usage": True}
        )
        chunks = aiter(stream)
        call = await calls.get()
        await watcher
        role, first = await anext(chunks), await anext(chunks)
        assert role.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "Hel"
        assert first.id == "chatcmpl-live-1" and not call.answer.done(), "it went out before the answer"
        call.show("Hello, wo")
        assert (await anext(chunks)).choices[0].delta.content == "lo, wo"
        if ending == "refused":
            session.refuse(ApiError(400, "context_length_exceeded", "too long"))
            with pytest.raises(openai.APIError, match="too long"):
                await anext(chunks)
            continue
        content = "Hello, world" if ending == "answered" else "Goodbye"
        reply = assistant_message(content, [])
        session.answer(
            200, completion_body("live-1", "m", call.created, reply, "stop", (3, 4), None, None, None)
        )
        if ending == "diverged":
            with pytest.raises(openai.APIError, match="differ from those this stream sent"):
                await anext(chunks)
            continue
        rest = [c async for c in chunks]
        assert [c.choices[0].delta.content for c in rest if c.choices] == ["rld", None]
        assert rest[-2].choices[0].finish_reason == "stop" and rest[-1].usage is not None
        assert {c.id for c in rest} == {"chatcmpl-live-1"}
    assert endpoint.refused == {"context_length_exceeded": 1}


async def test_a_text_completion_call_plain_and_streamed(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-c")
    episode = asyncio.create_task(_answer_calls(session, 2))
    client = _client(endpoint, session.key)
    out = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2, logprobs=1)
    assert out.choices[0].text == "answer 0" and out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.token_logprobs == [-1.0, -2.0] and out.choices[0].finish_reason == "length"
    stream = await client.completions.create(model="m", prompt="Once upon", stream=True)
    chunks = [c async for c in stream]
    (first, second) = await episode
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "answer 1"
    assert (first.request.prompt, second.request.prompt) == ([1, 2, 3], "Once upon")
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="m", prompt=[1, 10**9])
    assert err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="m", prompt="x", echo=True)
    assert (err.value.param, err.value.code) == ("echo", "unsupported_parameter")


async def test_a_strangers_key_and_a_late_call_are_refused(endpoint: AgentEndpoint) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        await _client(endpoint, "lk-not-a-key").chat.completions.create(model="m", messages=USER)
    assert err.value.code == "invalid_api_key"
    session = endpoint.open("traj-2")
    endpoint.drop(session)  # the trajectory ended
    with pytest.raises(openai.APIStatusError) as gone:
        await _client(endpoint, session.key).chat.completions.create(model="m", messages=USER)
    assert (gone.value.status_code, gone.value.code) == (410, "trajectory_ended")
    assert endpoint.refused == {"invalid_api_key": 1, "trajectory_ended": 1}


async def test_bad_calls_get_a_typed_4xx_and_change_nothing(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-3")
    client = _client(endpoint, session.key)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="m", messages=USER, presence_penalty=1.0)
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "presence_penalty")
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="m", messages=USER, n=9)
    assert err.value.param == "n"
    assert session.pending is None and session.events.empty()  # nothing reached the trajectory

    def post(data: bytes) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            endpoint.base_url + "/chat/completions",
            data=data,
            headers={"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = await asyncio.to_thread(post, b"{not json")
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = await asyncio.to_thread(post, b'{"messages": "' + b"x" * MAX_BODY_BYTES + b'"}')
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert session.pending is None and session.events.empty()


async def test_a_trajectorys_calls_are_one_at_a_time(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-4")
    client = _client(endpoint, session.key)
    first = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
    while session.pending is None:
        await asyncio.sleep(0.01)
    with pytest.raises(openai.ConflictError) as err:
        await client.chat.completions.create(model="m", messages=USER)
    assert err.value.code == "call_in_progress"
    await _answer_calls(session, 1)
    assert (await first).choices[0].message.content == "answer 0"


async def test_a_call_waiting_when_its_trajectory_ends_hears_so(endpoint: AgentEndpoint) -> None:
    session = endpoint.open("traj-5")
    waiting = asyncio.create_task(
        _client(endpoint, session.key).chat.completions.create(model="m", messages=USER)
    )
    while session.pending is None:
        await asyncio.sleep(0.01)
    endpoint.drop(session)
    with pytest.raises(openai.APIStatusError) as err:
        await waiting
    assert (err.value.status_code, err.value.code) == (410, "trajectory_ended")


AGENTS = """
import asyncio, os, time

async def fine(sample, base_url, api_key):
    await asyncio.sleep(0.2)
    return sample["n"] / 10

def plain(sample, base_url, api_key):
    return None if sample["n"] == 0 else {"score": 0.5}

async def moody(sample, base_url, api_key):
    mode = sample["mode"]
    if mode == "raise":
        raise KeyError("answer")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "lie":
        return "a lot"
    if mode == "die":
        await asyncio.sleep(0.5)
        os.kill(os.getpid(), 9)
    return 1.0
"""


@pytest.fixture
def agents_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_agents.py").write_text(textwrap.dedent(AGENTS))
    return tmp_path


async def test_one_process_runs_many_agents_at_once(agents_dir: Path) -> None:
    pool = AgentPool("my_agents:fine", [str(agents_dir)], workers=1, timeout_s=30)
    await pool.start()
    try:
        rewards = await asyncio.gather(*(pool.run(f"t{n}", {"n": n}, "http://x/v1", "k") for n in range(20)))
        assert rewards == [n / 10 for n in range(20)]
        plain = AgentPool("my_agents:plain", [str(agents_dir)], workers=2, timeout_s=30)
        await plain.start()
        try:
            assert [await plain.run(f"p{n}", {"n": n}, "u", "k") for n in range(2)] == [None, 0.5]
        finally:
            await plain.close()
    finally:
        await pool.close()


async def test_an_agent_that_fails_fails_only_its_trajectory(agents_dir: Path) -> None:
    pool = AgentPool("my_agents:moody", [str(agents_dir)], workers=1, timeout_s=3)
    await pool.start()
    try:
        outcomes = await asyncio.gather(
            *(pool.run(mode, {"mode": mode}, "u", "k") for mode in ("raise", "hang", "lie", "ok"))
        )
        codes = [o.code if isinstance(o, PluginFailure) else o for o in outcomes]
        assert codes == ["agent_error", "agent_timeout", "agent_invalid", 1.0]
        assert isinstance(outcomes[0], PluginFailure) and "KeyError" in outcomes[0].message
        assert "my_agents.py" in outcomes[0].message  # where the agent raised
        died, survivor = await asyncio.gather(
            pool.run("die", {"mode": "die"}, "u", "k"), pool.run("ok2", {"mode": "ok"}, "u", "k")
        )
        assert isinstance(died, PluginFailure) and died.code == "agent_crashed"
        assert survivor in (1.0, PluginFailure("agent_crashed", "the agent process died"))
        assert await pool.run("after", {"mode": "ok"}, "u", "k") == 1.0  # a new process took over
    finally:
        await pool.close()


async def test_a_cancelled_run_answers_at_once(agents_dir: Path) -> None:
    pool = AgentPool("my_agents:moody", [str(agents_dir)], workers=1, timeout_s=60)
    await pool.start()
    try:
        run = asyncio.create_task(pool.run("h", {"mode": "hang"}, "u", "k"))
        await asyncio.sleep(0.5)
        pool.cancel("h")
        outcome = await asyncio.wait_for(run, 10)
        assert isinstance(outcome, PluginFailure) and outcome.code == "agent_cancelled"
        assert pool.workers[0].alive
    finally:
        await pool.close()


async def test_an_agent_that_cannot_be_loaded_is_a_config_error(agents_dir: Path) -> None:
    with pytest.raises(PluginLoadError, match="task.agent 'my_agents:nope' cannot be loaded: AttributeError"):
        await check_agent("my_agents:nope", [str(agents_dir)])
    with pytest.raises(PluginLoadError, match="ModuleNotFoundError"):
        await check_agent("not_a_module:agent", [str(agents_dir)])
    await check_agent("my_agents:fine", [str(agents_dir)])


COMMAND_AGENT = """
import json, os, sys
import openai

row = json.loads(sys.stdin.readline())
assert row == json.loads(os.environ["LIBRA_SAMPLE"])
assert not [k for k in os.environ if k.startswith("LIBRA_") and k not in ("LIBRA_SAMPLE", "LIBRA_TRAJECTORY_ID")]
mode = row["mode"]
if mode == "fail":
    print("something went wrong", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    import time
    time.sleep(3600)
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY, as any client reads them
out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["q"]}])
print("the model said", out.choices[0].message.content)
print({"number": "0.75", "json": '{"reward": 0.25}', "none": "null", "lie": "lots"}[mode])
"""


async def test_a_command_agent_reads_the_endpoint_as_any_openai_client_does(
    endpoint: AgentEndpoint, tmp_path: Path
) -> None:
    (tmp_path / "agent.py").write_text(COMMAND_AGENT)
    agents = CommandAgents([sys.executable, "agent.py"], [str(tmp_path)], timeout_s=60)
    impatient = CommandAgents([sys.executable, "agent.py"], [str(tmp_path)], timeout_s=2)
    await agents.start()

    async def run(mode: str) -> Any:
        session = endpoint.open(f"cmd-{mode}")
        episode = asyncio.create_task(_answer_calls(session, 1))
        runner = impatient if mode == "hang" else agents
        outcome = await runner.run(f"cmd-{mode}", {"q": "hi", "mode": mode}, endpoint.base_url, session.key)
        if mode in ("fail", "hang"):
            episode.cancel()
        else:
            (call,) = await episode
            assert call.request.messages == [{"role": "user", "content": "hi"}]
        return outcome

    modes = ("number", "json", "none", "lie", "fail", "hang")
    number, json_, none, lie, failed, hung = await asyncio.gather(
        *(run(m) for m in modes)
    )  # one process each
    assert (number, json_, none) == (0.75, 0.25, None)
    assert isinstance(lie, PluginFailure) and lie.code == "agent_invalid" and "'lots'" in lie.message
    assert isinstance(failed, PluginFailure) and failed.code == "agent_error"
    assert "exited 3" in failed.message and "something went wrong" in failed.message
    assert isinstance(hung, PluginFailure) and hung.code == "agent_timeout"
    with pytest.raises(PluginLoadError, match="no program 'no-such-agent'"):
        await CommandAgents(["no-such-agent"], [], 5).start()


def test_a_command_agents_reward_is_its_last_line() -> None:
    assert reward_of("log\n1\n") == 1.0 and reward_of("") is None and reward_of("x\nnull\n") is None
    assert reward_of('{"reward": null}') is None
    bad = reward_of("nan")
    assert isinstance(bad, PluginFailure) and bad.code == "agent_invalid"


TLS_AGENT = """
import openai

def agent(sample, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": sample["q"]}])
    return 0.5 if out.choices[0].message.content == "answer 0" else 0.0
"""


async def test_beyond_loopback_the_endpoint_serves_https_that_agents_verify_unchanged(tmp_path: Path) -> None:
    """Bound beyond loopback the keys would cross the network: HTTPS with the scheduler's
    certificate, agents' clients trusting it with no change to them, and no certificate, no start."""
    Authority.create("test-ca").issue(tmp_path / "tls", "scheduler", ["scheduler", "localhost", "127.0.0.1"])
    ca, cert, key = (str(tmp_path / "tls" / f) for f in ("ca.pem", "cert.pem", "key.pem"))
    for tls in (None, TlsFiles(ca_file=ca)):
        with pytest.raises(EndpointInsecure, match="LIBRA_TLS_CERT_FILE"):
            AgentEndpoint("0.0.0.0", 0, "tiny", max_context_tokens=512, tls=tls)
    assert AgentEndpoint("127.0.0.1", 0, "tiny", 512, tls=TlsFiles(ca, cert, key)).tls is None

    ep = AgentEndpoint(
        "0.0.0.0", 0, "tiny", max_context_tokens=512, vocab_size=1000, tls=TlsFiles(ca, cert, key)
    )
    await ep.start()
    (tmp_path / "agent.py").write_text(COMMAND_AGENT)
    (tmp_path / "tls_agent.py").write_text(TLS_AGENT)
    command = CommandAgents([sys.executable, "agent.py"], [str(tmp_path)], timeout_s=60)
    pool = AgentPool("tls_agent:agent", [str(tmp_path)], workers=1, timeout_s=60)
    try:
        assert ep.base_url.startswith("https://localhost:")
        await command.start(ep.agent_env)
        await pool.start(ep.agent_env)
        for name, agents, expected in (("cmd", command, 0.75), ("fn", pool, 0.5)):
            session = ep.open(f"tls-{name}")
            episode = asyncio.create_task(_answer_calls(session, 1))
            outcome = await agents.run(f"tls-{name}", {"q": "hi", "mode": "number"}, ep.base_url, session.key)
            assert outcome == expected, outcome
            await episode
        stranger = ep.open("tls-stranger")  # a client that does not trust the stack's CA
        with pytest.raises(openai.APIConnectionError):
            await _client(ep, stranger.key).models.list()
        plain = ep.base_url.replace("https://", "http://") + "/models"
        with pytest.raises((ConnectionError, http.client.HTTPException)):  # plain HTTP is not served
            await asyncio.to_thread(urllib.request.urlopen, plain, timeout=30)
        assert stranger.key in ep.sessions  # nothing a refused connection did changed the endpoint
    finally:
        await pool.close()
        await ep.close()
    assert not Path(ep.agent_env["SSL_CERT_FILE"]).exists()  # the trust bundle goes with the endpoint
