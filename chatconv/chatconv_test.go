package chatconv

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// testCase is one testdata file: a request body, what vLLM derives from it
// (worked out by reading vLLM's conversion code, see the package doc), and
// optionally the chat-completions request a client would send for the same
// conversation (render_test.go).
type testCase struct {
	Note string          `json:"note"`
	Body json.RawMessage `json:"body"`
	Want struct {
		Model                string          `json:"model"`
		Messages             json.RawMessage `json:"messages"`
		Tools                json.RawMessage `json:"tools"`
		ToolChoice           json.RawMessage `json:"tool_choice"`
		AddGenerationPrompt  bool            `json:"add_generation_prompt"`
		ContinueFinalMessage bool            `json:"continue_final_message"`
		TemplateKwargs       json.RawMessage `json:"template_kwargs"`
		Stream               bool            `json:"stream"`
		MaxOutputTokens      int             `json:"max_output_tokens"`
		PreviousResponseID   string          `json:"previous_response_id"`
		Store                bool            `json:"store"`
	} `json:"want"`
	Chat *struct {
		Messages             json.RawMessage `json:"messages"`
		Tools                json.RawMessage `json:"tools"`
		Kwargs               json.RawMessage `json:"chat_template_kwargs"`
		AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
		ContinueFinalMessage bool            `json:"continue_final_message"`
	} `json:"chat"`
}

// loadCases reads testdata/<prefix>_*.json.
func loadCases(t testing.TB, prefix string) map[string]testCase {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", prefix+"_*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata for %s: %v", prefix, err)
	}
	cases := map[string]testCase{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var c testCase
		if err := json.Unmarshal(data, &c); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		cases[strings.TrimSuffix(filepath.Base(f), ".json")] = c
	}
	return cases
}

func converter(prefix string) func([]byte) (Chat, error) {
	if prefix == "responses" {
		return FromResponses
	}
	return FromMessages
}

// compact returns raw without insignificant whitespace; JSON null and
// absence both compact to "null".
func compact(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	if len(raw) == 0 {
		return "null"
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		t.Fatalf("invalid JSON %q: %v", raw, err)
	}
	return b.String()
}

// TestTestdata holds each conversion to the messages, tools and arguments
// vLLM derives, byte for byte after compaction (key order included: the
// templates print tools and arguments with tojson).
func TestTestdata(t *testing.T) {
	for _, prefix := range []string{"responses", "messages"} {
		for name, c := range loadCases(t, prefix) {
			t.Run(name, func(t *testing.T) {
				got, err := converter(prefix)(c.Body)
				if err != nil {
					t.Fatal(err)
				}
				w := c.Want
				for _, f := range []struct {
					name      string
					got, want json.RawMessage
				}{
					{"messages", got.Messages, w.Messages},
					{"tools", got.Tools, w.Tools},
					{"tool_choice", got.ToolChoice, w.ToolChoice},
					{"template_kwargs", got.TemplateKwargs, w.TemplateKwargs},
				} {
					if g, wt := compact(t, f.got), compact(t, f.want); g != wt {
						t.Errorf("%s:\n got %s\nwant %s", f.name, g, wt)
					}
				}
				if got.Model != w.Model || got.AddGenerationPrompt != w.AddGenerationPrompt ||
					got.ContinueFinalMessage != w.ContinueFinalMessage || got.Stream != w.Stream ||
					got.MaxOutputTokens != w.MaxOutputTokens || got.PreviousResponseID != w.PreviousResponseID ||
					got.Store != w.Store {
					t.Errorf("scalars: got model=%q agp=%v cfm=%v stream=%v max=%d prev=%q store=%v, want %+v",
						got.Model, got.AddGenerationPrompt, got.ContinueFinalMessage, got.Stream,
						got.MaxOutputTokens, got.PreviousResponseID, got.Store, w)
				}
			})
		}
	}
}

