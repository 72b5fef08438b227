import json, sys, glob, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import render

# Messages and tools are prepared as vLLM does before rendering (messages
# rebuilt by parse_chat_messages in the "string" content format, tool-call
# arguments parsed into mappings, tools validated and model_dump()ed), since
# kvmesh renders what the engine does.
templates = {}
for p in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "*.jinja"))):
    templates[os.path.basename(p)[:-6]] = open(p, newline="").read()

weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'later' in °C\u2028.",
    "parameters": {"type": "object", "required": ["city"], "properties": {"unit": {"type": "string", "enum": ["c", "f"], "default": "c"}, "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7.0}}}}}
search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
convs = {
 "basic": [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "Bye\n"}],
 "nosystem_ws": [{"role": "user", "content": "  lead\r\n\ttab \u00a0"}],
 "unicode": [{"role": "user", "content": "東京 😀 é\u0301 👩🏽\u200d💻 \u2028 end"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "شكراً"}],
 "tools": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c", "days": 2, "ratio": 1.0, "tags": ["<a>", "&"], "nested": {"z": None, "a": True}}}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 7.5}"}, {"role": "assistant", "content": "It is 7.5 °C."}, {"role": "user", "content": "Thanks"}],
 "two_tool_calls": [{"role": "user", "content": "Both please"},
           {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}, {"type": "function", "function": {"name": "search", "arguments": "{\"q\": \"raw string args\"}"}}]},
           {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "found"}],
 "tool_content_obj": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]}, {"role": "tool", "content": {"b": 1, "a": [1.5, "é"]}}],
 "thinking": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "\nadd again\n"}],
 "not_alternating": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
 "system_only": [{"role": "system", "content": "sys"}],
 "user_only": [{"role": "user", "content": "only"}],
}
convs["string_args"] = [{"role": "user", "content": "go"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"zürich\", \"n\": 1.0}"}},
        {"id": "b", "type": "function", "function": {"name": "search", "arguments": "not json"}},
        {"id": "c", "type": "function", "function": {"name": "get_weather"}}]},
    {"role": "tool", "content": "r1"}, {"role": "assistant", "content": "done", "tool_calls": []}, {"role": "user", "content": "ok"}]

TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}

class InputError(Exception):
    pass

def vllm_parse(messages):
    # vLLM chat_utils._parse_chat_message_content, "string" content format,
    # text-only parts; pydantic rejects content that is not str/list/None.
    out = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        reasoning = message.get("reasoning")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise InputError("message content must be a string, an array of parts or null")
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            ptype = part.get("type")
            c = part.get(TEXT_PART_KEYS[ptype])
            if ptype in ("text", "refusal") and c is None:
                continue
            texts.append(c)
        result = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if "tool_calls" in message and message["tool_calls"] is not None:
                result["tool_calls"] = list(message["tool_calls"])
            if reasoning is not None:
                result["reasoning"] = reasoning
                result["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                result["tool_call_id"] = message["tool_call_id"]
        if "name" in message and isinstance(message["name"], str):
            result["name"] = message["name"]
        if "task" in message and isinstance(message["task"], str):
            result["task"] = message["task"]
        if role == "developer":
            result["tools"] = message.get("tools", None)
        out.append(result)
    return out

def vllm_postprocess(messages):
    # vLLM chat_utils._postprocess_messages (tool-call arguments to dicts)
    for message in messages:
        if message["role"] == "assistant" and "tool_calls" in message:
            tool_calls = message.get("tool_calls")
            if not isinstance(tool_calls, list):
                continue
            if len(tool_calls) == 0:
                message.pop("tool_calls", None)
                continue
            for item in tool_calls:
                function = item.get("function")
                if content := function.get("arguments"):
                    if isinstance(content, dict):
                        parsed = content
                    else:
                        if isinstance(content, str):
                            try:
                                parsed = json.loads(content)
                            except json.JSONDecodeError:
                                parsed = None
                        else:
                            parsed = content
                        if not isinstance(parsed, dict):
                            parsed = {}
                    function["arguments"] = parsed
                else:
                    function["arguments"] = {}
    return messages

# vLLM validates tools with these pydantic models and renders model_dump():
# declared fields first (missing ones as None), extra fields after.
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
def vllm_tools(tools):
    if tools is None:
        return None
    return [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]

unordered = {"function": {"parameters": {"type": "object", "properties": {"z": {"type": "number"}, "a": {"type": "string"}}}, "strict": True, "name": "lookup"}, "x-extra": {"k": 1}}

tool_sets = {"none": None, "weather": [weather], "both": [weather, search], "unordered": [unordered, search]}
plan = [
 ("basic", "none"), ("nosystem_ws", "none"), ("unicode", "none"), ("tools", "weather"), ("tools", "both"),
 ("two_tool_calls", "both"), ("tool_content_obj", "weather"), ("thinking", "none"), ("not_alternating", "none"),
 ("system_only", "none"), ("user_only", "weather"), ("basic", "weather"), ("string_args", "both"), ("tools", "unordered"), ("user_only", "unordered"),
]
kwsets = [{"date_string": "26 Jul 2024"}, {"date_string": "01 Jan 2025", "enable_thinking": False, "tools_in_user_message": False}]
cases = []
for tname, src in templates.items():
    for conv, tools in plan:
        for agp in (True, False):
            for ki, kw in enumerate(kwsets):
                if ki == 1 and not agp:
                    continue
                c = {"template": tname, "conv": conv, "tools": tools, "add_generation_prompt": agp, "kwargs": kw}
                try:
                    msgs = vllm_postprocess(vllm_parse(json.loads(json.dumps(convs[conv]))))
                except InputError as e:
                    c["error"] = "InputError: " + str(e)
                    cases.append(c)
                    continue
                v = {"messages": msgs, "tools": vllm_tools(tool_sets[tools]), "documents": None,
                     "add_generation_prompt": agp, "bos_token": "<s>", "eos_token": "</s>", **kw}
                res = render(src, v)
                c.update(res)
                cases.append(c)
json.dump({"templates": templates, "conversations": convs, "tool_sets": tool_sets, "cases": cases}, sys.stdout, ensure_ascii=False, indent=1)
