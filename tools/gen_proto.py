"""Regenerates services/common/gen from proto/ and rewrites imports so the code lives in one package.

`python -m tools.gen_proto --check` exits 1 when the checked-in code differs from a fresh generation.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
GEN_DIR = ROOT / "services" / "common" / "gen"
GEN_PACKAGE = "services.common.gen"


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # heavy import, only when generating

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out_dir.rglob("*.py*"):
        if path.suffix not in (".py", ".pyi"):  # not an interpreter's cache of them (*.pyc)
            continue
        text = path.read_text()
        fixed = re.sub(r"^from libra\.", f"from {GEN_PACKAGE}.libra.", text, flags=re.M)
        fixed = re.sub(r"^import libra\.", f"import {GEN_PACKAGE}.libra.", fixed, flags=re.M)
        path.write_text(fixed)
    for pkg in [out_dir, *[p for p in out_dir.rglob("*") if p.is_dir()]]:
        (pkg / "__init__.py").touch()


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): p.read_text()
        for p in directory.rglob("*")
        if p.is_file() and p.suffix in {".py", ".pyi"}
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the generated code is stale")
    opts = parser.parse_args(argv)
    if opts.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            fresh, current = snapshot(Path(tmp)), snapshot(GEN_DIR)
        stale = sorted(k for k in fresh.keys() | current.keys() if fresh.get(k) != current.get(k))
        if stale:
            print("stale generated code (run `make proto`):", *stale, sep="\n  ", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    for old in GEN_DIR.rglob("*_pb2*.py*"):
        old.unlink()
    generate(GEN_DIR)
    print(f"generated {GEN_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
