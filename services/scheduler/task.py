"""The built-in task: arithmetic word problems, solved with a calculator or Python tool, scored by
exact answer. Pure and seeded, so the feed is reproducible and resumable."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are a math assistant that never does arithmetic in its head. First write the whole "
    "computation as <calc>EXPRESSION</calc> (or a ```python``` block that prints it) and stop; "
    "the user replies with the result. Then write <answer>NUMBER</answer>."
)

# Two worked examples: with one, SmolLM2-135M called a tool in 2 of 24 samples at T=1.0; with
# these two and T=0.7 (configs/default.yaml), in 13 of 24.
EXAMPLE = [
    {"role": "user", "content": "A box has 12 rows of 7 eggs and 5 loose eggs. How many eggs?"},
    {"role": "assistant", "content": "<calc>12*7+5</calc>"},
    {"role": "user", "content": "Result: 89"},
    {"role": "assistant", "content": "<answer>89</answer>"},
    {"role": "user", "content": "Ben reads 15 pages a day for 6 days, then 4 more pages. How many pages?"},
    {"role": "assistant", "content": "<calc>15*6+4</calc>"},
    {"role": "user", "content": "Result: 94"},
    {"role": "assistant", "content": "<answer>94</answer>"},
]

_TEMPLATES = [
    ("{name} has {a} apples and buys {b} bags of {c} apples. How many apples does {name} have now?", "a+b*c"),
    (
        "A shelf holds {a} books. {name} adds {b} boxes with {c} books each, then removes {d}. How many books?",
        "a+b*c-d",
    ),
    (
        "{name} earns {a} dollars a day for {b} days and spends {c} dollars. How many dollars are left?",
        "a*b-c",
    ),
    ("A train travels {a} km per hour for {b} hours, then {c} km more. How far did it go in total?", "a*b+c"),
    (
        "{name} splits {a} candies equally among {b} friends, {c} each, and keeps the rest. How many are kept?",
        "a-b*c",
    ),
]
_FORMULAS = {
    "a+b*c": lambda a, b, c, d: a + b * c,
    "a+b*c-d": lambda a, b, c, d: a + b * c - d,
    "a*b-c": lambda a, b, c, d: a * b - c,
    "a*b+c": lambda a, b, c, d: a * b + c,
    "a-b*c": lambda a, b, c, d: a - b * c,
}
_NAMES = ["Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Zoe", "Ivan"]


@dataclass(frozen=True)
class Task:
    prompt_id: str
    question: str
    answer: int


def arithmetic_tasks(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks: list[Task] = []
    for i in range(n):
        template, formula = _TEMPLATES[rng.randrange(len(_TEMPLATES))]
        b, c = rng.randint(2, 9), rng.randint(2, 12)
        # a-b*c must stay positive: a starts above b*c (up to 108), so its range grows with b*c
        a = rng.randint(b * c + 1, max(99, b * c + 9)) if formula.startswith("a-") else rng.randint(10, 99)
        d = rng.randint(1, 9)
        values = {"a": a, "b": b, "c": c, "d": d}
        answer = _FORMULAS[formula](a, b, c, d)
        question = template.format(name=rng.choice(_NAMES), **values)
        tasks.append(Task(prompt_id=f"arith-{seed}-{i}", question=question, answer=answer))
    return tasks


_ANSWER = re.compile(r"<answer>\s*(-?[\d,]+(?:\.\d+)?)\s*</answer>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> float | None:
    """The <answer> tag if present, else the last number in the text."""
    m = _ANSWER.search(text)
    raw = m.group(1) if m else (_NUMBER.findall(text) or [None])[-1]
    if raw is None:
        return None
    try:
        return float(raw.replace(",", ""))
    except ValueError:
        return None


def score(final_text: str, answer: int, tool_ok: int) -> float:
    """1 for the right number, plus 0.1 shaping when at least one tool call succeeded."""
    got = extract_answer(final_text)
    correct = got is not None and abs(got - answer) < 1e-6
    return (1.0 if correct else 0.0) + (0.1 if tool_ok > 0 else 0.0)
