package gateway

import (
	"encoding/json"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

const chatBody = `{"model":"sim","messages":[{"role":"system","content":"You are a careful assistant."},{"role":"user","content":"Say hello"}],"max_tokens":4,"unknown_field":{"kept":true}}`

func TestChatAndCompletionsThroughStaticUpstream(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})

	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		body := chatBody
		if path == "/v1/completions" {
			body = `{"model":"sim","prompt":"Once upon a time there was","max_tokens":3}`
		}
		res := r.post(t, path, body)
		if res.status != 200 {
			t.Fatalf("%s: %d %s", path, res.status, res.body)
		}
		if res.header["x-kvmesh-replica"] != "e1" || res.header["x-kvmesh-mode"] != "static" ||
			res.header["x-kvmesh-prompt-tokens"] == "0" || res.header["x-kvmesh-cached-tokens"] != "0" {
			t.Fatalf("%s: headers %v", path, res.header)
		}
		var out struct {
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(res.body), &out); err != nil {
			t.Fatal(err)
		}
		// The router tokenizes exactly as the engine does.
		if got := strconv.Itoa(out.Usage.PromptTokens); got != res.header["x-kvmesh-prompt-tokens"] {
			t.Fatalf("%s: engine counted %s prompt tokens, router %s", path, got, res.header["x-kvmesh-prompt-tokens"])
		}
	}
}

func TestStreamUsageIsAskedForButNotShownUnlessRequested(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	stream := strings.Replace(chatBody, `"max_tokens":4`, `"max_tokens":4,"stream":true`, 1)
	res := r.post(t, "/v1/chat/completions", stream)
	if res.status != 200 || !strings.HasSuffix(res.body, "data: [DONE]\n\n") || strings.Contains(res.body, `"usage"`) {
		t.Fatalf("unasked usage leaked or stream broken: %d %q", res.status, res.body)
	}
	asked := strings.Replace(stream, `"stream":true`, `"stream":true,"stream_options":{"include_usage":true}`, 1)
	res = r.post(t, "/v1/chat/completions", asked)
	if !strings.Contains(res.body, `"prompt_tokens_details"`) {
		t.Fatalf("asked-for usage missing: %q", res.body)
	}
	// Both streams reported the engine's cached tokens: the second prompt
	// repeated the first, so the engine had it cached.
	waitFor(t, func() bool { return r.g.metrics.actualValue() > 0 })
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	waitUntil(t, 3*time.Second, "the condition", cond)
}

// waitUntil polls cond every 5 ms for up to d.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%s not reached within %v", what, d)
		}
	}
}

func TestBadInputGetsOpenAIErrors(t *testing.T) {
	r := newRouter(t, Settings{}, 4096)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	r.table.Upsert(fleet.Info{Name: "down", Models: []string{"gone"}, URL: "http://127.0.0.1:1", KVEvents: true, BlockSize: 16}, time.Now())
	r.table.SetLoad("down", fleet.Load{}, false, time.Now())
	cases := []struct {
		name, path, body string
		status           int
		typ              string
	}{
		{"malformed JSON", "/v1/chat/completions", `{"model":"sim","messages":[`, 400, "invalid_request_error"},
		{"not an object", "/v1/chat/completions", `[1,2]`, 400, "invalid_request_error"},
		{"model wrong type", "/v1/chat/completions", `{"model":5,"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error"},
		{"stream wrong type", "/v1/chat/completions", `{"model":"sim","stream":"yes","messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error"},
		{"messages wrong type", "/v1/chat/completions", `{"model":"sim","messages":"hi"}`, 400, "invalid_request_error"},
		{"empty messages", "/v1/chat/completions", `{"model":"sim","messages":[]}`, 400, "invalid_request_error"},
		{"missing messages", "/v1/chat/completions", `{"model":"sim"}`, 400, "invalid_request_error"},
		{"message not object", "/v1/chat/completions", `{"model":"sim","messages":[1]}`, 400, "invalid_request_error"},
		{"invalid UTF-8", "/v1/chat/completions", "{\"model\":\"sim\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", 400, "invalid_request_error"},
		{"missing prompt", "/v1/completions", `{"model":"sim"}`, 400, "invalid_request_error"},
		{"prompt wrong type", "/v1/completions", `{"model":"sim","prompt":{"a":1}}`, 400, "invalid_request_error"},
		{"empty prompt list", "/v1/completions", `{"model":"sim","prompt":[]}`, 400, "invalid_request_error"},
		{"negative token id", "/v1/completions", `{"model":"sim","prompt":[1,-2]}`, 400, "invalid_request_error"},
		{"unknown model", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, 404, "not_found_error"},
		{"no replica", "/v1/completions", `{"model":"gone","prompt":"x"}`, 503, "service_unavailable"},
		{"too large", "/v1/completions", `{"model":"sim","prompt":"` + strings.Repeat("x", 8192) + `"}`, 413, "invalid_request_error"},
	}
	for _, c := range cases {
		res := r.post(t, c.path, c.body)
		var e struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(res.body), &e); err != nil {
			t.Errorf("%s: body %q is not an OpenAI error: %v", c.name, res.body, err)
			continue
		}
		if res.status != c.status || e.Error.Type != c.typ || e.Error.Code != c.status || e.Error.Message == "" {
			t.Errorf("%s: got %d %+v, want %d %s", c.name, res.status, e.Error, c.status, c.typ)
		}
		if c.status == 503 && res.header["retry-after"] == "" {
			t.Errorf("%s: no Retry-After", c.name)
		}
		if c.status == 413 && !strings.Contains(e.Error.Message, "--max-body-bytes") {
			t.Errorf("%s: %q does not name the limit's flag", c.name, e.Error.Message)
		}
	}
	// The router is still healthy after all that.
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 {
		t.Fatalf("after bad input: %d %s", res.status, res.body)
	}
}

