package proxy

import "testing"

func TestUsageReadsCompletionTokens(t *testing.T) {
	body := []byte(`{"id":"x","choices":[],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens_details":null}}`)
	if u := usageFromBody(body); u != (usage{prompt: 12, cached: 8, completion: 7}) {
		t.Fatalf("body usage %+v", u)
	}
	if u := usageFromBody([]byte(`{"usage":{"prompt_tokens":3}}`)); u != (usage{prompt: 3, cached: -1}) {
		t.Fatalf("without completion tokens %+v", u)
	}
	u, only, ok := parseUsageChunk([]byte(`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}`))
	if !ok || !only || u != (usage{prompt: 5, cached: -1, completion: 2}) {
		t.Fatalf("chunk usage %+v %v %v", u, only, ok)
	}
}
