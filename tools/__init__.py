"""Libra: gRPC's fork support is turned off before anything imports grpc.

With it on, a process that uses gRPC and then forks a child (the stack supervisor starting a
service, the sandbox starting a tool) has gRPC restart its poller thread in the child, where
`close_fds` closes that thread's epoll descriptor before `exec`, and the child aborts
("epoll_wait error: Bad file descriptor"). No Libra process uses gRPC across a fork.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
