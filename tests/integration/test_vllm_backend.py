"""The vllm backend on real vLLM (the CPU build here, the same code on GPUs): the logprob contract
against the trainer's float32 scoring, sampling as the request asks, priorities, hand-back with
tokens, bad requests refused while it serves on, and weight pushes over the real WeightSync
server, checked against what vLLM serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch

from services.common.contracts import ws, ws_grpc
from services.common.errors import InvalidMessage
from services.common.localstack import Server
from services.common.membership import TRAINER_ROLE
from services.common.models import load_model
from services.common.ownership import OwnershipStore
from services.common.runconfig import EngineJob, ModelConfig, RunConfig
from services.generation.backends.base import GenRequest
from services.generation.backends.vllm import VllmBackend, VllmEngine
from services.generation.config import EngineSettings
from services.generation.iteration_log import read as read_iterations
from services.generation.speculator import counters as spec_counters
from services.learning.snapshot import Snapshot, snapshot
from services.rollout_engine.weight_sync import WeightSyncServicer, start_server
from services.trainer.weight_push import encode_delta, encode_dense

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = list(range(100, 124))


def _spec_run(tiny_model: ModelConfig) -> RunConfig:
    """The second engine's job: vLLM's ngram speculation on, four sequences of up to 1,024 tokens."""
    return RunConfig.model_validate(
        {
            "model": tiny_model.model_dump(),
            "task": {"max_context_tokens": 1024, "max_new_tokens": 48},
            "rollout": {
                "backend": "vllm",
                "max_batch": 4,
                "speculative": {"method": "ngram", "num_tokens": 4},
            },
        }
    )


@pytest.fixture(scope="module")
async def engines(
    tiny_model: ModelConfig, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VllmBackend, VllmEngine, VllmEngine]]:
    """Both engines of the file, started together (each start is mostly waiting on its own engine
    core's processes): a plain one of two sequences with an iteration log, and a speculating one."""
    run = RunConfig.model_validate(
        {"model": tiny_model.model_dump(), "rollout": {"backend": "vllm", "max_batch": 2}}
    )
    backend = VllmBackend(
        EngineJob.of(run), EngineSettings(seed=0, iteration_log=tmp_path_factory.mktemp("iterations"))
    )
    spec_backend = VllmBackend(EngineJob.of(_spec_run(tiny_model)), EngineSettings(seed=0))
    started = await asyncio.gather(backend.start(), spec_backend.start(), return_exceptions=True)
    engine, spec = backend.make_engine(2), spec_backend.make_engine(4)
    try:
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        engine.start()
        spec.start()
        yield backend, engine, spec
    finally:
        for e, b in ((engine, backend), (spec, spec_backend)):
            with contextlib.suppress(Exception):
                await e.close(timeout=5)
            await b.close()


@pytest.fixture(scope="module")
def vllm(engines: tuple[VllmBackend, VllmEngine, VllmEngine]) -> tuple[VllmBackend, VllmEngine]:
    return engines[0], engines[1]


@pytest.fixture(scope="module")
def vllm_spec(engines: tuple[VllmBackend, VllmEngine, VllmEngine]) -> VllmEngine:
    return engines[2]


@pytest.fixture(scope="module")
def reference(tiny_model: ModelConfig) -> Any:
    return load_model(tiny_model).float().eval()


def scored(model: Any, req: GenRequest, ids: list[int]) -> list[float]:
    """The trainer's logprobs of `ids` after the prompt (temperature and nucleus as sampled)."""
    with torch.no_grad():
        logits = model(torch.tensor([req.prompt_ids + ids])).logits[0].float()
    p = len(req.prompt_ids)
    logits = logits[p - 1 : p - 1 + len(ids)] / (req.temperature if req.temperature > 0 else 1.0)
    logp = torch.log_softmax(logits, -1)
    if req.top_p < 1.0:
        probs, order = logp.exp().sort(-1, descending=True)
        keep = (probs.cumsum(-1) - probs) < req.top_p
        mask = torch.zeros_like(keep).scatter(-1, order, keep)
        logp = torch.log_softmax(logits.masked_fill(~mask, float("-inf")), -1)
    return [logp[j, t].item() for j, t in enumerate(ids)]


async def test_logprobs_match_the_trainers_and_sampling_follows_the_request(
    vllm: tuple[VllmBackend, VllmEngine], reference: Any
) -> None:
    backend, engine = vllm
    reqs = [
        GenRequest(PROMPT, 24, 0.8, min_new_tokens=24, seed=1),
        GenRequest(PROMPT, 24, 1.0, min_new_tokens=24, top_p=0.9, seed=2),
        GenRequest(PROMPT, 24, 0.0, min_new_tokens=24),
    ]
    done = await asyncio.gather(*(engine.submit(r) for r in reqs))
    for req, d in zip(reqs, done, strict=True):
        out = d.output
        assert len(out.token_ids) == len(out.logprobs) == len(out.token_versions) == 24
        assert set(out.token_versions) == {0} and out.finish_reason == "length"
        delta = [abs(a - b) for a, b in zip(out.logprobs, scored(reference, req, out.token_ids), strict=True)]
        assert sum(delta) / len(delta) <= 1e-3, (
            f"mean |logprob delta| {sum(delta) / len(delta):.2e} at float32"
        )

    again = await engine.submit(reqs[0])
    assert again.output.token_ids == done[0].output.token_ids, "the same seed samples the same tokens"
    other = await engine.submit(GenRequest(PROMPT, 24, 0.8, min_new_tokens=24, seed=99))
    assert other.output.token_ids != done[0].output.token_ids

    sampled = done[0].output.token_ids
    words = [backend.decode([t]).strip() for t in sampled[4:]]
    stop = next((w for w in words if len(w) >= 2 and w.isprintable() and "\ufffd" not in w), None)
    assert stop is not None, words
    stopped = await engine.submit(GenRequest(PROMPT, 24, 0.8, stop=[stop], seed=1))
    ids = stopped.output.token_ids
    assert stopped.output.finish_reason == "stop" and backend.decode(ids).endswith(stop)
    assert len(ids) < 24 and ids == sampled[: len(ids)], "the same tokens, up to the stop string"


async def test_the_iteration_log_holds_each_iteration_as_vllm_ran_it(
    vllm: tuple[VllmBackend, VllmEngine],
) -> None:
    """Two fresh prompts prefilled together, then decoded together: one line per iteration with
    the batch, the prompt tokens and the decoding sequences' context (`engine.iteration_log`)."""
    backend, engine = vllm
    log = backend.iterations
    assert log is not None
    settled = -1
    while engine.running or log.count != settled:  # an earlier test's last iterations come in
        settled = log.count
        await asyncio.sleep(0.3)
    log.flush()
    seen = len(read_iterations(log.path.parent))
    prompts = [list(range(3000 + 40 * i, 3030 + 40 * i)) for i in range(2)]  # no prefix-cache hit
    await asyncio.gather(
        *(engine.submit(GenRequest(p, 16, 1.0, min_new_tokens=16, seed=i)) for i, p in enumerate(prompts))
    )
    log.flush()
    its = read_iterations(log.path.parent)[seen:]
    assert sum(it.prefill_tokens for it in its) == 60, its
    # each sequence's first token comes with its prefill, the other 15 from decode iterations
    assert sum(it.decode_tokens for it in its) == sum(it.decode for it in its) == 30, its
    assert all(it.model_s > 0 and 0 <= it.context <= 30 + 16 for it in its), its
    assert max(it.context for it in its) > 30, "the decoding sequences' context grows past the prompt"
    assert all(it.dt is None or it.dt > 0 for it in its) and any(it.dt for it in its), its


async def test_a_full_batch_admits_the_lower_priority_value_first(
    vllm: tuple[VllmBackend, VllmEngine],
) -> None:
    _, engine = vllm
    finished: list[str] = []

    async def run(name: str, req: GenRequest) -> None:
        await engine.submit(req)
        finished.append(name)

    long = [
        asyncio.create_task(run(f"busy{n}", GenRequest(PROMPT, n, 1.0, min_new_tokens=n))) for n in (300, 640)
    ]
    while engine.running < 2:  # both slots taken (max_batch 2); one frees long before the other
        await asyncio.sleep(0.01)
    late = asyncio.create_task(run("late", GenRequest(PROMPT, 8, 1.0, min_new_tokens=8, priority=5)))
    await asyncio.sleep(0.05)
    urgent = asyncio.create_task(run("urgent", GenRequest(PROMPT, 8, 1.0, min_new_tokens=8, priority=0)))
    await asyncio.gather(*long, late, urgent)
    assert finished.index("urgent") < finished.index("late") < finished.index("busy640"), finished


async def test_a_drained_engine_hands_back_its_turns_with_their_tokens(
    vllm: tuple[VllmBackend, VllmEngine], reference: Any
) -> None:
    _, engine = vllm
    reqs = [GenRequest(PROMPT, 400, 1.0, min_new_tokens=400, seed=5) for _ in range(3)]
    tasks = [asyncio.create_task(engine.submit(r)) for r in reqs]
    while engine.tokens_generated == 0 or engine.running < 2:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert await engine.hand_back() == 3
    done = await asyncio.gather(*tasks)
    assert {d.output.finish_reason for d in done} == {"handed_back"}
    outs = sorted((d.output for d in done), key=lambda o: len(o.token_ids))
    assert len(outs[0].token_ids) == 0, "the queued request (batch of 2) had no token yet"
    kept = outs[-1]
    assert 0 < len(kept.token_ids) < 400 and len(kept.logprobs) == len(kept.token_ids)
    delta = [
        abs(a - b) for a, b in zip(kept.logprobs, scored(reference, reqs[0], kept.token_ids), strict=True)
    ]
    assert max(delta) < 1e-2, "the tokens handed back are the ones whose logprobs it reports"
    after = await engine.submit(GenRequest(PROMPT, 4, 1.0))
    assert after.output.finish_reason in ("length", "stop"), "it serves on after a hand-back"


async def test_bad_requests_are_refused_with_a_typed_error_and_it_serves_on(
    vllm: tuple[VllmBackend, VllmEngine],
) -> None:
    backend, engine = vllm
    with pytest.raises(InvalidMessage, match="sampling parameters"):
        await engine.submit(GenRequest(PROMPT, 8, 1.0, top_p=0.0))
    with pytest.raises(InvalidMessage, match="vLLM refused"):
        await engine.submit(GenRequest([7] * (backend.max_positions + 1), 8, 1.0))
    assert engine.in_flight == 0
    ok = await engine.submit(GenRequest(PROMPT, 4, 1.0))
    assert len(ok.output.token_ids) > 0


async def test_calibrates_empty_push_pauses_checksums_and_resumes_without_losing_a_request(
    vllm: tuple[VllmBackend, VllmEngine],
) -> None:
    """`libra calibrate` times what every push costs beyond its bytes as an empty push: it pauses
    generation with the running requests kept, reads the served weights back, and resumes."""
    from tools.calibrate import _empty_push, _tensors, push_specs

    backend, engine = vllm
    tensors, in_place = await _tensors(backend)
    assert not in_place, "vLLM loads whole tensors through its own loader"
    running = asyncio.create_task(engine.submit(GenRequest(PROMPT, 64, 1.0, min_new_tokens=64)))
    while engine.tokens_generated == 0:
        await asyncio.sleep(0.05)
    assert await _empty_push(backend, push_specs(tensors)) > 0
    assert len((await running).output.token_ids) == 64, "the running request went on after the pause"


@pytest.fixture
def store(redis_server: Server, run_id: str) -> Iterator[OwnershipStore]:
    yield OwnershipStore.from_url(redis_server.url, run_id)


def perturbed(model: Any, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.detach() + 0.05 * torch.randn(v.shape, generator=g)).clone()
        for k, v in model.named_parameters()
    }


