"""`python -m services.planner`."""

import sys

from services.common.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("planner", "services.planner.service", "services.planner.config:PlannerSettings"))
