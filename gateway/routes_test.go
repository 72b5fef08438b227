package gateway

import (
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/valyala/fasthttp"
)

// countingEngine serves every request with a JSON 200 naming its path and
// counts them.
func countingEngine(t *testing.T) (url string, served *atomic.Int64) {
	served = new(atomic.Int64)
	url = listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		served.Add(1)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"path":"` + string(ctx.Path()) + `","usage":{"prompt_tokens":1}}`)
	}})
	return url, served
}

// TestMistypedPathIsRouters404: a path that is not the router's nor one of
// enginePaths gets the router's own OpenAI-shaped 404, and no engine sees
// it, even with a body naming a served model.
func TestMistypedPathIsRouters404(t *testing.T) {
	engine, served := countingEngine(t)
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e", engine, []string{testModel})
	body := `{"model":"` + testModel + `","input":"hi","messages":[{"role":"user","content":"hi"}]}`
	for _, path := range []string{
		"/v1/chat/completion", "/v1/chat/completions/", "/v1/embedding", "/v1/completions/x",
		"/v1/responses/resp_1/x", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
		"/v2/anything", "/v1/", "/generate/", "/v1/generate", "/reset_prefix_cache", "/V1/embeddings",
	} {
		res := r.post(t, path, body)
		want := `{"error":{"message":"no route POST ` + path + `","type":"not_found_error","code":404}}`
		if res.status != 404 || res.body != want || res.header["content-type"] != "application/json" {
			t.Errorf("POST %s: %d %q %s, want 404 %s", path, res.status, res.header["content-type"], res.body, want)
		}
	}
	if n := served.Load(); n != 0 {
		t.Errorf("%d mistyped requests reached the engine, want none", n)
	}
}

// TestEnginePathsPassThrough: every path of enginePaths reaches the engine
// serving the body's model, at that path; a GET to one is a 405.
func TestEnginePathsPassThrough(t *testing.T) {
	engine, served := countingEngine(t)
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e", engine, []string{testModel})
	paths := make([]string, 0, len(enginePaths))
	for p := range enginePaths {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, path := range paths {
		res := r.post(t, path, `{"model":"`+testModel+`","input":"hi"}`)
		if res.status != 200 || res.body != `{"path":"`+path+`","usage":{"prompt_tokens":1}}` || res.header["x-kvmesh-replica"] != "e" {
			t.Errorf("POST %s: %d %v %s, want the engine's answer", path, res.status, res.header, res.body)
		}
		if res := r.get(t, path); res.status != 405 || res.header["allow"] != "POST" {
			t.Errorf("GET %s: %d %v, want 405 with Allow: POST", path, res.status, res.header)
		}
	}
	if n := served.Load(); n != int64(len(paths)) {
		t.Errorf("the engine served %d requests, want %d (one per path)", n, len(paths))
	}
	// SGLang's native /generate names no model: the fleet's only one.
	if res := r.post(t, "/generate", `{"text":"hi","sampling_params":{"max_new_tokens":4}}`); res.status != 200 || res.header["x-kvmesh-replica"] != "e" {
		t.Errorf("POST /generate without a model: %d %v %s, want the engine's answer", res.status, res.header, res.body)
	}
	for _, p := range []string{"/v1/embeddings", "/v1/audio/transcriptions", "/rerank", "/v1/messages/count_tokens", "/detokenize"} {
		if !enginePaths[p] {
			t.Errorf("%s is not passed through", p)
		}
	}
}

// TestAdminListenerServesOperatorRoutesAlone: with the routes split over
// two listeners, the API port answers /admin/*, the console and /metrics
// with the router's 404 and the admin port serves them (and nothing of the
// API); /health and /ready answer on both. One listener (Server) serves all.
func TestAdminListenerServesOperatorRoutesAlone(t *testing.T) {
	engine, served := countingEngine(t)
	one := newRouter(t, Settings{AdminOpen: true}, 1<<20)
	one.table.AddStatic("e", engine, []string{testModel})
	apiSrv, adminSrv := one.g.Servers(1 << 20)
	api := &testRouter{g: one.g, table: one.table, url: listen(t, apiSrv)}
	admin := &testRouter{g: one.g, table: one.table, url: listen(t, adminSrv)}

	for _, path := range []string{"/admin/replicas", "/metrics", "/", "/console/console.js"} {
		if res := api.get(t, path); res.status != 404 || res.body != `{"error":{"message":"no route GET `+path+`","type":"not_found_error","code":404}}` {
			t.Errorf("API port GET %s: %d %s, want the router's 404", path, res.status, res.body)
		}
		if res := admin.get(t, path); res.status != 200 {
			t.Errorf("admin port GET %s: %d %s, want 200", path, res.status, res.body)
		}
		if res := one.get(t, path); res.status != 200 {
			t.Errorf("single port GET %s: %d, want 200", path, res.status)
		}
	}
	if res := admin.get(t, "/admin/replicas"); !strings.Contains(res.body, `"name":"e"`) {
		t.Errorf("admin port /admin/replicas: %s, want replica e listed", res.body)
	}
	if res := api.post(t, "/admin/routes/clear", `{}`); res.status != 404 {
		t.Errorf("API port clear: %d %s, want 404", res.status, res.body)
	}
	if res := admin.post(t, "/admin/routes/clear", `{}`); res.status != 200 {
		t.Errorf("admin port clear: %d %s, want 200", res.status, res.body)
	}

	chat := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}]}`
	if res := admin.post(t, "/v1/chat/completions", chat); res.status != 404 {
		t.Errorf("admin port chat: %d %s, want 404", res.status, res.body)
	}
	if res := admin.get(t, "/v1/models"); res.status != 404 {
		t.Errorf("admin port /v1/models: %d, want 404", res.status)
	}
	if n := served.Load(); n != 0 {
		t.Fatalf("the admin port passed %d requests to the engine", n)
	}
	if res := api.post(t, "/v1/chat/completions", chat); res.status != 200 || res.header["x-kvmesh-replica"] != "e" {
		t.Errorf("API port chat: %d %v %s", res.status, res.header, res.body)
	}
	for _, path := range []string{"/health", "/ready"} {
		a, b := api.get(t, path), admin.get(t, path)
		if a.status != 200 || b.status != 200 {
			t.Errorf("GET %s: API port %d, admin port %d, want 200 on both", path, a.status, b.status)
		}
	}
}

