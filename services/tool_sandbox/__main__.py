"""`python -m services.tool_sandbox`."""

import sys

from services.common.cli import service_main

if __name__ == "__main__":
    sys.exit(
        service_main(
            "tool-sandbox", "services.tool_sandbox.service", "services.tool_sandbox.config:SandboxSettings"
        )
    )
