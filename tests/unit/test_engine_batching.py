"""The rollout engine's pure pieces and its batching contract, on the tiny model where it matters."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from services.common.contracts import ev
from services.common.cost_model import load_presets
from services.common.errors import InvalidMessage
from services.common.runconfig import EmulatedConfig, ModelConfig
from services.generation.backends.base import EngineClosed, GenOutput, GenRequest, Join, StepBackend
from services.generation.backends.emulated import EmulatedBackend
from services.generation.config import EngineSettings
from services.generation.engine import ContinuousEngine
from services.generation.sampling import left_pad, sample_next
from services.generation.serving import validate_turn
from services.generation.stops import StopMatcher
from services.scheduler.inflight import trajectory_seed


def test_left_pad_aligns_rows_at_the_end_and_counts_positions_from_real_tokens() -> None:
    ids, mask, pos = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_sample_next_reports_logprob_under_tempered_distribution_and_greedy_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    temps = torch.tensor([0.7, 1.3, 0.0])
    tokens, lps = sample_next(logits, temps, torch.Generator().manual_seed(1))
    for row, t in enumerate((0.7, 1.3)):
        expected = torch.log_softmax(logits[row] / t, -1)[tokens[row]]
        assert lps[row].item() == pytest.approx(expected.item(), abs=1e-6)
    assert tokens[2].item() == logits[2].argmax().item()
    assert lps[2].item() == pytest.approx(torch.log_softmax(logits[2], -1).max().item(), abs=1e-6)


def test_top_p_samples_only_the_nucleus_and_reports_its_renormalised_logprob() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(6000, 1)
    top_p = torch.full((6000,), 0.8)
    tokens, lps = sample_next(logits, torch.ones(6000), torch.Generator().manual_seed(0), top_p)
    # the nucleus of 0.8 is {0, 1}: 0.5 + 0.3 reaches it; token 2 (0.15) would not be needed
    assert set(tokens.tolist()) == {0, 1}
    assert 0.60 < (tokens == 0).float().mean().item() < 0.65  # 0.5 / 0.8 = 0.625
    for tok, want in ((0, 0.5 / 0.8), (1, 0.3 / 0.8)):
        assert lps[tokens == tok][0].item() == pytest.approx(math.log(want), abs=1e-5)
    # per row: top_p 1 is the full tempered distribution, exactly as without top_p
    mixed = torch.tensor([1.0, 0.3])
    t, lp = sample_next(torch.log(probs).repeat(2, 1), torch.ones(2), torch.Generator().manual_seed(3), mixed)
    assert lp[0].item() == pytest.approx(math.log(probs[t[0]].item()), abs=1e-5)
    assert t[1].item() == 0 and lp[1].item() == pytest.approx(0.0, abs=1e-6)  # nucleus {0}: certain


def test_sample_next_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.9, 0.1]])).repeat(4000, 1)
    tokens, _ = sample_next(logits, torch.ones(4000), torch.Generator().manual_seed(0))
    assert 0.85 < (tokens == 0).float().mean().item() < 0.95


def test_stop_matcher_sees_a_stop_string_split_over_tokens() -> None:
    vocab = {1: "ab", 2: "c", 3: "</", 4: "answer>"}
    m = StopMatcher(["</answer>"], lambda ids: "".join(vocab[i] for i in ids))
    assert not m.matches([1, 2, 3])
    assert m.matches([1, 2, 3, 4])
    assert not StopMatcher([], lambda ids: "").matches([1])


def test_emulated_iteration_time_is_the_cost_models_prefill_plus_decode() -> None:
    backend = EmulatedBackend(
        EngineSettings(tensor_parallel=2), EmulatedConfig(gpu="A800", model="qwen3-14b")
    )
    cm = load_presets("A800", "qwen3-14b")
    got = backend.iteration_s([100, 300], [1000, 3000, 2000])
    want = cm.prefill_s(100, 0, 2) + cm.prefill_s(300, 0, 2) + cm.decode_step_s(3, 2000.0, 2)
    assert got == pytest.approx(want)
    assert backend.free_kv_tokens() == cm.kv_capacity_tokens(2)
    assert backend.admits(cm.kv_capacity_tokens(2) - 10, 10)
    assert not backend.admits(cm.kv_capacity_tokens(2) - 10, 11)


def test_unknown_emulated_presets_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown GPU preset"):
        EmulatedConfig(gpu="TPU9")
    with pytest.raises(ValueError, match="unknown model preset"):
        EmulatedConfig(model="gpt-9")


async def test_emulated_turns_have_exactly_the_length_asked_for_and_take_their_bucket_tp() -> None:
    backend = EmulatedBackend(EngineSettings(seed=0), EmulatedConfig(time_scale=0.001))
    backend.set_tensor_parallel(4)
    assert backend.kv_capacity == backend.cm.kv_capacity_tokens(4)
    outs = await _generate(backend, [GenRequest([5] * 100, n, 1.0, min_new_tokens=n) for n in (1, 7, 30)])
    assert [len(o.token_ids) for o in outs] == [1, 7, 30]
    assert backend.emulated_s > 0


async def test_emulated_prefix_cache_prefills_only_what_is_new_and_new_weights_clear_it() -> None:
    backend = EmulatedBackend(EngineSettings(seed=0), EmulatedConfig(time_scale=0.001))
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    first = list(range(1000, 1100))
    out = (await engine.submit(GenRequest(first, 20, 1.0, min_new_tokens=20))).output
    await _until(lambda: not backend.rows and len(backend.cache) > 0)  # it left the batch
    follow_up = first + out.token_ids + [7] * 30  # the next turn: context, its output, a tool return
    cached = backend._cached_prefix(follow_up)
    assert cached == (len(first) + 20) // 16 * 16, "whole blocks of what was computed before"
    assert backend._cached_prefix(list(range(2000, 2100))) == 0, "another prompt shares nothing"
    cost_cached = backend.iteration_s([len(follow_up) - cached], [], [cached])
    assert cost_cached < backend.iteration_s([len(follow_up)], [])
    assert await engine.swap_weights({}, 1, "v1")
    await engine.submit(GenRequest([5] * 40, 2, 1.0))
    assert backend._cached_prefix(follow_up) == 0, "new weights invalidate the cache"
    await engine.close(timeout=1)


def _turn(**kw: Any) -> ev.TurnRequest:
    base: dict[str, Any] = dict(
        request_id="r1", trajectory_id="t1", context_token_ids=[1, 2, 3], max_new_tokens=8, temperature=1.0
    )
    base.update(kw)
    return ev.TurnRequest(**base)


@pytest.mark.parametrize(
    "bad",
    [
        {"request_id": ""},
        {"trajectory_id": ""},
        {"context_token_ids": []},
        {"max_new_tokens": 0},
        {"max_new_tokens": 5000},
        {"context_token_ids": [1, 49152]},
        {"context_token_ids": [1, -1]},
        {"context_token_ids": [1] * 40960},
        {"temperature": float("nan")},
        {"temperature": -1.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"stop": ["x" * 300]},
    ],
)
def test_validate_turn_refuses_broken_requests(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidMessage):
        validate_turn(_turn(**bad), EmulatedBackend(EngineSettings()), 4096)


def test_validate_turn_clips_generation_to_the_model_positions() -> None:
    gen = validate_turn(
        _turn(context_token_ids=[1] * 40958, max_new_tokens=100), EmulatedBackend(EngineSettings()), 4096
    )
    assert gen.max_new_tokens == 2 and gen.temperature == 1.0 and gen.top_p == 1.0  # unset: full
    assert validate_turn(_turn(top_p=0.9), EmulatedBackend(EngineSettings()), 4096).top_p == pytest.approx(
        0.9
    )


def test_a_turns_sampling_seed_reaches_the_engine_and_is_fixed_per_trajectory() -> None:
    engine = EmulatedBackend(EngineSettings())
    assert validate_turn(_turn(), engine, 4096).seed is None  # unset: the engine draws one
    assert validate_turn(_turn(sampling_seed=0), engine, 4096).seed == 0
    assert validate_turn(_turn(sampling_seed=2**63 - 1), engine, 4096).seed == 2**63 - 1
    seed = trajectory_seed(0, "g00001-p3-s0")
    assert seed == trajectory_seed(0, "g00001-p3-s0") and 0 <= seed < 2**63
    others = {trajectory_seed(0, "g00001-p3-s1"), trajectory_seed(1, "g00001-p3-s0"), seed}
    assert len(others) == 3  # siblings and runs with another rollout.sampling_seed differ


class ScriptedBackend(StepBackend):
    """Pure logic stand-in: every row emits its slot's next token from a counter; an iteration
    blocks while `gate` is clear, and every call is recorded."""

    name = "scripted"

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], bool]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.rows: set[int] = set()
        self.weights = 0
        self.capacity = 10**9
        self.held: dict[int, int] = {}
        self.at_gate = False
        self.no_eos: list[frozenset[int]] = []

    vocab_size = 100  # type: ignore[assignment]
    max_positions = 100  # type: ignore[assignment]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({99})

    async def start(self) -> None:
        return None

    async def step(
        self,
        joins: list[Join],
        leaves: list[int],
        reset: bool,
        no_eos: frozenset[int] = frozenset(),
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        self.calls.append(([j.slot for j in joins], list(leaves), reset))
        self.no_eos.append(no_eos)
        self.at_gate = not self.gate.is_set()
        await self.gate.wait()
        self.at_gate = False
        await asyncio.sleep(0.001)  # an iteration takes time, as on a real device
        if reset:
            self.rows.clear()
        self.rows -= set(leaves)
        self.rows |= {j.slot for j in joins}
        for j in joins:
            self.held[j.slot] = len(j.context)
        return {s: [(self.weights, -0.5)] for s in self.rows}

    def admits(self, running_tokens: int, context: int) -> bool:
        return running_tokens + context <= self.capacity

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.weights = version

    def decode(self, token_ids: list[int]) -> str:
        return "".join("x" if t != 98 else "STOP" for t in token_ids)


async def _until(cond: Any, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.002)

    await asyncio.wait_for(poll(), timeout)


async def test_a_request_joins_a_running_batch_and_leaves_before_the_longest_row() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    long = asyncio.create_task(engine.submit(GenRequest([1, 2], 400)))
    await _until(lambda: engine.iterations >= 3)
    short = await engine.submit(GenRequest([3], 5))
    assert not long.done() and engine.running == 1
    assert len(short.output.token_ids) == 5 and short.output.finish_reason == "length"
    joined_at = next(i for i, (joins, _, _) in enumerate(backend.calls) if joins and i > 0)
    assert joined_at >= 3, "the short request joined mid-way, not with the first batch"
    await engine.close(timeout=0)
    with pytest.raises(EngineClosed):
        await long


async def test_stop_strings_eos_and_budgets_are_per_request() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    backend.weights = 98  # every token decodes to "STOP"
    stopped, budget = await asyncio.gather(
        engine.submit(GenRequest([1], 10, stop=["STOP"])), engine.submit(GenRequest([1], 3))
    )
    assert (stopped.output.token_ids, stopped.output.finish_reason) == ([98], "stop")
    assert (len(budget.output.token_ids), budget.output.finish_reason) == (3, "length")
    backend.weights = 99  # EOS
    eos = await engine.submit(GenRequest([1], 10))
    assert (eos.output.token_ids, eos.output.finish_reason) == ([99], "stop")
    await engine.close(timeout=1)


async def test_min_new_tokens_holds_off_eos_and_stop_strings() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=2)
    engine.start()
    backend.weights = 99  # EOS every step; a real backend would not sample it while banned
    out = (await engine.submit(GenRequest([1], 10, stop=["x"], min_new_tokens=4))).output
    assert (len(out.token_ids), out.finish_reason) == (4, "stop")
    assert [0 in banned for banned in backend.no_eos[:4]] == [True] * 4, "EOS banned for tokens 1-4"
    exact = (await engine.submit(GenRequest([1], 6, min_new_tokens=6))).output
    assert (len(exact.token_ids), exact.finish_reason) == (6, "stop")
    await engine.close(timeout=1)


async def test_waiting_requests_are_admitted_lowest_priority_value_first() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=1)
    engine.start()
    order: list[str] = []

    async def run(name: str, priority: int, n: int) -> None:
        await engine.submit(GenRequest([1], n, priority=priority))
        order.append(name)

    first = asyncio.create_task(run("first", 5, 20))
    await _until(lambda: engine.running == 1)
    rest = [asyncio.create_task(run(n, p, 2)) for n, p in (("low", 3), ("high", 0), ("mid", 1))]
    await asyncio.gather(first, *rest)
    assert order == ["first", "high", "mid", "low"]
    await engine.close(timeout=1)


async def test_a_request_waits_while_the_kv_cache_is_full() -> None:
    backend = ScriptedBackend()
    backend.capacity = 10
    engine = ContinuousEngine(backend, max_batch=8)
    engine.start()
    big = asyncio.create_task(engine.submit(GenRequest([1] * 8, 200)))
    await _until(lambda: engine.running == 1)
    small = asyncio.create_task(engine.submit(GenRequest([1] * 4, 2)))
    await _until(lambda: engine.iterations >= 10)
    assert engine.waiting == 1 and not small.done() and not big.done()
    await big
    assert len((await small).output.token_ids) == 2
    await engine.close(timeout=1)


async def test_weights_swap_between_iterations_and_running_requests_continue_on_them() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=2)
    engine.start()
    running = asyncio.create_task(engine.submit(GenRequest([1, 2], 40)))
    await _until(lambda: engine.iterations >= 5)
    backend.gate.clear()
    await _until(lambda: backend.at_gate)  # an iteration is in flight
    swap = asyncio.create_task(engine.swap_weights({}, 1, "c1"))
    await asyncio.sleep(0.05)
    assert not swap.done() and engine.version == 0, "the swap waits for the iteration to end"
    backend.gate.set()
    assert await swap
    done = await running
    versions = done.output.token_versions
    assert len(versions) == 40 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions) and done.policy_version == 0
    cut = versions.index(1)
    assert done.output.token_ids[:cut] == [0] * cut and set(done.output.token_ids[cut:]) == {1}
    rejoin = next(c for c in backend.calls[1:] if c[2])
    assert rejoin[0] == [0], "the running row re-prefilled its context with the new weights"
    assert backend.held[0] == 2 + cut, "the re-prefilled context is the prompt plus what it generated"
    assert not await engine.swap_weights({}, 1, "again")
    await engine.close(timeout=1)


async def test_a_cancelled_request_leaves_the_batch() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=2)
    engine.start()
    task = asyncio.create_task(engine.submit(GenRequest([1], 1000)))
    await _until(lambda: engine.running == 1)
    task.cancel()
    await _until(lambda: engine.running == 0)
    assert any(0 in leaves for _, leaves, _ in backend.calls) or backend.rows == set()
    await engine.close(timeout=1)


async def test_close_hands_back_queued_requests_and_wakes_waiters() -> None:
    backend = ScriptedBackend()
    engine = ContinuousEngine(backend, max_batch=1)
    engine.start()
    running = asyncio.create_task(engine.submit(GenRequest([1], 50)))
    await _until(lambda: engine.running == 1)
    backend.gate.clear()
    await _until(lambda: backend.at_gate)
    queued = asyncio.create_task(engine.submit(GenRequest([1], 1)))
    waiter = asyncio.create_task(engine.wait_for_version(5, timeout=30))
    await asyncio.sleep(0.02)
    closing = asyncio.create_task(engine.close(timeout=5))
    await asyncio.sleep(0.02)
    backend.gate.set()
    await closing
    assert (await running).output.finish_reason == "length"
    with pytest.raises(EngineClosed):
        await queued
    assert await waiter is False


@pytest.fixture(scope="module")
def hf_backend(tiny_model: ModelConfig) -> Any:
    from services.generation.backends.hf import HFBackend

    backend = HFBackend(tiny_model, torch_threads=2, seed=0)
    asyncio.run(backend.start())
    return backend


def _recomputed_logprobs(backend: Any, req: GenRequest, out: GenOutput) -> list[float]:
    full = torch.tensor([req.prompt_ids + out.token_ids])
    with torch.no_grad():
        logits = backend.model(full).logits[0].float()
    t = req.temperature if req.temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, -1)
    p = len(req.prompt_ids)
    return [logp[p - 1 + j, tok].item() for j, tok in enumerate(out.token_ids)]


async def _generate(backend: Any, reqs: list[GenRequest], join_every: int = 0) -> list[GenOutput]:
    """Runs `reqs` on a fresh continuous batcher; with `join_every` > 0 each request after the
    first joins `join_every` iterations after the previous one, into the running batch."""
    engine = ContinuousEngine(backend, max_batch=8)
    engine.start()
    tasks = []
    for i, req in enumerate(reqs):
        if i and join_every:
            target = engine.iterations + join_every
            await _until(lambda t=target: engine.iterations >= t)  # type: ignore[misc]
        tasks.append(asyncio.create_task(engine.submit(req)))
    outs = [f.output for f in await asyncio.gather(*tasks)]
    await engine.close(timeout=5)
    return outs


async def test_hf_logprobs_match_a_recomputed_forward_while_rows_join_and_leave(hf_backend: Any) -> None:
    reqs = [
        GenRequest(list(range(100, 112)), 12, 1.0),
        GenRequest([7, 8, 9], 6, 0.7),
        GenRequest(list(range(300, 330)), 9, 0.0),
        GenRequest([11, 12], 5, 1.3),
        GenRequest(list(range(400, 420)), 14, 0.9),
    ]
    outs = await _generate(hf_backend, reqs, join_every=3)
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) == len(out.token_versions) == req.max_new_tokens
        assert out.finish_reason == "length" and set(out.token_versions) == {0}
        assert all(math.isfinite(x) and x <= 0 for x in out.logprobs)
        assert out.logprobs == pytest.approx(_recomputed_logprobs(hf_backend, req, out), abs=1e-4)


async def test_hf_top_p_rows_draw_from_their_nucleus_beside_full_rows(hf_backend: Any) -> None:
    """A top_p request joins a batch of full-distribution ones: each reports logprobs under its own
    sampling distribution (nucleus renormalised for it, the full one for the others)."""
    nucleus = GenRequest(list(range(100, 112)), 10, 1.0, top_p=0.5)
    full = GenRequest([7, 8, 9], 10, 1.0)
    out_full, out_nucleus = await _generate(hf_backend, [full, nucleus], join_every=2)
    assert out_full.logprobs == pytest.approx(_recomputed_logprobs(hf_backend, full, out_full), abs=1e-4)
    raw = _recomputed_logprobs(hf_backend, nucleus, out_nucleus)
    # renormalised over a nucleus of mass >= 0.5: each logprob is above the raw one by at most log 2
    for got, want in zip(out_nucleus.logprobs, raw, strict=True):
        assert want - 1e-4 <= got <= want + math.log(2) + 1e-4
    assert any(got > want + 0.1 for got, want in zip(out_nucleus.logprobs, raw, strict=True))  # truncated


async def test_hf_greedy_tokens_are_the_same_alone_and_joining_a_running_batch(hf_backend: Any) -> None:
    probe = GenRequest(list(range(500, 517)), 10, 0.0)
    alone = (await _generate(hf_backend, [probe]))[0]
    busy = [GenRequest(list(range(600, 640)), 30, 1.0), GenRequest([3, 4, 5], 25, 1.0)]
    joined = (await _generate(hf_backend, [*busy, probe], join_every=4))[2]
    assert joined.token_ids == alone.token_ids
    assert joined.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


async def test_hf_stops_at_a_stop_string_and_keeps_it(hf_backend: Any) -> None:
    prompt = list(range(500, 510))
    greedy = (await _generate(hf_backend, [GenRequest(prompt, 10, 0.0)]))[0]
    stop_text = hf_backend.tok.decode(greedy.token_ids[3:5])
    assert stop_text.strip(), "the tiny model's greedy tokens decode to text"
    out = (await _generate(hf_backend, [GenRequest(prompt, 10, 0.0, [stop_text])]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) <= 5 and stop_text in hf_backend.tok.decode(out.token_ids)


async def test_hf_stops_at_eos(hf_backend: Any) -> None:
    eos = min(hf_backend.eos)
    with torch.no_grad():
        bias = torch.zeros(hf_backend.vocab_size)
        bias[eos] = 1e4
        head = hf_backend.model.get_output_embeddings()
        saved = head.bias
        head.bias = torch.nn.Parameter(bias)
    try:
        out = (await _generate(hf_backend, [GenRequest([1, 2, 3], 10, 1.0)]))[0]
    finally:
        head.bias = saved
    assert out.token_ids == [eos] and out.finish_reason == "stop"


async def test_hf_min_new_tokens_masks_eos_out_of_the_distribution(hf_backend: Any) -> None:
    eos = min(hf_backend.eos)
    head = hf_backend.model.get_output_embeddings()
    saved = head.bias
    bias = torch.zeros(hf_backend.vocab_size)
    bias[eos] = 15.0  # EOS nearly certain at every step, unless masked
    head.bias = torch.nn.Parameter(bias)
    try:
        req = GenRequest([1, 2, 3], 12, 1.0, min_new_tokens=7)
        out = (await _generate(hf_backend, [req]))[0]
        free = (await _generate(hf_backend, [GenRequest([1, 2, 3], 12, 1.0)]))[0]
    finally:
        head.bias = saved
    assert eos not in out.token_ids[:7] and len(out.token_ids) >= 7
    assert len(free.token_ids) < 7, "without the minimum EOS comes early"
    # the reported logprobs are those of the distribution without EOS
    with torch.no_grad():
        head.bias = torch.nn.Parameter(bias)
        logits = hf_backend.model(torch.tensor([req.prompt_ids + out.token_ids])).logits[0].float()
        head.bias = saved
    logits[:, eos] = -math.inf
    logp = torch.log_softmax(logits, -1)
    want = [logp[2 + j, t].item() for j, t in enumerate(out.token_ids[:7])]
    assert out.logprobs[:7] == pytest.approx(want, abs=1e-4)


async def test_hf_weight_swap_under_load_loses_no_request_and_names_each_tokens_version(
    tiny_model: ModelConfig,
) -> None:
    from services.generation.backends.hf import HFBackend

    backend = HFBackend(tiny_model, torch_threads=2, seed=1)
    await backend.start()
    old = {k: v.clone() for k, v in backend.model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    engine = ContinuousEngine(backend, max_batch=8)
    engine.start()
    reqs = [GenRequest(list(range(100 + 10 * i, 110 + 12 * i)), 24, 1.0) for i in range(5)]
    tasks = [asyncio.create_task(engine.submit(r)) for r in reqs]
    await _until(lambda: engine.iterations >= 8)
    assert await engine.swap_weights(new, 1, "v1")
    done = await asyncio.gather(*tasks)
    await engine.close(timeout=5)
    for req, d in zip(reqs, done, strict=True):
        out = d.output
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        cut = out.token_versions.index(1)
        assert 0 < cut < 24 and out.token_versions == [0] * cut + [1] * (24 - cut)
        # tokens before the swap came from the old weights, after it from the new ones, KV included
        backend.model.load_state_dict(old)
        assert out.logprobs[:cut] == pytest.approx(_recomputed_logprobs(backend, req, out)[:cut], abs=1e-4)
        backend.model.load_state_dict(new)
        assert out.logprobs[cut:] == pytest.approx(_recomputed_logprobs(backend, req, out)[cut:], abs=1e-4)


def test_help_lists_settings_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import runpy, sys; sys.argv = ['rollout-engine', '--help']\n"
        "try:\n    runpy.run_module('services.rollout_engine', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "LIBRA_ROLLOUT_ENGINE_MAX_WAIT_FOR_WEIGHTS_S" in out.stdout and "LIBRA_CONFIG" in out.stdout


async def test_an_hf_backend_over_a_given_model_serves_its_own_parameters_as_they_change(
    hf_backend: Any, tiny_model: ModelConfig
) -> None:
    """The trainer's way to serve (`HFBackend(model=...)`): no weights of its own, the same tokens
    as a backend that loaded the same weights, and a change to the owner's weights is served at once."""
    import copy

    from services.generation.backends.hf import HFBackend

    model = copy.deepcopy(hf_backend.model)
    shared = HFBackend(tiny_model, torch_threads=2, model=model)
    await shared.start()
    assert shared.shared and shared.model is model
    assert all(
        a.data_ptr() == b.data_ptr()
        for a, b in zip(shared.weight_slots().values(), model.state_dict().values(), strict=True)
    )
    reqs = [GenRequest(list(range(100, 110)), 8, 1.0, seed=11), GenRequest([5, 6, 7], 6, 0.8, seed=12)]
    loaded, served = await _generate(hf_backend, reqs), await _generate(shared, reqs)
    assert [o.token_ids for o in served] == [o.token_ids for o in loaded]
    with torch.no_grad():  # the owner trains a step: every logit moves
        w = model.lm_head.weight  # tied to the embedding: a sign flip would nearly cancel
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    after = await _generate(shared, reqs)
    assert [o.token_ids for o in after] != [o.token_ids for o in loaded]
    assert [o.token_ids for o in await _generate(hf_backend, reqs)] == [o.token_ids for o in loaded]


