"""`python -m services.scheduler` as a real process, on real NATS and Redis: the test plays the
planner (a plan naming one engine), the engine (answers turn requests, reports its load) and the
tool sandbox, and reads what the scheduler hands the trainer off the TRAJ stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.facts import read_facts
from services.common.held_context import context_digest
from services.common.localstack import Server
from services.common.membership import SCHEDULER_ROLE
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig
from tests.service_process import pinned_job_env, service_process

pytestmark = pytest.mark.integration

ENGINE = "engine-s1"
ENGINE2 = "engine-s2"
SCHEDULER = "scheduler-t1"
CALL = "<calc>2+3</calc>"
ANSWER = "The sum is <answer>5</answer>"


class Harness:
    """Plays the engine and the sandbox for one scheduler process; `answer` decides each turn."""

    def __init__(self, bus: Bus, engine: str = ENGINE):
        self.bus, self.engine = bus, engine
        self.requests: list[ev.TurnRequest] = []
        self.calls: list[ev.ToolCall] = []
        self.held: set[str] = set()
        """Requests the engine holds (in its load reports) and has not answered yet."""
        self.answer: Callable[[ev.TurnRequest], ev.TurnResult | None] = self.normal
        self.hold = False
        """Hold every request (named in load reports) and never answer: a hung engine."""
        self.last_seq = 0
        self.answered: list[str] = []
        """Requests it names as answered in its load reports."""
        self.peer: Harness | None = None
        """A second engine, where the test asked for one."""
        self.free_kv_tokens = 0
        """The KV room its load reports name (0: one turn at a time)."""
        self.read_delay_s = 0.0
        """How long it takes to read each request (a busy engine: they wait in order meanwhile)."""

    async def start(self) -> None:
        async def on_request(req: ev.TurnRequest, _: Envelope) -> None:
            if self.read_delay_s:
                await asyncio.sleep(self.read_delay_s)
            self.requests.append(req)
            self.last_seq = max(self.last_seq, req.seq)
            if self.hold:
                self.held.add(req.request_id)
                return
            res = self.answer(req)
            if res is None:
                return  # dropped on the way: neither answered nor held
            await self.bus.publish(subjects.TURN_RESULT, res)

        async def on_call(call: ev.ToolCall, _: Envelope) -> None:
            self.calls.append(call)
            await self.bus.publish(
                subjects.TOOL_RETURN,
                ev.ToolReturn(
                    call_id=call.call_id,
                    trajectory_id=call.trajectory_id,
                    tool=call.tool,
                    status="ok",
                    payload=json.dumps({"result": "5"}),
                    size_class="small",
                ),
            )

        await self.bus.subscribe(f"{subjects.TURN_REQUEST}.{self.engine}", ev.TurnRequest, on_request)
        if self.engine == ENGINE:  # it plays the sandbox too
            await self.bus.subscribe(subjects.TOOL_CALL, ev.ToolCall, on_call)
        self.bus.spawn(self._report())

    async def _report(self) -> None:
        while True:
            load = ev.EngineLoad(
                engine_id=self.engine,
                bucket="short",
                capacity_seqs=4,
                free_kv_tokens=self.free_kv_tokens,
                request_ids=sorted(self.held),
                last_seq=self.last_seq,
                answered_ids=self.answered[-128:],
            )
            await self.bus.publish(subjects.ENGINE_LOAD, load)
            await asyncio.sleep(0.3)

    def result(self, req: ev.TurnRequest, text: str, **kw: Any) -> ev.TurnResult:
        tokens = [200 + i for i in range(4)]
        base: dict[str, Any] = dict(
            request_id=req.request_id,
            trajectory_id=req.trajectory_id,
            engine_id=self.engine,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            text=text,
            finish_reason="stop",
            policy_version=0,
            temperature=req.temperature,
            context_tokens=len(req.context_token_ids),
        )
        base.update(kw)
        return ev.TurnResult(**base)

    def normal(self, req: ev.TurnRequest) -> ev.TurnResult:
        """First turn calls the calculator (at its token budget: cut), the second answers; the
        first trajectory's answer is cut too (so it, alone, is truncated)."""
        first = self.requests[0].trajectory_id if self.requests else req.trajectory_id
        if req.turn_index == 0:
            return self.result(req, CALL, finish_reason="length")
        return self.result(req, ANSWER, finish_reason="length" if req.trajectory_id == first else "stop")

    async def completed(self, bus: Bus, n: int, timeout: float = 60) -> list[ev.CompletedTrajectory]:
        stream = subjects.stream_name(bus.run_id, "TRAJ")  # a reader of its own (no auth here)
        sub = await bus.js.pull_subscribe(bus.subject(subjects.TRAJ_COMPLETED), "test-reader", stream)
        out: dict[str, ev.CompletedTrajectory] = {}
        async with asyncio.timeout(timeout):
            while len(out) < n:
                for msg, raw in await bus.fetch(sub, ev.CompletedTrajectory, 16, 0.5):
                    out[msg.trajectory_id] = msg
                    await raw.ack()
        return sorted(out.values(), key=lambda t: t.trajectory_id)


