"""A validator for the small JSON-schema subset tool arguments use (no dependency, typed messages)."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
}


def validate(schema: dict[str, Any], value: Any, path: str = "args") -> list[str]:
    """Return every violation as `path: reason`; an empty list means the value is valid."""
    expected = schema.get("type")
    if expected:
        types = _TYPES[expected]
        is_bool = isinstance(value, bool)
        if not isinstance(value, types) or (is_bool and expected in ("integer", "number")):
            return [f"{path}: expected {expected}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: below minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: above maximum {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}.{name}: required")
        for name, item in value.items():
            if name in properties:
                errors += validate(properties[name], item, f"{path}.{name}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}.{name}: unknown argument")
    return errors
