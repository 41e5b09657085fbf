"""A process that uses gRPC can start children: the stack supervisor does it all the time.

With gRPC's fork support on (grpcio's default), a fork while another thread is in gRPC restarts
gRPC's poller in the child, `close_fds` then closes its epoll descriptor and the child dies
before `exec` (a trainer died this way in CI). Libra turns fork support off in `services/__init__`
and `tools/__init__`; here 40 children are started while a thread keeps a channel busy."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import grpc
import pytest

import services  # noqa: F401  (turns gRPC's fork support off)
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.integration


def test_children_start_while_grpc_is_busy() -> None:
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    codes = []
    with OtlpReceiver() as receiver:
        channel = grpc.insecure_channel(receiver.endpoint.replace("http://", ""))
        done = threading.Event()

        def busy() -> None:
            while not done.is_set():
                with contextlib.suppress(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(channel).result(timeout=0.1)

        thread = threading.Thread(target=busy)
        thread.start()
        try:
            for _ in range(40):
                p = subprocess.run(
                    [sys.executable, "-c", "pass"], preexec_fn=lambda: None, capture_output=True, timeout=60
                )
                codes.append(p.returncode)
        finally:
            done.set()
            thread.join()
    assert codes == [0] * 40, codes
