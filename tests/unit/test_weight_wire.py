"""The weight-push wire format: dense and sparse records round-trip bit-identically through the
engines' writer, deltas skip what did not change, damaged records are refused, relay trees."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.contracts import ws
from services.common.weights import RecordError, check_record, record_crc, subtree
from services.learning.snapshot import snapshot
from services.rollout_engine.weight_sync import InPlaceWriter, Writer
from services.trainer.weight_push import encode_delta, encode_dense, relay_tree


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=g),
        "norm": torch.ones(64),
        "proj": torch.randn(64, 64, generator=g),
    }


def apply(enc, into: dict[str, torch.Tensor]) -> str | None:
    writer = InPlaceWriter(enc.specs, enc.base_version != 0, into)

    async def run() -> str | None:
        for r in enc.records:
            await writer.write(r, check_record(r, enc.specs))
        return await writer.checksum()

    return asyncio.run(run())


def test_a_dense_push_lands_bit_identical_in_small_records() -> None:
    snap = snapshot(state(), 1)
    enc = encode_dense(snap, 4096)
    assert max(len(r.data) for r in enc.records) <= 4096 and len(enc.records) > 20
    assert enc.total_bytes == snap.nbytes
    held = {k: torch.zeros_like(v) for k, v in state().items()}
    assert apply(enc, held) == snap.checksum
    assert all(torch.equal(held[k], v) for k, v in state().items())


def test_a_delta_sends_only_changed_elements_and_lands_bit_identical() -> None:
    old = state()
    new = {k: v.clone() for k, v in old.items()}
    g = torch.Generator().manual_seed(1)
    hit = torch.rand(new["embed"].numel(), generator=g) < 0.01
    new["embed"].view(-1)[hit] += 1.0
    new["proj"] += 0.5  # every element: sent dense
    base, snap = snapshot(old, 1), snapshot(new, 2)
    delta = encode_delta(base, snap, 4096)
    assert (delta.sparse_tensors, delta.skipped_tensors) == (1, 1)  # embed sparse, norm unchanged
    assert (delta.base_version, delta.base_checksum) == (1, base.checksum)
    embed_bytes = sum(len(r.data) + len(r.indices) for r in delta.records if r.tensor == 0)
    assert embed_bytes == int(hit.sum()) * (4 + 2)  # uint16 gaps + fp32 values
    held = {k: v.clone() for k, v in old.items()}
    assert apply(delta, held) == snap.checksum
    assert all(torch.equal(held[k], v) for k, v in new.items())


def test_far_apart_changes_fall_back_to_absolute_indices() -> None:
    old = {"big": torch.zeros(200_000)}
    new = {"big": torch.zeros(200_000)}
    new["big"][[3, 100_000, 199_999]] = 1.0  # gaps beyond uint16
    delta = encode_delta(snapshot(old, 1), snapshot(new, 2), 1 << 20)
    assert [r.index_bytes for r in delta.records] == [4]
    held = {"big": torch.zeros(200_000)}
    apply(delta, held)
    assert torch.equal(held["big"], new["big"])


def test_in_bf16_most_of_a_small_update_changes_no_bit() -> None:
    old = state()
    new = {k: v + 1e-5 * torch.sign(v) for k, v in old.items()}  # an lr-sized step
    base, snap = snapshot(old, 1, "bfloat16"), snapshot(new, 2, "bfloat16")
    delta, dense = encode_delta(base, snap, 1 << 16), encode_dense(snap, 1 << 16)
    assert delta.total_bytes * 10 < dense.total_bytes
    held = {k: v.clone() for k, v in old.items()}
    apply(encode_dense(base, 1 << 16), held)
    assert apply(delta, held) == snap.checksum


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"tensor": 7}, "malformed"),
        ({"offset": 64 * 300}, "malformed"),
        ({"count": 3}, "malformed"),
        ({"crc32": 1}, "checksum_mismatch"),
    ],
)
def test_a_record_that_does_not_fit_its_header_is_refused(change: dict, code: str) -> None:
    enc = encode_dense(snapshot(state(), 1), 4096)
    r = ws.WeightChunk()
    r.CopyFrom(enc.records[0])
    for k, v in change.items():
        setattr(r, k, v)
    with pytest.raises(RecordError) as err:
        check_record(r, enc.specs)
    assert err.value.code == code
    assert record_crc(enc.records[0].indices, enc.records[0].data) == enc.records[0].crc32


def test_a_writer_without_tensors_vouches_only_for_an_ordered_full_push() -> None:
    snap = snapshot(state(), 1)
    enc = encode_dense(snap, 4096)

    async def run(records, delta=False) -> str | None:
        w = Writer(enc.specs, delta)
        for r in records:
            await w.write(r, check_record(r, enc.specs))
        return await w.checksum()

    assert asyncio.run(run(enc.records)) == snap.checksum
    assert asyncio.run(run(enc.records[:-1])) is None
    assert asyncio.run(run(enc.records, delta=True)) is None


def test_relay_trees_fan_out_from_the_trainer() -> None:
    addrs = [f"e{i}" for i in range(7)]
    roots = relay_tree(addrs, 2)
    assert [r.addr for r in roots] == ["e0", "e1"]
    assert [c.addr for c in roots[0].children] == ["e2", "e3"]
    assert [c.addr for c in roots[1].children] == ["e4", "e5"]
    assert [c.addr for c in roots[0].children[0].children] == ["e6"]
    assert sorted(a for r in roots for a in subtree(r)) == addrs
    assert [r.addr for r in relay_tree(addrs, 0)] == addrs
    chain = relay_tree(addrs[:3], 1)
    assert subtree(chain[0]) == ["e0", "e1", "e2"]
