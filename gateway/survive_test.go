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

// TestPanicWhileRelayingAStreamStaysWithIt: a stream is relayed from
// fasthttp's own goroutine, with no handler above it. A panic there (here
// the tokenizer, asked to count the text of a broken stream before it is
// continued) ends that stream with an error event and is counted; the
// process, its other requests and the replica's accounting live on.
func TestPanicWhileRelayingAStreamStaysWithIt(t *testing.T) {
	r := newRouter(t, Settings{DefaultTokenizer: panickingTokenizer{}, ResumeStreams: true}, 1<<20)
	r.table.AddStatic("a", dyingEngine(t), []string{testModel})
	r.table.AddStatic("b", startEngine(t, testModel), []string{testModel})
	body := `{"model":"sim","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"Greet me"}]}`
	hit := false
	for range 20 { // static replicas take turns: find streams that started on a
		res := r.post(t, "/v1/chat/completions", body)
		if res.header["x-kvmesh-replica"] != "a" {
			continue
		}
		hit = true
		if !strings.HasPrefix(res.body, chunk("Hel")) || !strings.Contains(res.body, `data: {"error":`) || !strings.Contains(res.body, "internal error") {
			t.Fatalf("client got %q, want the first events, then an error event", res.body)
		}
	}
	if !hit {
		t.Fatal("no request was routed to replica a first")
	}
	if !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_errors_total{type="panic"}`) {
		t.Error("the relay's panic was not counted")
	}
	if res := r.post(t, "/v1/chat/completions", strings.Replace(body, `"stream":true,`, "", 1)); res.status != 200 {
		t.Fatalf("after the panics: %d %s", res.status, res.body)
	}
	waitFor(t, func() bool {
		busy := false
		r.g.inflight.each(func(_ string, l *replicaLoad) {
			busy = busy || l.requests.Load() != 0 || l.prefill.Load() != 0
		})
		return !busy
	})
}

// TestDeepNestingIsABadRequest: a body nested 3,000,000 deep in a field
// routing does not read (6 MB) once overflowed the stack of the validator
// used on bodies of 256 bytes or more: a fatal error that ended the router.
// It is a 400 on every route that reads a body, and the router serves on.
func TestDeepNestingIsABadRequest(t *testing.T) {
	r := newRouter(t, Settings{}, 16<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	deep := strings.Repeat("[", 3_000_000) + strings.Repeat("]", 3_000_000)
	for path, body := range map[string]string{
		"/v1/chat/completions": `{"model":"sim","messages":[{"role":"user","content":"hi"}],"x":` + deep + `}`,
		"/v1/completions":      `{"model":"sim","prompt":"hi","x":` + deep + `}`,
		"/tokenize":            `{"model":"sim","prompt":"hi","x":` + deep + `}`,
		"/v1/embeddings":       `{"model":"sim","input":"hi","x":` + deep + `}`,
	} {
		if res := r.post(t, path, body); res.status != 400 || !strings.Contains(res.body, "exceeded max depth") {
			t.Errorf("%s nested 3,000,000 deep: %d %.200s, want a 400 naming the depth", path, res.status, res.body)
		}
	}
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 {
		t.Fatalf("after the deep bodies: %d %s", res.status, res.body)
	}
}

// TestAcceptErrorsAreExported: the count of a listener's failed accepts
// (the router's own file-descriptor shortage) is in /metrics by listener.
func TestAcceptErrorsAreExported(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	if err := r.g.RegisterAcceptErrors("api", func() uint64 { return 3 }); err != nil {
		t.Fatal(err)
	}
	if body := r.get(t, "/metrics").body; !strings.Contains(body, `kvmesh_router_accept_errors_total{listener="api"} 3`) {
		t.Fatalf("accept errors not exported:\n%s", body)
	}
}
