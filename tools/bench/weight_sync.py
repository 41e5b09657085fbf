"""Weight sync: dense push speed against raw memcpy, relay fan-out, sparse deltas, engine memory.

A random-weight model of SmolLM2-135M's architecture (538 MB in fp32) is pushed by the trainer's
real pusher to real engine processes (hf backend, continuous batcher, WeightSync server with Redis
fencing; `tools/bench/_weight_engine.py`) on loopback:

- **dense, 1 engine** and **dense, 8 engines** (relay tree, fan-out 2): model bytes ÷ wall time
  until every engine acked (encode, stream, apply, the engine's sha256 of its state); against a
  torch memcpy of the same bytes in the same run;
- **sparse deltas**: bytes of the dense push ÷ bytes of the delta, with 1 % of the elements
  changed, and at the real update of one AdamW training step (lr 2e-6, the default job's) in fp32
  and in bf16; each pushed to an engine, whose state checksum must equal the trainer's;
- **engine memory**: the engine's peak RSS during a push above its RSS before (Linux VmHWM,
  reset before each push), against the model size.

Every process shares this machine's cores, so the 8-engine figures measure the machine as much as
the protocol.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "weight_sync"
ENGINES = 8
FANOUT = 2
CHUNK = 2 << 20
ROOT = Path(__file__).resolve().parents[2]


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _train_step(model: Any) -> None:
    """One GRPO step of the trainer's code on random token sequences (AdamW, lr 2e-6)."""
    import torch

    from services.learning.data import Sample
    from services.learning.grpo import LossConfig
    from services.learning.step import StepSettings, train_step

    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(8):
        ids = torch.randint(100, 40_000, (96,), generator=g).tolist()
        mask = [False] * 32 + [True] * 64
        behaviour = [0.0] * 32 + [-10.0] * 64
        samples.append(Sample(f"t{i}", f"g{i // 4}", float(i % 2), ids, mask, behaviour))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-6)
    train_step(model, opt, samples, StepSettings(LossConfig(), micro_batch=4, pad_id=0))