@pytest.fixture
async def scheduler(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    nats_server: Server,
    redis_server: Server,
    run_id: str,
    tiny_model: ModelConfig,
) -> AsyncIterator[tuple[subprocess.Popen[bytes], Harness, Bus]]:
    """One engine (ENGINE); an `indirect` parameter may ask for a second one (`{"engines": 2}`:
    `harness.peer`), add task settings (`{"task": {...}}`) and scheduler settings (`{"env": {...}}`)."""
    param = getattr(request, "param", {})
    engines = param.get("engines", 1)
    for name, text in param.get("files", {}).items():  # beside the job's config (plugins)
        (tmp_path / name).write_text(text)
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is 2+3? ({i})", "answer": "5"}) + "\n" for i in range(4))
    )
    run = {
        "model": {"source": "tiny-random", "cache_dir": tiny_model.cache_dir},
        "task": {
            "dataset": {"path": str(data)},
            "num_prompts": 4,
            "group_size": 2,
            "max_turns": 3,
            # 8 generated tokens of 12, 4 past the buffer's start: -0.5 x 4 / 8
            "overlong": {"max_tokens": 12, "soft_penalty": {"length": 8, "factor": 0.5}},
            **param.get("task", {}),
        },
        "rollout": {"engines": 1},
        "training": {"steps": 2, "groups_per_step": 1, "max_staleness": 1},
    }
    env = pinned_job_env(
        tmp_path,
        run,
        nats_server.url,
        redis_server.url,
        run_id,
        SCHEDULER,
        LIBRA_SCHEDULER_TICK_S="0.05",
        LIBRA_SCHEDULER_LOST_TURN_GRACE_S="0.5",
        LIBRA_SCHEDULER_ANSWERED_GRACE_S="1",
        **{"LIBRA_SCHEDULER_TURN_TIMEOUT_S": "3", **param.get("env", {})},
    )
    bus = await Bus.connect(nats_server.url, run_id, "rollout-engine", ENGINE)  # plays the engine
    harness = Harness(bus)
    # an engine that read an earlier scheduler's turns, slow to read this one's
    harness.last_seq = param.get("engine_last_seq", 0)
    harness.read_delay_s = param.get("read_delay_s", 0.0)
    await harness.start()
    names = [ENGINE, ENGINE2][:engines]
    if engines > 1:
        peer_bus = await Bus.connect(nats_server.url, run_id, "rollout-engine", ENGINE2)
        harness.peer = Harness(peer_bus, ENGINE2)
        if (answer := param.get("peer_answer")) is not None:  # before the scheduler sends a turn
            harness.peer.answer = answer(harness.peer)
        await harness.peer.start()
    # the scheduler acts once the plan gives it the role and Redis holds its lease, as the planner
    # would have it (services/scheduler/leadership.py)
    store = OwnershipStore.from_url(redis_server.url, run_id)
    lease = await store.acquire(SCHEDULER_ROLE, SCHEDULER, 30)
    await store.close()
    assert lease is not None
    plan = ev.Plan(
        plan_version=1,
        assignments=[
            ev.Assignment(worker_id=w, role="rollout", bucket="short", fencing_token=1 + i)
            for i, w in enumerate(names)
        ]
        + [ev.Assignment(worker_id=SCHEDULER, role="schedule", fencing_token=lease.token)],
    )
    await bus.publish_durable(subjects.PLAN, plan, msg_id=f"{run_id}-plan-1")
    try:
        with service_process("services.scheduler", env, tmp_path / "scheduler.log") as proc:
            yield proc, harness, bus
    finally:
        await bus.close()
        if harness.peer is not None:
            await harness.peer.bus.close()


async def stats(bus: Bus, completed: int) -> ev.SchedulerStats:
    """The scheduler's stats once it counts `completed` trajectories (it counts one just after the
    stream has it)."""
    async with asyncio.timeout(10):
        while True:
            s = await bus.request(subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, timeout=10)
            if s.trajectories_completed >= completed:
                return s
            await asyncio.sleep(0.1)


