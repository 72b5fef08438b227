package enginesim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/tokenize"
)

type testServer struct {
	srv    *Server
	addr   string
	client *fasthttp.HostClient
}

// startServer runs a Server and its HTTP listener on loopback until the
// test ends. Zero engine fields get small defaults.
func startServer(t testing.TB, cfg Config) *testServer {
	t.Helper()
	if cfg.Model == "" {
		cfg.Model = "sim"
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = tokenize.Builtin{}
	}
	if cfg.Engine.BlockSize == 0 {
		cfg.Engine = engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 8192, Cost: engine.DefaultCost}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	engineDone := make(chan struct{})
	go func() { srv.Run(ctx); close(engineDone) }()
	hs := &fasthttp.Server{Handler: srv.Handler, MaxRequestBodySize: 64 << 20}
	serveDone := make(chan struct{})
	go func() { _ = hs.Serve(ln); close(serveDone) }()
	t.Cleanup(func() {
		cancel()
		<-engineDone
		sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer scancel()
		_ = hs.ShutdownWithContext(sctx)
		<-serveDone
	})
	return &testServer{srv: srv, addr: ln.Addr().String(), client: &fasthttp.HostClient{Addr: ln.Addr().String(), MaxConns: 1024}}
}

func (ts *testServer) do(t testing.TB, method, path string, body []byte) (int, []byte) {
	t.Helper()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + ts.addr + path)
	req.Header.SetMethod(method)
	req.SetBody(body)
	if err := ts.client.DoTimeout(req, resp, 10*time.Second); err != nil {
		t.Errorf("%s %s: %v", method, path, err) // may run off the test goroutine
		return 0, nil
	}
	return resp.StatusCode(), append([]byte(nil), resp.Body()...)
}

// onLoop runs f on the engine goroutine, between steps.
func (ts *testServer) onLoop(t testing.TB, f func(e *engine.Engine)) {
	t.Helper()
	done := make(chan struct{})
	ts.srv.ranks[0].loop.control <- func() { f(ts.srv.ranks[0].eng); close(done) }
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("engine loop did not run the control function")
	}
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// words returns a prompt of n builtin tokens (plus BOS when encoded).
func words(prefix string, n int) string {
	var sb strings.Builder
	for i := range n {
		if i > 0 {
			sb.WriteByte(' ')
		}
		fmt.Fprintf(&sb, "%s%d", prefix, i)
	}
	return sb.String()
}

// streamTTFT sends a streamed completion and returns the time to the first
// data event and the final usage.
func streamTTFT(t *testing.T, addr, prompt string, maxTokens int) (time.Duration, usage) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	start := time.Now()
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var ttft time.Duration
	var u usage
	var texts, done int
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		if ttft == 0 {
			ttft = time.Since(start)
		}
		data := strings.TrimPrefix(line, "data: ")
		if data == "[DONE]" {
			done++
			continue
		}
		var chunk struct {
			Choices []struct {
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		if chunk.Usage != nil {
			u = *chunk.Usage
		}
		texts += len(chunk.Choices)
	}
	if done != 1 || texts != maxTokens || u.CompletionTokens != maxTokens {
		t.Fatalf("stream: %d [DONE], %d text chunks, usage %+v; want 1, %d, %d completion tokens", done, texts, u, maxTokens, maxTokens)
	}
	return ttft, u
}