// TestPassthroughPathsReachEngines: a path the operator adds
// (Settings.PassthroughPaths) is passed through as enginePaths are, a GET
// to it is a 405, and a reload without it makes it the router's 404 again.
func TestPassthroughPathsReachEngines(t *testing.T) {
	engine, served := countingEngine(t)
	r := newRouter(t, Settings{PassthroughPaths: []string{"/v1/new_endpoint", "/invocations"}}, 1<<20)
	r.table.AddStatic("e", engine, []string{testModel})
	body := `{"model":"` + testModel + `","input":"hi"}`
	for _, path := range []string{"/v1/new_endpoint", "/invocations", "/v1/embeddings"} {
		if res := r.post(t, path, body); res.status != 200 || res.body != `{"path":"`+path+`","usage":{"prompt_tokens":1}}` {
			t.Errorf("POST %s: %d %s, want the engine's answer", path, res.status, res.body)
		}
	}
	if res := r.get(t, "/v1/new_endpoint"); res.status != 405 || res.header["allow"] != "POST" {
		t.Errorf("GET /v1/new_endpoint: %d %v, want 405 with Allow: POST", res.status, res.header)
	}
	if res := r.post(t, "/v1/new_endpoint/", body); res.status != 404 {
		t.Errorf("POST /v1/new_endpoint/: %d %s, want 404 (paths match exactly)", res.status, res.body)
	}
	if n := served.Load(); n != 3 {
		t.Fatalf("the engine served %d requests, want 3", n)
	}
	r.g.Apply(Settings{})
	want := `{"error":{"message":"no route POST /v1/new_endpoint","type":"not_found_error","code":404}}`
	if res := r.post(t, "/v1/new_endpoint", body); res.status != 404 || res.body != want {
		t.Errorf("after a reload without it: %d %s, want %s", res.status, res.body, want)
	}
	if n := served.Load(); n != 3 {
		t.Errorf("the engine served %d requests, want still 3", n)
	}
}

// TestCheckPassthroughPath: a path alone, and none the router answers.
func TestCheckPassthroughPath(t *testing.T) {
	for _, ok := range []string{"/v1/new_endpoint", "/invocations", "/v1/embeddings", "/generate"} {
		if err := CheckPassthroughPath(ok); err != nil {
			t.Errorf("%q: %v, want accepted", ok, err)
		}
	}
	for _, bad := range []string{"", "/", "v1/x", "/x?y=1", "/x#f", "/x y", "/x\n",
		"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize",
		"/v1/models", "/v1/models/llama", "/v1/responses/resp_1/cancel", "/health", "/ready",
		"/metrics", "/admin/replicas", "/admin/x", "/"} {
		if err := CheckPassthroughPath(bad); err == nil {
			t.Errorf("%q accepted, want refused", bad)
		}
	}
}
