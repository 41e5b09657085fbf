"""`libra calibrate --backend vllm|hf [--model M] [--out PROFILE] [--quick]`: measures the rollout
engine on the machine it runs on and fits the cost model's constants to it, so that `libra sim
--profile PROFILE` prices what this machine does rather than what a preset assumes.

What it measures, each the fastest of `REPEATS` rounds, one engine alone on the machine:
- decode: B requests of a C-token context each make 1 token (filling the prefix cache where the
  engine has one), the same again, then the same making N tokens; the last two runs' difference
  over N - 1 is one decode iteration of batch B at context ~C (B and C over a grid);
- prefill: one request of P new tokens making one token (P over a range);
- the prefix cache: the longest prefill prompt again (vLLM finds it cached; `hf` has no cache);
- weight loads: a quarter, half and all of the model's tensors loaded into the serving engine;
- a push that changes nothing (vLLM): generation paused, the served weights checksummed, resumed;
- with `--neighbours N` (a CPU only), the decode grid again while N more engines configured as
  this one, each its own process, decode without pause on the same host;
- with `--trainer`, the trainer's real GRPO step (`services/learning/step.py`: AdamW, bf16 autocast
  on CUDA) on S sequences of L tokens each, over a grid of both.

`--model random:NAME` measures a model of a real shape with random weights, built on the machine
from `services/common/presets/model_configs/NAME.json` (or `random:CONFIG.json`), on the GPU when
there is one: no download, so a GPU node calibrates a 4B-parameter shape in minutes.

What it fits, in the cost model's own formulas (`services/common/cost_model.py`):
- decode: `decode_overhead_s + max(bytes read / mem_bw, FLOPs / flops)`: the achieved memory
  bandwidth, the achieved FLOP/s and the per-iteration overhead, by a grid search on relative
  error (the profile's `gpu.mem_bw` and `gpu.flops` are the achieved values: `mem_efficiency` and
  `prefill_mfu` are 1);
- prefill: the same FLOP/s prices it; what it misses stays as the `prefill` multiplier;
- weight loads: `bytes / net_bw + sync_fixed_s`, least squares, with the empty push's median
  added to `sync_fixed_s` (every push pays it; an empty delta pays nothing else);
- host sharing: `host_sharing`, how much each busy neighbour slows an iteration (the median of
  beside / alone - 1 over the grid, per neighbour), as the simulator prices engines of one host;
- training: `train_mfu`, the share of the same FLOP/s a training step achieves, counting the FLOPs
  the step really does (forward and backward, no recomputation: the trainer does not checkpoint
  activations; one more forward for the proximal logprobs with several mini-batches).
On a GPU whose preset is known (`presets/hardware.yaml`) the profile also gives every fitted rate
as an efficiency against the preset's peak (`efficiency`), the form the presets' assumptions take,
which `libra sim --efficiencies PROFILE` applies to another scenario's hardware.
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
import statistics
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
GPU: dict[str, Any] = {
    "batches": (1, 8, 32, 64),
    "contexts": (512, 2048),
    "new": 32,
    "prefill": (256, 1024, 4096),
}
TRAIN_FULL: dict[str, Any] = {"sequences": (2, 4), "lengths": (64, 128), "micro_batch": 2}
TRAIN_QUICK: dict[str, Any] = {"sequences": (2,), "lengths": (32, 64), "micro_batch": 2}
TRAIN_GPU: dict[str, Any] = {"sequences": (8, 16), "lengths": (512, 2048), "micro_batch": 2}
MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "services" / "common" / "presets" / "model_configs"
LOAD_FRACTIONS = (0.25, 0.5, 1.0)
PUSH_REPEATS = 3
NOT_FITTED = ("kv_block_tokens", "host_sharing")
"""A profile's constants that its samples may not fit: the engine's KV block, as it reported it,
and the host sharing where no `decode_beside` sample measured it (`libra bench live` may have
fitted it to a live job's iterations); a refit keeps them then."""


@dataclass(frozen=True)
class Sample:
    kind: str
    """decode | prefill | prefix_hit | weights | push | train (batch: sequences, context: their
    length)"""
    seconds: float
    batch: int = 1
    context: int = 0
    tokens: int = 0
    bytes: int = 0
    recompute: bool = False
    """A train step that recomputed each layer's activations in its backward pass (the trainer's
    `training.gradient_checkpointing`): one more forward's FLOPs."""


def model_spec(model_dir: Path, dtype_bytes: int, params: int = 0) -> ModelSpec:
    """The served model's shape, from its config.json and its safetensors headers (no weights read),
    or `params` where the model was built in memory."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    for f in sorted(model_dir.glob("*.safetensors")) if not params else ():
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


def random_config(name: str) -> tuple[str, dict[str, Any]]:
    """The shape `random:NAME` names: a preset under `presets/model_configs/`, or a config.json path."""
    path = Path(name) if name.endswith(".json") else MODEL_CONFIGS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(f.stem for f in MODEL_CONFIGS.glob("*.json")))
        raise SystemExit(
            f"--model random:{name}: no such config (known: {known}, or a path to a config.json)"
        )
    cfg = json.loads(path.read_text())
    return path.stem, {k: v for k, v in cfg.items() if not k.startswith("_")}


def random_model(config: dict[str, Any], tokenizer_dir: Path, out: Path, dtype: str, device: str) -> Any:
    """A model of `config`'s shape with random weights, built on `device` in `dtype` (never on
    disk: `out` gets its config.json and the tokenizer, which the engine's start-up reads)."""
    import shutil

    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    cfg = transformers.AutoConfig.for_model(**config)
    cfg.save_pretrained(out)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model


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
    out += await _decode_grid(backend, engine, grid, rng, say)
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
    tensors, in_place = await _tensors(backend)
    for frac in LOAD_FRACTIONS:
        nbytes, t = await _load_weights(backend, tensors, in_place, frac)
        out.append(Sample("weights", t, bytes=nbytes))
        say(f"weights: {nbytes / 2**20:.0f} MiB loaded in {t:.2f} s")
    if callable(getattr(backend, "served_checksum", None)):
        specs = push_specs(tensors)
        for _ in range(PUSH_REPEATS):
            t = await _empty_push(backend, specs)
            out.append(Sample("push", t))
        say(f"a push that changes nothing: {statistics.median(s.seconds for s in out[-PUSH_REPEATS:]):.2f} s")
    return out


async def _decode_grid(
    backend: Any, engine: Any, grid: dict[str, Any], rng: random.Random, say: Any, neighbours: int = 0
) -> list[Sample]:
    """One decode iteration's seconds at every batch size and context of `grid` (see the module
    doc); with `neighbours`, as `decode_beside` samples: measured while that many other engines
    decode on this host."""
    from services.generation.backends.base import GenRequest

    out: list[Sample] = []
    n = grid["new"]
    longest = max(1, backend.max_positions - n - 2)
    kind, beside = ("decode_beside", f" beside {neighbours}") if neighbours else ("decode", "")
    for b in grid["batches"]:
        for c in grid["contexts"]:
            c = min(c, longest)
            steps = []
            for _ in range(REPEATS):
                # fresh ids, prefilled once first: where the engine has a prefix cache (vLLM) the
                # two timed runs find the same blocks cached, and their difference is decode
                # alone rather than two large prefills' noise (beside a busy neighbour, a batch's
                # prefill varies by more than its decode takes)
                prompts = [_prompt(rng, c) for _ in range(b)]
                await _timed(
                    engine, [GenRequest(p, 1, 1.0, min_new_tokens=1, seed=i) for i, p in enumerate(prompts)]
                )
                one = await _timed(
                    engine, [GenRequest(p, 1, 1.0, min_new_tokens=1, seed=i) for i, p in enumerate(prompts)]
                )
                many = await _timed(
                    engine, [GenRequest(p, n, 1.0, min_new_tokens=n, seed=i) for i, p in enumerate(prompts)]
                )
                steps.append((many - one) / (n - 1))
            # the median: one round's prefill can outlast the next's (a difference of two runs is
            # noisy when their iterations are few); a non-positive one measured nothing
            step = statistics.median(steps)
            if step <= 0:
                say(
                    f"decode batch {b:>3} context {c:>5}{beside}: not measurable (noise above {n} iterations)"
                )
                continue
            out.append(Sample(kind, step, batch=b, context=c + n // 2, tokens=neighbours))
            say(f"decode batch {b:>3} context {c:>5}{beside}: {step * 1000:.1f} ms/iteration")
    return out


NEIGHBOUR_START_S = 900.0
"""How long a neighbour engine may take to load and warm up (vLLM compiles on its first start)."""


def _neighbour_argv(args: argparse.Namespace, workdir: Path, ready: Path) -> list[str]:
    """The command of a neighbour engine configured as `args` configure the measured one."""
    argv = [sys.executable, "-m", "tools.calibrate", "--neighbour", str(ready), "--backend", args.backend]
    argv += ["--model", args.model, "--device", args.device, "--threads", str(args.threads)]
    argv += ["--workdir", str(workdir)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.tokenizer:
        argv += ["--tokenizer", str(args.tokenizer)]
    if args.quick:
        argv.append("--quick")
    return argv


async def measure_beside(
    args: argparse.Namespace, backend: Any, engine: Any, grid: dict[str, Any], say: Any
) -> list[Sample]:
    """The decode grid again while `args.neighbours` more engines, configured as this one, each in
    its own process, decode on this host without pause: how much engines sharing a host slow each
    other (`Calibration.host_sharing`), which one engine alone cannot show. Each neighbour's
    output goes to `WORKDIR/neighbour-I.log`."""
    k = args.neighbours
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[Any, Path, Path]] = []
    say(f"starting {k} neighbour engine(s) on this host …")
    try:
        for i in range(k):
            ready, log = workdir / f"neighbour-{i}.ready", workdir / f"neighbour-{i}.log"
            ready.unlink(missing_ok=True)
            with log.open("wb") as sink:
                proc = await asyncio.create_subprocess_exec(
                    *_neighbour_argv(args, workdir / f"neighbour-{i}", ready),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=sink,
                    stderr=asyncio.subprocess.STDOUT,
                )
            procs.append((proc, ready, log))
        deadline = time.monotonic() + NEIGHBOUR_START_S
        for proc, ready, log in procs:
            while not ready.exists():
                if proc.returncode is not None:
                    raise SystemExit(
                        f"a neighbour engine exited ({proc.returncode}) before it was ready: see {log}"
                    )
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"a neighbour engine was not ready in {NEIGHBOUR_START_S:.0f} s: see {log}"
                    )
                await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # into their decoding
        return await _decode_grid(backend, engine, grid, random.Random(2), say, neighbours=k)
    finally:
        for proc, _, _ in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc, _, _ in procs:
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _neighbour(args: argparse.Namespace) -> None:
    """A neighbour engine (`--neighbours`): decodes batches of the grid's shapes one after another,
    from when it touches `args.neighbour` (warmed up) until its stdin closes."""
    from services.generation.backends.base import GenRequest
    from services.generation.engine import engine_for

    grid, device, dtype = _settings(args)
    backend, *_ = await _backend(args, grid, device, dtype)
    await backend.start()
    engine = engine_for(backend, max(grid["batches"]))
    engine.start()
    closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.buffer.read))
    rng = random.Random(3)
    n = grid["new"]
    shapes = [
        (b, min(c, max(1, backend.max_positions - n - 2))) for b in grid["batches"] for c in grid["contexts"]
    ]
    try:
        await _timed(
            engine, [GenRequest(_prompt(rng, 32), n, 1.0, min_new_tokens=n, seed=i) for i in range(2)]
        )
        Path(args.neighbour).touch()
        i = 0
        while not closed.done():
            b, c = shapes[i % len(shapes)]
            i += 1
            reqs = [GenRequest(_prompt(rng, c), n, 1.0, min_new_tokens=n, seed=j) for j in range(b)]
            await _timed(engine, reqs)
    finally:
        await engine.close(timeout=5)
        await backend.close()
        closed.cancel()