async def test_turns_tools_and_completion_reach_the_trainer_within_the_staleness_budget(
    scheduler: Any,
) -> None:
    proc, h, bus = scheduler
    done = await h.completed(bus, 4)  # (max_staleness 1 + 1) x 1 group per step x 2 samples
    for t in done:
        assert t.finish == "answer" and t.num_turns == 2 and list(t.tool_statuses) == ["ok"]
        # the right answer, less the soft overlong penalty
        assert t.overlong_penalty == pytest.approx(-0.25)
        assert t.reward == pytest.approx(1.0 - 0.25)
        generated = [s for s in t.segments if s.generated]
        assert [list(s.token_ids) for s in generated] == [[200, 201, 202, 203]] * 2
        assert all(s.temperature == 1.0 and s.policy_version == 0 for s in generated)
        assert not t.HasField("failure")
    assert {t.group_id for t in done} == {done[0].group_id, done[-1].group_id} and len(done) == 4
    assert len(h.calls) == 4 and {c.tool for c in h.calls} == {"calculator"}
    # its last turn decides: only the trajectory whose answer was cut is truncated
    assert [t.trajectory_id for t in done if t.truncated] == [h.requests[0].trajectory_id]
    # every turn names its group and prompt (what the engine's drafter reads)
    by_traj = {t.trajectory_id: t for t in done}
    assert all(r.group_id == by_traj[r.trajectory_id].group_id for r in h.requests)
    assert all(r.prompt_id == by_traj[r.trajectory_id].prompt_id != "" for r in h.requests)
    # nothing trained yet: the feed holds the third group back (the staleness budget)
    await asyncio.sleep(1.0)
    s = await stats(bus, 4)
    assert (s.trajectories_completed, s.trajectories_in_flight, s.groups_launched) == (4, 0, 2)
    assert s.turns == 8 and s.tool_calls_by_status["ok"] == 4 and s.engines == [ENGINE]
    facts = await ledger_facts(bus, lambda f: f.published == 4)
    assert (facts.trained, facts.dropped, facts.open_at_end, facts.lost) == (0, 0, 4, 0)

    # the trainer's part: group A trained (its outcome names one member only), group B stale
    a, b = sorted({t.group_id for t in done})
    a0, a1 = sorted(t.trajectory_id for t in done if t.group_id == a)

    async def outcome(group: str, what: str, trained: list[str], msg_id: str) -> None:
        msg = ev.GroupOutcome(group_id=group, outcome=what, trained_ids=trained)
        await bus.publish_durable(subjects.GROUP_OUTCOME, msg, msg_id=msg_id)

    await outcome(a, "trained", [a0], "a")
    await outcome(b, "stale", [], "b")  # the feed launches a group in its place
    facts = await ledger_facts(bus, lambda f: f.dropped == 2 and f.trained == 1)
    # handed to the trainer in a trained group, yet not named trained: the report's lost trajectory
    assert (facts.lost, list(facts.lost_ids)) == (1, [a1])
    await outcome(a, "trained", [a1], "a-again")  # a trainer re-announcing a redelivered member
    facts = await ledger_facts(bus, lambda f: f.trained == 2)
    assert (facts.dropped, facts.lost) == (2, 0)
    assert facts.published == 4 + facts.open_at_end  # the replacement group's are still open
    assert proc.poll() is None


async def ledger_facts(bus: Bus, ready: Callable[[ev.SchedulerFacts], bool]) -> ev.SchedulerFacts:
    """The scheduler's published ledger facts once `ready` holds for them."""
    async with asyncio.timeout(20):
        while True:
            facts = await read_facts(bus, subjects.FACTS_SCHEDULER, ev.SchedulerFacts)
            if facts is not None and not facts.error and ready(facts):
                return facts
            await asyncio.sleep(0.1)


async def test_lost_and_malformed_turns_are_sent_again_and_bad_input_changes_nothing(scheduler: Any) -> None:
    proc, h, bus = scheduler
    seen: dict[str, int] = {}

    def flaky(req: ev.TurnRequest) -> ev.TurnResult | None:
        key = f"{req.trajectory_id}/{req.turn_index}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1 and req.turn_index == 0:
            # the first attempt of every first turn is lost: on the way there (the engine's reports
            # never name it), or its result on the way back (they name it answered; re-sent once
            # LIBRA_SCHEDULER_ANSWERED_GRACE_S has passed)
            if len(seen) % 2:
                h.answered.append(req.request_id)
            return None
        if seen[key] == 2 and req.turn_index == 0:
            return h.result(req, CALL, logprobs=[-0.5])  # one logprob for four tokens
        return h.normal(req)

    h.answer = flaky
    await bus.nc.publish(bus.outgoing(subjects.TURN_RESULT), b"\xff\x00garbage")
    done = await h.completed(bus, 4, timeout=90)
    assert all(t.finish == "answer" and not t.HasField("failure") for t in done)
    first_turns = [r for r in h.requests if r.turn_index == 0]
    assert len(first_turns) == 12  # lost, malformed, answered: three requests per trajectory
    assert len({r.request_id for r in first_turns}) == 12
    s = await stats(bus, 4)
    assert s.trajectories_failed == 0 and s.turns == 8
    assert proc.poll() is None


