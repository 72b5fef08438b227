package chatconv

import (
	"strings"
	"testing"
)

// The answers below are shaped as vLLM writes them (ResponsesResponse,
// ResponseCompletedEvent, AnthropicMessagesResponse, AnthropicStreamEvent).
func TestUsage(t *testing.T) {
	cases := []struct {
		name           string
		read           func([]byte) (Usage, bool)
		in             string
		prompt, cached int
		ok             bool
	}{
		{"responses body", body(ResponsesUsage),
			`{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"the \"usage\": field"}]}],"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":96,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":127},"user":null}`,
			120, 96, true},
		{"responses body no details", body(ResponsesUsage), `{"usage":{"input_tokens":5,"output_tokens":1}}`, 5, -1, true},
		{"responses body null usage", body(ResponsesUsage), `{"status":"queued","usage":null}`, -1, -1, true},
		{"responses body garbage", body(ResponsesUsage), `{"usage":`, -1, -1, true},
		{"responses completed", ResponsesEventUsage,
			`{"type":"response.completed","sequence_number":9,"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":2048,"input_tokens_details":{"cached_tokens":2032},"output_tokens":3,"total_tokens":2051}}}`,
			2048, 2032, true},
		{"responses incomplete", ResponsesEventUsage,
			`{"type":"response.incomplete","response":{"usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":0}}}}`, 10, 0, true},
		{"responses created", ResponsesEventUsage, `{"type":"response.created","response":{"usage":null}}`, -1, -1, false},
		{"responses delta", ResponsesEventUsage, `{"type":"response.output_text.delta","delta":"\"usage\""}`, -1, -1, false},
		{"messages body", body(MessagesUsage),
			`{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"model":"m","stop_reason":"end_turn","usage":{"input_tokens":24,"output_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":96}}`,
			120, 96, true},
		{"messages body before cache fields", body(MessagesUsage), `{"usage":{"input_tokens":120,"output_tokens":5}}`, 120, -1, true},
		{"messages body creation", body(MessagesUsage), `{"usage":{"input_tokens":4,"cache_creation_input_tokens":100,"cache_read_input_tokens":16}}`, 120, 16, true},
		{"message_start", MessagesEventUsage,
			`{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":8,"output_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":32}}}`,
			40, 32, true},
		{"message_delta", MessagesEventUsage,
			`{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":8,"output_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":32}}`,
			40, 32, true},
		{"message_delta output only", MessagesEventUsage, `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":12}}`, -1, -1, true},
		{"content_block_delta", MessagesEventUsage, `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\"usage\":"}}`, -1, -1, false},
		{"negative", body(MessagesUsage), `{"usage":{"input_tokens":-3,"cache_read_input_tokens":-1}}`, -1, -1, true},
		{"ping", MessagesEventUsage, `{"type":"ping"}`, -1, -1, false},
	}
	for _, c := range cases {
		u, ok := c.read([]byte(c.in))
		if u.Prompt != c.prompt || u.Cached != c.cached || ok != c.ok {
			t.Errorf("%s: got (%d, %d, %v), want (%d, %d, %v)", c.name, u.Prompt, u.Cached, ok, c.prompt, c.cached, c.ok)
		}
	}
}

func body(f func([]byte) Usage) func([]byte) (Usage, bool) {
	return func(b []byte) (Usage, bool) { return f(b), true }
}

// TestStoredOutputs: the text parts of a stored answer's output messages,
// in order, reasoning and function calls left out, as vLLM continues it.
func TestStoredOutputs(t *testing.T) {
	body := []byte(`{"id":"resp_1","output":[{"type":"reasoning","content":[{"type":"reasoning_text","text":"hm"}]},` +
		`{"type":"message","role":"assistant","content":[{"type":"output_text","text":"One."},{"type":"output_text","text":"Two."}]},` +
		`{"type":"function_call","name":"f","arguments":"{}","call_id":"c"},{"type":"message","content":[{"type":"output_text","text":""}]}]}`)
	got, err := StoredOutputs(body)
	if err != nil || strings.Join(got, "|") != "One.|Two.|" {
		t.Fatalf("StoredOutputs = %q, %v", got, err)
	}
	for _, bad := range []string{`{"output":[{"type":"message","content":[{"type":"refusal","refusal":"no"}]}]}`, `{"output":3}`, `[`} {
		if _, err := StoredOutputs([]byte(bad)); err == nil {
			t.Errorf("StoredOutputs(%s) read it", bad)
		}
	}
}

func TestOutputTokens(t *testing.T) {
	if n := ResponsesUsage([]byte(`{"id":"resp_1","usage":{"input_tokens":40,"output_tokens":7,"total_tokens":47}}`)).Output; n != 7 {
		t.Fatalf("body: %d", n)
	}
	if n := MessagesUsage([]byte(`{"usage":{"input_tokens":40}}`)).Output; n != -1 {
		t.Fatalf("body without output tokens: %d", n)
	}
	for _, c := range []struct {
		read    func([]byte) (Usage, bool)
		payload string
		want    int
	}{
		{ResponsesEventUsage, `{"type":"response.completed","response":{"id":"r","usage":{"input_tokens":9,"output_tokens":5}}}`, 5},
		{MessagesEventUsage, `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":12}}`, 12},
		{MessagesEventUsage, `{"type":"message_start","message":{"id":"m","usage":{"input_tokens":3,"output_tokens":1}}}`, 1},
		{ResponsesEventUsage, `{"type":"response.output_text.delta","delta":"usage"}`, -1},
	} {
		if u, ok := c.read([]byte(c.payload)); u.Output != c.want || ok != (c.want >= 0) {
			t.Errorf("%s: %d %v, want %d", c.payload, u.Output, ok, c.want)
		}
	}
}
