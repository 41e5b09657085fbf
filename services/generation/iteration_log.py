"""One JSON line per engine iteration, as the engine really ran it (`engine.iteration_log`).

The cost model prices an iteration from its batch (decode sequences and their mean context, and
the prompt tokens prefilled with them); `libra bench live` reads these lines back to set the
iterations a live job's real engines ran against what the cost model, fitted offline by `libra
calibrate`, says they cost (`tools/engine_iterations.py`). A line:

- `t`: wall-clock time (Unix seconds) the iteration's output reached the engine's process;
- `dt`: seconds since the previous iteration's output, when the engine had work left after it (so
  it began the next one at once: the iteration's whole cost, scheduling and output included), else
  null (it sat idle in between);
- `model_s`: the model's forward and sampling alone (vLLM's `elapsed_ms`);
- `decode`, `decode_tokens`: sequences decoding and the tokens they computed (more than one each
  when drafted tokens are verified);
- `context`: their mean context (prompt and tokens so far, as this process last saw them);
- `prefill`, `prefill_tokens`: prompts prefilled in the same iteration and their tokens;
- `running`, `waiting`: the engine's scheduler after the iteration.

Lines are buffered and appended once a second; nothing is kept in memory beyond that.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

FLUSH_S = 1.0


@dataclass(frozen=True)
class Iteration:
    t: float
    dt: float | None
    model_s: float
    decode: int
    decode_tokens: int
    context: float
    prefill: int
    prefill_tokens: int
    running: int
    waiting: int


class IterationLog:
    """Appends `Iteration` lines to `DIR/<name>-<pid>.jsonl`."""

    def __init__(self, directory: Path, name: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}-{os.getpid()}.jsonl"
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._lines: list[str] = []
        self._last: float | None = None
        """When the previous iteration's output came, if the engine had work left after it."""
        self._flushed = time.monotonic()
        self.count = 0

    def add(
        self,
        model_s: float,
        decode: int,
        decode_tokens: int,
        context: float,
        prefill: int,
        prefill_tokens: int,
        running: int,
        waiting: int,
    ) -> Iteration:
        now = time.monotonic()
        it = Iteration(
            t=round(time.time(), 4),
            dt=round(now - self._last, 6) if self._last is not None else None,
            model_s=round(model_s, 6),
            decode=decode,
            decode_tokens=decode_tokens,
            context=round(context, 1),
            prefill=prefill,
            prefill_tokens=prefill_tokens,
            running=running,
            waiting=waiting,
        )
        self._last = now if running + waiting > 0 else None
        self._lines.append(json.dumps(asdict(it), separators=(",", ":")))
        self.count += 1
        if now - self._flushed >= FLUSH_S:
            self.flush()
        return it

    def gap(self) -> None:
        """The engine stops between iterations (generation paused): the next one's `dt` is null."""
        self._last = None

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self._file is None or not self._lines:
            return
        self._file.write("\n".join(self._lines) + "\n")
        self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_engines(directory: Path) -> dict[str, list[Iteration]]:
    """Each engine's iterations under `directory` (by file name), in order; a torn line is skipped."""
    out: dict[str, list[Iteration]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        its = out[path.stem] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                its.append(Iteration(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return out


def read(directory: Path) -> list[Iteration]:
    """Every engine's iterations under `directory`, by time."""
    return sorted((it for its in read_engines(directory).values() for it in its), key=lambda it: it.t)