@pytest.mark.parametrize(
    "scheduler",
    [{"engine_last_seq": 1000, "read_delay_s": 1.5, "env": {"LIBRA_SCHEDULER_TURN_TIMEOUT_S": "60"}}],
    indirect=True,
)
async def test_a_busy_engine_that_served_a_scheduler_before_this_one_loses_none_of_its_turns(
    scheduler: Any,
) -> None:
    """A scheduler taking over (a standby, a restart) sends to engines whose reports say they read
    up to the earlier one's 1,000th turn, and this engine reads each request 1.5 s late. Its
    turns count as unread until it has read them, not as lost and sent again (a new scheduler's
    numbers start past the earlier one's): at 1,024 engines on 2 cores, before, turns of a
    standby that had taken over were lost 4 times each and their trajectories failed."""
    proc, h, bus = scheduler
    done = await h.completed(bus, 4, timeout=90)
    assert all(t.finish == "answer" and not t.HasField("failure") for t in done)
    first_turns = [r for r in h.requests if r.turn_index == 0]
    assert len(first_turns) == 4, [r.trajectory_id for r in first_turns]  # none sent again
    assert all(r.seq > 1000 for r in h.requests)
    s = await stats(bus, 4)
    assert s.trajectories_failed == 0 and s.turns == 8
    assert proc.poll() is None


def _lying(garbage: Harness) -> Callable[[ev.TurnRequest], ev.TurnResult]:
    """Answers for an engine that makes what no engine serving this job's weights could."""

    def lie(req: ev.TurnRequest) -> ev.TurnResult:
        kind = len(garbage.requests) % 4
        if kind == 0:
            return garbage.result(req, CALL, logprobs=[float("nan"), -0.1, 0.5, -0.2])
        if kind == 1:
            return garbage.result(req, CALL, token_ids=[10**7, 1, 2, 3])
        if kind == 2:
            return garbage.result(req, CALL, policy_version=1_000_000)
        n = req.max_new_tokens + 1
        return garbage.result(req, CALL, token_ids=[200] * n, logprobs=[-0.1] * n)

    return lie


@pytest.mark.parametrize(
    "scheduler", [{"engines": 2, "task": {"group_size": 4}, "peer_answer": _lying}], indirect=True
)
async def test_an_engine_answering_garbage_changes_no_trajectory_and_is_quarantined(scheduler: Any) -> None:
    """A second engine answers every turn with something no engine serving this job's weights
    could make: NaN or positive logprobs, token ids outside the vocabulary, a policy version the
    trainer never made, more tokens than the turn asked for. Each fails its turn (`engine_invalid`)
    and is retried on the honest engine; after three in a row the scheduler takes the engine out
    of routing. Every trajectory completes with the honest engine's tokens only.

    Eight trajectories start at once (two groups of four), so least-loaded placement gives the
    garbage engine at least three first turns; with four, it could get two (the rest of their
    turns then stay with the honest engine that holds their context) and never reach the streak."""
    proc, h, bus = scheduler
    garbage = h.peer  # lying from before the scheduler's first turn (`_lying`)
    assert garbage is not None
    done = await h.completed(bus, 8, timeout=90)
    assert all(t.finish == "answer" and not t.HasField("failure") for t in done), [
        (t.finish, t.failure.code, t.failure.message) for t in done
    ]
    for t in done:
        for seg in t.segments:
            if seg.generated:
                assert list(seg.token_ids) == [200, 201, 202, 203] and seg.policy_version == 0
                assert all(lp == -0.5 for lp in seg.logprobs)
    s = await stats(bus, 8)
    # a turn sent to it before the third refusal is answered after: a quarantined engine's
    # results are not read (its turns are sent again elsewhere), so that one is not counted
    assert 3 <= s.invalid_results_by_engine[ENGINE2] <= len(garbage.requests)
    assert ENGINE not in s.invalid_results_by_engine
    assert list(s.engines_quarantined) == [ENGINE2] and list(s.engines) == [ENGINE]
    assert s.trajectories_failed == 0
    assert proc.poll() is None


