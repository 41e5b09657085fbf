"""A verifiers (0.4) taskset written against verifiers' own API, trained by Libra unchanged
(`configs/verifiers_example.yaml`): sums, a calculator tool served over MCP, and the task's own
reward (the `\\boxed{}` answer, else the last number, equals the reference). Libra loads it by id
(`task.dataset: {verifiers: arithmetic_taskset}`), as `vf-eval` would."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from arithmetic_tools import Calculator, CalculatorConfig


class ArithmeticData(vf.TaskData):
    answer: str = ""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(CalculatorConfig())]

    @vf.reward
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        """The `\\boxed{}` answer, else the reply's last number, equals the reference."""
        reply = trace.last_reply or ""
        boxed = vf.extract_boxed_answer(reply).strip() if "\\boxed" in reply else ""
        numbers = re.findall(r"-?\d+", reply)
        return float((boxed or (numbers[-1] if numbers else "")) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ArithmeticTasksetConfig(vf.TasksetConfig):
    size: int = 64
    seed: int = 0


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticTasksetConfig]):
    def load(self) -> Iterator[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(2, 60), rng.randint(2, 40)
            question = f"What is {a} plus {b}? Answer with \\boxed{{NUMBER}}."
            yield ArithmeticTask(ArithmeticData(prompt=question, answer=str(a + b)), self.config.task)


__all__ = ["ArithmeticTaskset"]