async def _empty_push(backend: Any, specs: list[Any]) -> float:
    """What any push costs the engine beyond its bytes, as a delta push that changes nothing runs
    it (services/rollout_engine/weight_sync.py): generation paused with the running requests kept,
    the reload finished, the served weights read back and checksummed by the pushed tensors'
    names (`specs`), generation resumed."""
    start = time.perf_counter()
    await backend.pause()
    try:
        await backend.finish_load()
        await backend.served_checksum(specs)
    finally:
        await backend.resume()
    return time.perf_counter() - start


def push_specs(tensors: list[tuple[str, Any]]) -> list[Any]:
    """A push's manifest entries of `tensors`, as the served checksum reads them back."""
    from services.common.contracts import ws

    return [ws.TensorSpec(name=n, dtype="float32", shape=list(t.shape)) for n, t in tensors]


async def _tensors(backend: Any) -> tuple[list[tuple[str, Any]], bool]:
    """The tensors a push writes, and whether in place: the hf engine's own (InPlaceWriter copies
    records into them), or the model's, whole, for vLLM's loader (as AssemblingWriter hands them)."""
    slots = backend.weight_slots()
    if slots is not None:
        return list(slots.items()), True
    from services.common.models import load_model

    model = await asyncio.to_thread(load_model, backend.job.model)
    return [(k, v.detach()) for k, v in model.named_parameters()], False