@pytest.mark.parametrize("scheduler", [{"task": {"tools": ["python"]}}], indirect=True)
async def test_a_rejected_tool_call_is_in_the_samples_with_its_reason(scheduler: Any) -> None:
    """The model calls the calculator, which this task does not enable: the call never reaches a
    sandbox, and the trajectory's sample (what `libra run` writes to samples.jsonl) shows the
    call, its arguments, `rejected` and why."""
    proc, h, bus = scheduler
    samples: list[ev.TrajectorySample] = []

    async def on_sample(s: ev.TrajectorySample, _: Envelope) -> None:
        samples.append(s)

    await bus.subscribe(subjects.TRAJ_SAMPLE, ev.TrajectorySample, on_sample)
    done = await h.completed(bus, 4, timeout=90)
    assert len(done) == 4 and not h.calls, "no call reached the sandbox"
    async with asyncio.timeout(10):
        while len(samples) < 4:
            await asyncio.sleep(0.1)
    body = json.loads(samples[0].transcript_json)
    assert body["prompt"][-1]["content"].startswith("What is 2+3?") and body["answer"] == "5"
    roles = [e["role"] for e in body["events"]]
    assert roles[:3] == ["assistant", "tool", "assistant"], roles
    call = body["events"][1]
    assert (call["tool"], call["status"]) == ("calculator", "rejected") and call["args"], call
    assert "'calculator' is not enabled; available: python" in call["returned"], call
    assert body["events"][0]["text"] == CALL and isinstance(body["reward"], float)
    assert proc.poll() is None


async def test_turns_an_engine_keeps_losing_spend_retries_and_fail_typed(scheduler: Any) -> None:
    """An engine that reports its load but never holds a turn: the first loss of a turn is re-sent
    for free (a dropped message), every further one spends a retry, so the trajectory ends failed
    instead of being re-sent forever."""
    proc, h, bus = scheduler
    h.answer = lambda req: None
    done = await h.completed(bus, 4, timeout=120)
    for t in done:
        assert t.finish == "error" and t.failure.code == "engine_unavailable"
        assert "lost" in t.failure.message
    assert len(h.requests) == 16  # per trajectory: sent, lost and re-sent free, then two retries
    assert proc.poll() is None


@pytest.mark.parametrize("scheduler", [{"env": {"LIBRA_SCHEDULER_TURN_TIMEOUT_S": "1.5"}}], indirect=True)
async def test_an_engine_that_never_answers_fails_its_trajectories_typed(scheduler: Any) -> None:
    """Turn retries are bounded: a trajectory whose turns an engine holds and never answers ends
    as failed (`engine_unavailable`), is handed to the trainer as such, and the scheduler keeps
    serving."""
    proc, h, bus = scheduler
    h.hold, h.free_kv_tokens = True, 1 << 20  # room for all four at once: they hang together
    done = await h.completed(bus, 4, timeout=120)
    for t in done:
        assert t.finish == "error" and t.failure.code == "engine_unavailable"
        assert not any(s.generated for s in t.segments)
    ids = {t.trajectory_id for t in done}
    sent = [r for r in h.requests if r.trajectory_id in ids]  # replacements may have begun since
    assert len(sent) == 12  # the turn timeout, twice retried, for each of the four
    s = await stats(bus, 4)
    assert s.trajectories_failed == 4 and s.failures_by_code["engine_unavailable"] == 4
    assert proc.poll() is None


async def test_a_turn_handed_back_mid_way_goes_on_from_the_tokens_it_made(
    scheduler: Any, tiny_model: ModelConfig
) -> None:
    """A draining engine hands the first turn back after two tokens: the scheduler keeps them,
    sends the rest of the turn (context + those tokens, budget less them, no retry spent), and the
    trajectory's turn is the two joined — tokens, logprobs, and the text they decode to, whose
    tool call runs."""
    from services.common.models import load_tokenizer

    proc, h, bus = scheduler
    tok = load_tokenizer(tiny_model)
    head = tok.encode("<calc>2", add_special_tokens=False)
    rest = tok.encode("+3</calc>", add_special_tokens=False)
    assert tok.decode(head + rest) == CALL
    first: list[ev.TurnRequest] = []

    def answer(req: ev.TurnRequest) -> ev.TurnResult:
        if req.turn_index == 0 and not first:  # the first turn of all: handed back mid-way
            first.append(req)
            gave_up = ev.ErrorInfo(code="handed_back", message="engine-s1 is draining")
            return h.result(req, "<calc>2", token_ids=head, logprobs=[-0.25] * len(head), finish_reason="handed_back", error=gave_up)  # fmt: skip
        if first and req.trajectory_id == first[0].trajectory_id and req.turn_index == 0:
            return h.result(req, "+3</calc>", token_ids=rest, logprobs=[-0.75] * len(rest))
        return h.normal(req)

    h.answer = answer
    done = {t.trajectory_id: t for t in await h.completed(bus, 4)}
    cut = first[0]
    again = [r for r in h.requests if r.trajectory_id == cut.trajectory_id and r.turn_index == 0]
    assert len(again) == 2
    assert list(again[1].context_token_ids) == list(cut.context_token_ids) + head
    assert again[1].max_new_tokens == cut.max_new_tokens - len(head)
    t = done[cut.trajectory_id]
    turn = [s for s in t.segments if s.generated][0]
    assert list(turn.token_ids) == head + rest
    assert list(turn.logprobs) == pytest.approx([-0.25] * len(head) + [-0.75] * len(rest))
    assert t.finish == "answer" and list(t.tool_statuses) == ["ok"]  # the joined text's call ran
    assert not t.HasField("failure") and proc.poll() is None
    s = await stats(bus, 4)  # counted for the report
    assert (s.turns_handed_back, s.tokens_kept_on_hand_back) == (1, len(head))


