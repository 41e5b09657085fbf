"""`python -m tests.e2e.rogue_engine`: a compromised rollout engine. It is the real engine service,
under its own worker's credentials, except that every turn result it publishes is replaced by one
no engine serving the job could make: in turn NaN logprobs, token ids outside any vocabulary, and
a policy version the trainer never made (tests/e2e/test_chaos.py runs a job beside it)."""

import math
import sys
from typing import Any

from services.common.contracts import ev
from services.generation import serving
from services.rollout_engine.__main__ import main as engine_main

_honest = serving.turn_result
_sent = [0]


def _garbage(*args: Any, **kwargs: Any) -> ev.TurnResult:
    res = _honest(*args, **kwargs)
    n = max(1, len(res.token_ids))
    kind = _sent[0] % 3
    _sent[0] += 1
    ids = list(res.token_ids) or [1]
    del res.token_ids[:], res.logprobs[:], res.token_versions[:]
    res.token_ids.extend([10**8] * n if kind == 1 else ids)
    res.logprobs.extend([math.nan if kind == 0 else -0.5] * n)
    if kind == 2:
        res.policy_version = 10**6
    return res


serving.turn_result = _garbage

if __name__ == "__main__":
    sys.exit(engine_main())
