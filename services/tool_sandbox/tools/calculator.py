"""Arithmetic over a whitelisted AST: no `eval`, no names beyond math constants and functions.

Every operation is bounded (operand size, exponent, factorial argument, node count), so the
evaluation runs in-process in microseconds without a sandbox.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from services.tool_sandbox.outcome import Status
from services.tool_sandbox.tools.base import SandboxRun, Tool, ToolResult

MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 400
MAX_INT_BITS = 4096

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}


def _factorial(n: Number) -> int:
    if not isinstance(n, int) or n < 0 or n > 1000:
        raise ValueError("factorial() needs an integer between 0 and 1000")
    return math.factorial(n)


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "atan2": math.atan2,
    "hypot": math.hypot,
    "floor": math.floor,
    "ceil": math.ceil,
    "gcd": math.gcd,
    "factorial": _factorial,
}


class CalculatorError(ValueError):
    pass


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result exceeds {MAX_INT_BITS} bits")
    return value


def _pow(base: Number, exponent: Number) -> Number:
    huge = (
        isinstance(base, int)
        and isinstance(exponent, int)
        and abs(base) > 1
        and base.bit_length() * exponent > MAX_INT_BITS * 2
    )
    if huge:
        raise CalculatorError(f"result exceeds {MAX_INT_BITS} bits")
    return base**exponent


def _eval(node: ast.AST) -> Number:
    match node:
        case ast.Expression(body=body):
            return _eval(body)
        case ast.Constant(value=value) if isinstance(value, int | float) and not isinstance(value, bool):
            return _check_size(value)
        case ast.Name(id=name) if name in _CONSTANTS:
            return _CONSTANTS[name]
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_eval(operand))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            lhs, rhs = _eval(left), _eval(right)
            if isinstance(op, ast.Pow):
                return _check_size(_pow(lhs, rhs))
            return _check_size(_BINARY[type(op)](lhs, rhs))
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
            return _check_size(_FUNCTIONS[name](*[_eval(arg) for arg in args]))
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:80]}")


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression; raises CalculatorError (or ArithmeticError) on bad input."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} nodes")
    return _eval(tree)


def format_number(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression (+ - * / // % **, math functions, pi, e)."

    def schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "minLength": 1, "maxLength": MAX_EXPRESSION_CHARS},
            },
            "required": ["expression"],
            "additionalProperties": False,
        }

    async def call(self, args: dict[str, Any], sandbox: SandboxRun, timeout_s: float) -> ToolResult:
        try:
            return ToolResult(status=Status.OK, payload=format_number(evaluate(args["expression"])))
        except (CalculatorError, ArithmeticError, ValueError, TypeError) as exc:
            return ToolResult(status=Status.ERROR, error=f"{type(exc).__name__}: {exc}")
