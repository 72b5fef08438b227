package gateway

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

const testModel = "sim"

// listen serves h on loopback until the test ends and returns its base URL.
func listen(t testing.TB, srv *fasthttp.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.ShutdownWithContext(ctx)
	})
	return "http://" + ln.Addr().String()
}

// startEngine runs a real enginesim (no simulated delays) and returns its URL.
func startEngine(t testing.TB, model string) string {
	t.Helper()
	return startEngineWithKey(t, model, "")
}

// startEngineWithKey serves an enginesim whose /v1 calls need apiKey (none
// when empty), as vllm serve --api-key.
func startEngineWithKey(t testing.TB, model, apiKey string) string {
	t.Helper()
	url, _ := serveEngine(t, model, apiKey)
	return url
}

// serveEngine is startEngineWithKey, also returning the server (to stop it:
// the engine dies).
func serveEngine(t testing.TB, model, apiKey string) (string, *fasthttp.Server) {
	t.Helper()
	return serveSim(t, enginesim.Config{
		Model: model, Tokenizer: tokenize.Builtin{}, APIKey: apiKey,
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 32768},
	})
}

// serveSim runs an enginesim of cfg until the test ends and returns its
// URL and server.
func serveSim(t testing.TB, cfg enginesim.Config) (string, *fasthttp.Server) {
	t.Helper()
	sim, err := enginesim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go sim.Run(ctx)
	t.Cleanup(cancel)
	srv := &fasthttp.Server{Handler: sim.Handler, CloseOnShutdown: true}
	return listen(t, srv), srv
}

func refusedURL(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

type testRouter struct {
	g     *Gateway
	table *fleet.Table
	url   string
}

func newRouter(t testing.TB, s Settings, maxBody int) *testRouter {
	t.Helper()
	if s.Policy == nil {
		p, err := routing.New("kvaware", routing.Config{})
		if err != nil {
			t.Fatal(err)
		}
		s.Policy = p
	}
	if s.DefaultTokenizer == nil {
		s.DefaultTokenizer = tokenize.Builtin{}
	}
	s.Upstream = proxy.Options{FirstByteTimeout: 10 * time.Second, IdleTimeout: 5 * time.Second}
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Hour, DropAfter: time.Hour})
	g := New(table, nil, s, zerolog.Nop())
	return &testRouter{g: g, table: table, url: listen(t, g.Server(maxBody))}
}

type reply struct {
	status int
	header map[string]string
	body   string
}

func (r *testRouter) post(t testing.TB, path, body string, headers ...string) reply {
	t.Helper()
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(r.url + path)
	req.Header.SetMethod("POST")
	req.Header.SetContentType("application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	req.SetBodyString(body)
	if err := client.DoTimeout(req, resp, 10*time.Second); err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	return toReply(resp)
}

func (r *testRouter) get(t testing.TB, path string, headers ...string) reply {
	t.Helper()
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(r.url + path)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	if err := client.DoTimeout(req, resp, 10*time.Second); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return toReply(resp)
}

var client = &fasthttp.Client{MaxConnsPerHost: 512}

func toReply(resp *fasthttp.Response) reply {
	out := reply{status: resp.StatusCode(), header: map[string]string{}, body: string(resp.Body())}
	for k, v := range resp.Header.All() {
		out.header[strings.ToLower(string(k))] = string(v)
	}
	return out
}

// postJSON posts body to url (an engine's, say) and returns the answer's
// body, failing the test on anything but a 200.
func postJSON(t testing.TB, url, body string) string {
	t.Helper()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod("POST")
	req.Header.SetContentType("application/json")
	req.SetBodyString(body)
	if err := client.DoTimeout(req, resp, 10*time.Second); err != nil || resp.StatusCode() != 200 {
		t.Fatalf("POST %s: %v %d %s", url, err, resp.StatusCode(), resp.Body())
	}
	return string(resp.Body())
}
