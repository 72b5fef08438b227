package request

import (
	"encoding/json"
	"reflect"
	"testing"
)

// TestContinuationBodies: what a replica is asked when it takes over a
// broken stream, and which requests cannot be taken over.
func TestContinuationBodies(t *testing.T) {
	cases := []struct {
		name   string
		k      Kind
		body   string
		text   string
		chunks int
		want   string // "" when it cannot be continued
	}{
		{"chat", Chat, `{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":10,"stream":true,"x":{"kept":1}}`, "Hello <b>", 3,
			`{"add_generation_prompt":false,"continue_final_message":true,"max_tokens":7,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello <b>"}],"model":"m","stream":true,"x":{"kept":1}}`},
		{"chat, max_completion_tokens", Chat, `{"messages":[],"max_completion_tokens":5,"n":1}`, "a", 1,
			`{"add_generation_prompt":false,"continue_final_message":true,"max_completion_tokens":4,"messages":[{"role":"assistant","content":"a"}],"n":1}`},
		{"completion", Completion, `{"prompt":"Once","max_tokens":null}`, " upon", 1, `{"max_tokens":null,"prompt":"Once upon"}`},
		{"nothing said yet", Chat, `{"messages":[{"role":"user","content":"Hi"}]}`, "", 0, `{"messages":[{"role":"user","content":"Hi"}]}`},
		{"several choices", Chat, `{"messages":[],"n":2}`, "a", 1, ""},
		{"echo", Completion, `{"prompt":"x","echo":true}`, "a", 1, ""},
		{"token ids", Completion, `{"prompt":[1,2,3]}`, "a", 1, ""},
		{"batch", Completion, `{"prompt":["a","b"]}`, "a", 1, ""},
		{"already continuing", Chat, `{"messages":[],"continue_final_message":true}`, "a", 1, ""},
		{"budget spent", Chat, `{"messages":[],"max_tokens":3}`, "abc", 3, ""},
		{"not an object", Chat, `[1]`, "a", 1, ""},
	}
	for _, c := range cases {
		got, ok := Continuation([]byte(c.body), c.k, []byte(c.text), c.chunks)
		if c.want == "" {
			if ok {
				t.Errorf("%s: continued as %s", c.name, got)
			}
			continue
		}
		if !ok {
			t.Errorf("%s: not continued", c.name)
			continue
		}
		var g, w any
		if err := json.Unmarshal(got, &g); err != nil {
			t.Fatalf("%s: %v in %s", c.name, err, got)
		}
		_ = json.Unmarshal([]byte(c.want), &w)
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s:\n got %s\nwant %s", c.name, got, c.want)
		}
	}
}
