"""The summary `libra run` ends with (and `libra report` reprints)."""

from __future__ import annotations

import pytest

from tools.cli import print_summary

DONE = {
    "status": "completed",
    "all_engines_on_final_version": True,
    "policy_versions_per_step": [],
    "logprob_mismatch_per_step": [],
}


def test_the_summary_says_what_the_stack_refused_and_stays_quiet_when_nothing_was(
    capsys: pytest.CaptureFixture[str],
) -> None:
    refused = {
        "turn_results": {"rollout-engine-1": 3},
        "weight_pushes": {"rollout-engine-0": {"unauthorized": 2}},
        "redis": {"rollout-engine-1": {"key": 2, "command": 3}},
        "nats": None,  # a remote stack: nats-server's log is not on this machine
    }
    assert print_summary({**DONE, "refused": refused}) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("refused "))
    assert "weight_pushes {'rollout-engine-0': {'unauthorized': 2}}" in line
    assert "redis {'rollout-engine-1': {'key': 2, 'command': 3}}" in line and "nats" not in line
    empty = {"turn_results": {}, "weight_pushes": {}, "redis": {}, "nats": {}}
    assert print_summary({**DONE, "refused": empty}) == 0
    assert "refused" not in capsys.readouterr().out
