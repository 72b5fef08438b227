package enginesim

import (
	"encoding/json"
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

// TestTTFTByTierOverHTTP is the figure end to end, in real time (time
// scale 1): an 8,000-token prompt cold, with its prefix on the GPU, and
// with its prefix loaded from the host tier after another prompt pushed it
// out of the 501-block GPU cache.
func TestTTFTByTierOverHTTP(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 501, CPUBlocks: 2000, MaxNumSeqs: 8, MaxNumBatchedTokens: 8192, MaxModelLen: 8016, Cost: engine.DefaultCost}
	ts := startServer(t, Config{Engine: cfg, TimeScale: 1})
	p, q := words("p", 7999), words("q", 7999) // 8,000 tokens with BOS
	cold, u := streamTTFT(t, ts.addr, p, 2)
	gpu, ug := streamTTFT(t, ts.addr, p, 2)
	streamTTFT(t, ts.addr, q, 2)
	cpu, uc := streamTTFT(t, ts.addr, p, 2)
	t.Logf("TTFT over HTTP, 8,000-token prompt: cold %v, host-tier hit %v (%d cached), GPU hit %v (%d cached)",
		cold.Round(100*time.Microsecond), cpu.Round(100*time.Microsecond), uc.PromptTokensDetails.CachedTokens, gpu.Round(100*time.Microsecond), ug.PromptTokensDetails.CachedTokens)
	if u.PromptTokens != 8000 || u.PromptTokensDetails.CachedTokens != 0 || ug.PromptTokensDetails.CachedTokens != 7984 || uc.PromptTokensDetails.CachedTokens != 7984 {
		t.Fatalf("usage cold %+v, GPU %+v, CPU %+v", u, ug, uc)
	}
	// Noise only adds delay: the hits must stay far below the ≈ 260 ms cold.
	if cpu > cold/2 || gpu > cold/2 || cold < 250*time.Millisecond {
		t.Fatalf("cold %v, host-tier hit %v, GPU hit %v", cold, cpu, gpu)
	}
}