async def _load_weights(
    backend: Any, tensors: list[tuple[str, Any]], in_place: bool, fraction: float
) -> tuple[int, float]:
    """Loads the first `fraction` of `tensors` (by bytes) into the serving engine, as a push does,
    with their current values (nothing changes); returns (bytes, seconds)."""
    import torch

    total = sum(t.numel() * t.element_size() for _, t in tensors)
    chosen, size = [], 0
    for name, t in tensors:
        if size >= fraction * total:
            break
        chosen.append((name, t))
        size += t.numel() * t.element_size()
    start = time.perf_counter()
    if in_place:
        with torch.no_grad():
            for _, t in chosen:
                t.copy_(t.clone())
    else:
        await backend.load_tensors([(n, t.float()) for n, t in chosen])
        await backend.finish_load()
    return size, time.perf_counter() - start


def measure_training(
    model: Any, grid: dict[str, Any], device: str, say: Any, threads: int | None = None
) -> list[Sample]:
    """The trainer's GRPO step (`services/learning/step.py`) on `model` with a fresh AdamW, for each
    number of sequences and length in `grid` (the fastest of `REPEATS`, after one warm-up); on a
    CPU with `threads` threads, as the trainer's `training.torch_threads`."""
    import torch

    if device == "cpu" and threads:
        torch.set_num_threads(threads)

    from services.common.runconfig import LearnJob, RunConfig
    from services.learning.data import Sample as Trajectory
    from services.learning.recipe import optimizer_for, recompute_activations, step_settings
    from services.learning.step import train_step

    run = LearnJob.of(
        RunConfig.model_validate(
            {"training": {"micro_batch": grid["micro_batch"], "device": device, "precision": "auto"}}
        )
    )
    model.train()
    recompute = recompute_activations(run, model)  # as the trainer trains it
    optimizer = optimizer_for(run, model)
    settings = step_settings(run, 0, 0, None, torch.device(device))
    rng = random.Random(1)
    vocab = int(model.config.vocab_size)

    def batch(n: int, length: int) -> list[Trajectory]:
        prompt = length // 4
        return [
            Trajectory(
                trajectory_id=f"t{i}",
                group_id=f"g{i // 2}",
                reward=float(i % 2),  # every group informative: no sequence is dropped
                input_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=[False] * prompt + [True] * (length - prompt),
                behaviour_logprobs=[0.0] * prompt + [-2.0] * (length - prompt),
            )
            for i in range(n)
        ]

    def timed(n: int, length: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optimizer, batch(n, length), settings)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    out: list[Sample] = []
    timed(min(grid["sequences"]), min(grid["lengths"]))  # warm-up: optimizer state, kernels
    for n in grid["sequences"]:
        for length in grid["lengths"]:
            t = min(timed(n, length) for _ in range(REPEATS))
            out.append(Sample("train", t, batch=n, context=length, tokens=n * length, recompute=recompute))
            say(f"train {n:>3} sequences of {length:>5} tokens: {t:.3f} s/step")
    return out


