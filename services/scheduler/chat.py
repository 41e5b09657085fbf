"""Chat messages in the model's own chat template, token-exact across turns.

A trajectory's context is its prompt, then each turn's tokens as sampled and what came back between
turns. What comes back (a tool's result, the user's next message) is rendered by the tokenizer's own
template as the continuation of a conversation whose last message is the assistant's: the text the
template adds after a fixed conversation ending in an assistant message, so that the messages get
the template's own roles and markers (a `tool` role where it has one) while the sampled tokens are
never re-tokenised. The assistant's closing marker is kept unless the model sampled it itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]

_MARK = "LIBRA_ASSISTANT_TURN_7f3a"
"""The assistant's content in the fixed conversation: text no template adds on its own."""
_BASES: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": _MARK},
    ],
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}],  # no system role
)


class TemplateError(ValueError):
    """The tokenizer's chat template cannot render these messages as a continuation (it has none,
    refuses a role, or rewrites earlier messages once more follow)."""


class ChatTemplate:
    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_text = tokenizer.eos_token or ""

    def text(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, generation: bool = True
    ) -> str:
        if not self.has_template:
            raise TemplateError("the tokenizer has no chat template")
        try:
            out = self.tok.apply_chat_template(
                [dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=generation,
                tokenize=False,
            )
        except Exception as err:  # jinja raises what the template's author chose (TemplateError, ...)
            raise TemplateError(f"the chat template refused these messages: {err}") from None
        return str(out)

    def ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]]

    def render(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> list[int]:
        """The whole conversation, ready for the assistant's turn."""
        return self.ids(self.text(messages, tools))

    def continuation(self, messages: Sequence[Message], ended_with_eos: bool) -> str:
        """The text that follows an assistant turn: its closing marker (unless the model sampled
        the end of turn itself), then `messages` in the template, then the next assistant header."""
        last: TemplateError | None = None
        for base in _BASES:
            try:
                before = self.text(base, generation=False)
                after = self.text([*base, *messages], generation=True)
            except TemplateError as err:
                last = err
                continue
            if not after.startswith(before):
                raise TemplateError(
                    "the chat template renders earlier messages differently once more follow; "
                    "the sampled turns could not be kept token for token"
                )
            closing = before[before.rindex(_MARK) + len(_MARK) :]
            if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
                closing = closing[len(self.eos_text) :]
            return closing + after[len(before) :]
        raise last or TemplateError("the chat template cannot render a continuation")

    def continuation_ids(self, messages: Sequence[Message], ended_with_eos: bool) -> list[int]:
        return self.ids(self.continuation(messages, ended_with_eos))
