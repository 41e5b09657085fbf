"""`python -m tools.config_doc`: writes docs/config.md, the run-config reference, from the pydantic
models in services/common/runconfig.py (their field docstrings). A test fails when the file drifts;
`make docs` regenerates it."""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from services.common.runconfig import RunConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "config.md"

HEADER = """# Run config reference

Generated from `services/common/runconfig.py` by `make docs` (`python -m tools.config_doc`); do
not edit by hand. A run config is YAML; every field is optional, unknown fields are errors (with
the field you probably meant), and `libra config check FILE` validates one (reading its dataset
and loading its reward, environment and tools, and checking that the machine has the model
without a download and the rollout backend's library) without starting anything. Examples: `configs/`.

Any field can be overridden on the command line after the config, for `libra run`, `libra
config check` and `libra config show` alike: `--training.lr 1e-6`, `--task.max_turns=4` or
`rollout.engines=3` (values are YAML: `--task.tools '[calculator, python]'`); a number addresses an
item of a list (`--rollout.buckets.0.engines 2`). The job runs with the result, which `libra run`
writes to `runs/<run-id>/config.yaml` and `libra config show FILE [overrides]` prints.
"""


def _type(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(t))
    if origin in (list, tuple, dict):
        args = ", ".join(_type(a) for a in typing.get_args(t) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return f"[{t.__name__}](#{t.__name__.lower()})"
    if t is type(None):
        return "null"
    return getattr(t, "__name__", str(t))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def _limits(field: Any) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            parts.append(f"matches `{m.pattern}`".replace("|", "\\|"))
    return ", ".join(parts)


def _models(root: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """(YAML path, model) for the root and every nested model, in field order."""
    out: list[tuple[str, type[BaseModel]]] = []
    seen: set[type[BaseModel]] = set()

    def walk(path: str, model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        out.append((path, model))
        for name, field in model.model_fields.items():
            for t in (field.annotation, *typing.get_args(field.annotation)):
                for inner in (t, *typing.get_args(t)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(f"{path}.{name}" if path else name, inner)

    walk("", root)
    return out


def render() -> str:
    lines = [HEADER]
    for path, model in _models(RunConfig):
        lines.append(f"## {model.__name__}\n")
        lines.append(f"`{path}:`\n" if path else "The top level of a run config.\n")
        doc = (model.__doc__ or "").strip()
        if doc and path:
            lines.append(" ".join(doc.split()) + "\n")
        lines.append("| field | type | default | limits | meaning |")
        lines.append("|---|---|---|---|---|")
        for name, field in model.model_fields.items():
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            lines.append(
                f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {_limits(field)} | {meaning} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
