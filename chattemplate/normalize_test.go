package chattemplate

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestToolCallArgumentsNormalisedAsVLLM(t *testing.T) {
	tmpl, err := Compile(`{% for m in messages %}{{ m.role }}{% if m.tool_calls is defined %}:{% for c in m.tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}{% endif %}|{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	// Long enough to go through the shared cache (minCachedElement).
	pad := strings.Repeat("p", 300)
	msgs := `[{"role":"user","content":"` + pad + `"},` +
		`{"role":"assistant","content":null,"tool_calls":[` +
		`{"id":"1","type":"function","function":{"name":"a","arguments":"{\"z\": 1, \"a\": [1.0]}"}},` +
		`{"id":"2","type":"function","function":{"name":"b","arguments":"[1, 2]"}},` +
		`{"id":"3","type":"function","function":{"name":"c","arguments":"not json"}},` +
		`{"id":"4","function":{"name":"d"}},` +
		`{"id":"5","type":"function","function":{"name":"e","arguments":{"k":"v"}}}],"pad":"` + pad + `"},` +
		`{"role":"assistant","content":"x","tool_calls":[]},` +
		`{"role":"user","content":"u","tool_calls":[{"function":{"name":"f","arguments":"{\"u\":1}"}}]}]`
	// vLLM keeps tool_calls only on assistant messages.
	want := `user|assistant:{"z": 1, "a": [1.0]};{};{};{};{"k": "v"};|assistant|user|`
	for pass := range 3 { // the second and third passes hit the cache
		got, err := tmpl.Render(Input{Messages: json.RawMessage(msgs)})
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("pass %d:\n got %s\nwant %s", pass, got, want)
		}
	}

	for _, bad := range []string{
		`[{"role":"assistant","tool_calls":[3]}]`,
		`[{"role":"assistant","tool_calls":[{"type":"code_interpreter","function":{"name":"x"}}]}]`,
		`[{"role":"assistant","tool_calls":[{"type":"function"}]}]`,
	} {
		_, err := tmpl.Render(Input{Messages: json.RawMessage(bad)})
		var ie *InputError
		if !errors.As(err, &ie) {
			t.Errorf("%s: want InputError, got %v", bad, err)
		}
	}
}

// TestMessagesRebuiltAsVLLM checks the message shape vLLM's
// parse_chat_messages hands the template: only known fields survive,
// content null is "", text parts are joined with "\n" (or, for templates
// looping over content, every content is a list of text parts).
func TestMessagesRebuiltAsVLLM(t *testing.T) {
	msgs := json.RawMessage(`[` +
		`{"role":"system","content":[{"type":"text","text":"a"},"b",{"type":"text","text":null},{"type":"input_text","text":"c"}],"extra":1},` +
		`{"role":"user","content":"hi","name":"bob","tool_calls":[{"function":{"name":"x"}}]},` +
		`{"role":"assistant","content":null,"reasoning":"why","reasoning_content":"dropped","tool_calls":null},` +
		`{"role":"tool","content":[{"type":"text","text":"r1"},{"type":"text","text":"r2"}],"tool_call_id":"c1","name":7}]`)

	str, err := Compile(`{% for m in messages %}{{ m | tojson }}
{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	if str.openaiParts {
		t.Fatal("a template printing whole messages is not an openai-format template")
	}
	got, err := str.Render(Input{Messages: msgs})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"role": "system", "content": "a\nb\nc"}
{"role": "user", "content": "hi", "name": "bob"}
{"role": "assistant", "content": "", "reasoning": "why", "reasoning_content": "why"}
{"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}
`
	if got != want {
		t.Errorf("string format:\n got %s\nwant %s", got, want)
	}

	parts, err := Compile(`{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% if m.content is string %}<{{ m.content }}>{% endif %};{% endfor %}`)
	if err != nil {
		t.Fatal(err)
	}
	if !parts.openaiParts {
		t.Fatal("a template looping over m.content takes content parts")
	}
	got, err = parts.Render(Input{Messages: msgs})
	if err != nil {
		t.Fatal(err)
	}
	// Tool messages with only text parts are joined even in this format
	// (and a loop over a string visits its characters, as in jinja2).
	if want := "[text:a][text:b][text:c];[text:hi];;[:][:][:][:][:]<r1\nr2>;"; got != want {
		t.Errorf("openai format:\n got %q\nwant %q", got, want)
	}
}