func TestOneOfFourRefusingFailsNoRequest(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("dead", refusedURL(t), []string{testModel})
	for i := range 3 {
		r.table.AddStatic(fmt.Sprintf("e%d", i), startEngine(t, testModel), []string{testModel})
	}
	var failed, served atomic.Int64
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 125 {
				body := fmt.Sprintf(`{"model":"sim","prompt":"request %d from worker %d","max_tokens":1}`, i, w)
				if res := r.post(t, "/v1/completions", body); res.status != 200 || res.header["x-kvmesh-replica"] == "dead" {
					failed.Add(1)
				} else {
					served.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if failed.Load() != 0 || served.Load() != 1000 {
		t.Fatalf("%d failed, %d served out of 1000", failed.Load(), served.Load())
	}
	retries := r.g.metrics.retriesValue()
	t.Logf("%v retries", retries)
	if retries == 0 {
		t.Fatal("no retry counted although one replica refuses connections")
	}
	// The refusing replica is ejected after its first failure and only
	// probed again after a second or more: without that it drew about a
	// third of the traffic (nothing in flight there, it looks least loaded).
	if retries > 50 {
		t.Fatalf("%v requests tried the refusing replica first, want it ejected", retries)
	}
}

func TestAllReplicasDownFallbackServes(t *testing.T) {
	fb, err := proxy.NewUpstream("backup", startEngine(t, testModel), "backup-key", proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t, Settings{Models: map[string]Model{testModel: {Fallback: []*proxy.Upstream{fb}}}}, 1<<20)
	// Replicas that refuse connections: every attempt fails over to the fallback.
	r.table.AddStatic("a", refusedURL(t), []string{testModel})
	r.table.AddStatic("b", refusedURL(t), []string{testModel})
	res := r.post(t, "/v1/chat/completions", chatBody)
	if res.status != 200 || res.header["x-kvmesh-mode"] != "fallback" || res.header["x-kvmesh-replica"] != "backup" {
		t.Fatalf("refusing replicas: %d %v %s", res.status, res.header, res.body)
	}
	// No replica online at all: the fallback takes the request directly.
	r.table.RemoveStatic(nil)
	r.table.Upsert(fleet.Info{Name: "off", Models: []string{testModel}, URL: refusedURL(t), KVEvents: true, BlockSize: 16}, time.Now())
	r.table.SetLoad("off", fleet.Load{}, false, time.Now())
	res = r.post(t, "/v1/completions", `{"model":"sim","prompt":"hello","max_tokens":1}`)
	if res.status != 200 || res.header["x-kvmesh-mode"] != "fallback" {
		t.Fatalf("offline replicas: %d %v %s", res.status, res.header, res.body)
	}
}

// TestPrefixAwareRoutingFollowsFilters feeds the table as gossip would: three
// sidecar replicas, one whose filter holds the prompt's leading blocks.
func TestPrefixAwareRoutingFollowsFilters(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	for _, n := range []string{"a", "b", "c"} {
		r.table.Upsert(fleet.Info{Name: n, Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
		r.table.SetLoad(n, fleet.Load{}, true, now)
	}
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	keys := blockkey.Append(nil, blockkey.Seed("", ""), ids, 16)
	f := bloom.NewFilter(1024, 0.001)
	for _, k := range keys {
		f.Add(k)
	}
	r.table.SetFilter("b", f, 1, len(keys), now)
	res := r.post(t, "/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":1}`, prompt))
	want := strconv.Itoa(len(keys) * 16)
	if res.status != 200 || res.header["x-kvmesh-replica"] != "b" || res.header["x-kvmesh-mode"] != "prefix" ||
		res.header["x-kvmesh-cached-tokens"] != want || res.header["x-kvmesh-prompt-tokens"] != strconv.Itoa(len(ids)) {
		t.Fatalf("got %d %v, want replica b, mode prefix, %s cached", res.status, res.header, want)
	}
	// A different salt must not match b's blocks.
	res = r.post(t, "/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":1,"cache_salt":"tenant-2"}`, prompt))
	if res.header["x-kvmesh-cached-tokens"] != "0" || res.header["x-kvmesh-mode"] == "prefix" {
		t.Fatalf("salted request matched unsalted blocks: %v", res.header)
	}
	m := r.get(t, "/metrics")
	for _, line := range []string{`kvmesh_router_routes_total{mode="prefix"} 1`, "kvmesh_router_prefix_hits_total 1",
		"kvmesh_router_predicted_cached_tokens_total " + want, "kvmesh_router_degradations_total 0", "kvmesh_router_actual_cached_tokens_total", `kvmesh_router_info{policy="kvaware",version="` + buildinfo.Version() + `"} 1`,
		`kvmesh_router_ttft_seconds_count{replica="`, `kvmesh_router_upstream_latency_seconds_count{replica="`} {
		if !strings.Contains(m.body, line) {
			t.Errorf("metrics lack %q", line)
		}
	}
}

// TestRetriedRequestTakesItsRecordsAlong: the replica holding a prompt's
// first blocks fails it (refuses the connection, or answers 503 after
// longer than the records live) and the next replica serves it; a sibling
// that arrives before any engine event goes where the prompt was cached,
// not where it was meant to go.
func TestRetriedRequestTakesItsRecordsAlong(t *testing.T) {
	slow503 := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		time.Sleep(2200 * time.Millisecond) // over speculative_ttl: recorded at the decision, it would have expired
		ctx.SetStatusCode(503)
	}})
	for name, failing := range map[string]string{"refused": refusedURL(t), "slow 503": slow503} {
		t.Run(name, func(t *testing.T) {
			r := newRouter(t, Settings{}, 1<<20)
			now := time.Now()
			r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: failing, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
			for _, n := range []string{"b", "c", "d"} {
				r.table.Upsert(fleet.Info{Name: n, Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
			}
			prompt := strings.Repeat("Every sibling of a fan-out shares this long preamble. ", 20)
			ids, _ := tokenize.Builtin{}.Encode(prompt, true)
			keys := blockkey.Append(nil, blockkey.Seed("", ""), ids, 16)
			for _, n := range []string{"a", "b", "c", "d"} {
				f := bloom.NewFilter(1024, 0.001)
				if n == "a" {
					f.Add(keys[0])
					f.Add(keys[1])
				}
				r.table.SetFilter(n, f, 1, 2, now)
				r.table.SetLoad(n, fleet.Load{}, true, now)
			}
			res := r.post(t, "/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":1}`, prompt))
			servedAt := res.header["x-kvmesh-replica"]
			if res.status != 200 || servedAt == "a" || servedAt == "" {
				t.Fatalf("first request: %d %v", res.status, res.header)
			}

			sibling := prompt + "Now the sibling's own question?"
			sids, _ := tokenize.Builtin{}.Encode(sibling, true)
			skeys := blockkey.Append(nil, blockkey.Seed("", ""), sids, 16)
			shared := 0
			for shared < len(keys) && shared < len(skeys) && keys[shared] == skeys[shared] {
				shared++
			}
			res = r.post(t, "/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":1}`, sibling))
			if want := strconv.Itoa(shared * 16); res.status != 200 || res.header["x-kvmesh-replica"] != servedAt ||
				res.header["x-kvmesh-mode"] != "prefix" || res.header["x-kvmesh-cached-tokens"] != want {
				t.Fatalf("sibling: %d %v; want %s (where the first was served), prefix, %s cached", res.status, res.header, servedAt, want)
			}
		})
	}
}

