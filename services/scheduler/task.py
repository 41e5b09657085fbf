"""The built-in tasks, solved with a calculator or Python tool and scored by exact answer:
`arithmetic` (word problems) and `expressions` (arithmetic said in words, "What is 47 times 23 plus
15?"). Pure and seeded, so the feed is reproducible and resumable."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = (
    "You are a math assistant that never does arithmetic in its head. First write the whole "
    "computation as <calc>EXPRESSION</calc> (or a ```python``` block that prints it) and stop; "
    "the user replies with the result. Then write <answer>NUMBER</answer>."
)


# Two worked examples: with one, SmolLM2-135M called a tool in 2 of 24 samples at T=1.0; with
# these two and T=0.7 (configs/default.yaml), in 13 of 24.
def worked_examples(*shots: tuple[str, str, int]) -> list[dict[str, str]]:
    """Few-shot turns of the tool protocol: each (question, expression, result) becomes the
    question, the `<calc>` call, its result and the answer."""
    return [
        msg
        for question, expr, result in shots
        for msg in (
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"<calc>{expr}</calc>"},
            {"role": "user", "content": f"Result: {result}"},
            {"role": "assistant", "content": f"<answer>{result}</answer>"},
        )
    ]


EXAMPLE = worked_examples(
    ("A box has 12 rows of 7 eggs and 5 loose eggs. How many eggs?", "12*7+5", 89),
    ("Ben reads 15 pages a day for 6 days, then 4 more pages. How many pages?", "15*6+4", 94),
)

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


# `expressions`: the same tool protocol on problems sized to a 135M model. Measured here with
# SmolLM2-135M-Instruct at T=0.7 (64 samples of each, 2026-11-24): the word problems are solved in
# 4 of 128 samples (the model writes a wrong expression), these in 28 of 64, with 13 of 16 groups of 4
# mixed — what GRPO needs to learn from. Two-digit products are out of reach without the tool.
EXPRESSION_EXAMPLE = worked_examples(
    ("What is 12 times 7 plus 5?", "12*7+5", 89),
    ("What is 15 times 6 minus 4?", "15*6-4", 86),
)

_EXPRESSION_TEMPLATES = [
    ("What is {a} times {b} plus {c}?", lambda a, b, c: a * b + c),
    ("What is {a} times {b} minus {c}?", lambda a, b, c: a * b - c),
    ("What is {c} plus {a} times {b}?", lambda a, b, c: c + a * b),
    ("Multiply {a} by {b} and add {c}.", lambda a, b, c: a * b + c),
    ("Multiply {a} by {b} and subtract {c}.", lambda a, b, c: a * b - c),
]


@dataclass(frozen=True)
class Task:
    prompt_id: str
    question: str
    answer: Any
    """The reference answer: an int for the built-in tasks, whatever the row holds for a file."""
    messages: tuple[dict[str, str], ...] | None = field(default=None, compare=False)
    """A dataset file's prompt as chat messages (the built-in tasks render `question` themselves)."""
    sample: dict[str, Any] | None = field(default=None, compare=False)
    """A dataset file's whole row, for the reward."""

    def row(self) -> dict[str, Any]:
        """What a reward function gets as `sample`."""
        return (
            dict(self.sample)
            if self.sample is not None
            else {"question": self.question, "answer": self.answer}
        )


def examples(dataset: str) -> list[dict[str, str]]:
    """The worked examples shown before a built-in dataset's question."""
    return EXPRESSION_EXAMPLE if dataset == "expressions" else EXAMPLE


def builtin_tasks(dataset: str, n: int, seed: int) -> list[Task]:
    if dataset == "expressions":
        return expression_tasks(n, seed)
    if dataset == "arithmetic":
        return arithmetic_tasks(n, seed)
    raise ValueError(f"no built-in dataset {dataset!r}")


def synthetic_tasks(n: int) -> list[Task]:
    """Prompt ids for `task.dataset: synthetic`; the workload draws the trajectories (synthetic_task.py)."""
    return [Task(f"w{i}", "", 0) for i in range(n)]


def expression_tasks(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks: list[Task] = []
    for i in range(n):
        template, formula = _EXPRESSION_TEMPLATES[rng.randrange(len(_EXPRESSION_TEMPLATES))]
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        question = template.format(a=a, b=b, c=c)
        tasks.append(Task(prompt_id=f"expr-{seed}-{i}", question=question, answer=formula(a, b, c)))
    return tasks


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


def solved(final_text: str, answer: int) -> bool:
    """Task success: the final answer is the right number."""
    got = extract_answer(final_text)
    return got is not None and abs(got - answer) < 1e-6


def score(final_text: str, answer: int, tool_ok: int, tool_bonus: float = 0.1) -> float:
    """1 for the right number, plus `tool_bonus` (task.tool_bonus) when a tool call succeeded."""
    return (1.0 if solved(final_text, answer) else 0.0) + (tool_bonus if tool_ok > 0 else 0.0)