async def push(stub: Any, snap: Snapshot, token: int, checksum: str | None = None) -> ws.PushAck:
    enc = encode_dense(snap, 256 << 10)
    header = enc.header(token, "trainer-1")
    if checksum is not None:
        header.checksum = checksum
    return await push_encoded(stub, enc, header)


async def push_encoded(stub: Any, enc: Any, header: ws.WeightHeader) -> ws.PushAck:
    async def gen() -> AsyncIterator[ws.WeightChunk]:
        yield ws.WeightChunk(header=header)
        for r in enc.records:
            yield r

    return await stub.PushWeights(gen(), timeout=60)


async def test_ngram_speculation_maps_onto_vllms_drafter_and_changes_no_greedy_token(
    vllm: tuple[VllmBackend, VllmEngine], vllm_spec: VllmEngine
) -> None:
    """`rollout.speculative: ngram` runs vLLM's own prompt-lookup drafter: greedy output is token
    for token the plain engine's (verification is lossless), and the engine's speculation counters
    (its load reports' and metrics') count vLLM's drafted and accepted tokens."""
    _, plain = vllm
    looping = GenRequest(PROMPT * 3, 48, 0.0, min_new_tokens=48)  # a random model's greedy loop repeats
    want = (await plain.submit(looping)).output
    got = (await vllm_spec.submit(looping)).output
    counted = spec_counters(vllm_spec)
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-3
    assert counted is not None and counted.verify_steps > 0 and counted.drafted >= counted.accepted > 0, (
        counted
    )


