package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/storedid"
	"github.com/kvmesh/kvmesh/tokenize"
)

// residentSink keys an engine's stored blocks as a sidecar does and keeps
// them in a filter the test hands the router's table.
type residentSink struct {
	mu   sync.Mutex
	keys map[uint64]uint64 // engine hash → kvmesh key
	all  []uint64
}

func (s *residentSink) Publish(b *kvevents.Batch) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range b.Events {
		if ev.Kind != kvevents.KindBlockStored {
			continue
		}
		parent := blockkey.Seed("", "")
		if ev.HasParent {
			k, ok := s.keys[ev.ParentHash]
			if !ok {
				continue
			}
			parent = k
		}
		for i, h := range ev.BlockHashes {
			parent = blockkey.Next(parent, ev.TokenIDs[i*ev.BlockSize:(i+1)*ev.BlockSize])
			s.keys[h] = parent
			s.all = append(s.all, parent)
		}
	}
	return nil
}

func (s *residentSink) filter() (*bloom.Filter, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := bloom.NewFilter(4096, 0.0001)
	for _, k := range s.all {
		f.Add(k)
	}
	return f, len(s.all)
}

// agentFleet is a router over n enginesims whose stored blocks reach its
// table as a sidecar's filters would.
func agentFleet(t *testing.T, n int, s Settings) (*testRouter, []*residentSink, func()) {
	t.Helper()
	r := newRouter(t, s, 1<<20)
	sinks := make([]*residentSink, n)
	now := time.Now()
	for i := range sinks {
		sinks[i] = &residentSink{keys: map[uint64]uint64{}}
		sim, err := enginesim.New(enginesim.Config{Model: testModel, Tokenizer: tokenize.Builtin{}, Events: sinks[i],
			Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 64, MaxNumBatchedTokens: 8192, MaxModelLen: 32768}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		go sim.Run(ctx)
		t.Cleanup(cancel)
		name := string(rune('a' + i))
		r.table.Upsert(fleet.Info{Name: name, Models: []string{testModel}, URL: listen(t, &fasthttp.Server{Handler: sim.Handler}),
			Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
		r.table.SetLoad(name, fleet.Load{}, true, now)
		r.table.SetFilter(name, bloom.NewFilter(1024, 0.001), 1, 0, now)
	}
	gen := uint64(1)
	sync := func() {
		gen++
		for i, s := range sinks {
			f, keys := s.filter()
			r.table.SetFilter(string(rune('a'+i)), f, gen, keys, time.Now())
		}
	}
	return r, sinks, sync
}

// TestAgentAPIsPredictWhatTheEngineCaches: a conversation through
// /v1/responses and one through /v1/messages, each turn repeating the
// history: from the second turn on the router predicts, from the engines'
// own stored blocks, exactly the cached tokens the engine then reports,
// streamed or not, and the request goes where its prefix is.
func TestAgentAPIsPredictWhatTheEngineCaches(t *testing.T) {
	r, _, sync := agentFleet(t, 3, Settings{})
	system := strings.Repeat("You are a careful coding agent working in a large repository. ", 12)
	responses := func(history []string, stream bool) string {
		items := make([]string, 0, len(history))
		for i, h := range history {
			role := "user"
			if i%2 == 1 {
				role = "assistant"
			}
			items = append(items, fmt.Sprintf(`{"type":"message","role":%q,"content":[{"type":"input_text","text":%q}]}`, role, h))
		}
		return fmt.Sprintf(`{"model":"sim","instructions":%q,"input":[%s],"max_output_tokens":4,"stream":%v,"store":false}`, system, strings.Join(items, ","), stream)
	}
	messages := func(history []string, stream bool) string {
		items := make([]string, 0, len(history))
		for i, h := range history {
			role := "user"
			if i%2 == 1 {
				role = "assistant"
			}
			items = append(items, fmt.Sprintf(`{"role":%q,"content":[{"type":"text","text":%q}]}`, role, h))
		}
		return fmt.Sprintf(`{"model":"sim","system":%q,"messages":[%s],"max_tokens":4,"stream":%v}`, system, strings.Join(items, ","), stream)
	}
	for _, api := range []struct {
		path string
		body func([]string, bool) string
	}{
		{"/v1/responses", responses},
		{"/v1/messages", messages},
	} {
		t.Run(api.path, func(t *testing.T) {
			history := []string{"Read main.go and tell me what it does."}
			home := ""
			for i := range 4 {
				stream := i%2 == 1
				res := r.post(t, api.path, api.body(history, stream))
				if res.status != 200 {
					t.Fatalf("turn %d: %d %s", i, res.status, res.body)
				}
				engineCached := engineCached(t, res.body, stream)
				predicted, _ := strconv.Atoi(res.header["x-kvmesh-cached-tokens"])
				if i > 0 && (predicted != engineCached || predicted == 0 || res.header["x-kvmesh-mode"] != "prefix" || res.header["x-kvmesh-replica"] != home) {
					t.Fatalf("turn %d (stream %v): predicted %d cached at %s (%s), the engine reports %d; home %s",
						i, stream, predicted, res.header["x-kvmesh-replica"], res.header["x-kvmesh-mode"], engineCached, home)
				}
				home = res.header["x-kvmesh-replica"]
				time.Sleep(20 * time.Millisecond) // the stream's last events reach the engine's sink
				sync()
				history = append(history, fmt.Sprintf("Answer %d: the code does thing %d.", i, i), fmt.Sprintf("Now look at file %d.", i))
			}
		})
	}
	// The Messages conversation's first turn finds the system prompt the
	// Responses one left: one cold route in eight. The four streamed turns
	// taught the cost model.
	m := r.get(t, "/metrics").body
	predicted, actual := metricValue(m, "kvmesh_router_predicted_cached_tokens_total"), metricValue(m, "kvmesh_router_actual_cached_tokens_total")
	if predicted == "" || predicted == "0" || predicted != actual {
		t.Errorf("predicted cached tokens %s, the engines reported %s", predicted, actual)
	}
	t.Logf("cached tokens over 8 turns: predicted %s, engines %s", predicted, actual)
	for _, want := range []string{`kvmesh_router_routes_total{mode="prefix"} 7`, `kvmesh_router_routes_total{mode="cold"} 1`, `kvmesh_router_cost_model_observations{model="sim"} 3.99`,
		`kvmesh_router_endpoint_requests_total{endpoint="responses"} 4`, `kvmesh_router_endpoint_requests_total{endpoint="messages"} 4`, `kvmesh_router_endpoint_requests_total{endpoint="chat_completions"} 0`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// engineCached reads the engine's cached tokens from a Responses or a
// Messages answer as the client received it: the usage of the body, or of
// the stream's last event (response.completed, message_delta).
func engineCached(t *testing.T, body string, stream bool) int {
	t.Helper()
	if stream && strings.Contains(body, "event: response.completed") {
		body = lastEventData(t, body, "response.completed", "response")
	} else if stream {
		body = lastEventData(t, body, "message_delta", "")
	}
	var v struct {
		Usage struct {
			InputTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
			CacheRead int `json:"cache_read_input_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return v.Usage.InputTokensDetails.CachedTokens + v.Usage.CacheRead
}

// lastEventData returns the data of the stream's event typ (its field
// inner, when set).
func lastEventData(t *testing.T, stream, typ, inner string) string {
	t.Helper()
	for _, ev := range strings.Split(stream, "\n\n") {
		if !strings.HasPrefix(ev, "event: "+typ+"\n") {
			continue
		}
		data := strings.TrimPrefix(ev[strings.Index(ev, "\n")+1:], "data: ")
		if inner == "" {
			return data
		}
		var v map[string]json.RawMessage
		if err := json.Unmarshal([]byte(data), &v); err != nil {
			t.Fatal(err)
		}
		return string(v[inner])
	}
	t.Fatalf("no %s event in %s", typ, stream)
	return ""
}

// metricValue is the value of the metric line named name in m, "" if none.
func metricValue(m, name string) string {
	for _, line := range strings.Split(m, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == name {
			return f[1]
		}
	}
	return ""
}

// TestUnconvertibleAgentRequestsGoByLoadUntouched: a Messages body vLLM
// accepts but the router cannot reproduce (a tool_use block without an id,
// which vLLM names from the clock), and a Responses follow-up of a response
// this router did not name, are routed by load with the body as sent; an
// invalid body is the router's 400.
func TestUnconvertibleAgentRequestsGoByLoadUntouched(t *testing.T) {
	got := make(chan string, 4)
	engine := listen(t, &fasthttp.Server{Handler: func(ctx *fasthttp.RequestCtx) {
		got <- string(ctx.PostBody())
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"id":"msg_1","type":"message","usage":{"input_tokens":3,"cache_read_input_tokens":0}}`)
	}})
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: engine, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
	r.table.SetLoad("a", fleet.Load{}, true, now)
	for _, c := range []struct{ path, body string }{
		{"/v1/messages", `{"model":"sim","max_tokens":4,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","name":"ls","input":{}}]}]}`},
		{"/v1/responses", `{"model":"sim","input":"go on","previous_response_id":"resp_0123"}`},
	} {
		res := r.post(t, c.path, c.body)
		if res.status != 200 || res.header["x-kvmesh-mode"] != "balance" || res.header["x-kvmesh-prompt-tokens"] != "0" {
			t.Fatalf("%s: %d %v %s", c.path, res.status, res.header, res.body)
		}
		if sent := <-got; sent != c.body {
			t.Errorf("%s: the engine got %s, want the body as sent", c.path, sent)
		}
	}
	if res := r.post(t, "/v1/messages", `{"model":"sim","messages":[]}`); res.status != 400 || !strings.Contains(res.body, "max_tokens") {
		t.Errorf("invalid Messages body: %d %s", res.status, res.body)
	}
	if len(got) > 0 {
		t.Errorf("an invalid body reached the engine: %s", <-got)
	}
}

// TestBrokenAgentStreamsEndInTheirAPIsErrorEvent: a stream that breaks
// after reaching the client ends with the error event of its API, not a
// chat completion's.
func TestBrokenAgentStreamsEndInTheirAPIsErrorEvent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 64<<10)
				_, _ = c.Read(buf) // the request (small: one read)
				ev := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n"
				_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s", len(ev)+100, ev)
			}()
		}
	}()
	r := newRouter(t, Settings{}, 1<<20)
	now := time.Now()
	r.table.Upsert(fleet.Info{Name: "a", Models: []string{testModel}, URL: "http://" + ln.Addr().String(), Protocol: fleet.ProtocolVLLM}, now)
	r.table.SetLoad("a", fleet.Load{}, true, now)
	for path, want := range map[string]string{
		"/v1/messages":  `event: error` + "\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream broken: `,
		"/v1/responses": `event: error` + "\n" + `data: {"type":"error","code":"upstream_error","message":"upstream stream broken: `,
	} {
		res := r.post(t, path, `{"model":"sim","max_tokens":4,"stream":true,"input":"hi","messages":[{"role":"user","content":"hi"}]}`)
		if res.status != 200 || !strings.HasPrefix(res.body, "event: message_start\n") || !strings.Contains(res.body, want) || strings.Contains(res.body, "[DONE]") {
			t.Errorf("%s: %d %q, want it to end with %q", path, res.status, res.body, want)
		}
	}
}