func TestTokenizeModelsReadyAndAdmin(t *testing.T) {
	r := newRouter(t, Settings{AdminToken: "s3cret"}, 1<<20)
	if res := r.get(t, "/ready"); res.status != 503 {
		t.Fatalf("ready without replicas: %d", res.status)
	}
	engineURL := startEngine(t, testModel)
	r.table.AddStatic("e1", engineURL, []string{testModel, "sim-lora"})
	if res := r.get(t, "/ready"); res.status != 200 {
		t.Fatalf("ready: %d", res.status)
	}
	if res := r.get(t, "/health"); res.status != 200 {
		t.Fatalf("health: %d", res.status)
	}
	res := r.post(t, "/tokenize", `{"model":"sim","prompt":"Hello world"}`)
	ids, _ := tokenize.Builtin{}.Encode("Hello world", true)
	want, _ := json.Marshal(map[string]any{"count": len(ids), "tokens": ids})
	if res.status != 200 || res.body != string(want) {
		t.Fatalf("tokenize: %d %s, want %s", res.status, res.body, want)
	}
	res = r.post(t, "/tokenize", `{"model":"sim","messages":[{"role":"user","content":"hi"}]}`)
	_, ids, _ = tokenize.Builtin{}.EncodeChat(tokenize.Chat{Messages: []byte(`[{"role":"user","content":"hi"}]`), AddGenerationPrompt: true})
	want, _ = json.Marshal(map[string]any{"count": len(ids), "tokens": ids})
	if res.body != string(want) {
		t.Fatalf("tokenize chat: %s, want %s", res.body, want)
	}
	// add_special_tokens on a chat adds the BOS the template may already
	// have, as vLLM does: the router must count what the engine counts.
	type counted struct {
		Count  int      `json:"count"`
		Tokens []uint32 `json:"tokens"`
	}
	var withBOS, without counted
	for i, body := range []string{
		`{"model":"sim","messages":[{"role":"user","content":"hi"}],"add_special_tokens":true}`,
		`{"model":"sim","messages":[{"role":"user","content":"hi"}],"add_special_tokens":false}`,
		`{"model":"sim","prompt":"hi","add_special_tokens":false}`,
	} {
		var engineSays, routerSays counted
		if err := json.Unmarshal([]byte(postJSON(t, engineURL+"/tokenize", body)), &engineSays); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(r.post(t, "/tokenize", body).body), &routerSays); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(routerSays) != fmt.Sprint(engineSays) {
			t.Errorf("%s: router %v, engine %v", body, routerSays, engineSays)
		}
		switch i {
		case 0:
			withBOS = routerSays
		case 1:
			without = routerSays
		}
	}
	if withBOS.Count != without.Count+1 {
		t.Errorf("add_special_tokens on a chat: %d tokens, without %d: want one more (the BOS)", withBOS.Count, without.Count)
	}
	if res := r.post(t, "/tokenize", `{"model":"nope","prompt":"x"}`); res.status != 404 || !strings.Contains(res.body, `"code":404`) {
		t.Errorf("tokenize for a model nobody serves: %d %s, want 404 (the default tokenizer answers any name)", res.status, res.body)
	}
	res = r.get(t, "/v1/models")
	if !strings.Contains(res.body, `"id":"sim"`) || !strings.Contains(res.body, `"id":"sim-lora"`) {
		t.Fatalf("models: %s", res.body)
	}
	res = r.get(t, "/admin/replicas")
	var reps []map[string]any
	if err := json.Unmarshal([]byte(res.body), &reps); err != nil || len(reps) != 1 {
		t.Fatalf("replicas: %s", res.body)
	}
	for _, k := range []string{"name", "model", "url", "protocol", "online", "selected", "kv_events", "waiting", "running", "kv_usage", "filter_generation", "filter_keys", "state_age_ms"} {
		if _, ok := reps[0][k]; !ok {
			t.Errorf("/admin/replicas lacks %q", k)
		}
	}
	if res := r.post(t, "/admin/routes/clear", `{}`); res.status != 401 {
		t.Fatalf("clear without token: %d", res.status)
	}
	if res := r.post(t, "/admin/routes/clear", `{"replicas":["e1"]}`, "Authorization", "Bearer s3cret"); res.status != 200 || !strings.HasPrefix(res.body, `{"cleared":["e1"],"replicas":[{"name":"e1",`) {
		t.Fatalf("clear: %d %s", res.status, res.body)
	}
	if res := r.post(t, "/admin/routes/clear", `{"replicas":"e1"}`, "Authorization", "Bearer s3cret"); res.status != 400 {
		t.Fatalf("bad clear body: %d", res.status)
	}
}

