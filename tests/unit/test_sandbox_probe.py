import subprocess

import pytest

from services.tool_sandbox.isolation import _probe


def _script(tmp_path, crashes: int):
    """A stand-in for `bwrap --version` that aborts itself `crashes` times, then succeeds."""
    count = tmp_path / "count"
    count.write_text("0")
    script = tmp_path / "fake-bwrap"
    script.write_text(
        f"#!/bin/sh\nn=$(cat {count})\necho $((n + 1)) > {count}\n"
        f'if [ "$n" -lt {crashes} ]; then kill -ABRT $$; fi\necho "bubblewrap 0.11.0"\n'
    )
    script.chmod(0o755)
    return str(script), count


def test_a_probe_killed_by_a_signal_is_retried(tmp_path):
    script, count = _script(tmp_path, crashes=2)
    _probe(script, {})
    assert count.read_text().strip() == "3"


def test_a_probe_that_keeps_crashing_still_fails(tmp_path):
    script, _ = _script(tmp_path, crashes=5)
    with pytest.raises(subprocess.CalledProcessError):
        _probe(script, {})


def test_a_probe_that_exits_with_an_error_is_not_retried(tmp_path):
    script = tmp_path / "broken"
    script.write_text("#!/bin/sh\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(subprocess.CalledProcessError) as err:
        _probe(str(script), {})
    assert err.value.returncode == 3