// TestStoredFollowUpsPredictWhatTheEngineCaches: a stored conversation
// chained by previous_response_id through two routers, the instructions
// resent each turn as they do not carry over: every follow-up's history is
// on its replica only, yet each router predicts, from the state the id it
// was given carries and the stored output it reads back, exactly the
// cached tokens the engine reports, streamed or not.
func TestStoredFollowUpsPredictWhatTheEngineCaches(t *testing.T) {
	first, sinks, sync := agentFleet(t, 2, Settings{CarryStoredState: true})
	second := newRouter(t, Settings{CarryStoredState: true}, 1<<20)
	now := time.Now()
	for _, name := range []string{"a", "b"} {
		rep := first.table.Snapshot().Replicas[first.table.Snapshot().Find(name)]
		second.table.Upsert(fleet.Info{Name: name, Models: []string{testModel}, URL: rep.URL, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
		second.table.SetLoad(name, fleet.Load{}, true, now)
	}
	syncBoth := func() {
		sync()
		for i, s := range sinks {
			f, keys := s.filter()
			second.table.SetFilter(string(rune('a'+i)), f, uint64(100+i)+uint64(time.Now().UnixNano()%1000000), keys, time.Now())
		}
	}
	syncBoth()
	system := strings.Repeat("You are a careful coding agent working in a large repository. ", 12)
	inputs := []string{
		`"Read main.go and tell me what it does."`,
		`[{"type":"function_call_output","call_id":"call_1","output":"package main\n\nfunc main() { println(\"hi\") }\n"}]`,
		`[{"type":"message","role":"user","content":[{"type":"input_text","text":"Now add a flag for the greeting."}]}]`,
		`"And a test for it, please."`,
	}
	prev := ""
	exact := 0
	for turn, input := range inputs {
		r := []*testRouter{first, second}[turn%2]
		stream := turn%2 == 1
		body := fmt.Sprintf(`{"model":"sim","instructions":%q,"input":%s,"max_output_tokens":20,"stream":%v`, system, input, stream)
		if prev != "" {
			body += fmt.Sprintf(`,"previous_response_id":%q`, prev)
		}
		res := r.post(t, "/v1/responses", body+"}")
		if res.status != 200 {
			t.Fatalf("turn %d: %d %s", turn, res.status, res.body)
		}
		cached := engineCached(t, res.body, stream)
		predicted, _ := strconv.Atoi(res.header["x-kvmesh-cached-tokens"])
		prompt, _ := strconv.Atoi(res.header["x-kvmesh-prompt-tokens"])
		t.Logf("turn %d (stream %v): predicted %d of %d, the engine cached %d", turn, stream, predicted, prompt, cached)
		if turn > 0 {
			if predicted != cached || predicted < 150 {
				t.Fatalf("turn %d (stream %v): predicted %d cached tokens, the engine reports %d", turn, stream, predicted, cached)
			}
			exact++
		}
		prev = responseID(t, res.body, stream)
		if _, _, state, ok := storedid.DecodeState(prev); !ok || state == nil || len(prev) > 330 {
			t.Fatalf("turn %d: the id %q carries no state", turn, prev)
		}
		time.Sleep(20 * time.Millisecond) // the stream's last events reach the engine's sink
		syncBoth()
	}
	// An id of the plain form, as a router of the release before issued
	// it, is followed to its replica all the same, unpredicted.
	replica, engineID, _ := storedid.Decode(prev)
	plain, _ := storedid.Encode(replica, engineID)
	res := first.post(t, "/v1/responses", fmt.Sprintf(`{"model":"sim","instructions":%q,"input":"Done?","max_output_tokens":2,"previous_response_id":%q}`, system, plain))
	if res.status != 200 || res.header["x-kvmesh-replica"] != replica || res.header["x-kvmesh-cached-tokens"] != "0" ||
		!strings.Contains(res.body, `"previous_response_id":"`+plain+`"`) {
		t.Fatalf("a plain id's follow-up: %d %v %s", res.status, res.header, res.body)
	}
	t.Logf("%d follow-ups predicted exactly", exact)
	// Without --carry-stored-state (routers of the release before may be
	// about), ids name their replica alone, and one that carries state is
	// still read: its follow-up is predicted, its answer's id plain.
	plainRouter := newRouter(t, Settings{}, 1<<20)
	for _, name := range []string{"a", "b"} {
		rep := first.table.Snapshot().Replicas[first.table.Snapshot().Find(name)]
		plainRouter.table.Upsert(fleet.Info{Name: name, Models: []string{testModel}, URL: rep.URL, Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}, now)
		plainRouter.table.SetLoad(name, fleet.Load{}, true, now)
		f, keys := sinks[int(name[0]-'a')].filter()
		plainRouter.table.SetFilter(name, f, 1, keys, time.Now())
	}
	res = plainRouter.post(t, "/v1/responses", fmt.Sprintf(`{"model":"sim","instructions":%q,"input":"One more.","max_output_tokens":2,"previous_response_id":%q}`, system, prev))
	predicted, _ := strconv.Atoi(res.header["x-kvmesh-cached-tokens"])
	if id := responseID(t, res.body, false); res.status != 200 || predicted != engineCached(t, res.body, false) || predicted == 0 || !strings.HasPrefix(id, "resp_kvm") {
		t.Fatalf("without --carry-stored-state: %d, predicted %d, id %q: %s", res.status, predicted, id, res.body)
	}
}
