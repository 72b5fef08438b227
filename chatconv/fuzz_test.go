package chatconv

import (
	"encoding/json"
	"errors"
	"testing"
)

// seedBodies adds the testdata bodies of one API to the corpus.
func seedBodies(f *testing.F, prefix string) {
	for _, c := range loadCases(f, prefix) {
		f.Add([]byte(c.Body))
	}
}

// checkConverted fails unless conv either returns an *InputError or a Chat
// whose JSON parts are valid JSON of the right shape.
func checkConverted(t *testing.T, conv func([]byte) (Chat, error), body []byte) {
	c, err := conv(body)
	if err != nil {
		var ie *InputError
		if !errors.As(err, &ie) || ie.Field == "" {
			t.Fatalf("error %v is not an *InputError naming a field", err)
		}
		return
	}
	var msgs []map[string]json.RawMessage
	if err := json.Unmarshal(c.Messages, &msgs); err != nil {
		t.Fatalf("messages %q: %v", c.Messages, err)
	}
	for i, m := range msgs {
		var role string
		if json.Unmarshal(m["role"], &role) != nil || role == "" {
			t.Fatalf("message %d has no role: %s", i, c.Messages)
		}
	}
	for name, raw := range map[string]json.RawMessage{"tools": c.Tools, "tool_choice": c.ToolChoice, "template_kwargs": c.TemplateKwargs} {
		if raw != nil && !json.Valid(raw) {
			t.Fatalf("%s %q is not JSON", name, raw)
		}
	}
	if c.Tools != nil {
		var tools []json.RawMessage
		if json.Unmarshal(c.Tools, &tools) != nil {
			t.Fatalf("tools %q is not an array", c.Tools)
		}
	}
}

func FuzzFromResponses(f *testing.F) {
	seedBodies(f, "responses")
	f.Add([]byte(`{"input":[{"type":"reasoning","content":["x"]},{"type":"function_call","call_id":"c","name":"n","arguments":"{}"}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		checkConverted(t, FromResponses, body)
	})
}

func FuzzFromMessages(f *testing.F) {
	seedBodies(f, "messages")
	f.Add([]byte(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"image","source":{}}]}]}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		checkConverted(t, FromMessages, body)
	})
}

// FuzzUsage runs every usage reader on the same bytes: none may panic, and
// what they report is -1 or a count.
func FuzzUsage(f *testing.F) {
	f.Add([]byte(`{"type":"response.completed","response":{"usage":{"input_tokens":3,"input_tokens_details":{"cached_tokens":2}}}}`))
	f.Add([]byte(`{"type":"message_start","message":{"usage":{"input_tokens":1,"cache_read_input_tokens":2}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		check := func(name string, u Usage) {
			if u.Prompt < -1 || u.Cached < -1 || u.Output < -1 {
				t.Fatalf("%s: %+v", name, u)
			}
		}
		check("ResponsesUsage", ResponsesUsage(b))
		check("MessagesUsage", MessagesUsage(b))
		u, _ := ResponsesEventUsage(b)
		check("ResponsesEventUsage", u)
		u, _ = MessagesEventUsage(b)
		check("MessagesEventUsage", u)
	})
}

// FuzzStoredOutputs: any stored answer is read without panicking, and
// the texts read are the output messages' parts, in order.
func FuzzStoredOutputs(f *testing.F) {
	f.Add([]byte(`{"output":[{"type":"message","content":[{"type":"output_text","text":"a"},{"text":"b"}]},{"type":"function_call"}]}`))
	f.Add([]byte(`{"output":[{"type":"message","content":[{"type":"refusal"}]}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		texts, err := StoredOutputs(b)
		if err != nil {
			return
		}
		n := 0
		var r struct {
			Output []struct {
				Type    string
				Content []json.RawMessage
			}
		}
		if json.Unmarshal(b, &r) != nil {
			t.Fatalf("%s read, but is no answer", b)
		}
		for _, item := range r.Output {
			if item.Type == "message" {
				n += len(item.Content)
			}
		}
		if n != len(texts) {
			t.Fatalf("%s: %d texts of %d parts", b, len(texts), n)
		}
	})
}
