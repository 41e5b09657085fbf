"""The rollout engine's pure pieces and its batching contract, on the tiny model where it matters."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from services.common.contracts import ev
from services.common.errors import InvalidMessage
from services.common.runconfig import ModelConfig
from services.rollout_engine.backends.base import Backend, GenOutput, GenRequest
from services.rollout_engine.backends.emulated import EmulatedBackend, batch_seconds
from services.rollout_engine.config import EngineSettings
from services.rollout_engine.engine import BatchingEngine, EngineClosed
from services.rollout_engine.sampling import StopMatcher, left_pad, sample_next
from services.rollout_engine.service import validate_turn


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


def test_emulated_cost_model_charges_prefill_and_running_sequences() -> None:
    s = EngineSettings(
        emulated_prefill_s_per_token=0.01, emulated_decode_s_per_step=0.1, emulated_decode_s_per_seq=1.0
    )
    # prefill 0.01*30; step 0: 0.1 + 2*1.0; step 1: 0.1 + 1*1.0
    assert batch_seconds([10, 20], [2, 1], s) == pytest.approx(0.3 + 2.1 + 1.1)


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
        {"context_token_ids": [1] * 8192},
        {"temperature": float("nan")},
        {"temperature": -1.0},
        {"stop": ["x" * 300]},
    ],
)
def test_validate_turn_refuses_broken_requests(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidMessage):
        validate_turn(_turn(**bad), EmulatedBackend(EngineSettings()), 4096)


def test_validate_turn_clips_generation_to_the_model_positions() -> None:
    gen = validate_turn(
        _turn(context_token_ids=[1] * 8190, max_new_tokens=100), EmulatedBackend(EngineSettings()), 4096
    )
    assert gen.max_new_tokens == 2 and gen.temperature == 1.0


class RecordingBackend(Backend):
    """Records the order of batches and swaps; a batch blocks until released."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release = asyncio.Event()
        self.weights = 0

    vocab_size = 100  # type: ignore[assignment]
    max_positions = 100  # type: ignore[assignment]

    async def start(self) -> None:
        return None

    async def generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        self.events.append(f"batch_start:{len(batch)}")
        await self.release.wait()
        self.events.append("batch_end")
        return [GenOutput([self.weights], [0.0], "length") for _ in batch]

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.events.append(f"swap:{version}")
        self.weights = version

    def decode(self, token_ids: list[int]) -> str:
        return ""


async def test_weights_swap_between_batches_and_outputs_name_their_version() -> None:
    backend = RecordingBackend()
    engine = BatchingEngine(backend, max_batch=2)
    engine.start()
    first = [asyncio.create_task(engine.submit(GenRequest([1], 1))) for _ in range(3)]
    await asyncio.sleep(0.05)
    swap = asyncio.create_task(engine.swap_weights({}, 1, "c1"))
    await asyncio.sleep(0.05)
    assert not swap.done() and engine.version == 0
    backend.release.set()
    results = await asyncio.gather(*first)
    assert await swap
    assert backend.events[:3] == ["batch_start:2", "batch_end", "swap:1"]
    assert [r.policy_version for r in results[:2]] == [0, 0]
    assert results[2].policy_version == 1 and results[2].output.token_ids == [1]
    assert not await engine.swap_weights({}, 1, "again")
    await engine.close(timeout=1)


async def test_close_hands_back_queued_requests_and_wakes_waiters() -> None:
    backend = RecordingBackend()
    engine = BatchingEngine(backend, max_batch=1)
    engine.start()
    running = asyncio.create_task(engine.submit(GenRequest([1], 1)))
    queued = asyncio.create_task(engine.submit(GenRequest([1], 1)))
    waiter = asyncio.create_task(engine.wait_for_version(5, timeout=30))
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(engine.close(timeout=5))
    await asyncio.sleep(0.05)
    backend.release.set()
    await closing
    assert (await running).output.finish_reason == "length"
    with pytest.raises(EngineClosed):
        await queued
    assert await waiter is False


@pytest.fixture(scope="module")
def hf_backend(tiny_model: ModelConfig) -> Any:
    from services.rollout_engine.backends.hf import HFBackend

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


def test_hf_logprobs_match_a_recomputed_forward_in_a_padded_batch(hf_backend: Any) -> None:
    reqs = [
        GenRequest(list(range(100, 112)), 12, 1.0),
        GenRequest([7, 8, 9], 6, 0.7),
        GenRequest(list(range(300, 305)), 9, 0.0),
    ]
    outs = hf_backend.generate_sync(reqs)
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) == req.max_new_tokens
        assert out.finish_reason == "length"
        assert all(math.isfinite(x) and x <= 0 for x in out.logprobs)
        assert out.logprobs == pytest.approx(_recomputed_logprobs(hf_backend, req, out), abs=1e-4)


def test_hf_stops_at_a_stop_string_and_keeps_it(hf_backend: Any) -> None:
    prompt = list(range(500, 510))
    greedy = hf_backend.generate_sync([GenRequest(prompt, 10, 0.0)])[0]
    stop_text = hf_backend.tok.decode(greedy.token_ids[3:5])
    assert stop_text.strip(), "the tiny model's greedy tokens decode to text"
    out = hf_backend.generate_sync([GenRequest(prompt, 10, 0.0, [stop_text])])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) <= 5 and stop_text in hf_backend.tok.decode(out.token_ids)


def test_hf_stops_at_eos(hf_backend: Any) -> None:
    eos = min(hf_backend.eos)
    with torch.no_grad():
        bias = torch.zeros(hf_backend.vocab_size)
        bias[eos] = 1e4
        head = hf_backend.model.get_output_embeddings()
        saved = head.bias
        head.bias = torch.nn.Parameter(bias)
    try:
        out = hf_backend.generate_sync([GenRequest([1, 2, 3], 10, 1.0)])[0]
    finally:
        head.bias = saved
    assert out.token_ids == [eos] and out.finish_reason == "stop"


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
