package enginesim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/tokenize"
)

// TestRankBalancerScoresLikeVLLM replays vLLM v0.26.0's
// get_core_engine_for_request on fixed snapshots: lowest waiting·4 +
// running, the first rank on a tie, each placement one more waiting until
// the next snapshot.
func TestRankBalancerScoresLikeVLLM(t *testing.T) {
	for _, tc := range []struct {
		name  string
		load  [][2]int // per rank: waiting, running
		picks []int
	}{
		{"idle ranks take turns", [][2]int{{0, 0}, {0, 0}, {0, 0}, {0, 0}}, []int{0, 1, 2, 3, 0, 1, 2, 3, 0}},
		{"waiting weighs four running", [][2]int{{0, 3}, {1, 0}}, []int{0, 1, 0, 1, 0}},
		{"a busy rank is skipped until the others catch up", [][2]int{{2, 8}, {0, 0}, {0, 1}}, []int{1, 2, 1, 2, 1, 2, 1, 2, 0}},
		{"one rank", [][2]int{{5, 5}}, []int{0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newRankBalancer(len(tc.load), time.Hour, func(i int) (int, int) { return tc.load[i][0], tc.load[i][1] })
			now := time.Unix(1e9, 0)
			var got []int
			for range tc.picks {
				got = append(got, b.pick(now))
				now = now.Add(time.Millisecond)
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.picks) {
				t.Fatalf("picks %v, want %v", got, tc.picks)
			}
		})
	}
	t.Run("a snapshot replaces the counted placements", func(t *testing.T) {
		load := [][2]int{{0, 0}, {0, 0}}
		b := newRankBalancer(2, 100*time.Millisecond, func(i int) (int, int) { return load[i][0], load[i][1] })
		now := time.Unix(1e9, 0)
		if r := b.pick(now); r != 0 {
			t.Fatalf("first pick %d", r)
		}
		// Rank 0 reports nothing waiting yet (its request not queued), so a
		// snapshot within the interval keeps the optimistic count ...
		if r := b.pick(now.Add(99 * time.Millisecond)); r != 1 {
			t.Fatalf("pick within the interval %d, want 1", r)
		}
		// ... and one after it forgets both placements.
		load[1] = [2]int{0, 1}
		if r := b.pick(now.Add(100 * time.Millisecond)); r != 0 {
			t.Fatalf("pick after a snapshot %d, want 0", r)
		}
	})
}

func TestPythonIntReadsTheHeaderAsVLLM(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int64
		text string
		ok   bool
	}{
		{"2", 2, "2", true},
		{" 3\t", 3, "3", true},
		{"+1", 1, "1", true},
		{"-1", -1, "-1", true},
		{"-0", 0, "0", true},
		{"007", 7, "7", true},
		{"1_0", 10, "10", true},
		{"99999999999999999999", 1<<63 - 1, "99999999999999999999", true},
		{"", 0, "", false},
		{"x", 0, "", false},
		{"1.0", 0, "", false},
		{"0x1", 0, "", false},
		{"_1", 0, "", false},
		{"1_", 0, "", false},
		{"1__0", 0, "", false},
		{"+", 0, "", false},
		{"1 2", 0, "", false},
	} {
		n, text, ok := pythonInt(tc.in)
		if n != tc.n || text != tc.text || ok != tc.ok {
			t.Errorf("pythonInt(%q) = %d, %q, %v; want %d, %q, %v", tc.in, n, text, ok, tc.n, tc.text, tc.ok)
		}
	}
}

// rankRecorder keeps every batch published, by the rank it is stamped
// with, as wire bytes.
type rankRecorder struct {
	mu      sync.Mutex
	batches map[int][][]byte
}

func (r *rankRecorder) Publish(b *kvevents.Batch) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	ts := b.TS
	b.TS = 0 // wall clock; zero so the bytes compare exactly
	r.batches[b.DPRank] = append(r.batches[b.DPRank], kvevents.AppendBatch(nil, b, kvevents.FormatVLLMMap))
	b.TS = ts
	return nil
}

func (r *rankRecorder) take() map[int][][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.batches
	r.batches = map[int][][]byte{}
	return m
}

func (ts *testServer) doHeader(t testing.TB, path, body string, header ...string) (int, []byte) {
	t.Helper()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + ts.addr + path)
	req.Header.SetMethod("POST")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	req.SetBodyString(body)
	if err := ts.client.DoTimeout(req, resp, 10*time.Second); err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	return resp.StatusCode(), append([]byte(nil), resp.Body()...)
}

func rankCounts(ts *testServer) []uint64 {
	var n []uint64
	for _, r := range ts.srv.ranks {
		n = append(n, r.metrics.stats().FinishedRequests)
	}
	return n
}