STREAM_AGENT = """
import json, pathlib, uuid
import openai

async def agent(sample, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True)
    parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    seen = pathlib.Path(__file__).parent / "seen"
    seen.mkdir(exist_ok=True)
    (seen / uuid.uuid4().hex).write_text(json.dumps(parts))
    return 1.0
"""


@pytest.mark.parametrize(
    "scheduler",
    [
        {
            "files": {"stream_agent.py": STREAM_AGENT},
            "task": {"agent": "stream_agent:agent", "plugin_paths": ["."]},
        }
    ],
    indirect=True,
)
async def test_an_agents_streamed_call_reads_its_turn_as_the_engine_generates_it(
    scheduler: Any, tiny_model: ModelConfig, tmp_path: Path
) -> None:
    """Each turn the engine streams says its first tokens, and only a second later its result: the
    agent's streamed call reads the first words before the turn ended (a part of its own), then
    the rest; what is trained is the whole turn."""
    from services.common.models import load_tokenizer

    proc, h, bus = scheduler
    tok = load_tokenizer(tiny_model)
    head = tok.encode("The sum", add_special_tokens=False)
    rest = tok.encode(" is <answer>5</answer>", add_special_tokens=False)
    assert tok.decode(head + rest) == ANSWER

    async def stream(req: ev.TurnRequest) -> None:
        assert req.stream, "an agent's streamed call is a streamed turn"
        progress = ev.TurnProgress(
            request_id=req.request_id, trajectory_id=req.trajectory_id, engine_id=ENGINE, token_ids=head
        )
        h.held.add(req.request_id)  # running, as its load reports say
        for bad in (  # none believed: out of the vocabulary, out of order, more than the budget
            ev.TurnProgress(request_id=req.request_id, engine_id=ENGINE, token_ids=[10**9]),
            ev.TurnProgress(request_id=req.request_id, engine_id=ENGINE, offset=3, token_ids=head),
            ev.TurnProgress(request_id=req.request_id, engine_id=ENGINE, token_ids=[5] * 10_000),
        ):
            await bus.publish(subjects.TURN_PROGRESS, bad)
        await bus.publish(subjects.TURN_PROGRESS, progress)
        await asyncio.sleep(1.0)
        tokens = head + rest
        res = h.result(req, ANSWER, token_ids=tokens, logprobs=[-0.5] * len(tokens))
        await bus.publish(subjects.TURN_RESULT, res)
        h.held.discard(req.request_id)
        h.answered.append(req.request_id)

    def answer(req: ev.TurnRequest) -> None:
        bus.spawn(stream(req))

    h.answer = answer
    done = await h.completed(bus, 4)
    assert all(not t.HasField("failure") for t in done)
    assert all([s.token_ids for s in t.segments if s.generated] == [head + rest] for t in done)
    seen = [json.loads(p.read_text()) for p in (tmp_path / "seen").iterdir()]
    assert len(seen) == 4 and all(parts == ["The sum", " is <answer>5</answer>"] for parts in seen), seen
    assert proc.poll() is None


CHOOSING_AGENT = """
import openai

async def agent(sample, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = await client.chat.completions.create(model="tiny", messages=messages, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2], first
    picked = first.choices[2].message.content  # the last: the one that answers
    messages += [{"role": "assistant", "content": picked}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="tiny", messages=messages)
    return 1.0 if "5" in picked else 0.0
"""


