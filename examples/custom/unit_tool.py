"""A tool of your own (examples/custom): `task.tool_plugins: [examples/custom/unit_tool.py]`.

The tool sandbox reads NAME, DESCRIPTION and SCHEMA from this file without importing it, checks
each call's arguments against SCHEMA, and runs `run(**arguments)` in a fresh sandbox (the same
isolation as the python tool). The model calls it as
<tool_call>{"name": "convert", "arguments": {"value": 2, "from": "h", "to": "s"}}</tool_call>."""

from __future__ import annotations

NAME = "convert"
DESCRIPTION = "Convert a quantity between units of time, length or mass."
UNITS = {
    "s": ("time", 1),
    "min": ("time", 60),
    "h": ("time", 3600),
    "day": ("time", 86400),
    "week": ("time", 604800),
    "mm": ("length", 0.001),
    "cm": ("length", 0.01),
    "m": ("length", 1),
    "km": ("length", 1000),
    "g": ("mass", 0.001),
    "kg": ("mass", 1),
    "t": ("mass", 1000),
}
SCHEMA = {  # a literal: read with ast.literal_eval
    "type": "object",
    "properties": {
        "value": {"type": "number"},
        "from": {
            "type": "string",
            "enum": ["s", "min", "h", "day", "week", "mm", "cm", "m", "km", "g", "kg", "t"],
        },
        "to": {
            "type": "string",
            "enum": ["s", "min", "h", "day", "week", "mm", "cm", "m", "km", "g", "kg", "t"],
        },
    },
    "required": ["value", "from", "to"],
    "additionalProperties": False,
}


def run(value: float, **units: str) -> str:
    (kind_a, a), (kind_b, b) = UNITS[units["from"]], UNITS[units["to"]]
    if kind_a != kind_b:
        raise ValueError(f"cannot convert {kind_a} to {kind_b}")
    result = value * a / b
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
