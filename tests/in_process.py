"""Entry points run in the test's own process: `libra ...` (`tools.cli.main`) and `python -m
services.<name>` (its `__main__`), with the environment and working directory a fresh process would
have, their exit code and output as `subprocess.CompletedProcess` holds them. For the many cases
that check what an entry point answers (a bad config, a refusal): an interpreter start costs 1.5 s
of CPU alone and 5-25 s on a loaded 2-core runner. Each entry point is still started as a process
of its own somewhere in the tests."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Exited:
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _environment(env: dict[str, str], clean: bool) -> Iterator[None]:
    """`env` set (`clean`: no inherited LIBRA_* variable), all of it undone afterwards."""
    saved = dict(os.environ)
    try:
        if clean:
            for key in [k for k in os.environ if k.startswith("LIBRA_")]:
                del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_main(
    main: Callable[[], object], env: dict[str, str] | None = None, cwd: Path = ROOT, clean: bool = True
) -> Exited:
    """Runs `main()` in `cwd` with `env`; its exit code (returned, or SystemExit's) and output."""
    out, err = io.StringIO(), io.StringIO()
    with (
        _environment(env or {}, clean),
        contextlib.chdir(cwd),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            result = main()
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Exited(code, out.getvalue(), err.getvalue())


def libra(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, clean: bool = True) -> Exited:
    """`libra ARGS`."""
    from tools.cli import main

    return run_main(lambda: main(list(args)), env, cwd, clean)


def service(module: str, env: dict[str, str] | None = None) -> Exited:
    """`python -m services.<module>` with no arguments (configured by `env`, as a service is)."""
    argv = sys.argv
    sys.argv = [f"services/{module}"]
    try:
        return run_main(lambda: runpy.run_module(f"services.{module}", run_name="__main__"), env)
    finally:
        sys.argv = argv
