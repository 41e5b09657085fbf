import pytest

from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.tools import build_tools
from services.tool_sandbox.tools.schema import validate
from services.tool_sandbox.tools.shell import CommandRejected, parse_pipeline, to_script

SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 1, "maxLength": 5},
        "k": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["code"],
    "additionalProperties": False,
}


def test_valid_arguments_pass() -> None:
    assert validate(SCHEMA, {"code": "x", "k": 2}) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({}, "args.code: required"),
        ({"code": 1}, "expected string"),
        ({"code": ""}, "shorter than"),
        ({"code": "toolong"}, "longer than"),
        ({"code": "x", "k": 0}, "below minimum"),
        ({"code": "x", "k": True}, "expected integer"),
        ({"code": "x", "extra": 1}, "unknown argument"),
        ("not an object", "expected object"),
        (None, "expected object"),
    ],
)
def test_invalid_arguments_are_reported(args: object, fragment: str) -> None:
    errors = validate(SCHEMA, args)
    assert errors and any(fragment in error for error in errors)


def test_every_tool_has_an_object_schema() -> None:
    tools = build_tools(SandboxSettings())
    assert set(tools) == {"python", "calculator", "search", "shell", "synthetic"}
    for tool in tools.values():
        schema = tool.schema()
        assert schema["type"] == "object" and schema["required"] and schema["additionalProperties"] is False


ALLOWED = {"grep", "sort", "wc", "echo"}


def test_pipeline_is_split_and_quoted() -> None:
    stages = parse_pipeline("grep -c 'a b' | sort | wc -l", ALLOWED)
    assert stages == [["grep", "-c", "a b"], ["sort"], ["wc", "-l"]]
    script = to_script([["echo", "$HOME", "*"]])
    assert script.endswith("echo '$HOME' '*'")


@pytest.mark.parametrize(
    "command",
    [
        "rm -rf /",
        "echo hi; rm x",
        "echo hi > /etc/x",
        "echo $(id) && ls",
        "echo a &",
        "sort |",
        "| wc",
        "python3 -c 1",
    ],
)
def test_pipeline_rejects_unsafe_input(command: str) -> None:
    with pytest.raises(CommandRejected):
        parse_pipeline(command, ALLOWED)
