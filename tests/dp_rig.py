"""One replica of a data-parallel training step, as its own process (tests/integration/test_data_parallel.py):
`python -m tests.dp_rig RANK WORLD INIT_FILE MODEL_DIR OUT`. Rank 0 is the trainer and steps; the
others are hybrid replicas that contribute gradients. Every rank writes its stats and weights to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def samples() -> list:
    from services.trainer.data import Sample

    g = torch.Generator().manual_seed(7)
    out = []
    for i, n in enumerate((9, 14, 6, 20, 11, 17, 8, 13)):
        ids = torch.randint(5, 200, (n,), generator=g).tolist()
        mask = [False] * 3 + [True] * (n - 3)
        old = [-float(x) if m else 0.0 for x, m in zip(torch.rand(n, generator=g), mask, strict=True)]
        out.append(Sample(f"t{i}", f"g{i // 4}", float(i % 3 == 0), ids, mask, old))
    return out


def step(model_dir: str, group: object = None) -> tuple[torch.nn.Module, dict]:
    from services.common.models import load_model
    from services.common.runconfig import ModelConfig
    from services.trainer.step import train_step

    torch.manual_seed(0)
    model = load_model(ModelConfig(source="tiny-random", cache_dir=model_dir))
    # the update is the gradient itself, scaled up to well above float32's rounding of the weights
    opt = torch.optim.SGD(model.parameters(), lr=1000.0)
    stats = train_step(
        model, opt, samples(), temperature=1.0, clip_eps=0.2, micro_batch=2, pad_id=0,
        max_grad_norm=1e9, dp_group=group,
    )  # fmt: skip
    return model, {"loss": stats.loss, "grad_norm": stats.grad_norm, "kl": stats.kl, "tokens": stats.tokens}


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
    model, stats = step(model_dir, group)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights-{rank}.pt")
    (out / f"stats-{rank}.json").write_text(json.dumps(stats))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