async def _measure(tmp: Path) -> dict[str, Any]:
    import torch

    from services.common.localstack import start_redis
    from services.common.membership import TRAINER_ROLE
    from services.common.ownership import OwnershipStore
    from services.learning.snapshot import snapshot
    from services.trainer.weight_push import WeightPusher, encode_delta, encode_dense
    from tools.bench._weight_engine import smollm2_shaped

    torch.set_num_threads(2)
    redis = start_redis(tmp / "redis")
    run_id = "bench-weights"
    store = OwnershipStore.from_url(redis.url, run_id)
    procs: list[subprocess.Popen[bytes]] = []
    pusher = WeightPusher("bench-trainer", CHUNK, retries=0, fanout=FANOUT, timeout_s=600)
    try:
        lease = await store.acquire(TRAINER_ROLE, "bench-trainer", 3600)
        assert lease is not None
        for i in range(ENGINES):
            argv = [
                sys.executable,
                "-m",
                "tools.bench._weight_engine",
                str(tmp / f"e{i}.port"),
                redis.url,
                run_id,
                "1",
            ]
            procs.append(subprocess.Popen(argv, cwd=ROOT))
        model = smollm2_shaped(0)
        deadline = time.monotonic() + 600
        while not all((tmp / f"e{i}.port").exists() for i in range(ENGINES)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the benchmark's engines did not start")
            await asyncio.sleep(0.2)
        addrs = [f"127.0.0.1:{(tmp / f'e{i}.port').read_text()}" for i in range(ENGINES)]
        version = 0
        peaks: list[int] = []

        async def push(snap: Any, targets: list[str], base: Any = None) -> tuple[float, dict[str, Any]]:
            watched = procs[: len(targets)]
            before = [_status(p.pid)["VmRSS"] for p in watched]
            for p in watched:
                _reset_peak(p.pid)
            start = time.perf_counter()
            results = await pusher.push(snap, lease.token, targets, base)
            wall = time.perf_counter() - start
            bad = {a: r.code for a, r in results.items() if not r.in_sync}
            assert not bad, f"push of version {snap.version} failed: {bad}"
            peaks.extend(_status(p.pid)["VmHWM"] - b for p, b in zip(watched, before, strict=True))
            return wall, results

        def state() -> dict[str, torch.Tensor]:
            """The parameters, tied ones once (as the trainer's snapshot sends them)."""
            return {k: v.detach().clone() for k, v in model.named_parameters()}

        memcpy = _memcpy_gbps(snapshot(state(), 0).nbytes)
        one, eight = [], []
        for _ in range(5):  # dense to one engine
            version += 1
            snap = snapshot(state(), version)
            wall, _ = await push(snap, addrs[:1])
            one.append(snap.nbytes / wall / 1e9)
        for _ in range(2):  # dense to all eight down the relay tree
            version += 1
            snap = snapshot(state(), version)
            wall, results = await push(snap, addrs)
            eight.append(snap.nbytes / wall / 1e9)
            uploaded = pusher.last.uploaded
            relayed = sum(1 for r in results.values() if r.via)
        last = snap

        # 1 % of the elements changed
        g = torch.Generator().manual_seed(5)
        changed = state()
        for t in changed.values():
            flat = t.view(-1)
            flat[torch.rand(flat.numel(), generator=g) < 0.01] += 1e-3
        version += 1
        pct = snapshot(changed, version)
        delta = encode_delta(last, pct, CHUNK)
        dense_bytes = encode_dense(pct, CHUNK).total_bytes
        await push(pct, addrs[:1], base=last)
        identical = [(await pusher.versions(addrs[:1]))[addrs[0]] == pct.version]
        identical.append(pusher.last.delta_engines == 1)

        # the real update of one training step, fp32 then bf16 on the wire
        model.load_state_dict(changed, strict=False)  # lm_head is tied to the embedding
        before32, before16 = snapshot(state(), 0), snapshot(state(), 0, "bfloat16")
        step_start = time.perf_counter()
        await asyncio.to_thread(_train_step, model)
        step_s = time.perf_counter() - step_start
        ratios = {}
        for dtype, prior in (("float32", before32), ("bfloat16", before16)):
            version += 1
            base = snapshot(
                {n: t.view(s) for n, s, t in zip(prior.names, prior.shapes, prior.tensors, strict=True)},
                version,
                dtype if dtype != "float32" else None,
            )
            await push(base, addrs[:1])
            version += 1
            after = snapshot(state(), version, dtype if dtype != "float32" else None)
            enc = encode_delta(base, after, CHUNK)
            ratios[dtype] = encode_dense(after, CHUNK).total_bytes / max(1, enc.total_bytes)
            await push(after, addrs[:1], base=base)
            identical.append(pusher.last.delta_engines == 1)
            info = await pusher.versions(addrs[:1])
            identical.append(info[addrs[0]] == after.version)
        return {
            "model_bytes": last.nbytes,
            "memcpy_gbps": memcpy,
            "dense_gbps_1_engine": statistics.median(one),
            "dense_gbps_1_engine_runs": one,
            "dense_gbps_8_engines": statistics.median(eight),
            "dense_gbps_8_engines_runs": eight,
            "dense_gbps_8_engines_aggregate": ENGINES * statistics.median(eight),
            "trainer_upload_ratio_8_engines": uploaded / last.nbytes,
            "relayed_engines": relayed,
            "sparse_ratio_at_1pct": dense_bytes / delta.total_bytes,
            "sparse_ratio_real_step": ratios["float32"],
            "sparse_ratio_real_step_bf16": ratios["bfloat16"],
            "train_step_s": step_s,
            "bit_identical": all(identical),
            "engine_peak_extra_bytes": max(peaks),
            "engine_peak_extra_runs": peaks,
            "engine_peak_extra_fraction": max(peaks) / last.nbytes,
        }
    finally:
        await pusher.close()
        for p in procs:
            p.kill()
            p.wait()
        await store.close()
        redis.stop()


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="libra-bench-ws-") as tmp:
        r = asyncio.run(_measure(Path(tmp)))
    mb = r["model_bytes"] / 1e6
    rows = [
        ["model", f"{mb:.0f} MB fp32", "random weights, SmolLM2-135M's architecture"],
        ["memcpy", f"{r['memcpy_gbps']:.2f} GB/s", "torch copy of the same bytes, this run"],
        ["dense push, 1 engine", f"{r['dense_gbps_1_engine']:.2f} GB/s", "target >= 0.5; median of 5"],
        [
            "dense push, 8 engines",
            f"{r['dense_gbps_8_engines']:.2f} GB/s to every engine ({r['dense_gbps_8_engines_aggregate']:.2f} aggregate)",
            f"relay tree fan-out {FANOUT}; 9 processes on this machine's cores",
        ],
        [
            "trainer upload, 8 engines",
            f"{r['trainer_upload_ratio_8_engines']:.1f} x model",
            f"{r['relayed_engines']} engines relayed",
        ],
        ["sparse delta, 1 % changed", f"{r['sparse_ratio_at_1pct']:.1f}x fewer bytes", "target >= 50x"],
        ["sparse delta, real step fp32", f"{r['sparse_ratio_real_step']:.2f}x", "AdamW moves every weight"],
        [
            "sparse delta, real step bf16",
            f"{r['sparse_ratio_real_step_bf16']:.1f}x",
            "updates below bf16 resolution change no bit",
        ],
        [
            "bit-identical after push",
            str(r["bit_identical"]).lower(),
            "engine sha256 of its state = trainer's",
        ],
        [
            "engine peak extra memory",
            f"{r['engine_peak_extra_bytes'] / 1e6:.1f} MB ({100 * r['engine_peak_extra_fraction']:.1f} % of model)",
            "target <= 10 %",
        ],
    ]
    headline = (
        "dense_gbps_1_engine",
        "dense_gbps_8_engines",
        "memcpy_gbps",
        "sparse_ratio_at_1pct",
        "sparse_ratio_real_step",
        "bit_identical",
        "engine_peak_extra_bytes",
    )
    return {
        "title": "Weight sync (trainer -> engines, loopback)",
        "command": "make bench  (python -m tools.bench weight_sync)",
        "rows": rows,
        "results": r,
        **{k: r[k] for k in headline},
    }
