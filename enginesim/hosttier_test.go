package enginesim

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
)

// TestHostTierOverHTTP: with --cpu-offload-blocks a prompt the GPU cache
// lost is served from the host tier: its cached tokens count the loaded
// ones, /metrics shows vLLM's connector counters, and the events carry
// medium CPU.
func TestHostTierOverHTTP(t *testing.T) {
	rec := &rankRecorder{batches: map[int][][]byte{}}
	cfg := engine.Config{BlockSize: 16, KVBlocks: 8, CPUBlocks: 64, MaxNumSeqs: 4, MaxNumBatchedTokens: 512, MaxModelLen: 128, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 0, Events: rec})
	cachedOf := func(prompt string) int {
		t.Helper()
		code, resp := ts.doHeader(t, "/v1/completions", `{"prompt":"`+prompt+`","max_tokens":1}`)
		var r struct{ Usage usage }
		if code != 200 || json.Unmarshal(resp, &r) != nil {
			t.Fatalf("status %d: %s", code, resp)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}
	a, b := words("a", 96), words("b", 112) // 97 and 113 tokens with BOS
	if c := cachedOf(a); c != 0 {
		t.Fatalf("cold: %d cached", c)
	}
	cachedOf(b) // needs all 8 GPU blocks: a is gone from the GPU
	if c := cachedOf(a); c != 96 {
		t.Fatalf("from the host tier: %d cached, want 96", c)
	}
	var media []string
	for _, batch := range rec.take()[0] {
		var d kvevents.Batch
		if err := kvevents.DecodeBatch(batch, &d); err != nil {
			t.Fatal(err)
		}
		for _, ev := range d.Events {
			media = append(media, ev.Kind.String()+"/"+ev.Medium)
		}
	}
	if !strings.Contains(strings.Join(media, " "), "BlockStored/GPU BlockStored/CPU") {
		t.Fatalf("events %v lack a GPU store written through to the CPU", media)
	}
	_, m := ts.do(t, "GET", "/metrics", nil)
	for _, line := range []string{
		`vllm:external_prefix_cache_hits_total{engine="0",model_name="sim"} 96`,
		`vllm:external_prefix_cache_queries_total{engine="0",model_name="sim"} 307`,
		`vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 0`,
	} {
		if !strings.Contains(string(m), line+"\n") {
			t.Errorf("metrics lack %q", line)
		}
	}
}

// simTTFT is the simulated time to first token of the request ts served
// last, from rank 0's histogram sum before and after it.
func simTTFT(ts *testServer, serve func()) time.Duration {
	m := ts.srv.ranks[0].metrics
	m.mu.Lock()
	before := m.ttft.sum
	m.mu.Unlock()
	serve()
	m.mu.Lock()
	defer m.mu.Unlock()
	return time.Duration((m.ttft.sum - before) * 1e9).Round(10 * time.Microsecond)
}

// TestTTFTByTierOverHTTP is the figure end to end, in real time (time
// scale 1): an 8,000-token prompt cold, with its prefix on the GPU, and
// with its prefix loaded from the host tier after another prompt pushed it
// out of the 501-block GPU cache. The engine's simulated TTFTs are exact;
// the wall-clock ones, which add HTTP, tokenizing and this machine's
// neighbours, are logged.
func TestTTFTByTierOverHTTP(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 501, CPUBlocks: 2000, MaxNumSeqs: 8, MaxNumBatchedTokens: 8192, MaxModelLen: 8016, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	p, q := words("p", 7999), words("q", 7999) // 8,000 tokens with BOS
	var wall [3]time.Duration
	var use [3]usage
	var sim [3]time.Duration
	sim[0] = simTTFT(ts, func() { wall[0], use[0] = streamTTFT(t, ts.addr, p, 2) })
	sim[1] = simTTFT(ts, func() { wall[1], use[1] = streamTTFT(t, ts.addr, p, 2) })
	streamTTFT(t, ts.addr, q, 2)
	sim[2] = simTTFT(ts, func() { wall[2], use[2] = streamTTFT(t, ts.addr, p, 2) })
	t.Logf("TTFT of an 8,000-token prompt, simulated (wall over HTTP): cold %v (%v), GPU hit %v (%v), host-tier hit %v (%v)",
		sim[0], wall[0].Round(100*time.Microsecond), sim[1], wall[1].Round(100*time.Microsecond), sim[2], wall[2].Round(100*time.Microsecond))
	if use[0].PromptTokens != 8000 || use[0].PromptTokensDetails.CachedTokens != 0 || use[1].PromptTokensDetails.CachedTokens != 7984 || use[2].PromptTokensDetails.CachedTokens != 7984 {
		t.Fatalf("usage cold %+v, GPU %+v, host tier %+v", use[0], use[1], use[2])
	}
	// The engine's own figures (TestTTFTByTier in package engine).
	if fmt.Sprint(sim) != "[259.94ms 5.57ms 26.33ms]" {
		t.Fatalf("simulated TTFTs %v, want [259.94ms 5.57ms 26.33ms]", sim)
	}
}
