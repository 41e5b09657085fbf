"""Where runs are: `libra run --output-dir DIR` notes DIR in .libra/ (of the directory it starts
in), so that `libra report`, `export`, `trace` and `samples` started there find the last run without
the flag, then fall back to ./runs."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

OUTPUT_DIR_HELP = (
    "the directory holding runs/<run-id>/, as given to `libra run --output-dir` (default: where the "
    "last `libra run` started here wrote, then ./runs)"
)


def add_output_dir(p: argparse.ArgumentParser) -> None:
    """The flag every command that reads runs/<run-id>/ takes (`--runs-dir`, its old name, too)."""
    p.add_argument("--output-dir", "--runs-dir", dest="runs_dir", default=None, help=OUTPUT_DIR_HELP)


def _last_runs_file() -> Path:
    from tools.stack import state_dir

    return state_dir() / "last_runs_dir"


def remember_runs_dir(runs_dir: Path) -> None:
    """Notes where the last run's directory went (`libra run --output-dir`), so that `libra
    report`, `export` and `trace` started in the same directory find it without the flag."""
    with contextlib.suppress(OSError):
        _last_runs_file().parent.mkdir(parents=True, exist_ok=True)
        _last_runs_file().write_text(str(runs_dir.resolve()) + "\n")


def find_run(run: str, runs_dir: str | None, needs: str = "report.json") -> tuple[Path | None, list[Path]]:
    """The directory of run `run` (`latest`: the last one) holding `needs`, and where it looked:
    under `runs_dir` when given, else the last run's output directory, then ./runs."""
    if runs_dir is not None:
        candidates = [Path(runs_dir)]
    else:
        candidates = []
        with contextlib.suppress(OSError):
            candidates.append(Path(_last_runs_file().read_text().strip()))
        candidates.append(Path("runs"))
    looked: list[Path] = []
    for d in dict.fromkeys(candidates):
        where = d / run
        looked.append(where)
        if (where / needs).exists():
            return where, looked
    return None, looked
