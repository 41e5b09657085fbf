"""`libra calibrate --backend vllm|hf [--model M] [--out PROFILE] [--quick]`: measures the rollout
engine on the machine it runs on and fits the cost model's constants to it, so that `libra sim
--profile PROFILE` prices what this machine does rather than what a preset assumes.

What it measures, each the fastest of `REPEATS` rounds, one engine alone on the machine:
- decode: B requests of a C-token context each make N tokens, then again 1 token; the difference
  over N - 1 is one decode iteration of batch B at context ~C (B and C over a grid);
- prefill: one request of P new tokens making one token (P over a range);
- the prefix cache: the longest prefill prompt again (vLLM finds it cached; `hf` has no cache);
- weight loads: a quarter, half and all of the model's tensors loaded into the serving engine.

What it fits, in the cost model's own formulas (`services/common/cost_model.py`):
- decode: `decode_overhead_s + max(bytes read / mem_bw, FLOPs / flops)`: the achieved memory
  bandwidth, the achieved FLOP/s and the per-iteration overhead, by a grid search on relative
  error (the profile's `gpu.mem_bw` and `gpu.flops` are the achieved values: `mem_efficiency` and
  `prefill_mfu` are 1);
- prefill: the same FLOP/s prices it; what it misses stays as the `prefill` multiplier;
- weight loads: `bytes / net_bw + sync_fixed_s`, least squares.
The profile keeps every raw measurement, the fitted constants and each fit's relative error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.cost_model import Calibration, CostModel, GPUSpec, ModelSpec

REPEATS = 3
FULL: dict[str, Any] = {"batches": (1, 4, 16), "contexts": (64, 512), "new": 24, "prefill": (64, 256, 1024)}
QUICK: dict[str, Any] = {"batches": (1, 4), "contexts": (32, 128), "new": 8, "prefill": (32, 128, 256)}
LOAD_FRACTIONS = (0.25, 0.5, 1.0)


@dataclass(frozen=True)
class Sample:
    kind: str
    """decode | prefill | prefix_hit | weights"""
    seconds: float
    batch: int = 1
    context: int = 0
    tokens: int = 0
    bytes: int = 0


def model_spec(model_dir: Path, dtype_bytes: int) -> ModelSpec:
    """The served model's shape, from its config.json and its safetensors headers (no weights read)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    params = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                params += math.prod(t["shape"])
    heads = int(cfg["num_attention_heads"])
    return ModelSpec(
        name=model_dir.name,
        params=float(params),
        active_params=float(params),
        layers=int(cfg["num_hidden_layers"]),
        hidden=int(cfg["hidden_size"]),
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        bytes_per_param=dtype_bytes,
        max_context=int(cfg.get("max_position_embeddings") or 0),
    )