func TestClientAPIKeys(t *testing.T) {
	r := newRouter(t, Settings{APIKeys: map[string]bool{"k1": true}}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel})
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 401 || res.header["x-request-id"] == "" {
		t.Fatalf("no key: %d, X-Request-Id %q", res.status, res.header["x-request-id"])
	}
	if res := r.post(t, "/v1/chat/completions", chatBody, "Authorization", "Bearer k1"); res.status != 200 {
		t.Fatalf("good key: %d %s", res.status, res.body)
	}
	// Listing models is guarded too, as vLLM guards every /v1 route.
	for _, path := range []string{"/v1/models", "/v1/models/" + testModel} {
		if res := r.get(t, path); res.status != 401 {
			t.Errorf("GET %s without a key: %d %s", path, res.status, res.body)
		}
		if res := r.get(t, path, "Authorization", "Bearer k1"); res.status != 200 {
			t.Errorf("GET %s with a key: %d %s", path, res.status, res.body)
		}
	}
}

// TestEngineAPIKey: engines started with an API key get the router's
// engine key on every call, in place of whatever the client sent (here the
// router's own client key): proxied requests, model discovery of a static
// upstream. A reload with another key rebuilds the connection pools.
func TestEngineAPIKey(t *testing.T) {
	r := newRouter(t, Settings{APIKeys: map[string]bool{"client-key": true}, EngineAPIKey: "engine-secret"}, 1<<20)
	r.table.AddStatic("keyed", startEngineWithKey(t, "keyed-model", "engine-secret"), nil)
	r.g.RefreshStaticModels()
	if res := r.get(t, "/v1/models/keyed-model", "Authorization", "Bearer client-key"); res.status != 200 {
		t.Fatalf("the keyed engine's models were not learned: %d %s", res.status, res.body)
	}
	chat := `{"model":"keyed-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	if res := r.post(t, "/v1/chat/completions", chat, "Authorization", "Bearer client-key"); res.status != 200 || res.header["x-kvmesh-replica"] != "keyed" {
		t.Fatalf("chat to a keyed engine: %d %s", res.status, res.body)
	}
	if res := r.post(t, "/v1/embeddings", `{"model":"keyed-model","input":"hi"}`, "Authorization", "Bearer client-key"); res.status == 401 {
		t.Fatalf("passed-through call reached the engine without its key: %s", res.body)
	}
	s := *r.g.Settings()
	s.EngineAPIKey = "rotated"
	r.g.Apply(s)
	if res := r.post(t, "/v1/chat/completions", chat, "Authorization", "Bearer client-key"); res.status != 401 {
		t.Fatalf("after a reload to another key the engine answered %d, want its 401 (old pool kept?)", res.status)
	}
	if !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_errors_total{type="upstream_unauthorized"} 1`) {
		t.Error("a replica refusing the router's key not counted")
	}
}

// TestRetrieveModel: GET /v1/models/{id} answers one card, ids with
// slashes included, and 404 in OpenAI's shape for a model nobody serves.
func TestRetrieveModel(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, testModel), []string{testModel, "meta-llama/Llama-3.1-8B-Instruct"})
	for _, id := range []string{testModel, "meta-llama/Llama-3.1-8B-Instruct"} {
		res := r.get(t, "/v1/models/"+id)
		var card modelCard
		if err := json.Unmarshal([]byte(res.body), &card); err != nil || res.status != 200 || card.ID != id || card.Object != "model" {
			t.Errorf("GET /v1/models/%s: %d %s", id, res.status, res.body)
		}
	}
	res := r.get(t, "/v1/models/nobody-serves-this")
	var e struct {
		Error struct{ Message, Type string } `json:"error"`
	}
	if err := json.Unmarshal([]byte(res.body), &e); err != nil || res.status != 404 || e.Error.Type != "not_found_error" || !strings.Contains(e.Error.Message, "nobody-serves-this") {
		t.Errorf("unknown model: %d %s", res.status, res.body)
	}
}

func TestStaticUpstreamModelsAreLearned(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("e1", startEngine(t, "learned-model"), nil)
	r.table.AddStatic("e2", startEngine(t, testModel), []string{testModel})
	r.g.RefreshStaticModels()
	snap := r.table.Snapshot()
	if got := snap.Replicas[snap.Find("e1")].Models; len(got) != 1 || got[0] != "learned-model" {
		t.Fatalf("learned %v", got)
	}
	// Requests for the learned model now go only to e1.
	for range 5 {
		if res := r.post(t, "/v1/completions", `{"model":"learned-model","prompt":"x","max_tokens":1}`); res.header["x-kvmesh-replica"] != "e1" {
			t.Fatalf("went to %v (%d %s)", res.header["x-kvmesh-replica"], res.status, res.body)
		}
	}
	if res := r.get(t, "/v1/models"); !strings.Contains(res.body, `"id":"learned-model"`) {
		t.Fatalf("models: %s", res.body)
	}
}

