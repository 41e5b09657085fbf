"""`python -m services.rollout_engine`: settings are checked first; torch is imported only inside
`serve`."""

import sys

from services.common.cli import service_main


def main() -> int:
    return service_main(
        "rollout-engine",
        "services.rollout_engine.service",
        "services.generation.config:EngineSettings",
        # Before any thread: bounds the engine's memory during weight pushes.
        before="services.rollout_engine.weight_sync:limit_malloc_arenas",
    )


if __name__ == "__main__":
    sys.exit(main())