// TestInvalid checks that bad input is refused with the field at fault, and
// that what vLLM accepts but the router cannot reproduce says so.
func TestInvalid(t *testing.T) {
	deep := strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1)
	cases := []struct {
		name        string
		conv        func([]byte) (Chat, error)
		body        string
		field       string
		unsupported bool
	}{
		{"not json", FromResponses, `{`, "body", false},
		{"not an object", FromResponses, `[1]`, "body", false},
		{"too deep", FromResponses, `{"input":` + deep + `}`, "body", false},
		{"no input", FromResponses, `{"model":"m"}`, "input", false},
		{"input number", FromResponses, `{"input":3}`, "input", false},
		{"item not object", FromResponses, `{"input":[1]}`, "input[0]", false},
		{"call without id", FromResponses, `{"input":[{"type":"function_call","name":"f","arguments":"{}"}]}`, "input[0].call_id", false},
		{"arguments object", FromResponses, `{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":{}}]}`, "input[0].arguments", false},
		{"output without call", FromResponses, `{"input":[{"type":"function_call_output","output":"x"}]}`, "input[0].call_id", false},
		{"unknown item", FromResponses, `{"input":[{"type":"item_reference","id":"x"}]}`, "input[0].type", false},
		{"bad role", FromResponses, `{"input":[{"role":"tool","content":"x"}]}`, "input[0].role", false},
		{"no content", FromResponses, `{"input":[{"role":"user"}]}`, "input[0].content", false},
		{"stream string", FromResponses, `{"input":"x","stream":"yes"}`, "stream", false},
		{"max tokens float", FromResponses, `{"input":"x","max_output_tokens":1.5}`, "max_output_tokens", false},
		{"prompt template", FromResponses, `{"input":"x","prompt":{"id":"p"}}`, "prompt", false},
		{"tool without name", FromResponses, `{"input":"x","tools":[{"type":"function"}]}`, "tools[0].name", false},
		{"tool parameters list", FromResponses, `{"input":"x","tools":[{"type":"function","name":"f","parameters":[]}]}`, "tools[0].parameters", false},
		{"effort number", FromResponses, `{"input":"x","reasoning":{"effort":1}}`, "reasoning.effort", false},
		{"encrypted reasoning", FromResponses, `{"input":[{"type":"reasoning","summary":[],"encrypted_content":"gAAA"}]}`, "input[0].encrypted_content", true},
		{"kwargs not object", FromResponses, `{"input":"x","chat_template_kwargs":[]}`, "chat_template_kwargs", false},
		{"null text part", FromResponses, `{"input":[{"role":"assistant","content":[{"type":"output_text","text":null}]}]}`, "input[0].content[0].text", true},

		{"no model", FromMessages, `{"max_tokens":1,"messages":[]}`, "model", false},
		{"no max_tokens", FromMessages, `{"model":"m","messages":[]}`, "max_tokens", false},
		{"zero max_tokens", FromMessages, `{"model":"m","max_tokens":0,"messages":[]}`, "max_tokens", false},
		{"no messages", FromMessages, `{"model":"m","max_tokens":1}`, "messages", false},
		{"bad role", FromMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"tool","content":"x"}]}`, "messages[0].role", false},
		{"bad block", FromMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"document"}]}]}`, "messages[0].content[0].type", false},
		{"input not object", FromMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","input":[]}]}]}`, "messages[0].content[0].input", false},
		{"system number", FromMessages, `{"model":"m","max_tokens":1,"system":5,"messages":[]}`, "system", false},
		{"tool no schema", FromMessages, `{"model":"m","max_tokens":1,"messages":[],"tools":[{"name":"t"}]}`, "tools[0].input_schema", false},
		{"tool choice name", FromMessages, `{"model":"m","max_tokens":1,"messages":[],"tool_choice":{"type":"tool"}}`, "tool_choice.name", false},
		{"effort", FromMessages, `{"model":"m","max_tokens":1,"messages":[],"output_config":{"effort":"huge"}}`, "output_config.effort", false},
		{"tool_use without id", FromMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use","name":"f","input":{}}]}]}`, "messages[0].content[0].id", true},
		{"assistant tool_result list", FromMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"x"}]}]}]}`, "messages[0].content[0].content", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.conv([]byte(c.body))
			var ie *InputError
			if !errors.As(err, &ie) {
				t.Fatalf("err = %v, want an *InputError", err)
			}
			if ie.Field != c.field || ie.Unsupported != c.unsupported {
				t.Errorf("field %q unsupported %v (%v), want %q %v", ie.Field, ie.Unsupported, err, c.field, c.unsupported)
			}
		})
	}
}

// TestPyJSON holds appendPyJSON to Python's json.dumps output (strings
// taken from CPython 3's json.dumps).
func TestPyJSON(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{}`, `{}`},
		{`{"a":1,"b":[true,false,null],"c":{"d":"e"}}`, `{"a": 1, "b": [true, false, null], "c": {"d": "e"}}`},
		{`{"k":"café \u2028 😀 \u0001 \u007f <&>"}`, `{"k": "caf\u00e9 \u2028 \ud83d\ude00 \u0001 \u007f <&>"}`},
		{`{"q":"a\"b\\c\n\t\r\b\f/"}`, `{"q": "a\"b\\c\n\t\r\b\f/"}`},
		{` { "x" : [ ] , "y" : { } } `, `{"x": [], "y": {}}`},
	} {
		got, err := appendPyJSON(nil, []byte(c.in))
		if err != nil || string(got) != c.want {
			t.Errorf("%s: got %s (%v), want %s", c.in, got, err, c.want)
		}
	}
	if _, err := appendPyJSON(nil, []byte(`{"a":`)); err == nil {
		t.Error("truncated JSON accepted")
	}
}

