"""Chat templates with tool support, written for the tests, and a tiny model that uses one.

HERMES_TEMPLATE follows the layout of the Qwen2.5 / Hermes family (tools listed as JSON lines in
`<tools>`, calls as `<tool_call>{"name", "arguments"}</tool_call>`, answers in
`<tool_response>`); LLAMA3_JSON_TEMPLATE the Llama 3 one (a call is the whole answer, a JSON
object with "name" and "parameters").
"""

from __future__ import annotations

import json
import os
import shutil

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}Functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call: <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}
{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant
{% if m['content'] %}{{ m['content'] }}
{% endif %}{% for call in m['tool_calls'] %}<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": \
{{ call['function']['arguments'] | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_JSON_TEMPLATE = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Call one as {"name": ..., "parameters": {...}}. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>

{% if m.get('tool_calls') %}{% for call in m['tool_calls'] %}{"name": \
"{{ call['function']['name'] }}", "parameters": {{ call['function']['arguments'] | tojson }}}\
{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def with_chat_template(model_dir: str, dst: str, template: str,
                       max_positions: int = 2048) -> str:
    """A copy of the tiny model directory `model_dir` at `dst` whose tokenizer uses
    `template`, with a longer context: the tiny tokenizer spends about a token per character
    of the rendered tool definitions."""
    shutil.copytree(model_dir, dst)
    for name, key, value in (("tokenizer_config.json", "chat_template", template),
                             ("config.json", "max_position_embeddings", max_positions)):
        path = os.path.join(dst, name)
        with open(path) as f:
            cfg = json.load(f)
        cfg[key] = value
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dst
