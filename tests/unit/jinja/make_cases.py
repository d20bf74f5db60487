#!/usr/bin/env python3
"""make_cases.py - renders the chat-template cases with Python's jinja2 set up as Hugging Face
transformers sets it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
its tojson, raise_exception and strftime_now), and writes cases.json for test_jinja, which renders
them with common/jinja and compares byte for byte. Run it again after changing a case:

    python3 tests/unit/jinja/make_cases.py      # needs jinja2 (Debian: python3-jinja2)

Every strftime_now formats NOW in UTC; test_jinja renders with the same time, TZ=UTC.
"""
import datetime
import json
import os
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
NOW = 1764644645  # 2025-12-02 03:04:05 UTC


class Raised(Exception):
    pass


def make_env():
    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.fromtimestamp(NOW, datetime.timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


SYSTEM = {"role": "system", "content": "  You are terse.\n"}
CHATS = {
    "one": [{"role": "user", "content": "Hello!"}],
    "system": [SYSTEM, {"role": "user", "content": " What is 2+2? "}],
    "turns": [SYSTEM,
              {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": " Hello, how can I help?  "},
              {"role": "user", "content": "Tell me a joke about <|eot_id|> and \u00e9t\u00e9 \u2014 \U0001F600"}],
    "no-system": [{"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c\r\nd\n"}],
    "not-alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "thinking": [{"role": "user", "content": "q1"},
                 {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
                 {"role": "user", "content": "q2"},
                 {"role": "assistant", "content": "<think>\nagain\n</think>\nA2"},
                 {"role": "user", "content": "<tool_response>r</tool_response>"}],
    "tool": [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
             {"role": "tool", "content": "{\"temp\": 21}"},
             {"role": "user", "content": "thanks"}],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                               "required": ["city"]}}}]

TEMPLATE_CASES = {
    "llama31-style": ["one", "system", "turns", "no-system", "tool",
                      ("system", {"tools": TOOLS}), ("one", {"tools": TOOLS, "tools_in_user_message": False}),
                      ("one", {"date_string": "26 Jul 2024"}), ("one", {"add_generation_prompt": False})],
    "mistral-style": ["one", "system", "turns", "no-system", "not-alternating", ("one", {"tools": TOOLS})],
    "chatml-think-style": ["one", "system", "turns", "thinking", "tool", ("one", {"enable_thinking": False})],
    "llama2-style": ["one", "system", "turns", "no-system", "not-alternating"],
    "gemma-style": ["one", "system", "no-system", "not-alternating"],
}