@pytest.mark.parametrize(
    "scheduler",
    [
        {
            "files": {"choosing_agent.py": CHOOSING_AGENT},
            "task": {"agent": "choosing_agent:agent", "plugin_paths": ["."]},
        }
    ],
    indirect=True,
)
async def test_an_agent_that_asks_n_choices_trains_the_one_it_went_on_from(scheduler: Any) -> None:
    """A call with n = 3 is one turn with two alternatives sampled beside it; the agent goes on
    from the third choice, and that one is the turn trained: its tokens, logprobs and versions as
    sampled, not the first's. An engine that answers more alternatives than asked is not believed."""
    proc, h, bus = scheduler
    first, alts = [300, 301], [([310, 311, 312], "No idea."), ([320, 321], ANSWER)]
    lied: list[str] = []

    def answer(req: ev.TurnRequest) -> ev.TurnResult:
        if req.turn_index > 0:
            assert req.alternatives == 0
            return h.result(req, "Yes.")
        assert req.alternatives == 2, req
        res = h.result(req, "Hmm.", token_ids=first, logprobs=[-0.5] * 2)
        for ids, text in alts:
            res.alternatives.add(token_ids=ids, logprobs=[-0.25] * len(ids), token_versions=[0] * len(ids), text=text, finish_reason="stop")  # fmt: skip
        if not lied:  # one answer with an alternative too many: refused, the turn goes again
            lied.append(req.trajectory_id)
            res.alternatives.add(token_ids=[330], logprobs=[-1.0], finish_reason="stop")
        return res

    h.answer = answer
    done = await h.completed(bus, 4)
    for t in done:
        assert not t.HasField("failure") and t.reward > 0.5, t  # it picked the answer
        turns = [s for s in t.segments if s.generated]
        assert list(turns[0].token_ids) == [320, 321] and list(turns[0].logprobs) == [-0.25, -0.25]
    assert len([r for r in h.requests if r.trajectory_id == lied[0] and r.turn_index == 0]) == 2
    assert (await stats(bus, 4)).agent_alternatives_kept == 4  # counted for the report
    assert proc.poll() is None


SANDBOXED_AGENT = """
import socket
import openai

async def agent(sample, base_url, api_key):
    assert socket.gethostname() == "sandbox", socket.gethostname()  # in the tool sandbox
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = await client.chat.completions.create(model="tiny", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "Result: 5"}]
    second = await client.chat.completions.create(model="tiny", messages=messages)
    return 1.0 if "<answer>5</answer>" in second.choices[0].message.content else 0.0
"""


@pytest.mark.parametrize(
    "scheduler",
    [
        {
            "files": {"sandboxed_agent.py": SANDBOXED_AGENT},
            "task": {"agent": "sandboxed_agent:agent", "plugin_paths": ["."], "agent_sandbox": True},
        }
    ],
    indirect=True,
)
async def test_a_sandboxed_agent_drives_its_trajectories_from_the_tool_sandbox(
    scheduler: Any, nats_server: Server, run_id: str, tmp_path: Path
) -> None:
    """`task.agent_sandbox`: the scheduler asks the tool sandbox (a real one, started after the
    scheduler: the runs wait for it) to run each trajectory's agent; the agent, in bubblewrap,
    calls the scheduler's endpoint through the sandbox's bridge, and its turns train as sampled."""
    from services.tool_sandbox.agents import AgentJob, AgentSandboxes
    from services.tool_sandbox.config import SandboxSettings
    from services.tool_sandbox.executor import SandboxExecutor
    from services.tool_sandbox.service import ToolSandboxService

    proc, h, bus = scheduler
    await asyncio.sleep(1.0)  # the scheduler asks before any sandbox is there
    sandbox_bus = await Bus.connect(nats_server.url, run_id, "tool-sandbox", "tool-sandbox-0")
    executor = SandboxExecutor(SandboxSettings())
    agents = AgentSandboxes(SandboxSettings(), AgentJob("sandboxed_agent:agent", [str(tmp_path)]), None)
    try:
        await executor.start()
        await agents.start()
        await ToolSandboxService(sandbox_bus, executor, agents).start()
        done = await h.completed(bus, 4, timeout=120)
        for t in done:
            assert not t.HasField("failure") and t.reward == pytest.approx(1.0 + t.overlong_penalty), t
            turns = [s for s in t.segments if s.generated]
            assert [list(s.token_ids) for s in turns] == [[200, 201, 202, 203]] * 2
        assert {r.trajectory_id for r in h.requests} == {t.trajectory_id for t in done}
        assert proc.poll() is None
    finally:
        await agents.close()
        await sandbox_bus.close()
        await executor.close()


