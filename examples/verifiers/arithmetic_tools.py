"""The taskset's tool, as verifiers serves it: an MCP toolset (`vf.Toolset`), one server per rollout,
started by verifiers as `python -m arithmetic_tools`."""

from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class CalculatorConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig]):
    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate + - * on whole numbers, e.g. "47*23+15"."""

        def ev(node: ast.AST) -> int:
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](ev(node.left), ev(node.right))
            raise ValueError("only + - * on whole numbers")

        try:
            return str(ev(ast.parse(expression.strip(), mode="eval").body))
        except (SyntaxError, ValueError) as err:
            return f"Error: {err}"


if __name__ == "__main__":
    Calculator.run()