# Small templates, each of one feature (vars given as JSON).
FEATURES = [
    ("{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}|{{ x }}", {}),
    ("{% if true %}{% set y = 5 %}{% endif %}{{ y }}", {}),
    ("a\n  {% if true %}\n  b\n  {% endif %}\nc\n", {}),
    ("a {# c #}\n  {# d #}\nb", {}),
    ("  {%+ if true %}x{% endif %}\n  {%- if true -%}  y  {%- endif %}  \n{{ 'z' }}\n{{- 'w' -}}\n  .", {}),
    ("{{ x }}|{{ x is defined }}|{{ not x }}|{{ x == 1 }}|{% for a in x %}A{% endfor %}|{{ x | length }}", {}),
    ("{{ d.a }}{{ d.b }}|{{ d['b'] is defined }}|{{ d.get('a') }}{{ d.get('z', 7) }}{{ d.get('z') }}", {"d": {"a": 1}}),
    ("{{ 1.0 }} {{ 0.1+0.2 }} {{ 1e20 }} {{ 1e-7 }} {{ 10/4 }} {{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }} {{ 1.5e300*10 }}", {}),
    ("{{ [1,'a',none,true,1.5,'it''s'] }} {{ {'a':1, 'b': [2]} }} {{ (1, 2) }} {{ 'x\"y' }}", {}),
    ("{{ 'ab' * 3 }} {{ 'a' ~ 1 ~ none }} {{ 'x' in 'xy' }} {{ 1 in [1,2] }} {{ 'a' + 'b' }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}", {}),
    ("{{ m | tojson }}|{{ m | tojson(indent=2) }}|{{ m | tojson(sort_keys=true, separators=(',', ':')) }}",
     {"m": {"b": [1, 2.5, "\u00e9<\n\"", {}, []], "a": None, "c": True}}),
    ("{% for k, v in d.items() %}{{k}}={{v}};{% endfor %}{% for k in d %}{{ k }}{% endfor %}{{ d.keys() | list }}{{ d.values() | list }}{{ d | items | list }}",
     {"d": {"a": 1, "b": 2}}),
    ("{{ m[::-1] }} {{ m[1:] }} {{ m[-1] }} {{ m[:-1] }} {{ m[::2] }} {{ m[5:1:-2] }} {{ 'h\u00e9llo'[1:3] }} {{ 'abc'[-1] }}",
     {"m": [1, 2, 3, 4, 5, 6]}),
    ("{{ '  a b  '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'ab'.startswith('a') }}|{{ 'ab'.endswith(('x', 'b')) }}|{{ 'xxaxx'.strip('x') }}|{{ 'xxa'.lstrip('x') }}|{{ 'ax\n'.rstrip() }}",
     {}),
    ("{{ 'Hello World'.upper() }} {{ 'Hello'.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }} {{ 'a-b-c'.replace('-', '+') }} {{ 'a-b-c'.replace('-', '', 1) }} {{ 'abc'.find('c') }} {{ ', '.join(['x', 'y']) }}",
     {}),
    ("{{ 'Hello' | upper }} {{ 'Hello' | lower }} {{ 'hello world' | title }} {{ 'hELLO' | capitalize }} {{ 'a-b' | replace('-', '+') }} {{ [3,1,3] | unique | list }} {{ [1,2] | reverse | list }} {{ 'ab' | reverse }}",
     {}),
    ("{% set ns = namespace(a=1, b='x') %}{% for i in [1,2] %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}{{ ns.b }}", {}),
    ("{{ x | default('d') }} {{ none | default('d') }} {{ '' | default('d', true) }} {{ x | d('e') }}", {}),
    ("{{ m | selectattr('role','equalto','user') | list | length }} {{ m | rejectattr('role', 'equalto', 'user') | map(attribute='role') | join(', ') }} {{ m | selectattr('x') | list }} {{ m | selectattr('x', 'undefined') | list | length }}",
     {"m": [{"role": "user"}, {"role": "x", "x": 1}, {"role": "y"}]}),
    ("{{ [1,2,3,4] | select('odd') | list }} {{ [1,2,3,4] | reject('even') | list }} {{ [0, 1, '', 'a'] | select | list }} {{ ['a','b'] | map('upper') | list }} {{ [1, 'a'] | map('string') | join('-') }}",
     {}),
    ("{% for i in [1,2,3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{% endfor %}{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}",
     {}),
    ("{% for i in [1,2,3,4] if i is even %}{{ i }}{{ loop.index }}{{ loop.previtem }}{{ loop.nextitem }};{% else %}none{% endfor %}{% for i in [] %}x{% else %}empty{% endfor %}", {}),
    ("{{ 'a' if false }}|{{ 1 if true else 2 }}|{{ 'y' if none else 'n' }}|{{ 0 or 'z' }}|{{ 1 and 2 }}|{{ [] and 1 }}", {}),
    ("{{ 3 > 2 > 1 }} {{ 1 < 2 < 2 }} {{ none is none }} {{ 'a' is string }} {{ 1 is number }} {{ {} is mapping }} {{ [] is iterable }} {{ 'a' is iterable }} {{ 1 is iterable }} {{ 2 is divisibleby 2 }} {{ 3 is odd }} {{ true is boolean }} {{ 1.5 is float }} {{ 1 is integer }} {{ 'ab' is lower }} {{ 'AB' is upper }} {{ x is not defined }} {{ 1 is sameas 1 }} {{ 'a' is in 'abc' }} {{ 1 is eq 1 }} {{ 2 is gt 1 }}",
     {}),
    ("{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1] == [1] }} {{ {'a': 1} == {'a': 1} }} {{ 'a' != 'b' }} {{ [1, 2] < [1, 3] }} {{ 'B' < 'a' }}", {}),
    ("{{ '%s' ~ 1 }} {{ -3 | abs }} {{ '42' | int + 1 }} {{ '4.5' | float }} {{ 'x' | int }} {{ 3.9 | int }} {{ 2 | float }} {{ [1, [2]] | string }} {{ none | string }} {{ true | string }}", {}),
    ("{{ 'a\nb\n\nc' | indent(2) }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent(width=1, blank=true) }}|{{ 'a\n' | indent }}", {}),
    ("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(name='c', punct='.') }}", {}),
    ("{% set blk %}x{{ 1 + 1 }}y{% endset %}[{{ blk }}]{% set t = 1, 2 %}{{ t }}", {}),
    ("{% raw %}{{ not run }}{%- endraw %}\n{%raw-%}  x {% endraw -%} y", {}),
    ("{{ strftime_now('%Y-%m-%d %H:%M:%S %b %A') }}", {}),
    ("{{ messages | length }}{{ messages[0].content | trim }}{{ (messages | first).role }}{{ (messages | last)['role'] }}",
     {"messages": [{"role": "user", "content": " x "}, {"role": "assistant", "content": "y"}]}),
    ("{{ '\\u00e9\\n\\x41\\t' }}{{ \"a'b\" }}{{ 'a\\'b' }}{{ 'adj' 'acent' }}", {}),
    ("{{ 'h\u00e9' | length }} {{ 'h\u00e9'[1] }} {{ 'h\u00e9' | list }} {{ 'x' * 0 }}{{ [1] * 0 if false else '' }}", {}),
    ("{% if a %}A{% elif b %}B{% elif c %}C{% else %}D{% endif %}", {"b": 0, "c": [1]}),
    ("{{ {'a': {'b': 1}} }}|{{ {'a': {}}|tojson }}|{{ [x] }}|{{ {'k': x} }}", {}),
    ("{% raw %}\nA{% endraw %}|x\n  {% raw %}B\n  {% endraw %}C|{% if true +%}\nD{% endif %}", {}),
    ("a\u3000{%- if true %}x{% endif %}|{{ 1 -}}\u00a0b|c\x0bd\u2028e{{ 'f\x85g' }}", {}),
    ('{{ "hello_world don\'t 1st (x) [y]" | title }}|{{ "hello_world don\'t 1st".title() }}', {}),
    ("{% for i in [] %}{% else %}{% set y = 3 %}{% endfor %}[{{ y }}]|{{ ' a b  '.split(none, 1) }}|{{ ['A', 'a', 'B', 'b'] | unique | list }}|{{ 'a\r\nb' | indent(2) }}", {}),
    ("{% for i in [1, 2] %}{% macro m() %}[{{ i }}]{% endmacro %}{{ m() }}{% endfor %}|{{ loop is defined }}", {}),
    ("{% for i in [1] %}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}|{{ none[::-1] is defined }}|{{ l[1::9223372036854775807] }}|{{ l[5:-100:-9223372036854775807] }}|{{ l[-100:100] }}|{{ l[::-3] }}",
     {"l": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}),
    ("{{ '' * 9000000000000000000 }}|{{ 'ab' * -1 }}|{{ s | length }}|{{ s | first }}|{{ s | last }}|{{ s[::-2] }}|{{ s.strip('\u00e9') }}",
     {"s": "\u00e9t\u00e9 \u2014 \U0001F600"}),
    ("{{ raise_exception('boom: ' + x) }}", {"x": "why"}),
    ("{{ x.y }}", {}),
    ("{{ x.y.z }}", {"x": {}}),
    ("{{ 1 + 'a' }}", {}),
    ("{{ 1 / 0 }}", {}),
    ("{% for a in 5 %}{% endfor %}", {}),
    ("{% set ns = 1 %}{% set ns.a = 2 %}", {}),
]