async def test_turns_of_an_engine_moved_out_of_rollout_wait_for_it_to_hand_them_back(
    scheduler: Any, run_id: str
) -> None:
    """The plan takes the engine out of rollout (drained, parked: same lease) before its handed-back
    turn arrives: the scheduler does not re-send the turn from scratch at the plan, it waits for
    the engine to hand it back and goes on from the tokens it made."""
    proc, h, bus = scheduler
    first: list[ev.TurnRequest] = []
    head = [300, 301, 302]

    async def move_out_then_hand_back(req: ev.TurnRequest) -> None:
        def plan(version: int, role: str) -> ev.Plan:
            a = ev.Assignment(worker_id=ENGINE, role=role, bucket="short", fencing_token=1)
            return ev.Plan(plan_version=version, assignments=[a])

        await bus.publish_durable(subjects.PLAN, plan(2, "parked"), msg_id=f"{run_id}-plan-2")
        await asyncio.sleep(0.5)  # the scheduler has the plan by now
        gave_up = ev.ErrorInfo(code="handed_back", message=f"{ENGINE} is draining")
        res = h.result(req, "", token_ids=head, logprobs=[-0.25] * 3, finish_reason="handed_back", error=gave_up)  # fmt: skip
        await bus.publish(subjects.TURN_RESULT, res)
        await asyncio.sleep(0.2)
        await bus.publish_durable(subjects.PLAN, plan(3, "lent"), msg_id=f"{run_id}-plan-3")

    def answer(req: ev.TurnRequest) -> ev.TurnResult | None:
        if req.turn_index == 0 and not first:
            first.append(req)
            bus.spawn(move_out_then_hand_back(req))
            return None
        return h.normal(req)

    h.answer = answer
    await h.completed(bus, 4)
    cut = first[0]
    again = [r for r in h.requests if r.trajectory_id == cut.trajectory_id and r.turn_index == 0]
    assert len(again) == 2, again  # not re-sent from scratch when the plan moved the engine out
    assert list(again[1].context_token_ids) == list(cut.context_token_ids) + head
    assert proc.poll() is None
    s = await stats(bus, 4)
    assert (s.turns_handed_back, s.tokens_kept_on_hand_back) == (1, len(head))


@pytest.mark.parametrize("scheduler", [{"env": {"LIBRA_SCHEDULER_MAX_TURN_RETRIES": "0"}}], indirect=True)
async def test_a_turn_back_on_the_engine_holding_its_context_carries_only_what_is_new(scheduler: Any) -> None:
    """A trajectory's second turn goes back to the engine that served its first (one engine
    here): it carries the tokens after what that engine holds (the first turn's context and its
    generated tokens), with their digest. An engine that no longer holds them answers
    `context_unknown`, and the turn goes again whole, without a retry spent (none are allowed
    here: a spent one would fail the trajectory)."""
    proc, h, bus = scheduler
    forgot: set[str] = set()

    def forgetful(req: ev.TurnRequest) -> ev.TurnResult | None:
        if req.context_offset and req.trajectory_id not in forgot and len(forgot) < 2:
            forgot.add(req.trajectory_id)  # as if it restarted since the first turn
            return h.result(req, "", finish_reason="error", error=ev.ErrorInfo(code="context_unknown"))
        return h.normal(req)

    h.answer = forgetful
    done = await h.completed(bus, 4)
    assert all(t.finish in ("answer", "truncated") and not t.HasField("failure") for t in done)
    first = {r.trajectory_id: r for r in h.requests if r.turn_index == 0}
    deltas = [r for r in h.requests if r.turn_index == 1 and r.context_offset]
    assert len(deltas) >= len(first), "every second turn went as a delta at least once"
    for r in deltas:
        whole = [*first[r.trajectory_id].context_token_ids, 200, 201, 202, 203]  # what it holds
        assert r.context_offset == len(whole) and r.context_digest == context_digest(whole)
        assert 0 < len(r.context_token_ids) < r.context_offset  # the tool return and the template's glue
    again = [
        r for r in h.requests if r.turn_index == 1 and r.trajectory_id in forgot and not r.context_offset
    ]
    assert len(forgot) == 2 and {r.trajectory_id for r in again} == forgot
    for r in again:  # whole: what it held, then the same new tokens
        d = next(x for x in deltas if x.trajectory_id == r.trajectory_id)
        held = [*first[r.trajectory_id].context_token_ids, 200, 201, 202, 203]
        assert list(r.context_token_ids) == held + list(d.context_token_ids)
    s = await stats(bus, 4)
    assert s.trajectories_failed == 0 and proc.poll() is None
    assert s.context_tokens_held == sum(r.context_offset for r in h.requests) > 0
    assert s.context_tokens_sent == sum(len(r.context_token_ids) for r in h.requests)
    # the turns' bytes on the bus: every request it sent, every result it heard, payload for payload
    assert s.turn_request_bytes == sum(r.ByteSize() for r in h.requests) > 0
    assert s.turn_result_bytes == h.bus.bytes_out[subjects.TURN_RESULT] > 0
