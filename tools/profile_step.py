"""`python -m tools.profile_step [--model smollm2] [--batch 4] [--length 640] [--top-p 1.0]
[--no-gradient-checkpointing] [--threads 2]`: one training micro-batch's peak memory and time.

The trainer's forward, token scoring (`services/learning/grpo.py`, `token_logprobs`), entropy and
backward on one micro-batch of random tokens, in a process of its own so that its peak RSS is the
step's (weights and gradients included, no optimizer state): one warm-up, then the mean of two
timed steps. Prints one JSON line. The figures in docs/training.md ("Memory of a step") were
measured this way on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profile_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny-random | a model directory")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=640)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from services.common.runconfig import LearnJob, RunConfig
    from services.learning import grpo
    from services.learning.recipe import policy_model

    torch.set_num_threads(ns.threads)
    source = {"source": "path", "path": ns.model} if os.path.isdir(ns.model) else {"source": ns.model}
    run = RunConfig.model_validate(
        {"model": source, "training": {"gradient_checkpointing": not ns.no_gradient_checkpointing}}
    )
    model = policy_model(LearnJob.of(run))
    model.train()
    vocab = int(model.config.vocab_size)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (ns.batch, ns.length))
    temps = torch.full((ns.batch, ns.length - 1), ns.temperature)
    mask = torch.ones(ns.batch, ns.length - 1, dtype=torch.bool)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step() -> float:
        logits = model(input_ids=ids).logits
        lp = grpo.token_logprobs(logits, ids, temps, ns.top_p)
        grpo.entropy_sum(logits, temps, mask)
        (-lp.mean()).backward()
        model.zero_grad(set_to_none=False)
        return float(lp.detach().sum())

    step()
    start = time.perf_counter()
    sums = [step() for _ in range(2)]
    out = {
        "model": ns.model,
        "batch": ns.batch,
        "length": ns.length,
        "vocab": vocab,
        "top_p": ns.top_p,
        "gradient_checkpointing": not ns.no_gradient_checkpointing,
        "threads": ns.threads,
        "step_s": round((time.perf_counter() - start) / 2, 3),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "rss_before_steps_gib": round(before / 2**20, 3),
        "logprob_sum": sums[-1],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
