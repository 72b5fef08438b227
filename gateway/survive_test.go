package gateway

import (
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// panickingTokenizer stands for a tokenizer bug some input triggers.
type panickingTokenizer struct{}

func (panickingTokenizer) Encode(string, bool) ([]uint32, error) { panic("index out of range") }
func (panickingTokenizer) EncodeChat(tokenize.Chat) (string, []uint32, error) {
	panic("index out of range")
}

// panickingPolicy stands for a bug anywhere else in a request's handling.
type panickingPolicy struct{}

func (panickingPolicy) Name() string                                                   { return "panicking" }
func (panickingPolicy) Route(*routing.Request, []routing.Candidate, *routing.Decision) { panic("boom") }

// TestPanicsStayWithTheirRequest: a tokenizer that panics leaves its request
// routed by load; a panic elsewhere answers that request 500. Both are
// counted, and the router goes on serving.
func TestPanicsStayWithTheirRequest(t *testing.T) {
	r := newRouter(t, Settings{DefaultTokenizer: panickingTokenizer{}}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	for _, body := range []string{chatBody, `{"model":"sim","prompt":"hello","max_tokens":1}`} {
		path := "/v1/completions"
		if strings.Contains(body, "messages") {
			path = "/v1/chat/completions"
		}
		if res := r.post(t, path, body); res.status != 200 || res.header["x-kvmesh-prompt-tokens"] != "0" {
			t.Fatalf("%s with a panicking tokenizer: %d %v %s", path, res.status, res.header, res.body)
		}
	}
	if !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_errors_total{type="tokenizer_panic"} 2`) {
		t.Error("tokenizer panics not counted")
	}

	s := *r.g.Settings()
	good := s.Policy
	s.Policy = panickingPolicy{}
	r.g.Apply(s)
	res := r.post(t, "/v1/chat/completions", chatBody)
	if res.status != 500 || !strings.Contains(res.body, `"type":"internal_error"`) {
		t.Fatalf("a panic in routing: %d %s, want an OpenAI-shaped 500", res.status, res.body)
	}
	if !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_errors_total{type="panic"} 1`) {
		t.Error("handler panic not counted")
	}
	s.Policy = good
	r.g.Apply(s)
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 {
		t.Fatalf("after the panic: %d %s", res.status, res.body)
	}
}
