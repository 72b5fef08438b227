package request

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/chatconv"
)

// TestParseConverted: Responses and Messages bodies become the chat vLLM
// renders, with its template options; one the router cannot reproduce is
// kept for routing by load, and one vLLM refuses is a 400.
func TestParseConverted(t *testing.T) {
	cases := []struct {
		name, body    string
		kind          Kind
		messages      string
		stream        bool
		maxTokens     string
		previous      string
		unconvertible bool
		err           string
	}{
		{name: "responses", kind: Responses,
			body:     `{"model":"m","instructions":"Be brief.","input":"Hi","max_output_tokens":7,"stream":true}`,
			messages: `[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]`, stream: true, maxTokens: "7"},
		{name: "responses follow-up", kind: Responses,
			body:     `{"model":"m","input":"And then?","previous_response_id":"resp_1"}`,
			messages: `[{"role":"user","content":"And then?"}]`, previous: "resp_1"},
		{name: "messages", kind: Messages,
			body:     `{"model":"m","system":"Be brief.","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`,
			messages: `[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]`, maxTokens: "5"},
		{name: "messages ignore cache_salt, as vLLM does", kind: Messages,
			body:     `{"model":"m","max_tokens":5,"cache_salt":"s","messages":[{"role":"user","content":"Hi"}]}`,
			messages: `[{"role":"user","content":"Hi"}]`, maxTokens: "5"},
		{name: "messages tool_use without id", kind: Messages,
			body:          `{"model":"m","max_tokens":5,"messages":[{"role":"assistant","content":[{"type":"tool_use","name":"f","input":{}}]}]}`,
			unconvertible: true},
		{name: "messages without max_tokens", kind: Messages, body: `{"model":"m","messages":[]}`,
			err: "max_tokens: must be a positive integer"},
		{name: "responses without input", kind: Responses, body: `{"model":"m"}`, err: "input: is required"},
	}
	for _, c := range cases {
		r, err := Parse([]byte(c.body), c.kind)
		if c.err != "" {
			var e *Error
			if !errors.As(err, &e) || e.Status != 400 || e.Message != c.err {
				t.Errorf("%s: error %v, want a 400 %q", c.name, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var ie *chatconv.InputError
		if got := errors.As(r.Unconvertible, &ie) && ie.Unsupported; got != c.unconvertible {
			t.Errorf("%s: unconvertible %v (%v), want %v", c.name, got, r.Unconvertible, c.unconvertible)
		}
		if c.unconvertible {
			continue
		}
		chat := r.ChatInput()
		if string(chat.Messages) != c.messages || !chat.AddGenerationPrompt || chat.AddSpecialTokens || !r.Kind.RendersAsChat() {
			t.Errorf("%s: chat %s %+v, want %s with a generation prompt and no special tokens", c.name, chat.Messages, chat, c.messages)
		}
		if r.Stream != c.stream || string(r.MaxTokens) != c.maxTokens || r.PreviousResponseID != c.previous || r.Model != "m" || r.CacheSalt != "" {
			t.Errorf("%s: stream %v max %q previous %q model %q", c.name, r.Stream, r.MaxTokens, r.PreviousResponseID, r.Model)
		}
	}
}

// FuzzParseConverted: any body to /v1/responses or /v1/messages is a
// request error or a request, never a panic; a request is either routed
// by load (Unconvertible) or holds a JSON array of messages to render.
func FuzzParseConverted(f *testing.F) {
	f.Add([]byte(`{"model":"m","instructions":"x","input":[{"type":"message","role":"user","content":"hi"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}]}`), true)
	f.Add([]byte(`{"model":"m","max_tokens":3,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"r"}]}]}`), false)
	f.Fuzz(func(t *testing.T, body []byte, responses bool) {
		k := Messages
		if responses {
			k = Responses
		}
		p, err := Parse(body, k)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error of type %T", err)
			}
			return
		}
		if p.Unconvertible == nil && (len(p.Messages) == 0 || p.Messages[0] != '[' || !json.Valid(p.Messages)) {
			t.Fatalf("messages %q from %q", p.Messages, body)
		}
	})
}