KERNEL_TOKENS = (1, 16, 64, 256, 1024, 4096)


def measure_kernels(model: Any, say: Any) -> list[Sample]:
    """Every projection of `model` (its `Linear` layers, the head included) applied to T tokens,
    captured once in a CUDA graph and replayed: the weight-read bandwidth (T = 1) and matmul rate
    (T = 4096) this GPU achieves with no launch gaps, for T in `KERNEL_TOKENS`."""
    import torch

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    out: list[Sample] = []
    for t in KERNEL_TOKENS:
        xs = {w.shape[1]: torch.randn(t, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}

        def project(xs: dict[int, Any] = xs) -> None:
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
            project()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            project()
        times = []
        for _ in range(REPEATS + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000 / 5)
        del graph
        out.append(Sample("kernels", min(times), batch=t, tokens=t, bytes=nbytes))
        say(
            f"projections of {t:>5} tokens: {min(times) * 1000:.2f} ms "
            f"({nbytes / min(times) / 1e12:.2f} TB/s, {2 * params * t / min(times) / 1e12:.0f} TFLOP/s)"
        )
    return out


def _shape(m: ModelSpec) -> CostModel:
    """The cost model's FLOP and byte counts of `m` (its rates play no part)."""
    return CostModel(GPUSpec(name="counts", flops=1.0, mem_bw=1.0, mem_bytes=1.0), m)


def _train_flops(m: ModelSpec, s: Sample) -> float:
    """FLOPs of the trainer's step (one mini-batch): forward and backward (three forwards' worth),
    and one more forward where it recomputed activations, with causal attention."""
    return _shape(m).train_flops(s.tokens, s.context, passes=4 if s.recompute else 3)


def _decode_terms(m: ModelSpec, s: Sample) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode iteration, as `CostModel.verify_step_s` counts them."""
    cm = _shape(m)
    return cm.decode_bytes(s.batch, s.context), cm.forward_flops(s.batch, s.context)


def _prefill_flops(m: ModelSpec, tokens: int) -> float:
    return _shape(m).forward_flops(tokens, tokens / 2)


def host_sharing(samples: list[Sample]) -> tuple[float, float] | None:
    """How much each busy neighbour slows an engine's decode iteration on a shared host, from the
    `decode_beside` samples against the alone `decode` sample of the same batch and context: the
    median of (beside / alone - 1) / neighbours, and that fit's relative error (None without
    such samples)."""
    alone = {(s.batch, s.context): s.seconds for s in samples if s.kind == "decode" and s.seconds > 0}
    pairs = [
        (alone[(s.batch, s.context)], s)
        for s in samples
        if s.kind == "decode_beside" and s.tokens > 0 and (s.batch, s.context) in alone
    ]
    if not pairs:
        return None
    sharing = max(0.0, statistics.median((s.seconds / a - 1) / s.tokens for a, s in pairs))
    err = _rel_rms([a * (1 + sharing * s.tokens) for a, s in pairs], [s.seconds for _, s in pairs])
    return sharing, err


def _rel_rms(pred: list[float], got: list[float]) -> float:
    return (
        math.sqrt(sum(((p - g) / g) ** 2 for p, g in zip(pred, got, strict=True)) / len(got)) if got else 0.0
    )


def _line(got: list[float], x: list[float]) -> tuple[float, float]:
    """(a, k) of `got ~ a + x / k` with a >= 0, least squares in relative error."""
    w = [1 / g**2 for g in got]
    sw, sx = sum(w), sum(wi * xi for wi, xi in zip(w, x, strict=True))
    sy = sum(wi * g for wi, g in zip(w, got, strict=True))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))
    sxy = sum(wi * xi * g for wi, xi, g in zip(w, x, got, strict=True))
    det = sw * sxx - sx * sx
    if det > 0:
        a, b = (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det
        if a >= 0 and b > 0:
            return a, 1 / b
    return 0.0, sxx / sxy if sxy else 1.0  # through the origin


def fit(
    samples: list[Sample], model: ModelSpec, name: str, mem_bytes: float, preset: GPUSpec | None = None
) -> dict[str, Any]:
    """The cost model's constants fitted to `samples` (see the module doc), with their errors;
    with `preset`, the machine's GPU as the presets know it, also as efficiencies against its peak."""
    # (a profile of an earlier version may hold decode timings clipped at 1 us: they measured nothing)
    dec = [s for s in samples if s.kind == "decode" and s.seconds > 1e-6]
    terms = [_decode_terms(model, s) for s in dec]
    got = [s.seconds for s in dec]
    kern = sorted((s for s in samples if s.kind == "kernels"), key=lambda s: s.tokens)
    if kern:  # graph-captured projections: the rates the GPU achieves, free of launch overheads
        a = kern[0].seconds / kern[0].bytes
        f = kern[-1].seconds / (2 * kern[-1].bytes / model.bytes_per_param * kern[-1].tokens)
        over = max(
            0.0,
            sorted(g - max(mb * a, fl * f) for g, (mb, fl) in zip(got, terms, strict=True))[len(got) // 2],
        )
    else:
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
    # a prefill measured alone is one engine iteration: its overhead, then the prompt's FLOPs
    pre = [s for s in samples if s.kind == "prefill"]
    raw = [_prefill_flops(model, s.tokens) * f for s in pre]
    got_pre = [s.seconds for s in pre]
    den = sum((r / g) ** 2 for r, g in zip(raw, got_pre, strict=True))
    mult = (  # least squares of over + mult * raw, in relative error
        max(0.0, sum(r * (g - over) / g**2 for r, g in zip(raw, got_pre, strict=True)) / den) if den else 1.0
    )
    pre_err_raw = _rel_rms([over + r for r in raw], [s.seconds for s in pre])
    pre_err = _rel_rms([over + r * mult for r in raw], [s.seconds for s in pre])
    wts = [s for s in samples if s.kind == "weights"]
    xs, ys = [float(s.bytes) for s in wts], [s.seconds for s in wts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = (
        max(1e-15, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var) if var else my / mx
    )
    fixed = max(0.0, my - slope * mx)
    # every push also pauses, checksums what is served and resumes, whatever its bytes: an empty
    # delta (an emulated trainer's, or a step that moved no weight) costs that alone
    pushes = [s.seconds for s in samples if s.kind == "push"]
    push_fixed = statistics.median(pushes) if pushes else 0.0
    train = [s for s in samples if s.kind == "train"]
    # a step = a fixed part (optimizer, per-micro-batch launches: amortised in a large job's steps,
    # which the cost model prices by FLOPs alone) + its FLOPs at the marginal MFU
    tflops = [_train_flops(model, s) * f for s in train]
    step_fixed, train_mfu = (
        _line([s.seconds for s in train], tflops) if train else (0.0, Calibration().train_mfu)
    )
    shared = host_sharing(samples)
    calib = Calibration(
        host_sharing=shared[0] if shared else 0.0,
        mem_efficiency=1.0,
        prefill_mfu=1.0,
        train_mfu=train_mfu,
        tp_decode_efficiency=1.0,
        decode_overhead_s=over,
        prefill=mult,
        sync_fixed_s=fixed + push_fixed,
        # as the trainer's measured steps ran (none measured: the cost model's default)
        activation_recompute=any(s.recompute for s in train) if train else True,
    )
    gpu = GPUSpec(**{**asdict(gpu), "net_bw": 1 / slope})
    check = CostModel(gpu, model, calib)
    errors = {
        "decode_rel_rms": round(_rel_rms([check.decode_step_s(s.batch, s.context, 1) for s in dec], got), 4),
        "prefill_rel_rms_before_multiplier": round(pre_err_raw, 4),
        "prefill_rel_rms": round(pre_err, 4),
        "weights_rel_rms": round(_rel_rms([x * slope + fixed for x in xs], ys), 4) if wts else None,
        "push_fixed_s": round(push_fixed, 4) if pushes else None,
        "train_step_fixed_s": round(step_fixed, 4) if train else None,
        "train_rel_rms": (
            round(_rel_rms([step_fixed + t / train_mfu for t in tflops], [s.seconds for s in train]), 4)
            if train
            else None
        ),
        "host_sharing_rel_rms": round(shared[1], 4) if shared else None,
    }
    out = {"gpu": asdict(gpu), "model": asdict(model), "calibration": asdict(calib), "fit_error": errors}
    if preset is not None:  # the same fit, in the presets' terms: rates as shares of the peak
        out["efficiency"] = {
            "preset": preset.name,
            "mem_efficiency": round(gpu.mem_bw / preset.mem_bw, 4),
            "prefill_mfu": round(gpu.flops / preset.flops, 4),
            "train_mfu": round(gpu.flops * train_mfu / preset.flops, 4) if train else None,
            "decode_overhead_s": round(over, 6),
            "prefill": round(mult, 4),
        }
    return out


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def _device(want: str) -> str:
    from services.learning.recipe import resolve_device

    try:
        return resolve_device(want).type
    except RuntimeError as err:
        raise SystemExit(f"--device: {err}") from None


def _gpu_preset(device: str) -> GPUSpec | None:
    """The preset of the GPU this machine has (by its name: `H100`, `H200`, `A800`…), if any."""
    if not device.startswith("cuda"):
        return None
    import torch

    from services.common.cost_model import gpu_preset, preset_names

    words = torch.cuda.get_device_name().upper().replace("-", " ").split()
    known = [key for key in preset_names()[0] if key.upper() in words]
    return gpu_preset(known[0]) if known else None


async def _backend(
    args: argparse.Namespace, grid: dict[str, Any], device: str, dtype: str
) -> tuple[Any, Any, Any, Path]:
    """The engine's backend as `args` configure it (not started), the model built in memory for
    `random:` shapes (else None), the model's config and its directory."""
    from services.common.models import resolve_model_dir
    from services.common.runconfig import EngineJob, ModelConfig, RunConfig

    built: Any = None
    if args.model.startswith("random:"):
        if args.backend != "hf":
            raise SystemExit("--model random:… is built in memory: it needs --backend hf")
        shape, config = random_config(args.model.removeprefix("random:"))
        tokenizer = args.tokenizer or await asyncio.to_thread(
            resolve_model_dir, ModelConfig(source="smollm2")
        )
        model_dir = Path(args.workdir) / f"random-{shape}"
        built = await asyncio.to_thread(random_model, config, Path(tokenizer), model_dir, dtype, device)
        model = ModelConfig(source="path", path=str(model_dir))
        _say(
            f"built {shape} with random weights: {sum(p.numel() for p in built.parameters()) / 1e9:.2f}B parameters on {device}"
        )
    else:
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
        backend: Any = VllmBackend(EngineJob.of(run), EngineSettings(seed=0, vllm_dtype=dtype))
    else:
        from services.generation.backends.hf import HFBackend

        if built is None and dtype != "float32":
            raise SystemExit(
                "--dtype: the hf engine serves a model directory in float32 (random:… takes any)"
            )
        if built is not None:
            built.eval()
        backend = HFBackend(model, torch_threads=args.threads, seed=0, model=built)
    return backend, built, model, model_dir


def _settings(args: argparse.Namespace) -> tuple[dict[str, Any], str, str]:
    """The grid, device and served dtype that `args` ask for."""
    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    grid = QUICK if args.quick else GPU if device == "cuda" else FULL
    return grid, device, dtype


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from services.generation.engine import engine_for

    grid, device, dtype = _settings(args)
    if args.neighbours and device != "cpu":
        raise SystemExit(
            "--neighbours measures engines sharing one CPU host; engines on GPUs each have devices of their own"
        )
    backend, built, model, model_dir = await _backend(args, grid, device, dtype)
    batch = max(grid["batches"])
    longest = max(max(grid["contexts"]), max(grid["prefill"])) + grid["new"] + 8
    await backend.start()
    engine = engine_for(backend, batch)
    engine.start()
    try:
        samples = await measure(backend, engine, grid, _say)
        if args.neighbours:
            samples += await measure_beside(args, backend, engine, grid, _say)
    finally:
        await engine.close(timeout=5)
        await backend.close()
    if device == "cuda" and built is not None:
        try:
            samples += await asyncio.to_thread(measure_kernels, built, _say)
        except RuntimeError as err:  # the engine's timings stand without them
            _say(f"graph-captured projections failed, rates fitted from the engine alone: {err}")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)  # the raw timings, whatever the fit does
    (Path(args.workdir) / "samples.json").write_text(json.dumps([asdict(s) for s in samples]))
    params = sum(p.numel() for p in built.parameters()) if built is not None else 0
    spec = model_spec(model_dir, 2 if dtype == "bfloat16" else 4, params)
    if args.trainer:
        if built is not None:  # the trainer keeps float32 weights (bf16 autocast on CUDA)
            built.float()
            trained = built
        else:
            from services.common.models import load_model

            trained = (await asyncio.to_thread(load_model, model)).to(device)
        tgrid = TRAIN_QUICK if args.quick else TRAIN_GPU if device == "cuda" else TRAIN_FULL
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()  # the engine's KV cache
        samples += await asyncio.to_thread(measure_training, trained, tgrid, device, _say, args.threads)
        (Path(args.workdir) / "samples.json").write_text(json.dumps([asdict(s) for s in samples]))
    kv_tokens = getattr(backend, "kv_tokens", 0) or batch * longest
    mem_bytes = (spec.weight_bytes + kv_tokens * spec.kv_bytes_per_token) / 0.9  # reserved_fraction 0.1
    preset = _gpu_preset(device)
    name = (
        f"{preset.name}-{args.backend}"
        if preset is not None
        else f"{platform.machine()}-{os.cpu_count()}cpu-{args.backend}"
    )
    if preset is not None:
        mem_bytes = preset.mem_bytes
    fitted = fit(samples, spec, name, mem_bytes, preset)
    fitted["calibration"]["kv_block_tokens"] = int(getattr(backend, "block_tokens", 1))
    return {
        "libra_profile": 1,
        "measured": {
            "backend": args.backend,
            "model": args.model,
            "dtype": dtype,
            "device": device if device != "cuda" else f"cuda ({_cuda_name()})",
            "threads": args.threads,
            "neighbours": args.neighbours,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores ({_cpu_model()}), {platform.system()}",
            "date": time.strftime("%Y-%m-%d"),
            "command": "libra calibrate "
            + " ".join(sys.argv[2:] if sys.argv[1:2] == ["calibrate"] else sys.argv[1:]),
            "quick": bool(args.quick),
            "trainer": bool(args.trainer),
        },
        **fitted,
        "samples": [asdict(s) for s in samples],
    }


def _cpu_model() -> str:
    """The host's CPU as the kernel names it: a profile holds for that host (and its day: a VM's
    share of it can change, `tools/engine_iterations.py`, `STALE`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cuda_name() -> str:
    import torch

    return str(torch.cuda.get_device_name())


def _refit(path: Path, out: Path) -> int:
    """The current fit on a profile's recorded timings: its measurements and machine are kept."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or data.get("libra_profile") != 1:
        raise SystemExit(f"libra calibrate --refit: {path} is not a profile written by `libra calibrate`")
    data = refitted(data, data["samples"])
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"{out}: refitted; fit errors {data['fit_error']}")
    return 0