func TestSamePromptTwiceIsServedFromCache(t *testing.T) {
	// Real time (time scale 1): 2,000 words + BOS = 2,001 tokens. The
	// machine is shared, and scheduling noise only ever adds delay, so an
	// attempt is a cold request and the best of three warm repeats, and a
	// fresh prompt gets up to three attempts.
	ts := startServer(t, Config{TimeScale: 1})
	for attempt := range 3 {
		prompt := words(fmt.Sprintf("w%dx", attempt), 2000)
		cold, u1 := streamTTFT(t, ts.addr, prompt, 4)
		if u1.PromptTokens != 2001 || u1.PromptTokensDetails.CachedTokens != 0 {
			t.Fatalf("first usage %+v, want 2001 prompt tokens, none cached", u1)
		}
		warm := time.Hour
		for range 3 {
			d, u2 := streamTTFT(t, ts.addr, prompt, 4)
			if u2.PromptTokensDetails.CachedTokens != 2000 {
				t.Fatalf("repeat cached %d tokens, want 2000 (all 125 full blocks)", u2.PromptTokensDetails.CachedTokens)
			}
			warm = min(warm, d)
		}
		t.Logf("2,001-token prompt: TTFT cold %v, warm %v (%.3f×); cached tokens 0 then 2000", cold, warm, float64(warm)/float64(cold))
		if warm <= cold/5 {
			// The metrics count what vLLM counts: prompt tokens queried and hit.
			st := ts.srv.ranks[0].metrics.stats()
			if q, h := uint64(4*2001*(attempt+1)), uint64(3*2000*(attempt+1)); st.PrefixQueries != q || st.PrefixHits != h {
				t.Fatalf("prefix cache queries/hits %d/%d, want %d/%d", st.PrefixQueries, st.PrefixHits, q, h)
			}
			return
		}
	}
	t.Fatal("warm TTFT above 0.2 × cold in three attempts")
}

func TestBadInputGetsVLLMStyleErrors(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 512, MaxModelLen: 256, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 0})
	long := words("x", 300)
	// Nested 3,000,000 deep (6 MB): encoding/json stops at 10,000 levels.
	deep := strings.Repeat("[", 3_000_000) + strings.Repeat("]", 3_000_000)
	cases := []struct {
		path, body string
		code       int
	}{
		{"/v1/completions", `{"prompt":"hi"`, 400},
		{"/v1/completions", `[]`, 400},
		{"/v1/completions", ``, 400},
		{"/v1/completions", `{}`, 400},
		{"/v1/completions", `{"prompt":null}`, 400},
		{"/v1/completions", `{"prompt":5}`, 400},
		{"/v1/completions", `{"prompt":{"a":1}}`, 400},
		{"/v1/completions", `{"prompt":[]}`, 400},
		{"/v1/completions", `{"prompt":["a","b"]}`, 400},
		{"/v1/completions", `{"prompt":[1,-2]}`, 400},
		{"/v1/completions", `{"prompt":[1,2.5]}`, 400},
		{"/v1/completions", `{"prompt":[1,null,3]}`, 400},
		{"/v1/completions", `{"prompt":[null]}`, 400},
		{"/v1/completions", `{"prompt":"hi","max_tokens":0}`, 400},
		{"/v1/completions", `{"prompt":"hi","max_tokens":-3}`, 400},
		{"/v1/completions", `{"prompt":"hi","max_tokens":"8"}`, 400},
		{"/v1/completions", `{"prompt":"hi","max_tokens":1.5}`, 400},
		{"/v1/completions", `{"prompt":"hi","max_tokens":255}`, 400},
		// sys.maxsize for "no limit": the prompt plus it wraps negative.
		{"/v1/completions", `{"prompt":"hi","max_tokens":9223372036854775807}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9223372036854775807}`, 400},
		{"/v1/completions", `{"prompt":"hi","stream_options":{"include_usage":false}}`, 400},
		{"/v1/completions", `{"prompt":"` + long + `"}`, 400},
		{"/v1/completions", `{"prompt":"hi","stream":"yes"}`, 400},
		{"/v1/completions", `{"prompt":"hi","stream_options":{"include_usage":true}}`, 400},
		{"/v1/completions", `{"prompt":"hi","n":3}`, 400},
		{"/v1/completions", "{\"prompt\":\"a\xff\xfeb\"}", 400},
		{"/v1/completions", `{"prompt":"","add_special_tokens":false}`, 400},
		{"/v1/completions", `{"prompt":"hi","model":"other"}`, 404},
		{"/v1/chat/completions", `{}`, 400},
		{"/v1/chat/completions", `{"messages":"hi"}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`, 400},
		{"/v1/chat/completions", `{"messages":[1,2]}`, 400},
		{"/v1/chat/completions", `{"messages":[null]}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"continue_final_message":true}`, 400},
		{"/tokenize", `{"prompt":[1,2]}`, 400},
		{"/tokenize", `{}`, 400},
		{"/v1/completions", `{"prompt":"hi","x":` + deep + `}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":` + deep + `}]}`, 400},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":` + deep + `}}]}`, 400},
		{"/tokenize", `{"messages":[{"role":"user","content":"hi"}],"x":` + deep + `}`, 400},
	}
	for _, c := range cases {
		code, body := ts.do(t, "POST", c.path, []byte(c.body))
		var e vllmError
		if err := json.Unmarshal(body, &e); err != nil || code != c.code || e.Error.Code != c.code || e.Error.Message == "" {
			t.Fatalf("%s %.200q: status %d body %s; want %d with a vLLM error object", c.path, c.body, code, body, c.code)
		}
		if c.code == 400 && e.Error.Type != "BadRequestError" {
			t.Fatalf("%s %.200q: error type %q", c.path, c.body, e.Error.Type)
		}
		if strings.Contains(e.Error.Message, "Go ") || strings.Contains(e.Error.Message, "apiRequest") {
			t.Errorf("%s %.200q: %q names Go types", c.path, c.body, e.Error.Message)
		}
	}
	// A field of the wrong type is named as the client wrote it.
	if _, body := ts.do(t, "POST", "/v1/completions", []byte(`{"prompt":"hi","max_tokens":"8"}`)); !strings.Contains(string(body), "max_tokens must be an integer, not string") {
		t.Errorf("max_tokens as a string: %s", body)
	}
	// stream_options is tested for its truth: {} passes without a stream.
	if code, body := ts.do(t, "POST", "/v1/completions", []byte(`{"prompt":"hi","max_tokens":2,"stream_options":{}}`)); code != 200 {
		t.Fatalf("stream_options {} without a stream: %d %s", code, body)
	}
	if code, _ := ts.do(t, "GET", "/v1/completions", nil); code != 405 {
		t.Fatalf("GET /v1/completions: %d, want 405", code)
	}
	if code, _ := ts.do(t, "GET", "/nope", nil); code != 404 {
		t.Fatalf("GET /nope: %d, want 404", code)
	}
	// Still healthy and serving.
	if code, _ := ts.do(t, "GET", "/health", nil); code != 200 {
		t.Fatalf("health %d after bad input", code)
	}
	code, body := ts.do(t, "POST", "/v1/completions", []byte(`{"prompt":[5,6,7],"max_tokens":3}`))
	if code != 200 || !bytes.Contains(body, []byte(`"completion_tokens":3`)) {
		t.Fatalf("good request after bad input: %d %s", code, body)
	}
}