// TestLargeBodies converts bodies with very many keys and items: a
// conversion quadratic in either would not finish within the test timeout.
func TestLargeBodies(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"input":[`)
	for i := range 50000 {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}`)
	}
	b.WriteString(`]`)
	for i := range 100000 {
		fmt.Fprintf(&b, `,"k%d":%d`, i, i)
	}
	b.WriteString(`}`)
	c, err := FromResponses([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	var msgs []struct {
		ToolCalls []json.RawMessage `json:"tool_calls"`
	}
	if err := json.Unmarshal(c.Messages, &msgs); err != nil || len(msgs) != 1 || len(msgs[0].ToolCalls) != 50000 {
		t.Fatalf("got %d messages (%v), want one with 50000 tool calls", len(msgs), err)
	}
}

// TestResponsesToolChoice checks the mapping of a Responses tool_choice onto
// the chat shape.
func TestResponsesToolChoice(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`"none"`, `"none"`},
		{`"required"`, `"required"`},
		{`{"type":"function","name":"f"}`, `{"type":"function","function":{"name":"f"}}`},
		{`{"type":"allowed_tools","mode":"auto","tools":[]}`, `{"type":"allowed_tools","mode":"auto","tools":[]}`},
		{`null`, `null`},
	} {
		got, err := FromResponses([]byte(`{"input":"x","tool_choice":` + c.in + `}`))
		if err != nil {
			t.Fatal(err)
		}
		if g := compact(t, got.ToolChoice); g != c.want {
			t.Errorf("%s: got %s, want %s", c.in, g, c.want)
		}
	}
}

func TestInputErrorText(t *testing.T) {
	for _, c := range []struct {
		err  InputError
		want string
	}{
		{InputError{Field: "input[2].call_id", Reason: "is required"}, "chatconv: invalid input[2].call_id: is required"},
		{InputError{Field: "messages[0].content[1].id", Reason: "clock", Unsupported: true}, "chatconv: messages[0].content[1].id: cannot be reproduced: clock"},
	} {
		if got := c.err.Error(); got != c.want {
			t.Errorf("got %q, want %q", got, c.want)
		}
	}
}

// TestAssistantMerge holds vLLM's merging of consecutive assistant-side
// items (its TestConstructChatMessagesCombinePolicy cases): each kind fills
// the open assistant message once; a tool output, or a second item of a
// kind already filled, starts a new message.
func TestAssistantMerge(t *testing.T) {
	const (
		msg  = `{"type":"message","role":"assistant","status":"completed","content":[{"type":"output_text","text":"Hello","annotations":[]}]}`
		rs   = `{"type":"reasoning","id":"r","summary":[],"content":[{"type":"reasoning_text","text":"think"}]}`
		call = `{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}`
		out  = `{"type":"function_call_output","call_id":"c","output":"42"}`
	)
	for _, c := range []struct {
		items string
		want  string // roles and filled keys per message
	}{
		{rs + "," + msg, "assistant:reasoning,content"},
		{call + "," + call, "assistant:tool_calls*2"},
		{msg + "," + call, "assistant:content,tool_calls*1"},
		{rs + "," + msg + "," + call + "," + call, "assistant:reasoning,content,tool_calls*2"},
		{rs + `,{"type":"message","role":"assistant","content":"Hello"}`, "assistant:reasoning,content"},
		{msg + "," + msg, "assistant:content assistant:content"},
		{rs + "," + rs, "assistant:reasoning assistant:reasoning"},
		{call + "," + out + "," + call, "assistant:tool_calls*1 tool:content,tool_call_id assistant:tool_calls*1"},
	} {
		got, err := FromResponses([]byte(`{"input":[` + c.items + `]}`))
		if err != nil {
			t.Fatal(err)
		}
		msgs, _ := parseArray(got.Messages)
		var desc []string
		for _, m := range msgs {
			o, _ := parseObject(m)
			role, _, _ := str(o, "role", "role")
			var keys []string
			for _, k := range o.keys[1:] {
				if k == "tool_calls" {
					calls, _ := parseArray(o.raw(k))
					k = fmt.Sprintf("tool_calls*%d", len(calls))
				}
				keys = append(keys, k)
			}
			desc = append(desc, role+":"+strings.Join(keys, ","))
		}
		if g := strings.Join(desc, " "); g != c.want {
			t.Errorf("%s:\n got %s\nwant %s", c.items, g, c.want)
		}
	}
}