// TestDataParallelRanks: four ranks behind one server. The header sends a
// request to its rank, whose cache alone then holds the prompt and whose
// events alone (stamped with the rank) say so; without the header requests
// are spread by vLLM's balancer; a rank out of range is vLLM's 400.
func TestDataParallelRanks(t *testing.T) {
	rec := &rankRecorder{batches: map[int][][]byte{}}
	ts := startServer(t, Config{TimeScale: 0, DataParallelSize: 4, BalanceInterval: time.Hour, Events: rec})
	prompt := words("dp", 40) // 41 tokens with BOS: two full blocks
	ids, _ := tokenize.Builtin{}.Encode(prompt, true)
	body := `{"prompt":"` + prompt + `","max_tokens":1}`
	cached := func(code int, resp []byte) int {
		t.Helper()
		var r struct{ Usage usage }
		if code != 200 || json.Unmarshal(resp, &r) != nil {
			t.Fatalf("status %d: %s", code, resp)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}

	if c := cached(ts.doHeader(t, "/v1/completions", body, "X-data-parallel-rank", "2")); c != 0 {
		t.Fatalf("first request: %d cached", c)
	}
	if got := rankCounts(ts); fmt.Sprint(got) != "[0 0 1 0]" {
		t.Fatalf("requests per rank %v, want [0 0 1 0]", got)
	}
	// Rank 2's batch, byte for byte: the prompt's two blocks as vLLM
	// v0.26 rank 2 sends them, data_parallel_rank 2 last.
	hashes := blockkey.Append(nil, engine.DefaultHashSeed, ids, 16)
	want := kvevents.AppendBatch(nil, &kvevents.Batch{DPRank: 2, Events: []kvevents.Event{{
		Kind: kvevents.KindBlockStored, BlockHashes: hashes[:2], TokenIDs: ids[:32], BlockSize: 16,
		Medium: "GPU", HasGroupIdx: true, SpecKind: "full_attention", ExtraKeys: []byte{0x92, 0xc0, 0xc0},
	}}}, kvevents.FormatVLLMMap)
	if want[len(want)-1] != 0x02 {
		t.Fatalf("batch does not end in rank 2: % x", want[len(want)-4:])
	}
	got := rec.take()
	if len(got) != 1 || len(got[2]) != 1 || !bytes.Equal(got[2][0], want) {
		t.Fatalf("batches by rank %x,\nwant only rank 2's %x", got, want)
	}

	// The same rank hits its cache, another rank has never seen the prompt.
	if c := cached(ts.doHeader(t, "/v1/completions", body, "X-Data-Parallel-Rank", " +0_2 ")); c != 32 {
		t.Fatalf("same rank: %d cached, want 32", c)
	}
	if c := cached(ts.doHeader(t, "/v1/completions", body, "x-data-parallel-rank", "1")); c != 0 {
		t.Fatalf("other rank: %d cached, want 0", c)
	}
	if got := rankCounts(ts); fmt.Sprint(got) != "[0 1 2 0]" {
		t.Fatalf("requests per rank %v, want [0 1 2 0]", got)
	}
	if got := rec.take(); len(got) != 1 || len(got[1]) != 1 {
		t.Fatalf("batches by rank %x, want one of rank 1", got)
	}

	for _, tc := range []struct{ header, status, body string }{
		{"4", "400", `{"error":{"message":"data_parallel_rank 4 is out of range [0, 4).","type":"BadRequestError","param":null,"code":400}}`},
		{"-1", "400", `{"error":{"message":"data_parallel_rank -1 is out of range [0, 4).","type":"BadRequestError","param":null,"code":400}}`},
		{"00012", "400", `{"error":{"message":"data_parallel_rank 12 is out of range [0, 4).","type":"BadRequestError","param":null,"code":400}}`},
	} {
		code, resp := ts.doHeader(t, "/v1/completions", body, "X-data-parallel-rank", tc.header)
		if fmt.Sprint(code) != tc.status || string(resp) != tc.body {
			t.Errorf("rank %q: %d %s, want %s %s", tc.header, code, resp, tc.status, tc.body)
		}
	}

	// Without the header (or with one int() refuses) the balancer spreads
	// requests over idle ranks in rank order, each placement counted as
	// waiting until the next snapshot (an hour away here).
	for i, h := range []string{"", "two", "", "1.5"} {
		var hdr []string
		if h != "" {
			hdr = []string{"X-data-parallel-rank", h}
		}
		b := fmt.Sprintf(`{"prompt":"balanced %d","max_tokens":1}`, i)
		if code, resp := ts.doHeader(t, "/v1/completions", b, hdr...); code != 200 {
			t.Fatalf("balanced request %d: %d %s", i, code, resp)
		}
	}
	if got := rankCounts(ts); fmt.Sprint(got) != "[1 2 3 1]" {
		t.Fatalf("requests per rank %v, want [1 2 3 1]", got)
	}

	// /metrics: every family once, one sample per rank (vLLM's engine label).
	code, m := ts.do(t, "GET", "/metrics", nil)
	if code != 200 {
		t.Fatalf("metrics: %d", code)
	}
	text := string(m)
	for _, line := range []string{
		`vllm:request_success_total{engine="0",model_name="sim",finished_reason="length"} 1`,
		`vllm:request_success_total{engine="2",model_name="sim",finished_reason="length"} 3`,
		`vllm:prefix_cache_hits_total{engine="2",model_name="sim"} 32`,
		`vllm:prefix_cache_hits_total{engine="1",model_name="sim"} 0`,
		`vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",enable_prefix_caching="True",prefix_caching_hash_algo="xxhash",engine="3"} 1`,
	} {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}
	if n := strings.Count(text, "# TYPE vllm:num_requests_waiting gauge\n"); n != 1 {
		t.Errorf("%d TYPE lines for one family", n)
	}
	if n := strings.Count(text, "vllm:time_to_first_token_seconds_count{"); n != 4 {
		t.Errorf("%d TTFT histograms, want one per rank", n)
	}
}

// TestOneRankRefusesOtherRanks: the default server is a DP size of one,
// and like vLLM it serves rank 0 and refuses rank 1.
func TestOneRankRefusesOtherRanks(t *testing.T) {
	ts := startServer(t, Config{TimeScale: 0})
	if code, resp := ts.doHeader(t, "/v1/completions", `{"prompt":"x","max_tokens":1}`, "X-data-parallel-rank", "0"); code != 200 {
		t.Fatalf("rank 0: %d %s", code, resp)
	}
	code, resp := ts.doHeader(t, "/v1/completions", `{"prompt":"x","max_tokens":1}`, "X-data-parallel-rank", "1")
	if want := `{"error":{"message":"data_parallel_rank 1 is out of range [0, 1).","type":"BadRequestError","param":null,"code":400}}`; code != 400 || string(resp) != want {
		t.Fatalf("rank 1: %d %s, want 400 %s", code, resp, want)
	}
}

// FuzzPythonInt: any header value parses without panicking, and an
// accepted one prints as a number that reads back the same.
func FuzzPythonInt(f *testing.F) {
	for _, s := range []string{"2", " -0_1 ", "+", "1__2", "99999999999999999999", "\xa01\x85"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, text, ok := pythonInt(s)
		if !ok {
			return
		}
		n2, text2, ok2 := pythonInt(text)
		if !ok2 || n2 != n || text2 != text {
			t.Fatalf("%q → %d %q, which reads back as %d %q %v", s, n, text, n2, text2, ok2)
		}
		if len(text) < 18 {
			if v, err := strconv.ParseInt(text, 10, 64); err != nil || v != n {
				t.Fatalf("%q → %d %q; strconv reads %d, %v", s, n, text, v, err)
			}
		}
	})
}

