package proxy

import "testing"

func TestUsageReadsCompletionTokens(t *testing.T) {
	body := []byte(`{"id":"x","choices":[],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens_details":null}}`)
	if u := usageFromBody(body); u != (Usage{Prompt: 12, Cached: 8, Completion: 7}) {
		t.Fatalf("body usage %+v", u)
	}
	if u := usageFromBody([]byte(`{"usage":{"prompt_tokens":3}}`)); u != (Usage{Prompt: 3, Cached: -1}) {
		t.Fatalf("without completion tokens %+v", u)
	}
	u, only, ok := parseUsageChunk([]byte(`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}`))
	if !ok || !only || u != (Usage{Prompt: 5, Cached: -1, Completion: 2}) {
		t.Fatalf("chunk usage %+v %v %v", u, only, ok)
	}
}
