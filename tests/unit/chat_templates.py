"""Three chat-template families as test tokenizers, built on the tiny model's (SmolLM2's) vocabulary:
ChatML as SmolLM2 ships it, a Llama-3 style template with its own header and end-of-turn tokens, and
a Qwen2.5 style template with tools in the system message and a `tool` role rendered as
`<tool_response>` blocks inside a user turn."""

from __future__ import annotations

import copy
from typing import Any

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

QWEN_TOOLS = (
    r"{%- if tools %}{{- '<|im_start|>system\n' }}"
    r"{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    r"{{- '# Tools\n<tools>' }}{%- for t in tools %}{{- '\n' }}{{- t | tojson }}{%- endfor %}"
    r"{{- '\n</tools><|im_end|>\n' }}"
    r"{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    r"{%- endif %}"
    r"{%- for m in messages %}"
    r"{%- if m.role == 'system' %}"
    r"{%- elif m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    r"{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    r"{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + m.content }}"
    r"{%- for c in m.tool_calls %}"
    r"""{{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' }}"""
    r"{{- c.function.arguments | tojson }}{{- '}\n</tool_call>' }}"
    r"{%- endfor %}{{- '<|im_end|>\n' }}"
    r"{%- elif m.role == 'tool' %}"
    r"{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    r"{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def families(chatml: Any) -> dict[str, Any]:
    """`chatml` (SmolLM2's tokenizer) and two copies of it with the other templates."""
    llama = copy.deepcopy(chatml)
    llama.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ]
        }
    )
    llama.bos_token, llama.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    llama.chat_template = LLAMA3
    qwen = copy.deepcopy(chatml)
    qwen.chat_template = QWEN_TOOLS
    return {"chatml": chatml, "llama3": llama, "qwen-tools": qwen}