async def _timed(engine: Any, reqs: list[Any]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(engine.submit(r) for r in reqs))
    return time.perf_counter() - start


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def measure(backend: Any, engine: Any, grid: dict[str, Any], say: Any) -> list[Sample]:
    """The engine's decode, prefill, prefix-cache and weight-load timings (see the module doc)."""
    from services.generation.backends.base import GenRequest

    rng = random.Random(0)
    longest = max(1, backend.max_positions - grid["new"] - 2)
    out: list[Sample] = []
    n = grid["new"]
    for b in (1, max(grid["batches"])):  # warm-up: first calls allocate, kernels get picked
        await _timed(
            engine, [GenRequest(_prompt(rng, 32), n, 1.0, min_new_tokens=n, seed=i) for i in range(b)]
        )
    for b in grid["batches"]:
        for c in grid["contexts"]:
            c = min(c, longest)
            steps = []
            for _ in range(REPEATS):
                prompts = [_prompt(rng, c) for _ in range(b)]  # fresh ids: no prefix-cache hit
                one = await _timed(
                    engine, [GenRequest(p, 1, 1.0, min_new_tokens=1, seed=i) for i, p in enumerate(prompts)]
                )
                prompts = [_prompt(rng, c) for _ in range(b)]
                many = await _timed(
                    engine, [GenRequest(p, n, 1.0, min_new_tokens=n, seed=i) for i, p in enumerate(prompts)]
                )
                steps.append(max(1e-6, (many - one) / (n - 1)))
            out.append(Sample("decode", min(steps), batch=b, context=c + n // 2))
            say(f"decode batch {b:>3} context {c:>5}: {min(steps) * 1000:.1f} ms/iteration")
    for p in grid["prefill"]:
        p = min(p, longest)
        t = min(
            [
                await _timed(engine, [GenRequest(_prompt(rng, p), 1, 1.0, min_new_tokens=1, seed=1)])
                for _ in range(REPEATS)
            ]
        )
        out.append(Sample("prefill", t, tokens=p))
        say(f"prefill {p:>5} tokens: {t * 1000:.1f} ms")
    p = min(max(grid["prefill"]), longest)
    same = _prompt(rng, p)
    first = await _timed(engine, [GenRequest(same, 1, 1.0, min_new_tokens=1, seed=2)])
    again = await _timed(engine, [GenRequest(same, 1, 1.0, min_new_tokens=1, seed=3)])
    out.append(Sample("prefix_hit", again, tokens=p, context=round(first * 1e6)))
    say(f"prefix cache: {p} tokens {first * 1000:.1f} ms, again {again * 1000:.1f} ms")
    for frac in LOAD_FRACTIONS:
        nbytes, t = await _load_weights(backend, frac)
        out.append(Sample("weights", t, bytes=nbytes))
        say(f"weights: {nbytes / 2**20:.0f} MiB loaded in {t:.2f} s")
    return out


async def _load_weights(backend: Any, fraction: float) -> tuple[int, float]:
    """Loads the first `fraction` of the model's tensors (by bytes) into the serving engine, as a
    push does, with their current values (nothing changes); returns (bytes, seconds)."""
    import torch

    slots = backend.weight_slots() if callable(getattr(backend, "weight_slots", None)) else None
    if slots is not None:  # hf: in place, as InPlaceWriter copies records
        tensors = list(slots.items())
    else:  # vllm: whole tensors through its loader, as AssemblingWriter hands them over
        from services.common.models import load_model

        model = await asyncio.to_thread(load_model, backend.run.model)
        tensors = [(k, v.detach()) for k, v in model.named_parameters()]
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    chosen, size = [], 0
    for name, t in tensors:
        if size >= fraction * total:
            break
        chosen.append((name, t))
        size += t.numel() * t.element_size()
    start = time.perf_counter()
    if slots is not None:
        with torch.no_grad():
            for _, t in chosen:
                t.copy_(t.clone())
    else:
        await backend.load_tensors([(n, t.float()) for n, t in chosen])
        await backend.finish_load()
    return size, time.perf_counter() - start


def _decode_terms(m: ModelSpec, s: Sample) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode iteration, as `CostModel.verify_step_s` counts them."""
    kv = s.batch * s.context * m.kv_bytes_per_token
    flops = 2 * m.active_params * s.batch + 4 * m.layers * m.hidden * s.batch * s.context
    return m.weight_bytes + kv, flops


def _prefill_flops(m: ModelSpec, tokens: int) -> float:
    return 2 * m.active_params * tokens + 4 * m.layers * m.hidden * tokens * (tokens / 2)


def _rel_rms(pred: list[float], got: list[float]) -> float:
    return (
        math.sqrt(sum(((p - g) / g) ** 2 for p, g in zip(pred, got, strict=True)) / len(got)) if got else 0.0
    )


def fit(samples: list[Sample], model: ModelSpec, name: str, mem_bytes: float) -> dict[str, Any]:
    """The cost model's constants fitted to `samples` (see the module doc), with their errors."""
    dec = [s for s in samples if s.kind == "decode"]
    terms = [_decode_terms(model, s) for s in dec]
    got = [s.seconds for s in dec]
    best: tuple[float, float, float, float] | None = None
    for i in range(121):  # bandwidth 1e8 .. 1e14 B/s, FLOP/s 1e8 .. 1e15, log grid
        a = 10 ** -(8 + 6 * i / 120)
        for j in range(141):
            f = 10 ** -(8 + 7 * j / 140)
            base = [max(mb * a, fl * f) for mb, fl in terms]
            over = max(0.0, sorted(g - b for g, b in zip(got, base, strict=True))[len(got) // 2])
            err = _rel_rms([over + b for b in base], got)
            if best is None or err < best[0]:
                best = (err, a, f, over)
    assert best is not None, "no decode samples"
    _, a, f, over = best
    gpu = GPUSpec(name=name, flops=1 / f, mem_bw=1 / a, mem_bytes=mem_bytes, gpus_per_node=1)
    pre = [s for s in samples if s.kind == "prefill"]
    raw = [_prefill_flops(model, s.tokens) * f for s in pre]
    mult = sum(s.seconds / r for s, r in zip(pre, raw, strict=True)) / len(pre) if pre else 1.0
    pre_err_raw = _rel_rms(raw, [s.seconds for s in pre])
    pre_err = _rel_rms([r * mult for r in raw], [s.seconds for s in pre])
    wts = [s for s in samples if s.kind == "weights"]
    xs, ys = [float(s.bytes) for s in wts], [s.seconds for s in wts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = (
        max(1e-15, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var) if var else my / mx
    )
    fixed = max(0.0, my - slope * mx)
    calib = Calibration(
        mem_efficiency=1.0,
        prefill_mfu=1.0,
        tp_decode_efficiency=1.0,
        decode_overhead_s=over,
        prefill=mult,
        sync_fixed_s=fixed,
    )
    gpu = GPUSpec(**{**asdict(gpu), "net_bw": 1 / slope})
    check = CostModel(gpu, model, calib)
    errors = {
        "decode_rel_rms": round(_rel_rms([check.decode_step_s(s.batch, s.context, 1) for s in dec], got), 4),
        "prefill_rel_rms_before_multiplier": round(pre_err_raw, 4),
        "prefill_rel_rms": round(pre_err, 4),
        "weights_rel_rms": round(_rel_rms([x * slope + fixed for x in xs], ys), 4) if wts else None,
    }
    return {"gpu": asdict(gpu), "model": asdict(model), "calibration": asdict(calib), "fit_error": errors}


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from services.common.models import resolve_model_dir
    from services.common.runconfig import ModelConfig, RunConfig
    from services.generation.engine import engine_for

    grid = QUICK if args.quick else FULL
    model = (
        ModelConfig(source=args.model)
        if "/" not in args.model and args.model in ("smollm2", "tiny-random")
        else ModelConfig(source="path", path=args.model)
    )
    model_dir = await asyncio.to_thread(resolve_model_dir, model)
    batch = max(grid["batches"])
    longest = max(max(grid["contexts"]), max(grid["prefill"])) + grid["new"] + 8
    if args.backend == "vllm":
        from services.generation.backends.vllm import VllmBackend
        from services.generation.config import EngineSettings

        run = RunConfig.model_validate(
            {
                "model": model.model_dump(),
                "task": {"max_new_tokens": grid["new"], "max_context_tokens": longest},
                "rollout": {"backend": "vllm", "max_batch": batch, "torch_threads": args.threads},
            }
        )
        backend: Any = VllmBackend(run, EngineSettings(seed=0, vllm_dtype="float32"))
    else:
        from services.generation.backends.hf import HFBackend

        backend = HFBackend(model, torch_threads=args.threads, seed=0)
    await backend.start()
    engine = engine_for(backend, batch)
    engine.start()
    try:
        samples = await measure(backend, engine, grid, _say)
    finally:
        await engine.close(timeout=5)
        await backend.close()
    spec = model_spec(model_dir, 4)
    kv_tokens = getattr(backend, "kv_tokens", 0) or batch * longest
    mem_bytes = (spec.weight_bytes + kv_tokens * spec.kv_bytes_per_token) / 0.9  # reserved_fraction 0.1
    name = f"{platform.machine()}-{os.cpu_count()}cpu-{args.backend}"
    fitted = fit(samples, spec, name, mem_bytes)
    return {
        "libra_profile": 1,
        "measured": {
            "backend": args.backend,
            "model": args.model,
            "dtype": "float32",
            "threads": args.threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "date": time.strftime("%Y-%m-%d"),
            "command": "libra calibrate "
            + " ".join(sys.argv[2:] if sys.argv[1:2] == ["calibrate"] else sys.argv[1:]),
            "quick": bool(args.quick),
        },
        **fitted,
        "samples": [asdict(s) for s in samples],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="libra calibrate", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-random or a model directory")
    p.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    p.add_argument("--out", type=Path, help="profile YAML (default: profile-<backend>-<model>.yaml)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (seconds on a tiny model)")
    args = p.parse_args(argv)
    started = time.monotonic()
    print(
        f"calibrating the {args.backend} engine on {args.model} ({'quick' if args.quick else 'full'} grid)…",
        file=sys.stderr,
    )
    profile = asyncio.run(_run(args))
    out = args.out or Path(f"profile-{args.backend}-{Path(args.model).name}.yaml")
    out.write_text(yaml.safe_dump(profile, sort_keys=False))
    err = profile["fit_error"]
    print(
        f"{out}: decode fit within {err['decode_rel_rms']:.0%} (rel. RMS), prefill {err['prefill_rel_rms']:.0%}, "
        f"weights {err['weights_rel_rms']:.0%}; {time.monotonic() - started:.0f} s. Use it: libra sim --profile {out}"
    )
    return 0
