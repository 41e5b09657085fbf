"""`python -m services.trainer`: validate settings and the run config, then start the service.

Configuration is read and checked before anything heavy is imported, so `--help` and a bad setting
answer at once; torch is first imported inside `serve`.
"""

from __future__ import annotations

import argparse
import sys

from services.common.config import CommonSettings, load_settings
from services.common.runconfig import load_run_config
from services.trainer.config import TrainerSettings


def _describe(cls: type) -> str:
    fields = cls.model_fields  # type: ignore[attr-defined]
    prefix = cls.model_config.get("env_prefix", "")  # type: ignore[attr-defined]
    lines = []
    for name, f in fields.items():
        doc = (f.description or "").split("\n")[0]
        lines.append(f"  {(prefix + name).upper():<36} {doc} (default: {f.default!r})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.trainer",
        description="Libra trainer: GRPO steps on completed trajectories, weight pushes to rollout engines.",
        epilog="environment:\n" + _describe(CommonSettings) + "\n" + _describe(TrainerSettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    common = load_settings(CommonSettings)
    load_settings(TrainerSettings)
    load_run_config(common.config)

    from services.common.lifecycle import run_service
    from services.trainer.service import serve

    return run_service("trainer", serve)


if __name__ == "__main__":
    sys.exit(main())
