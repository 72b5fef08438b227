package gateway

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestRequestID: every proxied answer, errors included, carries the
// request's X-Request-Id; the engine gets the same id (enginesim, like
// vLLM, makes it its answer's id). A client's usable id is kept; a missing
// or unusable one is replaced by a new id, distinct per request.
func TestRequestID(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	answerID := func(res reply) string {
		var a struct{ ID string }
		_ = json.Unmarshal([]byte(res.body), &a)
		return a.ID
	}
	seen := map[string]bool{}
	for _, c := range []struct {
		name, sent string
		kept       bool
	}{
		{"none", "", false},
		{"none again", "", false},
		{"client's", "trace-7f3a/42", true},
		{"with a space", "two words", false},
		{"too long", strings.Repeat("x", maxRequestIDLen+1), false},
	} {
		var headers []string
		if c.sent != "" {
			headers = []string{"X-Request-Id", c.sent}
		}
		res := r.post(t, "/v1/chat/completions", chatBody, headers...)
		id := res.header["x-request-id"]
		switch {
		case res.status != 200:
			t.Errorf("%s: %d %s", c.name, res.status, res.body)
		case c.kept && id != c.sent:
			t.Errorf("%s: answered id %q, want the client's %q", c.name, id, c.sent)
		case !c.kept && (!strings.HasPrefix(id, "kvm-") || seen[id]):
			t.Errorf("%s: answered id %q, want a new router id", c.name, id)
		case answerID(res) != "chatcmpl-"+id:
			t.Errorf("%s: the engine answered id %q, so it did not get %q", c.name, answerID(res), id)
		}
		seen[id] = true
	}
	res := r.post(t, "/v1/chat/completions", `{"model":"nobody-serves-this","messages":[{"role":"user","content":"hi"}]}`, "X-Request-Id", "lost-1")
	if res.status != 404 || res.header["x-request-id"] != "lost-1" {
		t.Errorf("an error answer: %d, X-Request-Id %q", res.status, res.header["x-request-id"])
	}
}

func TestUsableRequestID(t *testing.T) {
	for id, want := range map[string]bool{
		"":                       false,
		"a":                      true,
		"0b5c-4a1e_9f~!":         true,
		"has space":              false,
		"tab\tinside":            false,
		"ünïcode":                false,
		strings.Repeat("z", 128): true,
		strings.Repeat("z", 129): false,
	} {
		if got := usableRequestID([]byte(id)); got != want {
			t.Errorf("usableRequestID(%q) = %v, want %v", id, got, want)
		}
	}
}
