import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import render
V = {"messages": [{"role": "system", "content": "You are X."}, {"role": "user", "content": "  hi\n there  "},
                  {"role": "assistant", "content": "<think>\nr\n</think>\n\nok", "tool_calls": [{"function": {"name": "f", "arguments": {"b": 1, "a": [1.5, None]}}}]},
                  {"role": "user", "content": [{"type": "text", "text": "part1"}, {"type": "image"}, {"type": "text", "text": "part2"}]}],
     "d": {"z": 1, "a": 2.0, "m": None}, "x": None, "n": 7, "f": 2.5, "s": "a,b,,c", "tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}]}
snips = r"""{{ messages | length }}
{{ messages[-1].role }}
{{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{{ messages | map(attribute='role') | join(',') }}
{% for m in messages %}{{ m.content is string }},{% endfor %}
{{ 'x' in 'xyz' }}|{{ 'q' not in 'xyz' }}
{% for m in messages %}{{ loop.length }}{{ loop.revindex }}{{ loop.first }}{% endfor %}
{{ messages[2].content.split('</think>')[-1].lstrip('\n') }}
{{ messages[2].content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') }}
{{ messages[3]['content'][0]['text'] }}
{% for item in messages[3].content %}{% if item.type == 'text' %}{{ item.text }}{% endif %}{% endfor %}
{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}
{{ d | dictsort }}
{{ "%s-%d" | format('a', 3) }}
{{ x | default('dflt') }}|{{ undefined_thing | default('dflt') }}|{{ x | default('dflt', true) }}
{{ d.nope is defined }}|{{ d.z is defined }}
{{ range(3) | list }}
{{ [1, 2, 3][1:] }}|{{ 'abc'[::-1] }}|{{ messages[::-1][0].role }}
{{ 'Hello' | upper }}|{{ 'Hello' | lower }}|{{ 'hello world' | title }}|{{ 'hello' | capitalize }}
{{ 3 // 2 }}|{{ 7 % 3 }}|{{ 2 ** 3 }}|{{ 'a' * 3 }}|{{ 7 / 2 }}|{{ 4 / 2 }}|{{ n * f }}|{{ n - 10 }}
{{ none is none }}|{{ true and false }}|{{ not x }}|{{ [] | length == 0 }}|{{ x is none }}
{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}
{{ messages[1].content | trim | replace('\n', ' ') }}
{{ 1.5 | round }}|{{ 2.567 | round(2) }}|{{ -3 | abs }}|{{ 2.5 | int }}|{{ '3' | int + 1 }}|{{ 3 | float }}
{{ s.split(',') }}|{{ 'a b  c'.split() }}|{{ '  x  '.strip() }}|{{ '--x--'.strip('-') }}
{{ messages[0].content.startswith('You') }}|{{ messages[0].content.endswith('.') }}
{{ 'x' if n > 3 else 'y' }}|{{ [1, 2] + [3] }}|{{ d.get('q', 'z') }}|{{ d.get('z') }}
{{ d.keys() | list }}|{{ d.values() | list }}|{{ d | length }}
{{ 'abc'.replace('b', 'X') }}|{{ 'AbC'.lower() }}|{{ 'abc'.upper() }}|{{ 'abcb'.count('b') }}|{{ 'abc'.find('c') }}
{% for m in messages if m.role != 'system' %}{{ m.role }},{% endfor %}
{{ messages | selectattr('role', 'eq', 'user') | map(attribute='role') | list }}
{% macro f(v, w='dw') %}[{{ v }}/{{ w }}]{% endmacro %}{{ f('a') }}{{ f('b', w='c') }}
{{ tools | tojson(indent=2) }}
{{ d is mapping }}|{{ messages is iterable }}|{{ 'a' is string }}|{{ 1 is number }}|{{ f is float }}|{{ n is integer }}|{{ x is defined }}
{{ messages[2].tool_calls[0].function.arguments | tojson }}
{{ messages[2].tool_calls[0].function.arguments }}
{{ d }}|{{ d.a }}|{{ d.m }}
{{ n ~ '|' ~ f ~ '|' ~ x }}
{{ messages | first | attr('role') if false else (messages | first).role }}|{{ (messages | last).role }}
{{ [3, 1, 2] | sort }}|{{ ['b', 'a'] | sort | join }}|{{ [1, 1, 2] | unique | list }}|{{ [1, 2] | reverse | list }}|{{ [1, 2, 3] | sum }}|{{ [4, 2] | max }}|{{ [4, 2] | min }}
{{ messages | rejectattr('role', 'equalto', 'system') | list | length }}
{{ "He said \"hi\"" }}|{{ 'it\'s' }}
{{ 'a\tb' }}|{{ '\u00e9' }}
{% set content = messages[1].content %}{{ content | trim }}|{{ content | length }}
{{ messages[1]['content'].strip() | wordcount }}
{{ '%d items' % 3 }}|{{ '%s and %s' % ('a', 'b') }}
{{ x.y }}|{{ x['y'] }}
{{ n | string + 'x' }}|{{ f | string }}
{{ 'x'.join(['a', 'b']) }}
{{ [1, [2, 3]] | tojson(separators=(',', ':')) }}
{{ 'abc' | list }}|{{ 'abc' | length }}|{{ d | list }}
{% if messages %}yes{% endif %}|{% if d %}d{% endif %}|{% if 0.0 %}z{% else %}nz{% endif %}
{{ messages[1:3] | length }}|{{ messages[-2:] | map(attribute='role') | join('+') }}
{% for i in range(2) %}{% for j in range(2) %}{% if j == 1 %}{% break %}{% endif %}{{ i }}{{ j }}{% endfor %}{% endfor %}
{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}
{{ raise_exception('custom ' ~ n) if n > 100 else 'noraise' }}
{{ "multi\nline" | indent(2) }}|{{ "a\nb" | indent(2, true) }}
{{ [1.0, 2.50, 1e-7] }}|{{ 1e-7 }}|{{ 100000000000000000.0 }}
""".strip("\n").split("\n") + ["{%- for m in messages -%}\n  {{ m.role }}\n{%- endfor %}\n{% for m in messages %}\n  {{ m.role }}\n{% endfor %}"]
from typing import Any, Literal
from pydantic import BaseModel, ConfigDict
class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")
class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition
# tools are rendered as vLLM passes them (pydantic model_dump), the stored
# vars keep the request form.
RV = dict(V, tools=[ChatCompletionToolsParam.model_validate(t).model_dump() for t in V["tools"]])
out = []
for s in snips:
    r = render(s, RV)
    out.append({"src": s, **r})
json.dump({"vars": V, "cases": out}, sys.stdout, ensure_ascii=False, indent=1)
