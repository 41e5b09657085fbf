"""One replica of a data-parallel training step, as its own process (tests/integration/test_data_parallel.py):
`python -m tests.dp_rig RANK WORLD INIT_FILE MODEL_DIR OUT [MINI_BATCHES]`. Rank 0 is the trainer and
steps; the others are hybrid replicas that contribute gradients (and, between the updates of a step
of several mini-batches, receive rank 0's weights). Every rank writes its stats and weights to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def samples() -> list:
    from services.learning.data import Sample

    g = torch.Generator().manual_seed(7)
    out = []
    for i, n in enumerate((9, 14, 6, 20, 11, 17, 8, 13)):
        ids = torch.randint(5, 200, (n,), generator=g).tolist()
        mask = [False] * 3 + [True] * (n - 3)
        old = [-float(x) if m else 0.0 for x, m in zip(torch.rand(n, generator=g), mask, strict=True)]
        out.append(Sample(f"t{i}", f"g{i // 4}", float(i % 3 == 0), ids, mask, old))
    return out


def step(model_dir: str, group: object = None, mini_batches: int = 1) -> tuple[torch.nn.Module, dict]:
    from services.common.models import load_model
    from services.common.runconfig import ModelConfig
    from services.learning.grpo import LossConfig
    from services.learning.step import StepSettings, train_step

    torch.manual_seed(0)
    model = load_model(ModelConfig(source="tiny-random", cache_dir=model_dir))
    # the update is the gradient itself, scaled up to well above float32's rounding of the weights
    opt = torch.optim.SGD(model.parameters(), lr=1000.0)
    settings = StepSettings(
        LossConfig(), micro_batch=2, pad_id=0, mini_batches=mini_batches, max_grad_norm=1e9
    )
    stats = train_step(model, opt, samples(), settings, dp_group=group)
    keys = ("loss", "grad_norm", "kl", "tokens", "updates", "entropy", "is_weight_mean", "clip_fraction")
    return model, {k: getattr(stats, k) for k in keys}


def assert_same_update(got: dict, expected: dict, initial: dict) -> None:
    """`got` moved the weights from `initial` as `expected` did, up to floating-point reduction order
    (within 1e-4 of the update's size), and the update is well above float32's rounding."""
    scale = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert scale > 1e-3, "the step moves the weights"
    for k in initial:
        dp, ref = got[k] - initial[k], expected[k] - initial[k]
        assert torch.allclose(dp, ref, rtol=1e-3, atol=1e-4 * scale), (k, float((dp - ref).abs().max()))


def main(argv: list[str]) -> None:
    rank, world, init_file, model_dir, out = int(argv[0]), int(argv[1]), argv[2], argv[3], Path(argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")  # a group of its own, as the trainer's
    model, stats = step(model_dir, group, int(argv[5]) if len(argv) > 5 else 1)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights-{rank}.pt")
    (out / f"stats-{rank}.json").write_text(json.dumps(stats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