def refitted(data: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Profile `data` fitted to `samples` (its own, or others in their place): its machine, model
    and what it says of its measurement are kept."""
    from services.common.cost_model import gpu_preset

    preset = gpu_preset(data["efficiency"]["preset"]) if data.get("efficiency") else None
    gpu = data["gpu"]
    fitted = fit(
        [Sample(**s) for s in samples],
        ModelSpec.from_dict(data["model"]),
        gpu["name"],
        gpu["mem_bytes"],
        preset,
    )
    calib = data.get("calibration") or {}
    measured = {"host_sharing"} if fitted["fit_error"]["host_sharing_rel_rms"] is not None else set()
    fitted["calibration"] |= {k: calib[k] for k in NOT_FITTED if k in calib and k not in measured}
    return (
        {k: v for k, v in data.items() if k not in ("samples", "efficiency")} | fitted | {"samples": samples}
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="libra calibrate", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, tiny-random, a model directory, or random:NAME (a shape under "
        "presets/model_configs/, random weights built here; hf only)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="hf engine and trainer")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="served weights (default: bfloat16 on CUDA, else float32)",
    )
    p.add_argument("--trainer", action="store_true", help="also measure the trainer's step and fit train_mfu")
    p.add_argument("--tokenizer", type=Path, help="random:… models: the tokenizer (default: SmolLM2's)")
    p.add_argument("--workdir", default=".libra/calibrate", help="random:… models: where their config goes")
    p.add_argument(
        "--threads", type=int, default=2, help="engine threads, and the trainer's on a CPU (default 2)"
    )
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        metavar="N",
        help="also time decoding while N more engines like this one decode on this CPU host, and fit "
        "how much engines sharing a host slow each other (host_sharing; a CPU only)",
    )
    p.add_argument("--neighbour", metavar="READY", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help="profile YAML (default: profile-<backend>-<model>.yaml)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (seconds on a tiny model)")
    p.add_argument(
        "--refit",
        type=Path,
        metavar="PROFILE",
        help="fit a profile's raw timings again, measuring nothing (into --out, else in place)",
    )
    args = p.parse_args(argv)
    if args.refit is not None:
        return _refit(args.refit, args.out or args.refit)
    if args.neighbours < 0:
        raise SystemExit("--neighbours: a count of engines, 0 or more")
    if args.neighbour:
        asyncio.run(_neighbour(args))
        return 0
    started = time.monotonic()
    print(
        f"calibrating the {args.backend} engine on {args.model} ({'quick' if args.quick else 'full'} grid)…",
        file=sys.stderr,
    )
    profile = asyncio.run(_run(args))
    out = args.out or Path(f"profile-{args.backend}-{Path(args.model.replace(':', '-')).name}.yaml")
    out.write_text(yaml.safe_dump(profile, sort_keys=False))
    err = profile["fit_error"]
    train = f", training {err['train_rel_rms']:.0%}" if err.get("train_rel_rms") is not None else ""
    if err.get("host_sharing_rel_rms") is not None:
        train += (
            f"; host sharing {profile['calibration']['host_sharing']:.2f} per busy neighbour "
            f"(within {err['host_sharing_rel_rms']:.0%})"
        )
    print(
        f"{out}: decode fit within {err['decode_rel_rms']:.0%} (rel. RMS), prefill {err['prefill_rel_rms']:.0%}, "
        f"weights {err['weights_rel_rms']:.0%}{train}; {time.monotonic() - started:.0f} s. "
        f"Use it: libra sim --profile {out}"
    )
    return 0


if __name__ == "__main__":  # the neighbour engines of `--neighbours` run as `python -m tools.calibrate`
    raise SystemExit(main())
