"""`python -m services.trainer`: settings are checked before anything heavy is imported; torch is
first imported inside `serve`."""

import sys

from services.common.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("trainer", "services.trainer.service", "services.trainer.config:TrainerSettings"))