// TestSilentReplicasAreRoutedByLoad: replicas whose sidecars fell silent
// (orphans: stale, without load figures) are still routed to by load.
func TestSilentReplicasAreRoutedByLoad(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table = fleet.NewTable(fleet.TableConfig{StaleAfter: time.Millisecond, DropAfter: 2 * time.Millisecond})
	r.g.table = r.table
	past := time.Now().Add(-time.Second)
	r.table.Upsert(fleet.Info{Name: "quiet", Models: []string{testModel}, URL: startEngine(t, testModel), KVEvents: true, BlockSize: 16}, past)
	r.table.SetLoad("quiet", fleet.Load{}, true, past)
	r.table.Expire(time.Now())
	if rep := r.table.Snapshot().Replicas[0]; !rep.Online || !rep.Orphan || !rep.Stale {
		t.Fatalf("setup: %+v", rep)
	}
	res := r.post(t, "/v1/chat/completions", chatBody)
	if res.status != 200 || res.header["x-kvmesh-replica"] != "quiet" {
		t.Fatalf("got %d %v %s", res.status, res.header, res.body)
	}
	// Its load figures are not current: its first tokens teach the cost
	// model nothing.
	if res := r.post(t, "/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":2,"stream":true}`); res.status != 200 {
		t.Fatalf("stream: %d %s", res.status, res.body)
	}
	time.Sleep(50 * time.Millisecond) // a stream is learned from just after its last event
	if m := r.get(t, "/metrics").body; strings.Contains(m, "kvmesh_router_cost_model_observations{") {
		t.Error("a stream served by a stale replica was learned from")
	}
	// A replica whose engine is reported down is not tried.
	r.table.SetLoad("quiet", fleet.Load{}, false, time.Now())
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 503 {
		t.Fatalf("unhealthy engine tried: %d", res.status)
	}
}

// TestInflightReturnsToZero: after served, streamed, retried, failed and
// abandoned requests, no in-flight request or prefill token is left over.
func TestInflightReturnsToZero(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "dead", Models: []string{testModel}, URL: refusedURL(t), KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("dead", fleet.Load{}, true, now)
	r.table.Upsert(fleet.Info{Name: "live", Models: []string{testModel}, URL: startEngine(t, testModel), KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("live", fleet.Load{}, true, now)
	stream := strings.Replace(chatBody, `"max_tokens":4`, `"max_tokens":64,"stream":true`, 1)
	for i := range 20 {
		body := chatBody
		if i%2 == 0 {
			body = stream
		}
		if res := r.post(t, "/v1/chat/completions", body); res.status != 200 {
			t.Fatalf("%d %s", res.status, res.body)
		}
	}
	// A client that hangs up mid-stream.
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(stream), stream)
	buf := make([]byte, 256)
	_, _ = c.Read(buf)
	_ = c.Close()
	waitFor(t, func() bool {
		busy := false
		r.g.inflight.each(func(_ string, l *replicaLoad) {
			busy = busy || l.requests.Load() != 0 || l.prefill.Load() != 0
		})
		return !busy
	})
}

// A router is not ready while a live replica with KV events has not sent
// its filter yet: it would route that replica's prefixes as cold.
func TestReadyWaitsForFilters(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("a", fleet.Load{}, true, now)
	if res := r.get(t, "/ready"); res.status != 503 {
		t.Fatalf("ready before the replica's filter arrived: %d %s", res.status, res.body)
	}
	r.table.SetFilter("a", bloom.NewFilter(100, 0.01), 1, 0, time.Now())
	if res := r.get(t, "/ready"); res.status != 200 {
		t.Fatalf("not ready with every filter in: %d %s", res.status, res.body)
	}
}

// TestSpillToFallback: with spill_after, a request whose best replica would
// keep it waiting longer goes to the fallback first (mode fallback, counted
// in kvmesh_router_spills_total); a quiet fleet keeps it; a fallback that
// fails leaves it to the replicas behind.
func TestSpillToFallback(t *testing.T) {
	backup, err := proxy.NewUpstream("backup", startEngine(t, testModel), "", proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	refusing, err := proxy.NewUpstream("refusing", refusedURL(t), "", proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t, Settings{Models: map[string]Model{testModel: {Fallback: []*proxy.Upstream{backup}, SpillAfter: 200 * time.Millisecond}}}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "e1", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	setQueue := func(waiting int) { r.table.SetLoad("e1", fleet.Load{Waiting: waiting}, true, time.Now()) }

	setQueue(0)
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 || res.header["x-kvmesh-replica"] != "e1" {
		t.Fatalf("quiet fleet: served by %q (%s), want e1", res.header["x-kvmesh-replica"], res.header["x-kvmesh-mode"])
	}
	setQueue(64) // 64 requests queued: seconds before a first token
	res := r.post(t, "/v1/chat/completions", chatBody)
	if res.status != 200 || res.header["x-kvmesh-replica"] != "backup" || res.header["x-kvmesh-mode"] != "fallback" {
		t.Fatalf("busy fleet: served by %q (%s), want the fallback", res.header["x-kvmesh-replica"], res.header["x-kvmesh-mode"])
	}
	if !strings.Contains(r.get(t, "/metrics").body, "kvmesh_router_spills_total 1") {
		t.Error("spill not counted")
	}
	s := *r.g.Settings()
	s.Models = map[string]Model{testModel: {Fallback: []*proxy.Upstream{refusing}, SpillAfter: 200 * time.Millisecond}}
	r.g.Apply(s)
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 || res.header["x-kvmesh-replica"] != "e1" {
		t.Fatalf("busy fleet, fallback down: %d served by %q, want e1", res.status, res.header["x-kvmesh-replica"])
	}
}

// TestSpilledRequestLeavesNoRecord: a prompt spilled to the fallback is
// cached at no replica, so the replica it was first meant for must not
// claim it for the siblings that follow.
func TestSpilledRequestLeavesNoRecord(t *testing.T) {
	backup, err := proxy.NewUpstream("backup", startEngine(t, testModel), "", proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t, Settings{Models: map[string]Model{testModel: {Fallback: []*proxy.Upstream{backup}, SpillAfter: 200 * time.Millisecond}}}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "e1", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	r.table.SetFilter("e1", bloom.NewFilter(1024, 0.001), 1, 0, now)
	body := fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":1}`, strings.Repeat("A preamble every sibling shares. ", 20))
	r.table.SetLoad("e1", fleet.Load{Waiting: 64}, true, time.Now())
	if res := r.post(t, "/v1/completions", body); res.status != 200 || res.header["x-kvmesh-mode"] != "fallback" {
		t.Fatalf("busy fleet: %d %v, want the fallback", res.status, res.header)
	}
	r.table.SetLoad("e1", fleet.Load{}, true, time.Now())
	if res := r.post(t, "/v1/completions", body); res.status != 200 || res.header["x-kvmesh-replica"] != "e1" ||
		res.header["x-kvmesh-cached-tokens"] != "0" || res.header["x-kvmesh-mode"] != "cold" {
		t.Fatalf("quiet again: %d %v; want e1, cold, nothing cached (the spilled prompt went to the fallback)", res.status, res.header)
	}
}

