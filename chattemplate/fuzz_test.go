package chattemplate

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/ardanlabs/jinja"
)

// qwen25Template is Qwen2.5-Instruct's chat template (tools, tool calls,
// tool responses), laid out on several lines; jinja's whitespace control
// makes the layout irrelevant to the output.
const qwen25Template = `{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
`

func TestQwenTemplateToolCall(t *testing.T) {
	tmpl, err := Compile(qwen25Template)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tmpl.Render(Input{
		Messages: json.RawMessage(`[{"role":"user","content":"Weather?"},{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"w","arguments":{"unit":"c","city":"Zürich","n":1.0}}}]},{"role":"tool","content":"7.5"}]`),
		Tools:    json.RawMessage(`[{"type":"function","function":{"name":"w"}}]`),
	})
	if err != nil {
		t.Fatal(err)
	}
	want := "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" +
		`{"type": "function", "function": {"name": "w", "description": null, "parameters": null}}` +
		"\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" +
		"<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n" +
		`{"name": "w", "arguments": {"unit": "c", "city": "Zürich", "n": 1.0}}` +
		"\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n7.5\n</tool_response><|im_end|>\n"
	if got != want {
		t.Errorf("%s", diffContext(got, want))
	}
}

// compileNatives compiles the templates natives renders: Llama 3's and
// Qwen2.5's.
func compileNatives(tb testing.TB) (llama3, qwen *Template) {
	llama3, err := Compile(llama3Template)
	if err != nil {
		tb.Fatal(err)
	}
	if qwen, err = Compile(qwen25Template); err != nil {
		tb.Fatal(err)
	}
	return llama3, qwen
}

// FuzzRender feeds arbitrary messages JSON to real templates: the renderer
// must return a prompt or an error, never panic.
func FuzzRender(f *testing.F) {
	llama3, qwen := compileNatives(f)
	seeds := []string{
		`[{"role":"system","content":"s"},{"role":"user","content":"hi"}]`,
		`[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":{"a":[1,2.5,{"b":null}]}}}]},{"role":"tool","content":"r"},{"role":"tool","content":"r2"}]`,
		`[{"role":"assistant","tool_calls":"notalist"}]`,
		`[{"role":"assistant","tool_calls":[1,"a",null]}]`,
		`[{"role":"user","content":[{"type":"text","text":"a"}]}]`,
		`[{"role":"tool"}]`,
		`[]`,
		`[{"role":"user","content":7}]`,
		`{"role":"user"}`,
		`[{"role":"user","content":"\ud800\u00e9 \"q\" \u2028"}]`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), []byte(`[{"type":"function","function":{"name":"f"}}]`), true, false)
		f.Add([]byte(s), []byte(nil), false, true)
	}
	f.Fuzz(func(t *testing.T, messages, tools []byte, genPrompt, cont bool) {
		in := Input{
			Messages:             messages,
			Tools:                tools,
			AddGenerationPrompt:  genPrompt,
			ContinueFinalMessage: cont,
			BOSToken:             "<s>",
			EOSToken:             "</s>",
		}
		for _, tmpl := range []*Template{llama3, qwen} {
			out, err := tmpl.Render(in)
			if err != nil && out != "" {
				t.Fatalf("error %v with output %q", err, out)
			}
			if err != nil && strings.Contains(err.Error(), "panic") {
				t.Fatalf("engine panicked: %v", err)
			}
			// The cached path (fuzzCache caches every element) must render
			// what the uncached one does.
			cached, cold := *tmpl, *tmpl
			cached.values, cold.values = fuzzCache, nil
			for pass := range 2 {
				got, gerr := cached.Render(in)
				want, werr := cold.Render(in)
				if got != want || (gerr == nil) != (werr == nil) {
					t.Fatalf("pass %d: cached render %q, %v; uncached %q, %v", pass, got, gerr, want, werr)
				}
			}
		}
	})
}

