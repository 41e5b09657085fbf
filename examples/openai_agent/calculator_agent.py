"""An agent written against the OpenAI chat API, trained by Libra unchanged (`configs/openai_agent.yaml`).

Libra calls `agent(sample, base_url, api_key)` once per trajectory: `base_url` is Libra's
OpenAI-compatible endpoint and `api_key` this trajectory's own key, so every call below is a turn
Libra samples, routes and trains on. The agent's loop is its own: it asks the model, runs the
calculator tool the model asked for (here, in this process), sends back the result and scores the
final answer. The same function runs against any OpenAI-compatible server (vLLM, a hosted model).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

import openai

SYSTEM = (
    "You are a math assistant that never does arithmetic in its head. First write the whole "
    "computation as <calc>EXPRESSION</calc> and stop; the user replies with the result. Then write "
    "<answer>NUMBER</answer>."
)
EXAMPLES = [
    {"role": "user", "content": "What is 12 times 7 plus 5?"},
    {"role": "assistant", "content": "<calc>12*7+5</calc>"},
    {"role": "user", "content": "Result: 89"},
    {"role": "assistant", "content": "<answer>89</answer>"},
]
STOP = ["</calc>", "</answer>"]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: + - * / on numbers, nothing else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only + - * / on numbers")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"Error: {err}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


async def agent(sample: dict[str, Any], base_url: str, api_key: str) -> float:
    return await solve(openai.AsyncOpenAI(base_url=base_url, api_key=api_key), sample)


async def solve(
    client: openai.AsyncOpenAI,
    sample: dict[str, Any],
    n: int = 1,
    pick: Callable[[list[str]], str] = lambda texts: texts[0],
) -> float:
    """The agent's loop: asks for `n` choices a call and goes on from the one `pick` takes."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        *EXAMPLES,
        {"role": "user", "content": sample["question"]},
    ]
    for _ in range(3):
        out = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=40, temperature=0.7, stop=STOP, n=n
        )
        text = pick([c.message.content or "" for c in out.choices])
        messages.append({"role": "assistant", "content": text})
        if "<answer>" in text:
            numbers = re.findall(r"-?\d+", text.split("<answer>")[-1].replace(",", ""))
            return float(bool(numbers) and int(numbers[0]) == int(sample["answer"]))
        call = re.search(r"<calc>(.*)", text, re.S)
        if call is None:
            return 0.0  # neither a tool call nor an answer
        messages.append({"role": "user", "content": f"Result: {calculator(call.group(1))}"})
    return 0.0
