"""A hybrid worker's training side as its own process (tests/integration/test_hybrid_group.py):
`python -m tests.hybrid_rig PORT GENERATION KEY RANK WORLD MODEL_DIR OUT [die-after-join]
[timeout=S]`. It joins one
generation of the trainer's group, follows it until the trainer closes it and writes its weights
and the number of steps it computed to OUT; with `die-after-join` it exits hard once it has the
weights, mid-generation, as a killed worker would; `timeout=S`: how long it waits for the
generation to form (20 s)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    port, gen, key, rank, world = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    model_dir, out, die = argv[5], Path(argv[6]), "die-after-join" in argv[7:]
    # how long its side waits for the generation to form (the trainer's is its own)
    timeout_s = next((float(a.split("=", 1)[1]) for a in argv[7:] if a.startswith("timeout=")), 20.0)
    from services.common.runconfig import LearnJob, RunConfig
    from services.learning.recipe import replica_for

    torch.set_num_threads(1)
    run = RunConfig.model_validate(
        {"model": {"source": "tiny-random", "cache_dir": model_dir}, "training": {"micro_batch": 2}}
    )  # the job config the trainer has (tests/integration/test_hybrid_group.py)
    replica = replica_for(LearnJob.of(run))

    def joined(nbytes: float) -> None:
        (out / f"joined-{rank}").write_text(str(nbytes))
        if die:
            os._exit(3)

    outcome = replica.serve("127.0.0.1", port, gen, key, rank, world, timeout_s, joined)
    torch.save(
        {k: v.detach().clone() for k, v in replica.model.state_dict().items()}, out / f"replica-{rank}.pt"
    )
    (out / f"replica-{rank}.json").write_text(json.dumps({"outcome": outcome, "steps": replica.steps}))


if __name__ == "__main__":
    main(sys.argv[1:])