// FuzzDecodeJSON checks the hand-written request decoder against
// encoding/json: same verdict on validity, same values (strings with the
// same U+FFFD replacements, ints and floats as the number text says).
func FuzzDecodeJSON(f *testing.F) {
	for _, s := range []string{
		`{"a":1,"b":[true,false,null],"c":{"d":-1.5e3}}`, `"\ud83d\ude00\ud800x\u00e9"`, `[1,]`, `01`, `-`, `1.`,
		`{"a" 1}`, "\"\xff\xfe\"", `1e999`, `[1, "a\\\"b", {"x":[2]}, true, null]`, `[1 2]`, `["\\\\"]`, `[{"a":1},]`, `123456789012345678901234`, `"\/\b\f\n\r\t"`, ` [ ] `, `{"a":1,"a":2}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if nesting(data) > maxJSONDepth-2 {
			return // depth limits differ on purpose
		}
		got, err := decodeJSON(string(data))
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		var want any
		werr := dec.Decode(&want)
		if werr == nil {
			if _, tokErr := dec.Token(); tokErr == nil || !errors.Is(tokErr, io.EOF) {
				werr = errors.New("trailing data")
			}
		}
		if (err == nil) != (werr == nil) {
			t.Fatalf("validity differs for %q: ours %v, encoding/json %v", data, err, werr)
		}
		if err == nil {
			if ok, why := sameValue(got, want); !ok {
				t.Fatalf("value differs for %q: %s", data, why)
			}
		}
		// The element-wise cached path must agree with the whole decode,
		// on a first (miss) and a second (hit) pass.
		for pass := range 2 {
			cached, cerr := fuzzCache.decodeArray(data)
			if (cerr == nil) != (err == nil) {
				t.Fatalf("pass %d: cached path validity differs for %q: %v vs %v", pass, data, cerr, err)
			}
			if err == nil && !cached.Equals(got) {
				t.Fatalf("pass %d: cached path value differs for %q", pass, data)
			}
		}
	})
}

// fuzzCache caches every element, however small, and evicts often.
var fuzzCache = newValueCache(4<<10, 0)

func nesting(data []byte) int {
	n := 0
	for _, c := range data {
		if c == '[' || c == '{' {
			n++
		}
	}
	return n
}

func sameValue(v jinja.Value, w any) (bool, string) {
	switch w := w.(type) {
	case nil:
		return v.IsNone(), "null"
	case bool:
		return v.IsBool() && v.AsBool() == w, "bool"
	case string:
		return v.IsString() && v.AsString() == w, strconv.Quote(w)
	case json.Number:
		s := string(w)
		if !strings.ContainsAny(s, ".eE") {
			if n, err := w.Int64(); err == nil {
				return v.IsInt() && v.AsInt() == n, "int " + s
			}
		}
		f, _ := strconv.ParseFloat(s, 64)
		if !v.IsFloat() {
			return false, "float " + s
		}
		return v.AsFloat() == f || (math.IsInf(f, 0) && math.IsInf(v.AsFloat(), 0)), "float " + s
	case []any:
		if !v.IsList() || v.AsList().Len() != len(w) {
			return false, "list length"
		}
		for i := range w {
			if ok, why := sameValue(v.AsList().Get(i), w[i]); !ok {
				return false, why
			}
		}
		return true, ""
	case map[string]any:
		if !v.IsDict() || v.AsDict().Len() != len(w) {
			return false, "dict size"
		}
		for k, wv := range w {
			gv, ok := v.AsDict().Get(k)
			if !ok {
				return false, "missing key " + k
			}
			if ok, why := sameValue(gv, wv); !ok {
				return false, why
			}
		}
		return true, ""
	}
	return false, "unexpected type"
}

// FuzzCompile feeds arbitrary template source (model files are outside
// input too): Compile and Render return errors, never panic.
func FuzzCompile(f *testing.F) {
	for _, s := range []string{llama3Template, qwen25Template, "{% raw %}{{ x }}{%- endraw +%}", "{{- x | tojson(indent=2) -}}\r\n{#+ c -#}",
		"{% for m in messages %}{{ m }}\n{% endfor %}", "{% if %}", "{{ 'unterminated }}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, src string) {
		if strings.Contains(src, "macro") || strings.Contains(src, "call") ||
			strings.Contains(src, "range") || strings.Contains(src, "*") || strings.Count(src, "for") > 2 {
			// Template source is operator configuration, and some of it can
			// run without bound: a macro that calls itself overflows the Go
			// stack (jinja v1.8.0 has no recursion limit), range(10**9),
			// 'x' * 10**9 or deeply nested loops take as long as they say.
			// Those are documented, not fuzzed.
			return
		}
		in := Input{Messages: json.RawMessage(`[{"role":"user","content":"hi"}]`), Tools: json.RawMessage(`[{"a":1.0}]`)}
		var outs [2]string
		var errs [2]error
		for i, direct := range []bool{true, false} {
			tmpl, err := compile(src, direct)
			if err != nil {
				return
			}
			outs[i], errs[i] = tmpl.Render(in)
			if errs[i] != nil && outs[i] != "" {
				t.Fatalf("error %v with output %q", errs[i], outs[i])
			}
		}
		// Direct output must not change what is rendered.
		if (errs[0] == nil) != (errs[1] == nil) || outs[0] != outs[1] {
			t.Fatalf("direct mode differs for %q:\n direct: %q, %v\n jinja:  %q, %v", src, outs[0], errs[0], outs[1], errs[1])
		}
	})
}
