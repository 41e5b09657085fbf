"""Speculative decoding in the live engine, on SmolLM2-135M-Instruct (the real model, CPU): greedy
and seeded sampled output identical to plain decoding while rows join and leave the batch
mid-verify, rejected drafts
rolled back out of the KV cache, and a fresh engine drafting from nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from services.common.runconfig import ModelConfig, SpeculativeConfig
from services.generation.backends.base import Finished, GenRequest, Join
from services.generation.backends.hf import HFBackend
from services.generation.engine import ContinuousEngine
from services.generation.speculator import Speculator

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is 17*23? Use the calculator: write <calc>17*23</calc>.",
    "Write a Python function that reverses a list.",
    "List three prime numbers and say why each is prime.",
]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    b = HFBackend(ModelConfig(source="smollm2"), torch_threads=2, seed=0)
    asyncio.run(b.start())
    return b


def prompts(b: HFBackend) -> list[list[int]]:
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [list(b.tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chat]


def requests(b: HFBackend) -> list[GenRequest]:
    """Two samples of each prompt (a GRPO group), with different budgets, a stop string and a
    minimum length, so rows end at different steps and others join in their place."""
    out = []
    for i, p in enumerate(prompts(b)):
        for k in range(2):
            out.append(
                GenRequest(
                    p,
                    max_new_tokens=16 + 12 * k + 6 * i,
                    temperature=0.0,
                    stop=["</calc>"] if i == 0 and k == 1 else [],
                    min_new_tokens=12 if i == 2 and k == 0 else 0,
                    prompt_id=f"p{i}",
                    group_id=f"g{i}",
                )
            )
    return out


async def generate(b: HFBackend, spec: Speculator | None, reqs: list[GenRequest]) -> list[Finished]:
    engine = ContinuousEngine(b, max_batch=3, speculator=spec)
    engine.start()
    try:
        # the first sample of each group a little ahead: its siblings find its response to draft from
        first = await asyncio.gather(*(engine.submit(r) for r in reqs[::2]))
        rest = await asyncio.gather(*(engine.submit(r) for r in reqs[1::2]))
    finally:
        await engine.close(5)
    return [x for pair in zip(first, rest, strict=True) for x in pair]


async def test_greedy_speculation_emits_exactly_what_plain_decoding_does(backend: HFBackend) -> None:
    reqs = requests(backend)
    plain = await generate(backend, None, reqs)
    spec = Speculator(SpeculativeConfig(method="suffix", num_tokens=6, policy="fixed"))
    fast = await generate(backend, spec, reqs)
    for a, b in zip(plain, fast, strict=True):
        assert b.output.token_ids == a.output.token_ids
        assert b.output.finish_reason == a.output.finish_reason
        # the target model's logprobs, whichever forward computed them
        assert max(abs(x - y) for x, y in zip(a.output.logprobs, b.output.logprobs, strict=True)) < 1e-3
    c = spec.counters
    assert c.verify_steps > 0 and 0 < c.accepted <= c.drafted
    assert sum(f.output.accepted for f in fast) == c.accepted
    assert c.by_source["group"][1] > 0, "siblings' responses were drafted from and accepted"
    assert fast[2 * 0 + 1].output.finish_reason == "stop"  # the stop string still ends a row mid-draft


async def test_seeded_sampling_emits_the_same_tokens_with_and_without_speculation(backend: HFBackend) -> None:
    """At temperature 1 (and top_p 0.9 for some rows) each request's seed fixes the uniform draw
    of each position, so speculation, verifying drafts, emits the very tokens plain decoding does."""
    reqs = [
        dataclasses.replace(r, temperature=1.0, top_p=0.9 if i % 3 == 0 else 1.0, seed=100 + i)
        for i, r in enumerate(requests(backend))
    ]
    plain = await generate(backend, None, reqs)
    spec = Speculator(SpeculativeConfig(method="suffix", num_tokens=6, policy="fixed"))
    fast = await generate(backend, spec, reqs)
    for a, b in zip(plain, fast, strict=True):  # (so seeded sampling is reproducible, too)
        assert b.output.token_ids == a.output.token_ids
        assert max(abs(x - y) for x, y in zip(a.output.logprobs, b.output.logprobs, strict=True)) < 1e-3
    assert spec.counters.accepted > 0
    # siblings with different seeds sample differently
    assert plain[0].output.token_ids != plain[1].output.token_ids


async def test_a_seeded_turn_continued_from_its_tokens_goes_on_as_if_never_moved(backend: HFBackend) -> None:
    """A turn taken off one engine after some tokens and sent to another with those tokens in its
    context and the same seed (a reclaimed engine's turn, handed back) samples what it would have
    sampled had it stayed; another engine, speculating, included."""
    prompt = prompts(backend)[1]
    whole = GenRequest(prompt, 40, 1.0, prompt_id="p1", group_id="g1", seed=77)
    full = (await generate(backend, None, [whole, dataclasses.replace(whole, seed=78)]))[0].output.token_ids
    assert len(full) == 40
    cut = 15
    rest = dataclasses.replace(whole, prompt_ids=prompt + full[:cut], max_new_tokens=40 - cut)
    spec = Speculator(SpeculativeConfig(method="suffix", num_tokens=4, policy="fixed"))
    spec.drafter.add("p1", "g1", full)  # a drafter that knows the answer: drafts accepted
    moved = (await generate(backend, spec, [rest, dataclasses.replace(rest, seed=79)]))[0].output
    assert full[:cut] + moved.token_ids == full
    assert moved.accepted > 0


def test_rejected_drafts_are_rolled_back_from_the_kv_cache(backend: HFBackend) -> None:
    """Drafts of random tokens (nearly all rejected) leave holes in the cache; the rows still emit
    the greedy tokens, compaction squeezes the holes out, and the next token's logprob from that
    cache equals a fresh prefill's of the same context."""
    rng = random.Random(3)
    ps = prompts(backend)
    joins = [Join(i, p, 0.0, GenRequest(p, 64, 0.0)) for i, p in enumerate(ps)]
    plain: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for slot, emitted in backend.step_sync(joins, [], True).items():
        plain[slot] += [t for t, _ in emitted]
    for _ in range(45):
        for slot, emitted in backend.step_sync([], [], False).items():
            plain[slot] += [t for t, _ in emitted]

    got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for slot, emitted in backend.step_sync(joins, [], True).items():
        got[slot] += [t for t, _ in emitted]
    widths = []
    while min(len(v) for v in got.values()) < 31:
        drafts = {s: [rng.randrange(1000, 40000) for _ in range(rng.randint(0, 6))] for s in got}
        for s in drafts:  # now and then the right next token, so some drafts are accepted
            if drafts[s] and rng.random() < 0.3 and len(got[s]) < len(plain[s]):
                drafts[s][0] = plain[s][len(got[s])]
        for slot, emitted in backend.step_sync([], [], False, drafts=drafts).items():
            got[slot] += [t for t, _ in emitted]
        widths.append(backend.batch.mask.shape[1])
    assert all(got[s] == plain[s][: len(got[s])] for s in got)
    assert any(b < a for a, b in zip(widths, widths[1:], strict=False)), "the holes were compacted"

    rows = sorted(got)
    nxt = backend.step_sync([], [], False)  # one plain step on the rolled-back cache
    fresh = {s: backend.step_sync([Join(s, ps[s] + got[s], 0.0, None)], [], True)[s][0] for s in rows}
    for s in rows:
        (token, logprob), (ref_token, ref_logprob) = nxt[s][0], fresh[s]
        assert token == ref_token and logprob == pytest.approx(ref_logprob, abs=1e-4)


async def test_a_fresh_engine_drafts_from_nothing_and_fills_its_drafter(backend: HFBackend) -> None:
    """A restarted engine has an empty drafter: it decodes (own-context drafts only) without error,
    learns the responses it generates, and drafts from them for the next samples."""
    reqs = requests(backend)[:2]
    # a fixed draft length: the adaptive policy prices drafts by the step times it measures, which
    # on a loaded machine can make it draft nothing (this test is about the drafter, not the policy)
    spec = Speculator(SpeculativeConfig(method="suffix", num_tokens=4, policy="fixed"))
    assert len(spec.drafter) == 0
    out: list[Any] = await generate(backend, spec, reqs)
    assert all(o.output.token_ids for o in out)
    assert len(spec.drafter) >= 1
    assert spec.counters.by_source["group"][0] > 0
