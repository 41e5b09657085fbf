"""`python -m services.scheduler`: settings are parsed before anything heavy is imported."""

import sys

from services.common.cli import service_main

if __name__ == "__main__":
    sys.exit(
        service_main("scheduler", "services.scheduler.service", "services.scheduler.config:SchedulerSettings")
    )
