"""`libra … | head`: the reader closing the pipe ends the command quietly (exit 141, as a shell
reports SIGPIPE), never with a traceback."""

from __future__ import annotations

import subprocess
import sys

from tools.stack import ROOT


def test_a_closed_pipe_ends_the_command_without_a_traceback() -> None:
    # the reader takes one line and closes its end; the command goes on writing far more
    # than a pipe holds, so the writer meets the closed pipe
    script = (
        "import sys\n"
        "from tools import cli\n"
        "cli._main = lambda argv=None: [print('x' * 1000, flush=True) for _ in range(10_000)] and 0\n"
        "sys.exit(cli.main([]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