// TestEngineTokenizerEjectsAHungReplica: a replica whose /tokenize does
// not answer costs one timeout, then is skipped: its ejection runs from
// when the call gave up, not from before it (which had expired by then).
func TestEngineTokenizerEjectsAHungReplica(t *testing.T) {
	hung := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) { time.Sleep(2 * time.Second) }})
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Hour, DropAfter: time.Hour})
	table.AddStatic("a-hung", hung, []string{testModel})
	table.AddStatic("b-live", startEngine(t, testModel), []string{testModel})
	tk := EngineTokenizer(table, testModel, "").(*engineTokenizer)
	tk.timeout = 1500 * time.Millisecond // over the 1 s first ejection
	if _, err := tk.Encode("hello", true); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := tk.Encode("hello again", true); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Fatalf("second prompt took %v: the hung replica was asked again", took)
	}
}

// TestEngineTokenizerPassesOverDeadReplica: the `engine` tokenizer asks the
// first replica in name order; when that one is down it asks the next, so
// routing keeps its tokens instead of falling to load only.
func TestEngineTokenizerPassesOverDeadReplica(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	table := r.table
	s := *r.g.Settings()
	s.Models = map[string]Model{testModel: {Tokenizer: EngineTokenizer(table, testModel, "")}}
	r.g.Apply(s)
	table.AddStatic("a-dead", refusedURL(t), []string{testModel})
	table.AddStatic("b-live", startEngine(t, testModel), []string{testModel})
	want, _ := tokenize.Builtin{}.Encode("the first prompt", true)
	for i := range 3 {
		res := r.post(t, "/v1/completions", `{"model":"sim","prompt":"the first prompt","max_tokens":1}`)
		if res.status != 200 || res.header["x-kvmesh-prompt-tokens"] != strconv.Itoa(len(want)) {
			t.Fatalf("request %d: %d, prompt tokens %q, want %d (tokenized by the live replica)", i, res.status, res.header["x-kvmesh-prompt-tokens"], len(want))
		}
	}
}

// TestDepartedReplicasAreForgotten: a replica that left the table keeps
// nothing in the router once it has been gone long enough and nothing of it
// is in flight: no in-flight entry, connection pool or metric series (a
// rollout replaces every pod under a new name; these grew with each).
func TestDepartedReplicasAreForgotten(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("pod-a", startEngine(t, testModel), []string{testModel})
	r.table.AddStatic("pod-b", startEngine(t, testModel), []string{testModel})
	for range 2 { // ties go to pod-a, first by name
		if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 {
			t.Fatalf("%d %s", res.status, res.body)
		}
	}
	if m := r.get(t, "/metrics").body; !strings.Contains(m, `kvmesh_router_ttft_seconds_count{replica="pod-a"}`) {
		t.Fatalf("no metric series for pod-a to begin with:\n%s", m)
	}
	r.table.RemoveStatic(map[string]bool{"pod-b": true})
	missing := map[string]time.Time{}
	now := time.Now()
	if gone := r.g.forgetDeparted(missing, now, 10*time.Minute); len(gone) != 0 {
		t.Fatalf("forgot %v at once", gone)
	}
	if gone := r.g.forgetDeparted(missing, now.Add(11*time.Minute), 10*time.Minute); !slices.Equal(gone, []string{"pod-a"}) {
		t.Fatalf("forgot %v after 11 minutes, want pod-a", gone)
	}
	if _, pooled := (*r.g.upstreams.Load())["pod-a"]; pooled {
		t.Error("pod-a's connection pool kept")
	}
	r.g.inflight.mu.RLock()
	_, counted := r.g.inflight.m["pod-a"]
	r.g.inflight.mu.RUnlock()
	if counted {
		t.Error("pod-a's in-flight entry kept")
	}
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 || res.header["x-kvmesh-replica"] != "pod-b" {
		t.Fatalf("after forgetting: %d %v", res.status, res.header)
	}
	m := r.get(t, "/metrics").body
	if strings.Contains(m, `replica="pod-a"`) {
		t.Errorf("pod-a's metric series kept:\n%s", m)
	}
	if !strings.Contains(m, `kvmesh_router_ttft_seconds_count{replica="pod-b"}`) {
		t.Error("pod-b has no series")
	}
}

