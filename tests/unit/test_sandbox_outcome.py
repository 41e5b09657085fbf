import signal

import pytest

from services.tool_sandbox.outcome import (
    EXIT_FILE_LIMIT,
    EXIT_MEMORY_LIMIT,
    SizeClass,
    Status,
    ToolOutcome,
    classify_exit,
    size_class,
)


def classify(code: int, *, timed_out: bool = False, output_exceeded: bool = False) -> Status:
    status, _ = classify_exit(
        code, timed_out=timed_out, output_exceeded=output_exceeded, timeout_s=1.0, output_limit=10
    )
    return status


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (0, Status.OK),
        (1, Status.ERROR),
        (2, Status.ERROR),
        (EXIT_MEMORY_LIMIT, Status.KILLED),
        (EXIT_FILE_LIMIT, Status.KILLED),
        (128 + signal.SIGKILL, Status.KILLED),
        (128 + signal.SIGSEGV, Status.KILLED),
        (128 + signal.SIGXCPU, Status.TIMEOUT),
        (-signal.SIGKILL, Status.KILLED),
    ],
)
def test_exit_codes_map_to_statuses(code: int, expected: Status) -> None:
    assert classify(code) == expected


def test_host_decisions_win_over_exit_code() -> None:
    assert classify(0, timed_out=True) == Status.TIMEOUT
    assert classify(137, timed_out=True) == Status.TIMEOUT
    assert classify(0, output_exceeded=True) == Status.KILLED


def test_reasons_are_human_readable() -> None:
    _, reason = classify_exit(137, timed_out=False, output_exceeded=False, timeout_s=1, output_limit=1)
    assert reason == "terminated by SIGKILL"
    _, reason = classify_exit(0, timed_out=True, output_exceeded=False, timeout_s=2.5, output_limit=1)
    assert "2.5s" in reason
    _, reason = classify_exit(0, timed_out=False, output_exceeded=True, timeout_s=1, output_limit=1024)
    assert "1024 bytes" in reason


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0, SizeClass.SMALL),
        (99, SizeClass.SMALL),
        (100, SizeClass.MEDIUM),
        (999, SizeClass.MEDIUM),
        (1000, SizeClass.LARGE),
    ],
)
def test_size_class_thresholds(size: int, expected: SizeClass) -> None:
    assert size_class(size, medium_bytes=100, large_bytes=1000) == expected


def test_outcome_serialises_every_scheduler_field() -> None:
    fields = ToolOutcome(tool="python", status="ok").to_dict()
    assert set(fields) == {
        "tool", "status", "payload", "payload_bytes", "size_class", "wall_s", "cpu_s",
        "peak_rss_bytes", "truncated", "exit_code", "error",
    }  # fmt: skip