# Templates that do not parse: each must be refused with a message (test_jinja checks the
# message holds the given text).
BAD = [
    ("{% if x %}", "'endif' is missing"),
    ("{% for %}", "expected a loop variable"),
    ("{{ x | nosuchfilter }}", "no filter named 'nosuchfilter'"),
    ("{{ x is nosuchtest }}", "no test named 'nosuchtest'"),
    ("{% frobnicate %}", "unknown or unexpected tag 'frobnicate'"),
    ("{{ 'abc }}", "not closed"),
    ("{{ x ", "not closed"),
    ("{% endif %}", "unknown or unexpected tag 'endif'"),
    ("{{ (1 }}", "not closed"),
    ("{{ {'a': 1 }}", "not closed"),
    ("{{ f(a=1, 2) }}", "a positional argument after a keyword argument"),
    ("{{ 1 + }}", "an expression is missing"),
    ("{{ x $ y }}", "unexpected character"),
]


def render(env, text, variables):
    try:
        return {"output": env.from_string(text).render(**variables)}
    except Raised as e:
        return {"raised": str(e)}
    except jinja2.TemplateError as e:
        return {"error": type(e).__name__}
    except (TypeError, ZeroDivisionError, ValueError) as e:
        return {"error": type(e).__name__}


def main():
    env = make_env()
    cases = []
    for name, uses in TEMPLATE_CASES.items():
        with open(os.path.join(HERE, "templates", name + ".jinja"), encoding="utf-8") as f:
            text = f.read()
        for use in uses:
            chat, extra = (use, {}) if isinstance(use, str) else use
            variables = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
            variables.update(extra)
            case = {"name": f"{name}/{chat}" + ("+" + ",".join(sorted(extra)) if extra else ""),
                    "template_file": f"templates/{name}.jinja", "vars": variables,
                    "data": {"messages": CHATS[chat]}}
            case.update(render(env, text, dict(variables, messages=CHATS[chat])))
            cases.append(case)
    for i, (text, variables) in enumerate(FEATURES):
        case = {"name": f"feature {i}", "template": text, "vars": variables}
        case.update(render(env, text, variables))
        cases.append(case)
    for text, message in BAD:
        try:
            env.from_string(text)
            sys.exit(f"make_cases.py: jinja2 parses the bad template {text!r}")
        except jinja2.TemplateSyntaxError:
            pass
        cases.append({"name": f"bad: {text}", "template": text, "parse_error": message})
    with open(os.path.join(HERE, "cases.json"), "w", encoding="utf-8") as f:
        json.dump({"now": NOW, "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"make_cases.py: {len(cases)} cases")


if __name__ == "__main__":
    main()