async def test_seeded_prompts_longer_than_a_step_do_not_kill_the_cpu_engine(vllm_spec: VllmEngine) -> None:
    """Four seeded 900-token prompts at once: more than one CPU step's 2,048 tokens. Split over
    steps, vLLM would rewind the seeded generator of a partly prefilled one, which a CPU generator
    cannot do (the engine core died: "CPU Generator does not use offset"); each is prefilled
    whole, and all complete."""
    reqs = [
        GenRequest([1000 + (7 * i + j) % 30000 for j in range(900)], 4, 1.0, min_new_tokens=4, seed=i)
        for i in range(4)
    ]
    done = await asyncio.gather(*(vllm_spec.submit(r) for r in reqs))
    assert [len(d.output.token_ids) for d in done] == [4, 4, 4, 4]
    assert (
        len((await vllm_spec.submit(GenRequest(PROMPT, 4, 1.0, seed=9))).output.token_ids) == 4
    )  # serving on


async def test_a_push_mid_generation_lands_in_vllm_as_the_trainer_sent_it(
    vllm: tuple[VllmBackend, VllmEngine], reference: Any, store: OwnershipStore
) -> None:
    backend, engine = vllm
    servicer = WeightSyncServicer(engine, store, "engine-v", record_timeout_s=5.0)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    opts = [("grpc.max_send_message_length", 64 << 20)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    stub = ws_grpc.WeightSyncStub(channel)
    lease = await store.acquire(TRAINER_ROLE, "trainer-1", 30)
    assert lease is not None
    try:
        greedy = GenRequest(PROMPT, 16, 0.0, min_new_tokens=16)
        before = (await engine.submit(greedy)).output.token_ids
        base = engine.version
        new = perturbed(reference, 7)
        snap = snapshot(new, base + 1)
        running = [
            asyncio.create_task(engine.submit(GenRequest(PROMPT, 300, 1.0, min_new_tokens=300)))
            for _ in range(2)
        ]
        while engine.tokens_generated == 0 or engine.running < 2:
            await asyncio.sleep(0.05)
        ack = await push(stub, snap, lease.token)
        assert (ack.accepted, ack.code, ack.version) == (True, "ok", base + 1), ack.message
        info = await stub.GetVersion(ws.VersionRequest())
        assert (info.version, info.checksum, info.torn) == (base + 1, snap.checksum, False)
        assert await backend.served_checksum(snap.specs()) == snap.checksum, "vLLM serves what was sent"
        spans = await asyncio.gather(*running)
        assert all(len(s.output.token_ids) == 300 for s in spans), "no request was lost to the push"
        assert any({base, base + 1} <= set(s.output.token_versions) for s in spans)

        after = await engine.submit(greedy)
        assert after.policy_version == base + 1 and after.output.token_ids != before
        reference.load_state_dict(new, strict=False)
        delta = [
            abs(a - b)
            for a, b in zip(
                after.output.logprobs, scored(reference, greedy, after.output.token_ids), strict=True
            )
        ]
        assert sum(delta) / len(delta) <= 1e-3

        bad = snapshot(perturbed(reference, 8), base + 2)
        refused = await push(stub, bad, lease.token, checksum="0" * 64)
        assert (refused.accepted, refused.code) == (False, "checksum_mismatch"), refused.message
        assert (await stub.GetVersion(ws.VersionRequest())).torn, "what it holds is neither version"
        repaired = await push(stub, bad, lease.token)
        assert repaired.accepted, repaired.message
        info = await stub.GetVersion(ws.VersionRequest())
        assert (info.version, info.checksum, info.torn) == (base + 2, bad.checksum, False)
        assert len((await engine.submit(GenRequest(PROMPT, 4, 1.0))).output.token_ids) > 0

        # a sparse delta: a few elements of every tensor, written in place into vLLM's fused
        # layout (q/k/v, gate/up), checked against what it then serves
        assert info.accepts_deltas
        moved = {
            n: t.clone().view(*shape) for n, shape, t in zip(bad.names, bad.shapes, bad.tensors, strict=True)
        }
        g = torch.Generator().manual_seed(9)
        for v in moved.values():
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
            flat[idx] += 0.5
        nxt = snapshot(moved, base + 3)
        enc = encode_delta(bad, nxt, 256 << 10)
        assert enc.sparse_tensors > 0 and enc.total_bytes < nxt.nbytes // 10
        ack = await push_encoded(stub, enc, enc.header(lease.token, "trainer-1"))
        assert ack.accepted, ack.message
        info = await stub.GetVersion(ws.VersionRequest())
        assert (info.version, info.checksum, info.torn) == (base + 3, nxt.checksum, False)
        assert await backend.served_checksum(nxt.specs()) == nxt.checksum, "vLLM serves the delta's result"
        assert len((await engine.submit(GenRequest(PROMPT, 4, 1.0))).output.token_ids) > 0
    finally:
        await channel.close()
        await server.stop(grace=0)
