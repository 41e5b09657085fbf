"""Tokenisation of the agent's conversation so that the trained sequence is exactly what was sampled.

Generated tokens are kept as sampled; only the text the environment adds (the prompt and each tool
observation) is tokenised here. Observations are appended in the model's chat format (ChatML for
SmolLM2), closing the assistant turn first if the model did not end it itself.
"""

from __future__ import annotations

from typing import Any

from services.scheduler.task import SYSTEM_PROMPT, Task, examples


class Prompter:
    def __init__(self, tokenizer: Any, dataset: object = "arithmetic", worked_examples: int = 2):
        self.tok = tokenizer
        shots = examples(dataset) if isinstance(dataset, str) else []
        self.examples = shots[: 4 * worked_examples]  # four messages each: question, call, result, answer
        self.chatml = "<|im_start|>" in tokenizer.get_vocab()
        self.eos_id = tokenizer.eos_token_id

    def prompt_ids(self, task: Task) -> list[int]:
        messages = (
            list(task.messages)
            if task.messages is not None
            else [
                {"role": "system", "content": SYSTEM_PROMPT},
                *self.examples,
                {"role": "user", "content": task.question},
            ]
        )
        return self.render(messages)

    def render(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Chat messages (or one user message's text) in the model's chat template, ready for the
        assistant's turn."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def observation_ids(self, text: str, ended_with_eos: bool) -> list[int]:
        if self.chatml:
            closing = "" if ended_with_eos else "<|im_end|>"
            rendered = f"{closing}\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        else:
            rendered = f"\nUser: {text}\nAssistant:"
        return [int(t) for t in self.tok(rendered, add_special_tokens=False)["input_ids"]]
