"""`python -m tools.profile_engine [--model smollm2] [--out FILE]`: the hf engine's step times.

For each batch size and speculative-decoding width (drafted tokens per row; 0 is plain decoding)
the backend's rows are prefilled with a real prompt and `STEPS` steps are timed after `WARMUP`:
the median step, and in a second pass the median time spent inside the transformer body (the
device synchronised around it, so the rest is the head, sampling and the backend's bookkeeping).
Drafts are random tokens (nearly all rejected: the cost of verifying, not its gain). Runs on
CUDA when the machine has it, else on the CPU; writes JSON (the profile committed in
`docs/data/` was measured this way, see docs/engine.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCHES = (1, 2, 8, 32)
WIDTHS = (0, 1, 2, 4, 6)
WARMUP, STEPS = 3, 20
PROMPT = "Explain in one paragraph how a hash table works, then give an example in Python."


def _timed_body(backend: Any, sink: list[float]) -> Callable[[], None]:
    """Wraps the transformer body's forward to record its device time; returns the undo."""
    import torch

    body = backend.model.get_decoder()
    plain = body.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        start = time.perf_counter()
        out = plain(*args, **kwargs)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        sink.append(time.perf_counter() - start)
        return out

    body.forward = forward
    return lambda: delattr(body, "forward")


def _steps(
    backend: Any, batch: int, width: int, prompt: list[int], rng: random.Random, steps: int
) -> list[float]:
    from services.generation.backends.base import Join

    vocab = backend.vocab_size
    joins = [Join(slot, list(prompt), 1.0, None) for slot in range(batch)]
    backend.step_sync(joins, [], True)
    times = []
    for _ in range(WARMUP + steps):
        drafts = {s: [rng.randrange(vocab) for _ in range(width)] for s in range(batch)} if width else None
        start = time.perf_counter()
        backend.step_sync([], [], False, frozenset(), drafts)
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def profile(
    model: str, batches: tuple[int, ...] = BATCHES, widths: tuple[int, ...] = WIDTHS, steps: int = STEPS
) -> dict[str, Any]:
    import torch

    from services.common.runconfig import ModelConfig
    from services.generation.backends.hf import HFBackend

    backend = HFBackend(
        ModelConfig(source=model), torch_threads=max(1, min(8, torch.get_num_threads())), seed=0
    )
    asyncio.run(backend.start())
    prompt = backend.tok(PROMPT)["input_ids"]
    rng = random.Random(0)
    rows = []
    for batch in batches:
        for width in widths:
            step = statistics.median(_steps(backend, batch, width, prompt, rng, steps))
            body: list[float] = []
            undo = _timed_body(backend, body)
            try:
                _steps(backend, batch, width, prompt, rng, steps)
            finally:
                undo()
            body_ms = statistics.median(body[-steps:]) * 1e3
            rows.append(
                {
                    "batch": batch,
                    "width": width,
                    "query_tokens": batch * (1 + width),
                    "step_ms": round(step * 1e3, 3),
                    "body_ms": round(body_ms, 3),
                }
            )
            print(
                f"batch {batch:3d} width {width}: step {step * 1e3:8.2f} ms, body {body_ms:8.2f} ms",
                flush=True,
            )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {
        "what": "hf engine step times (tools/profile_engine.py)",
        "model": model,
        "device": device,
        "torch": torch.__version__,
        "dtype": str(next(backend.model.parameters()).dtype),
        "prompt_tokens": len(prompt),
        "steps": steps,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_engine", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="model.source (default smollm2)")
    parser.add_argument("--out", type=Path, help="write the profile here (JSON)")
    ns = parser.parse_args(argv)
    result = profile(ns.model, BATCHES, WIDTHS, STEPS)
    text = json.dumps(result, indent=2) + "\n"
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
