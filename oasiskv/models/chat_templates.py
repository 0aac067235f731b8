"""Chat templates for GGUF files that carry none.

Gemma 3 270M is the base model; its GGUF has no `tokenizer.chat_template`. The serving API still
needs to turn messages into a prompt, so it gets Gemma's turn format: `<start_of_turn>user ...
<end_of_turn>`, the assistant's role named `model`, and no system role (a system message is
prepended to the first user turn, as Gemma's instruction-tuned models expect).
"""

from __future__ import annotations

GEMMA_TURNS = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}"
    "{%- if message['role'] == 'user' -%}{{- ns.system -}}{%- set ns.system = '' -%}{%- endif -%}"
    "{{- message['content'] | trim -}}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

# GGUF `general.architecture` -> template used when the file has none.
FALLBACK_CHAT_TEMPLATES = {"gemma3": GEMMA_TURNS}


def developer_as_system(messages: list[dict], chat_template: str) -> list[dict]:
    """OpenAI's `developer` role (newer clients send it for `system`) for a template that does
    not know it, as vLLM renders it: each developer message becomes a system message and, where
    that leaves a system message past the first place or several of them, they are merged into
    one at the start, joined by blank lines. The template would otherwise write a turn of role
    `developer`, and add its own default system prompt besides."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    if '"developer"' in chat_template or "'developer'" in chat_template:
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    system_at = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if system_at == [0]:
        return converted
    merged = "\n\n".join(m["content"] for m in converted if m["role"] == "system" and m.get("content"))
    return [{"role": "system", "content": merged}, *(m for m in converted if m["role"] != "system")]
