"""Libra's tools: the CLI, the stack supervisor, the simulator, benchmarks.

Importing `services` first turns gRPC's fork support off before anything imports grpc (see
`services/__init__.py`): the supervisor forks the services.
"""

import services  # noqa: F401