async def _emulated_run(coalesce: int, monkeypatch: pytest.MonkeyPatch) -> tuple[float, int, list[int]]:
    from services.generation.backends import emulated

    monkeypatch.setattr(emulated, "MAX_COALESCED", coalesce)
    backend = EmulatedBackend(EngineSettings(seed=0), EmulatedConfig(time_scale=0.0005))
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    lengths = (5, 40, 100, 130)
    done = await asyncio.gather(
        *(engine.submit(GenRequest([1] * (10 + n), n, min_new_tokens=n)) for n in lengths)
    )
    await engine.close(timeout=1)
    return backend.emulated_s, engine.iterations, [len(d.output.token_ids) for d in done]


async def test_emulated_iterations_run_in_one_step_until_a_row_ends_at_the_same_emulated_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hundreds of emulated engines fit two cores because an engine sleeps once for the iterations
    up to its first row's end, not once per token: the same iterations, priced the same."""
    one_at_a_time = await _emulated_run(1, monkeypatch)
    coalesced = await _emulated_run(64, monkeypatch)
    assert one_at_a_time[2] == coalesced[2] == [5, 40, 100, 130]
    assert coalesced[0] == pytest.approx(one_at_a_time[0], rel=1e-9)
    assert one_at_a_time[1] >= 130 and coalesced[1] <= 10, (one_at_a_time[1], coalesced[1])


async def test_a_request_stops_an_emulated_multi_iteration_step_at_the_running_iterations_end() -> None:
    """A request that arrives while an emulated engine sleeps through many iterations joins at the
    end of the iteration running then, as it would one iteration at a time."""
    backend = EmulatedBackend(EngineSettings(seed=0), EmulatedConfig(time_scale=1.0))
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    long = asyncio.create_task(engine.submit(GenRequest([1] * 10, 500, min_new_tokens=500)))
    await _until(lambda: backend._woken is not None)  # asleep through up to 64 iterations
    short = await engine.submit(GenRequest([2] * 10, 3, min_new_tokens=3))
    assert len(short.output.token_ids) == 3
    (running,) = engine._running.values()
    assert 0 < len(running.ids) < 64, "the short request joined before the long row's 64-token step ended"
    await engine.close(timeout=0)
    with pytest.raises(EngineClosed):
        await long
