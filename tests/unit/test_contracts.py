import subprocess
import sys
from pathlib import Path

import pytest

from services.common.bus import decode
from services.common.contracts import ev
from services.common.errors import MalformedMessage
from services.common.subjects import stream_name, subject

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current() -> None:
    """Fails when proto/ changed without `make proto`."""
    out = subprocess.run(
        [sys.executable, "-m", "tools.gen_proto", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_subjects_are_versioned_and_run_scoped() -> None:
    assert subject("r1", "turn.request", "e0") == "libra.v1.r1.turn.request.e0"
    assert stream_name("run-1", "TRAJ") == "LIBRA_RUN_1_TRAJ"


def test_decode_roundtrip_and_garbage() -> None:
    msg = ev.ToolCall(call_id="c", tool="python", args_json="{}")
    assert decode(ev.ToolCall, msg.SerializeToString()) == msg
    with pytest.raises(MalformedMessage):
        decode(ev.ToolCall, b"\xff\xff\xff\xff")
