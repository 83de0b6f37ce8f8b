"""Renders chat templates with Jinja2 exactly as Hugging Face transformers
does (`transformers.utils.chat_template_utils`: an immutable sandboxed
environment with trim_blocks, lstrip_blocks and loop controls, and its own
`tojson`, `raise_exception` and `strftime_now`), and writes the results to
tests/fixtures/chat_templates.json. kiln's minijinja rendering must give the
same text (crates/kiln-core/src/chat_template.rs, test
`renders_as_transformers_jinja2`).

    pip install jinja2==3.1.6
    python3 scripts/chat_template_reference.py

With `--render TEMPLATE_FILE` it renders that template instead, for the
conversations of a JSON object on stdin (`bos_token`, `eos_token`, `cases`:
each `messages` and `add_generation_prompt`), and prints a JSON list of the
texts (or `{"error": ...}`): how tests/released_files.rs renders the released
templates it holds kiln to, which are not in the repository.
"""

import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/chat_templates.json"


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


TEMPLATES = {
    # SmolLM2-135M-Instruct's, from its GGUF file.
    "smollm2": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    # Llama-2 style: system folded into the first turn, alternation enforced.
    "inst": "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
    # Zephyr style: one block tag per line, relying on trim/lstrip_blocks.
    "blocks": """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}""",
    # Whitespace control, namespace, filters, Python methods, loop controls, tojson.
    "helpers": """{{- bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- set ns.system = m.content | trim %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
{%- endfor %}
{%- if ns.system %}[{{ ns.system.upper() }}]{% endif %}
{%- for m in messages | selectattr('role', 'ne', 'system') %}
<{{ m.role }}>{{ m.content.split(' ') | join('_') }}{% if m.content.startswith('Wh') %}?{% endif %}{{ eos_token if loop.last }}
{%- endfor %}
roles={{ messages | map(attribute='role') | list | tojson }} turns={{ ns.turns }}
{{ messages[-1] | tojson }}
{{ {'n': [1, 'é']} | tojson(indent=2) }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}""",
    # The constructs of Qwen2.5's template (written for kiln, not copied): a
    # default system turn, branches on undefined `tools` and `tool_calls`,
    # attribute access on messages, and look-behind/ahead by loop index.
    "chatml-tools": """{%- if tools %}
    {{- '<|im_start|>system\n' + (messages[0].content if messages[0].role == 'system' else 'Default system.') }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nDefault system.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- for call in message.tool_calls %}
            {{- '\n<call>' + call.name + '</call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<result>' + message.content + '</result>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}""",
    # The constructs of Llama 3.1's template (written for kiln, not copied):
    # defaults set where a variable is undefined, `messages` reassigned, a
    # filter binding tighter than `+`, `is none` tests, header tokens.
    "header-ids": """{{- bos_token }}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = '1 Jan 2025' %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Today: ' + date_string + '\n' }}
{%- if tools is not none %}
    {{- 'Tools: ' + tools | length | string + '\n' }}
{%- endif %}
{{- '\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}""",
}

CONVERSATIONS = {
    "one": [{"role": "user", "content": "What is the capital of France?"}],
    "multi": [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Where is Paris? ça va"},
    ],
    "unalternating": [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ],
    "tool-results": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22 C"},
        {"role": "user", "content": "Thanks"},
    ],
}


def main():
    env = environment()
    cases = []
    for name, source in TEMPLATES.items():
        for conv, messages in CONVERSATIONS.items():
            for add_generation_prompt in (True, False):
                case = {
                    "template": name, "source": source, "bos_token": "<s>",
                    "eos_token": "</s>", "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                }
                try:
                    case["expected"] = env.from_string(source).render(
                        messages=messages, add_generation_prompt=add_generation_prompt,
                        bos_token="<s>", eos_token="</s>")
                except jinja2.exceptions.TemplateError as error:
                    case["error"] = str(error)
                cases.append(case)
    OUT.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


def render_file(path):
    """The `--render` mode (see the module's documentation)."""
    request = json.load(sys.stdin)
    template = environment().from_string(pathlib.Path(path).read_text())
    out = []
    for case in request["cases"]:
        try:
            out.append(template.render(
                messages=case["messages"], add_generation_prompt=case["add_generation_prompt"],
                bos_token=request["bos_token"], eos_token=request["eos_token"]))
        except jinja2.exceptions.TemplateError as error:
            out.append({"error": str(error)})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        render_file(sys.argv[2])
    else:
        main()