// TestBalancerAvoidsABusyRank: with fresh snapshots (every pick here), a
// request without the header goes to the rank with the lower
// waiting·4 + running, not to the one busy decoding.
func TestBalancerAvoidsABusyRank(t *testing.T) {
	ts := startServer(t, Config{TimeScale: 1, DataParallelSize: 2, BalanceInterval: time.Nanosecond})
	// Rank 0 decodes 2,000 tokens (≈ 11 s); the client leaves once the
	// short requests are placed, and the request is aborted.
	ctx, leave := context.WithCancel(context.Background())
	long := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+ts.addr+"/v1/completions", strings.NewReader(`{"prompt":"a long answer","max_tokens":2000}`))
		req.Header.Set("X-data-parallel-rank", "0")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		long <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for ts.srv.ranks[0].metrics.stats().Running != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the long request never ran")
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i := range 3 {
		if code, resp := ts.doHeader(t, "/v1/completions", fmt.Sprintf(`{"prompt":"short %d","max_tokens":1}`, i)); code != 200 {
			t.Fatalf("short request: %d %s", code, resp)
		}
	}
	if got := rankCounts(ts); fmt.Sprint(got) != "[0 3]" {
		t.Fatalf("finished requests per rank %v while rank 0 was busy, want [0 3]", got)
	}
	leave()
	if err := <-long; err == nil {
		t.Fatal("the long request ended before its client left")
	}
}