// TestEngineTokenizerForgetsDepartedEngines: the engine tokenizer keeps an
// answer cache per engine; an engine gone from the table is dropped with it.
func TestEngineTokenizerForgetsDepartedEngines(t *testing.T) {
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Hour, DropAfter: time.Hour})
	table.AddStatic("pod-a", startEngine(t, testModel), []string{testModel})
	tk := EngineTokenizer(table, testModel, "").(*engineTokenizer)
	if _, err := tk.Encode("hello", true); err != nil || len(tk.byURL) != 1 {
		t.Fatalf("%v, %d engines", err, len(tk.byURL))
	}
	table.RemoveStatic(nil)
	podB := startEngine(t, testModel)
	table.AddStatic("pod-b", podB, []string{testModel})
	var picked [maxEngineTries]*tokenizingEngine
	if n := tk.engines(time.Now().Add(2*time.Minute), &picked); n != 1 || len(tk.byURL) != 1 || tk.byURL[podB] == nil {
		t.Fatalf("%d picked, engines %v: pod-a's should be gone, pod-b's there", n, tk.byURL)
	}
}

// TestStreamsTeachTheCostModel: a streamed request served by the replica
// picked, on the first try, is one observation of the model's cost (fitted
// and exported whether or not decisions use it); a non-streamed answer (its
// first byte waits for the whole completion) and a stream that went to a
// second replica are not.
// learnRecorder is kvaware with every observation it is taught recorded,
// so that tests can check what the gateway reports, not only how often.
type learnRecorder struct {
	kvawareLike
	mu      sync.Mutex
	learned []learned
}

type kvawareLike interface {
	routing.Policy
	routing.Recorder
	routing.Learner
	routing.Degrader
	routing.CostModeler
	routing.Clearer
}

type learned struct {
	model        string
	promptTokens int
	replica      string
	running      int
	cachedTokens int
	ttft         time.Duration
}

func (l *learnRecorder) Learn(req *routing.Request, c *routing.Candidate, cachedTokens int, ttft time.Duration) {
	l.mu.Lock()
	l.learned = append(l.learned, learned{req.Model, req.PromptTokens, c.Name, c.Running, cachedTokens, ttft})
	l.mu.Unlock()
	l.kvawareLike.Learn(req, c, cachedTokens, ttft)
}

func (l *learnRecorder) observations() []learned {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.learned)
}