func TestEndpointsSpeakVLLM(t *testing.T) {
	ts := startServer(t, Config{Model: "llama-sim", TimeScale: 0})

	code, body := ts.do(t, "GET", "/v1/models", nil)
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string  `json:"id"`
			Object      string  `json:"object"`
			OwnedBy     string  `json:"owned_by"`
			Root        string  `json:"root"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &models); err != nil || code != 200 || models.Object != "list" || len(models.Data) != 1 ||
		models.Data[0].ID != "llama-sim" || models.Data[0].MaxModelLen != 8192 || models.Data[0].OwnedBy != "vllm" || models.Data[0].Parent != nil {
		t.Fatalf("/v1/models: %d %s", code, body)
	}

	messages := `[{"role":"system","content":"Be brief."},{"role":"user","content":"Where is the cache?"}]`
	code, body = ts.do(t, "POST", "/tokenize", []byte(`{"model":"llama-sim","messages":`+messages+`}`))
	var tok struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &tok); err != nil || code != 200 || tok.Count != len(tok.Tokens) || tok.MaxModelLen != 8192 {
		t.Fatalf("/tokenize: %d %s", code, body)
	}
	_, want, _ := tokenize.Builtin{}.EncodeChat(tokenize.Chat{Messages: json.RawMessage(messages), AddGenerationPrompt: true})
	if fmt.Sprint(want) != fmt.Sprint(tok.Tokens) {
		t.Fatalf("/tokenize chat tokens %v, want %v", tok.Tokens, want)
	}

	code, body = ts.do(t, "POST", "/v1/chat/completions", []byte(`{"model":"llama-sim","messages":`+messages+`,"max_tokens":5}`))
	var chat struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Model   string `json:"model"`
		Choices []struct {
			Message struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(body, &chat); err != nil || code != 200 || chat.Object != "chat.completion" || !strings.HasPrefix(chat.ID, "chatcmpl-") ||
		len(chat.Choices) != 1 || chat.Choices[0].Message.Role != "assistant" || chat.Choices[0].FinishReason != "length" ||
		chat.Usage.PromptTokens != tok.Count || chat.Usage.CompletionTokens != 5 || chat.Usage.TotalTokens != tok.Count+5 {
		t.Fatalf("chat completion: %d %s", code, body)
	}
	// Output text re-tokenizes to exactly the generated tokens.
	if ids, _ := (tokenize.Builtin{}).Encode(chat.Choices[0].Message.Content, false); len(ids) != 5 {
		t.Fatalf("output %q is %d tokens, want 5", chat.Choices[0].Message.Content, len(ids))
	}
	// Same request, same answer; the prompt's full blocks now hit.
	_, again := ts.do(t, "POST", "/v1/chat/completions", []byte(`{"model":"llama-sim","messages":`+messages+`,"max_tokens":5}`))
	if !bytes.Contains(again, []byte(chat.Choices[0].Message.Content)) {
		t.Fatalf("repeat answered differently: %s", again)
	}

	code, body = ts.do(t, "GET", "/metrics", nil)
	for _, name := range []string{"vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{",
		"vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{", `model_name="llama-sim"`, "vllm:time_to_first_token_seconds_bucket{"} {
		if code != 200 || !bytes.Contains(body, []byte(name)) {
			t.Fatalf("/metrics lacks %s:\n%s", name, body)
		}
	}
}

// rawPost sends a completion request over a connection of its own, which
// the test closes to play a client that leaves.
func rawPost(t *testing.T, addr, body string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return conn
}

func TestClientDisconnectAbortsStream(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 256, MaxNumSeqs: 8, MaxNumBatchedTokens: 2048, MaxModelLen: 2048, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	conn := rawPost(t, ts.addr, `{"prompt":"`+words("d", 100)+`","max_tokens":1500,"stream":true}`)
	r := bufio.NewReader(conn)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(line, "data: ") {
			break
		}
	}
	if st := ts.srv.ranks[0].metrics.stats(); st.Running != 1 || st.UsedBlocks == 0 {
		t.Fatalf("while streaming: %+v, want one running request holding blocks", st)
	}
	conn.Close()
	deadline := time.Now().Add(3 * time.Second)
	for {
		st := ts.srv.ranks[0].metrics.stats()
		if st.Running == 0 && st.UsedBlocks == 0 {
			if st.GenerationTokens >= 1500 {
				t.Fatalf("request ran to completion (%d tokens) instead of being aborted", st.GenerationTokens)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("3 s after disconnect: %+v, want the request aborted and its blocks freed", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestClientDisconnectAbortsNonStreamed: a non-streamed request writes
// nothing until its end, yet a client that leaves it is noticed and the
// request aborted within a second, counted as vLLM counts it.
func TestClientDisconnectAbortsNonStreamed(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 256, MaxNumSeqs: 8, MaxNumBatchedTokens: 2048, MaxModelLen: 2048, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	conn := rawPost(t, ts.addr, `{"prompt":"`+words("n", 100)+`","max_tokens":1500}`)
	deadline := time.Now().Add(3 * time.Second)
	for ts.srv.ranks[0].metrics.stats().GenerationTokens == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("request not generating: %+v", ts.srv.ranks[0].metrics.stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st := ts.srv.ranks[0].metrics.stats(); st.Running != 1 {
		t.Fatalf("while generating: %+v, want one running request", st)
	}
	conn.Close()
	left := time.Now()
	for {
		st := ts.srv.ranks[0].metrics.stats()
		if st.Running == 0 && st.UsedBlocks == 0 {
			if st.GenerationTokens >= 1500 || st.AbortedRequests != 1 {
				t.Fatalf("request not aborted: %+v", st)
			}
			break
		}
		if time.Since(left) > time.Second {
			t.Fatalf("1 s after disconnect: %+v, want the request aborted and its blocks freed", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("running=0 %v after the client left", time.Since(left).Round(time.Millisecond))
	_, m := ts.do(t, "GET", "/metrics", nil)
	if want := `vllm:request_success_total{engine="0",model_name="sim",finished_reason="abort"} 1`; !strings.Contains(string(m), want) {
		t.Errorf("metrics lack %q:\n%s", want, m)
	}
}

// TestClientDisconnectAbortsQueuedStream: a stream still queued has written
// nothing, yet its client leaving takes it off the queue within a second.
func TestClientDisconnectAbortsQueuedStream(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 256, MaxNumSeqs: 1, MaxNumBatchedTokens: 2048, MaxModelLen: 2048, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	busy := rawPost(t, ts.addr, `{"prompt":"`+words("b", 100)+`","max_tokens":1500}`)
	defer busy.Close()
	queued := rawPost(t, ts.addr, `{"prompt":"`+words("q", 100)+`","max_tokens":1500,"stream":true}`)
	deadline := time.Now().Add(3 * time.Second)
	for st := ts.srv.ranks[0].metrics.stats(); st.Running != 1 || st.Waiting != 1; st = ts.srv.ranks[0].metrics.stats() {
		if time.Now().After(deadline) {
			t.Fatalf("want one running and one queued: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	queued.Close()
	left := time.Now()
	for st := ts.srv.ranks[0].metrics.stats(); st.Waiting != 0 || st.AbortedRequests != 1; st = ts.srv.ranks[0].metrics.stats() {
		if time.Since(left) > time.Second {
			t.Fatalf("1 s after the queued stream's client left: %+v, want it aborted", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// wireRecorder is an event sink that sends every batch through the msgpack
// codec and replays the decoded events into a resident multiset.
type wireRecorder struct {
	mu       sync.Mutex
	buf      []byte
	batch    kvevents.Batch
	resident map[uint64]int
	stored   int
	removed  int
	cleared  int
}

func (w *wireRecorder) Publish(b *kvevents.Batch) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = kvevents.AppendBatch(w.buf[:0], b, kvevents.FormatVLLMMap)
	if err := kvevents.DecodeBatch(w.buf, &w.batch); err != nil {
		return err
	}
	for _, ev := range w.batch.Events {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			if ev.Medium != "GPU" || len(ev.TokenIDs) != len(ev.BlockHashes)*ev.BlockSize {
				return fmt.Errorf("malformed BlockStored %+v", ev)
			}
			for _, h := range ev.BlockHashes {
				w.resident[h]++
				w.stored++
			}
		case kvevents.KindBlockRemoved:
			for _, h := range ev.BlockHashes {
				if w.resident[h]--; w.resident[h] == 0 {
					delete(w.resident, h)
				}
				w.removed++
			}
		case kvevents.KindAllBlocksCleared:
			clear(w.resident)
			w.cleared++
		}
	}
	return nil
}

func TestEventsOverHTTPReproduceResidentSet(t *testing.T) {
	rec := &wireRecorder{resident: map[uint64]int{}}
	cfg := engine.Config{BlockSize: 16, KVBlocks: 48, MaxNumSeqs: 8, MaxNumBatchedTokens: 512, MaxModelLen: 256, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 0, Events: rec})
	compare := func(when string) {
		t.Helper()
		ts.onLoop(t, func(e *engine.Engine) {
			rec.mu.Lock()
			defer rec.mu.Unlock()
			want := e.Resident()
			ok := len(want) == len(rec.resident)
			for h, n := range want {
				ok = ok && rec.resident[h] == n
			}
			if !ok {
				t.Errorf("%s: replayed %d hashes, engine holds %d", when, len(rec.resident), len(want))
			}
		})
	}
	send := func(n int, tag string) {
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Three shared system prompts, distinct questions.
				prompt := words(fmt.Sprintf("sys%d_", i%3), 40) + " " + words(fmt.Sprintf("%s%d_", tag, i), 10+i%30)
				code, body := ts.do(t, "POST", "/v1/completions", []byte(`{"prompt":"`+prompt+`","max_tokens":`+fmt.Sprint(1+i%20)+`}`))
				if code != 200 {
					t.Errorf("status %d: %s", code, body)
				}
			}()
		}
		wg.Wait()
	}
	send(40, "a")
	compare("after 40 concurrent requests")
	code, _ := ts.do(t, "POST", "/reset_prefix_cache", nil)
	if code != 200 {
		t.Fatalf("reset: %d", code)
	}
	compare("after reset")
	send(40, "b")
	compare("after 40 more")
	rec.mu.Lock()
	defer rec.mu.Unlock()
	t.Logf("%d stored, %d removed, %d cleared, %d resident", rec.stored, rec.removed, rec.cleared, len(rec.resident))
	if rec.removed == 0 || rec.cleared != 1 {
		t.Fatalf("script did not exercise eviction (%d removed) and reset (%d cleared)", rec.removed, rec.cleared)
	}
}

func FuzzHandler(f *testing.F) {
	cfg := engine.Config{BlockSize: 4, KVBlocks: 64, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, MaxModelLen: 128, Cost: engine.DefaultCost}
	// The prefill role: a fuzzed do_remote_prefill never reaches out to a
	// host (FuzzKVTransferParams covers those parameters).
	srv, err := New(Config{Model: "m", Tokenizer: tokenize.Builtin{}, Engine: cfg, KVRole: KVRolePrefill, SideChannel: "127.0.0.1:1"})
	if err != nil {
		f.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go srv.Run(ctx)
	paths := []string{"/v1/completions", "/v1/chat/completions", "/tokenize", readPath, notifyPath, "/v1/responses", "/v1/messages"}
	for _, seed := range []string{
		`{"prompt":"hello there","max_tokens":3}`,
		`{"prompt":[1,2,3],"max_tokens":2,"model":"m"}`,
		`{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"add_special_tokens":true}`,
		`{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":"hello there","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"remote_block_ids":null}}`,
		`{"remote_engine_id":"x","remote_request_id":"1","remote_block_ids":[0,1]}`,
		`{"input":[{"type":"message","role":"user","content":"hi"}],"max_output_tokens":2,"previous_response_id":"resp_1"}`,
		`{"model":"m","max_tokens":2,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`,
	} {
		for i := range paths {
			f.Add(uint8(i), []byte(seed))
		}
	}
	f.Fuzz(func(t *testing.T, path uint8, body []byte) {
		var rc fasthttp.RequestCtx
		rc.Request.SetRequestURI(paths[int(path)%len(paths)])
		rc.Request.Header.SetMethod("POST")
		rc.Request.SetBody(body)
		srv.Handler(&rc)
		code := rc.Response.StatusCode()
		switch code {
		case 200:
		case 400, 404:
			var e vllmError
			if err := json.Unmarshal(rc.Response.Body(), &e); err != nil || e.Error.Code != code || e.Error.Message == "" {
				t.Fatalf("status %d with body %q", code, rc.Response.Body())
			}
		default:
			t.Fatalf("status %d for %q", code, body)
		}
	})
}

func benchBody(maxTokens int) []byte {
	return []byte(`{"model":"sim","prompt":"Summarise the cache state of replica seven in one line please","max_tokens":` + fmt.Sprint(maxTokens) + `}`)
}

// BenchmarkRequestSequential is enginesim's own overhead per request at
// time scale 0: one client, one request at a time, over loopback. The
// health sub-benchmark is the same client and server doing no work: the
// difference is what enginesim adds (parse, tokenize, engine steps, JSON).
// cpu-µs/req is the process's CPU time per request (client and server), the
// figure that holds up on a machine shared with other jobs; µs/req is wall
// time.
func BenchmarkRequestSequential(b *testing.B) {
	for _, c := range []struct {
		name, path string
		body       []byte
	}{
		{"baseline=health", "/health", nil},
		{"max_tokens=1", "/v1/completions", benchBody(1)},
		{"max_tokens=16", "/v1/completions", benchBody(16)},
	} {
		b.Run(c.name, func(b *testing.B) {
			ts := startServer(b, Config{TimeScale: 0})
			req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
			req.SetRequestURI("http://" + ts.addr + c.path)
			if c.body != nil {
				req.Header.SetMethod("POST")
				req.SetBody(c.body)
			}
			b.ReportAllocs()
			cpu := processCPU()
			for b.Loop() {
				if err := ts.client.Do(req, resp); err != nil || resp.StatusCode() != 200 {
					b.Fatal(err, resp.StatusCode())
				}
			}
			b.ReportMetric(float64((processCPU()-cpu).Microseconds())/float64(b.N), "cpu-µs/req")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/req")
		})
	}
}

// BenchmarkRequestParallel is throughput at time scale 0: 32 clients of
// small non-streamed requests (16 output tokens) over loopback.
func BenchmarkRequestParallel(b *testing.B) {
	ts := startServer(b, Config{TimeScale: 0})
	body := benchBody(16)
	b.SetParallelism(16) // × GOMAXPROCS client goroutines
	b.ResetTimer()
	cpu := processCPU()
	b.RunParallel(func(pb *testing.PB) {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.SetRequestURI("http://" + ts.addr + "/v1/completions")
		req.Header.SetMethod("POST")
		req.SetBody(body)
		for pb.Next() {
			if err := ts.client.Do(req, resp); err != nil || resp.StatusCode() != 200 {
				b.Error(err, resp.StatusCode())
				return
			}
		}
	})
	b.ReportMetric(float64((processCPU()-cpu).Microseconds())/float64(b.N), "cpu-µs/req")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
}

// BenchmarkHandler is enginesim's own work per request without the
// network: parse, tokenize, hand-off to the engine loop, the engine steps,
// and the JSON response, at time scale 0.
func BenchmarkHandler(b *testing.B) {
	for _, maxTokens := range []int{1, 16} {
		b.Run(fmt.Sprintf("max_tokens=%d", maxTokens), func(b *testing.B) {
			srv, err := New(Config{Model: "sim", Tokenizer: tokenize.Builtin{}, Engine: engine.Config{
				BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 8192, Cost: engine.DefaultCost}})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go srv.Run(ctx)
			body := benchBody(maxTokens)
			var rc fasthttp.RequestCtx
			b.ReportAllocs()
			cpu := processCPU()
			for b.Loop() {
				rc.Request.Reset()
				rc.Response.Reset()
				rc.Request.SetRequestURI("/v1/completions")
				rc.Request.Header.SetMethod("POST")
				rc.Request.SetBody(body)
				srv.Handler(&rc)
				if rc.Response.StatusCode() != 200 {
					b.Fatalf("status %d: %s", rc.Response.StatusCode(), rc.Response.Body())
				}
			}
			b.ReportMetric(float64((processCPU()-cpu).Microseconds())/float64(b.N), "cpu-µs/req")
		})
	}
}

// TestAPIKeyGuardsV1LikeVLLM: with an API key, /v1 calls need the bearer
// token and get vLLM's 401 without it; /health, /metrics and /tokenize stay
// open, as in vLLM.
func TestAPIKeyGuardsV1LikeVLLM(t *testing.T) {
	ts := startServer(t, Config{APIKey: "engine-secret"})
	call := func(method, path, auth string, body []byte) (int, string) {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		req.SetRequestURI("http://" + ts.addr + path)
		req.Header.SetMethod(method)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		req.SetBody(body)
		if err := ts.client.DoTimeout(req, resp, 10*time.Second); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		return resp.StatusCode(), string(resp.Body())
	}
	chat := []byte(`{"model":"sim","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`)
	for _, c := range []struct {
		method, path, auth string
		body               []byte
		want               int
	}{
		{"GET", "/v1/models", "", nil, 401},
		{"GET", "/v1/models", "Bearer wrong", nil, 401},
		{"GET", "/v1/models", "engine-secret", nil, 401},
		{"POST", "/v1/chat/completions", "", chat, 401},
		{"GET", "/v1/models", "Bearer engine-secret", nil, 200},
		{"POST", "/v1/chat/completions", "Bearer engine-secret", chat, 200},
		{"GET", "/health", "", nil, 200},
		{"GET", "/metrics", "", nil, 200},
		{"POST", "/tokenize", "", []byte(`{"model":"sim","prompt":"hi"}`), 200},
	} {
		code, body := call(c.method, c.path, c.auth, c.body)
		if code != c.want {
			t.Errorf("%s %s with %q: %d %s, want %d", c.method, c.path, c.auth, code, body, c.want)
		}
		if c.want == 401 && body != `{"error":"Unauthorized"}` {
			t.Errorf("%s %s: body %s, want vLLM's", c.method, c.path, body)
		}
	}
}

// vllmError is vLLM's error body since v0.10.1: ErrorResponse{error: ErrorInfo}.
type vllmError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

// TestStreamsAfterTheEngineStoppedEnd: a request that reaches the submit
// queue as the engine loop stops (the binary stops the engine before the
// HTTP server) gets an error, not a stream that waits for good.
func TestStreamsAfterTheEngineStoppedEnd(t *testing.T) {
	srv, err := New(Config{Model: "sim", Tokenizer: tokenize.Builtin{},
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 8192, Cost: engine.DefaultCost}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	srv.Run(ctx)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &fasthttp.Server{Handler: srv.Handler}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() {
		// A stream that never ends would hold Shutdown for good.
		sctx, stop := context.WithTimeout(context.Background(), 2*time.Second)
		defer stop()
		_ = hs.ShutdownWithContext(sctx)
	})
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	for i := range 8 {
		req.SetRequestURI("http://" + ln.Addr().String() + "/v1/completions")
		req.Header.SetMethod("POST")
		req.SetBodyString(`{"prompt":"hi","max_tokens":4,"stream":true}`)
		if err := fasthttp.DoTimeout(req, resp, 3*time.Second); err != nil {
			t.Fatalf("stream %d after the engine stopped: %v", i, err)
		}
		if code := resp.StatusCode(); code == 200 && !strings.Contains(string(resp.Body()), `"error"`) || code != 200 && code != 503 {
			t.Fatalf("stream %d after the engine stopped: %d %s", i, code, resp.Body())
		}
	}
}

// TestStreamOptionsIncludeUsageDefaultsToTrue: vLLM's StreamOptions has
// include_usage = True (OpenAI's API defaults it to false), so
// stream_options: {} gets the usage chunk.
func TestStreamOptionsIncludeUsageDefaultsToTrue(t *testing.T) {
	ts := startServer(t, Config{TimeScale: 0})
	for opts, want := range map[string]bool{`{}`: true, `{"include_usage":true}`: true, `{"include_usage":false}`: false, `{"include_usage":null}`: false, `null`: false} {
		code, body := ts.do(t, "POST", "/v1/completions", []byte(`{"prompt":"hi","max_tokens":2,"stream":true,"stream_options":`+opts+`}`))
		if code != 200 || strings.Contains(string(body), `"usage":{`) != want {
			t.Errorf("stream_options %s: %d, usage chunk %v, want %v:\n%s", opts, code, !want, want, body)
		}
	}
}

// Under --scheduling-policy priority a queued request with a lower priority
// value goes first; without it, a non-zero priority is refused as vLLM does.
func TestPriorityScheduling(t *testing.T) {
	off := startServer(t, Config{})
	code, body := off.do(t, "POST", "/v1/completions", []byte(`{"prompt":"hi","max_tokens":1,"priority":1}`))
	if code != 400 || !strings.Contains(string(body), "Got priority 1 but Priority scheduling is not enabled.") {
		t.Fatalf("priority without priority scheduling: %d %s", code, body)
	}
	if code, body := off.do(t, "POST", "/v1/completions", []byte(`{"prompt":"hi","max_tokens":1,"priority":0}`)); code != 200 {
		t.Fatalf("priority 0: %d %s", code, body)
	}

	cfg := engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 1, MaxNumBatchedTokens: 8192, MaxModelLen: 8192,
		Cost: engine.DefaultCost, PriorityScheduling: true}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	var mu sync.Mutex
	var done []string
	var wg sync.WaitGroup
	send := func(name, body string) {
		defer wg.Done()
		if code, b := ts.do(t, "POST", "/v1/completions", []byte(body)); code != 200 {
			t.Errorf("%s: %d %s", name, code, b)
		}
		mu.Lock()
		done = append(done, name)
		mu.Unlock()
	}
	wg.Add(3)
	// busy holds the one running slot for 40 steps (≥ 200 ms); low and
	// high queue behind it, low first.
	go send("busy", `{"prompt":"busy","max_tokens":40}`)
	time.Sleep(50 * time.Millisecond)
	go send("low", `{"prompt":"low","max_tokens":1,"priority":5}`)
	time.Sleep(30 * time.Millisecond)
	go send("high", `{"prompt":"high","max_tokens":1,"priority":-1}`)
	wg.Wait()
	if got := strings.Join(done, " "); got != "busy high low" {
		t.Fatalf("finished in order %s, want busy high low", got)
	}
}
