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