func TestStreamsTeachTheCostModel(t *testing.T) {
	p, err := routing.New("kvaware", routing.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rec := &learnRecorder{kvawareLike: p.(kvawareLike)}
	r := newRouter(t, Settings{Policy: rec}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: refusedURL(t), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	r.table.Upsert(fleet.Info{Name: "b", Models: []string{testModel}, URL: startEngine(t, testModel), Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	// a holds the preamble and runs three sequences, b is idle: a is
	// picked for the preamble (the prefill it saves outweighs its batch),
	// b for anything else (a's load keeps it from homing cold prompts).
	preamble := strings.Repeat("A preamble that only replica a holds. ", 40)
	ids, _ := tokenize.Builtin{}.Encode(preamble, true)
	fa := bloom.NewFilter(1024, 0.001)
	for _, k := range blockkey.Append(nil, blockkey.Seed("", ""), ids, 16) {
		fa.Add(k)
	}
	r.table.SetFilter("a", fa, 1, len(ids)/16, now)
	r.table.SetFilter("b", bloom.NewFilter(1024, 0.001), 1, 0, now)
	r.table.SetLoad("a", fleet.Load{Running: 3}, true, now)
	r.table.SetLoad("b", fleet.Load{}, true, now)

	// A stream is finished (and learned from) just after its last event
	// reached the client: wait a moment for the count to settle. Older
	// observations weigh a little less (1.9995 for two), hence the rounding.
	observations := func() string {
		t.Helper()
		n := 0.0
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			for _, line := range strings.Split(r.get(t, "/metrics").body, "\n") {
				if strings.HasPrefix(line, `kvmesh_router_cost_model_observations{model="sim"}`) {
					n, _ = strconv.ParseFloat(strings.Fields(line)[1], 64)
				}
			}
		}
		return strconv.Itoa(int(math.Round(n)))
	}
	send := func(prompt string, stream bool) (reply, time.Duration) {
		t.Helper()
		start := time.Now()
		res := r.post(t, "/v1/completions", fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":2,"stream":%v}`, prompt, stream))
		if res.status != 200 {
			t.Fatalf("%d %s", res.status, res.body)
		}
		return res, time.Since(start)
	}
	// Three blocks' worth: the engine reports them cached the second time
	// round, while the router predicts none (b's filter is empty and its
	// route records are cleared in between), so the cached count taught
	// must be the engine's, not the prediction.
	question := "A question for whoever is free. " + strings.Repeat("It goes on for a while, so that the engine keeps whole blocks of it. ", 3)
	qids, _ := tokenize.Builtin{}.Encode(question, true)
	if len(qids) < 48 {
		t.Fatalf("the question is %d tokens, want three blocks", len(qids))
	}
	checkLearned := func(i int, cached int, took time.Duration) {
		t.Helper()
		got := rec.observations()
		if len(got) <= i {
			t.Fatalf("observation %d not taught: %+v", i, got)
		}
		o := got[i]
		if o.model != "sim" || o.replica != "b" || o.running != 0 || o.promptTokens != len(qids) || o.cachedTokens != cached {
			t.Errorf("observation %d: %+v, want model sim, replica b, running 0, %d prompt tokens, %d cached", i, o, len(qids), cached)
		}
		if o.ttft <= 0 || o.ttft > took {
			t.Errorf("observation %d: ttft %v, want within the request's %v", i, o.ttft, took)
		}
	}
	res, took := send(question, true)
	if res.header["x-kvmesh-replica"] != "b" {
		t.Fatalf("served by %v", res.header)
	}
	if n := observations(); n != "1" {
		t.Fatalf("after one stream served by its pick: %s observations, want 1", n)
	}
	checkLearned(0, 0, took)
	send("Another question for whoever is free.", false)
	if n := observations(); n != "1" {
		t.Fatalf("a non-streamed answer was learned from: %s observations", n)
	}
	r.g.ClearRecords(nil)
	_, took = send(question, true)
	if n := observations(); n != "2" {
		t.Fatalf("after a second stream served by its pick: %s observations, want 2", n)
	}
	checkLearned(1, len(qids)/16*16, took)
	if res, _ := send(preamble+"And a question.", true); res.header["x-kvmesh-replica"] != "b" {
		t.Fatalf("retried stream served by %v", res.header)
	}
	if n := observations(); n != "2" {
		t.Fatalf("a stream retried at another replica was learned from: %s observations", n)
	}
	// An engine that answers a stream with one JSON body: its first byte
	// is its last, no time to first token.
	whole := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"c","object":"text_completion","model":"sim","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	}})
	r.table.Upsert(fleet.Info{Name: "b", Models: []string{testModel}, URL: whole, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, time.Now())
	if res, _ := send("One more question for whoever is free.", true); res.header["x-kvmesh-replica"] != "b" {
		t.Fatalf("served by %v", res.header)
	}
	if n := observations(); n != "2" {
		t.Fatalf("a stream answered without SSE was learned from: %s observations", n)
	}
	if got := rec.observations(); len(got) != 2 {
		t.Errorf("taught %d observations, want 2: %+v", len(got), got)
	}
	m := r.get(t, "/metrics").body
	if !strings.Contains(m, "kvmesh_router_retries_total 1") {
		t.Error("the preamble's stream should have been retried from a to b")
	}
	for _, term := range []string{"base", "prefill_per_token", "per_running"} {
		if !strings.Contains(m, `kvmesh_router_cost_model_seconds{model="sim",term="`+term+`"}`) {
			t.Errorf("metrics lack the %s term", term)
		}
	}
}

func TestWrongMethodIs405AndUnknownPath404(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/tokenize", "/admin/routes/clear", "/v1/embeddings"} {
		if res := r.get(t, path); res.status != 405 || res.header["allow"] != "POST" || !strings.Contains(res.body, `"code":405`) {
			t.Errorf("GET %s: %d %v %s, want 405 with Allow: POST", path, res.status, res.header, res.body)
		}
	}
	if res := r.get(t, "/no/such/route"); res.status != 404 || !strings.Contains(res.body, `"code":404`) {
		t.Errorf("GET of an unknown path: %d %s", res.status, res.body)
	}
}

// TestRouteClearNeedsTokenOrOptOut: with neither --admin-token nor
// --admin-open, anyone reaching the port could cut every prefix hit
// (five clears a second took them from 40/40 to 4/40); the clear is refused
// with how to enable it.
func TestRouteClearNeedsTokenOrOptOut(t *testing.T) {
	closed := newRouter(t, Settings{}, 1<<20)
	res := closed.post(t, "/admin/routes/clear", `{}`)
	if res.status != 403 || !strings.Contains(res.body, "--admin-token") || !strings.Contains(res.body, "--admin-open") {
		t.Fatalf("clear with no token set: %d %s, want 403 naming --admin-token and --admin-open", res.status, res.body)
	}
	if m := closed.get(t, "/metrics").body; !strings.Contains(m, `kvmesh_router_errors_total{type="forbidden"} 1`) {
		t.Error("the refused clear is not counted as errors_total{type=\"forbidden\"}")
	}
	if res := newRouter(t, Settings{AdminOpen: true}, 1<<20).post(t, "/admin/routes/clear", `{}`); res.status != 200 || res.body != `{"cleared":"all","replicas":[],"filter_keys":0}` {
		t.Fatalf("clear with --admin-open: %d %s", res.status, res.body)
	}
	guarded := newRouter(t, Settings{AdminToken: "s3cret", AdminOpen: true}, 1<<20)
	if res := guarded.post(t, "/admin/routes/clear", `{}`, "Authorization", "Bearer wrong"); res.status != 401 {
		t.Fatalf("a wrong token: %d %s, want 401 (the token wins over --admin-open)", res.status, res.body)
	}
	if res := guarded.post(t, "/admin/routes/clear", `{}`, "Authorization", "Bearer s3cret"); res.status != 200 {
		t.Fatalf("the right token: %d %s", res.status, res.body)
	}
	// A name the table does not hold is a typo, not a clear that happened.
	guarded.table.AddStatic("e1", "http://127.0.0.1:1", []string{"sim"})
	res = guarded.post(t, "/admin/routes/clear", `{"replicas":["e1","e9"]}`, "Authorization", "Bearer s3cret")
	if res.status != 404 || !strings.Contains(res.body, `\"e9\"`) || strings.Contains(res.body, `\"e1\"`) {
		t.Fatalf("clear naming an unknown replica: %d %s, want 404 naming e9 alone", res.status, res.body)
	}
	if res := guarded.post(t, "/admin/routes/clear", `{"replicas":["e1"]}`, "Authorization", "Bearer s3cret"); res.status != 200 || res.body != `{"cleared":["e1"],"replicas":[{"name":"e1","filter_keys":0,"kv_events":false}],"filter_keys":0}` {
		t.Fatalf("clear naming a known replica: %d %s", res.status, res.body)
	}
}
