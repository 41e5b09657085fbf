"""Tokenisation of the agent's conversation so that the trained sequence is exactly what was sampled.

Generated tokens are kept as sampled; only the text the environment adds (the prompt and each
observation) is tokenised here, in the model's own chat template (`chat.py`): an observation is a
user message continuing the conversation, the assistant's turn closed first if the model did not
end it itself. A tokenizer without a chat template gets plain `User:` / `Assistant:` text.
"""

from __future__ import annotations

from typing import Any

from services.scheduler.chat import ChatTemplate
from services.scheduler.task import SYSTEM_PROMPT, Task, examples


class Prompter:
    def __init__(self, tokenizer: Any, dataset: object = "arithmetic", worked_examples: int = 2):
        self.tok = tokenizer
        self.chat = ChatTemplate(tokenizer)
        shots = examples(dataset) if isinstance(dataset, str) else []
        self.examples = shots[: 4 * worked_examples]  # four messages each: question, call, result, answer
        self.eos_id = tokenizer.eos_token_id

    def ended_with_eos(self, token_ids: list[int], finish_reason: str) -> bool:
        """A turn of `token_ids` that ended `finish_reason` closed itself with the model's EOS (its
        continuation then does not close it again)."""
        return finish_reason == "stop" and bool(token_ids) and token_ids[-1] == self.eos_id

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
        if not self.chat.has_template:
            return self.chat.ids(
                "".join(f"{m['role'].title()}: {m['content']}\n" for m in messages) + "Assistant:"
            )
        return self.chat.render(messages)

    def observation_ids(self, text: str, ended_with_eos: bool) -> list[int]:
        """What the model sees after its turn: `text` as the user's next message."""
        if not self.chat.has_template:
            return self.chat.ids(f"\nUser: {text}\nAssistant:")
        return self.chat.continuation_ids([{"role": "user", "content": text}], ended_with_eos)
