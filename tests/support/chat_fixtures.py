"""Chat templates of each family for the chat front end's tests (no tests here).

Hermes and think are the tiny model's own (tools/make_tiny_gguf.py). The Llama 3.x and
Mistral ones are small templates of our own in the shape of those models' templates: the
parts that matter here (header tokens and the ``ipython`` role, ``[TOOL_CALLS]``, where the
tools go and how a call is written back), not their full text.
"""

from __future__ import annotations

from harness.make_tiny_gguf import CHATML_TEMPLATE, HERMES_TEMPLATE, THINK_TEMPLATE

from model_runtime.chat.formats import ChatFormat, detect_format
from model_runtime.chat.templates import ChatTemplate

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}"
    "{%- endif %}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}"
    "{%- if tools and not tools_in_user_message %}"
    "{{- '\\n\\nCall a function with JSON {\"name\": name, \"parameters\": {...}}:\\n' }}"
    "{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' "
    "+ (c.function.arguments | tojson) + '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == user_messages[-1] %}"
    "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{{- '[TOOL_CALLS][' }}{%- for c in m.tool_calls %}"
    "{%- if c.id | length != 9 %}{{- raise_exception('Tool call IDs must be 9 characters') }}"
    "{%- endif %}"
    "{{- (c.function | tojson)[:-1] + ', \"id\": \"' + c.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif m.role == 'assistant' %}{{- m.content + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + (m.content | tojson) + ', \"call_id\": \"' "
    "+ m.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- elif m.role == 'system' %}{%- else %}"
    "{{- raise_exception('Only user, assistant and tool roles are supported') }}"
    "{%- endif %}{%- endfor %}"
)

SOURCES = {"chatml": CHATML_TEMPLATE, "hermes": HERMES_TEMPLATE, "think": THINK_TEMPLATE,
           "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def template(name: str) -> tuple[ChatTemplate, ChatFormat]:
    source = SOURCES[name]
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>"), detect_format(source)
