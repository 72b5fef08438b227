package enginesim

import (
	"strconv"
	"strings"
	"sync"

	"github.com/kvmesh/kvmesh/engine"
)

// vLLM's bucket bounds for time to first token and end-to-end latency.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
)

type histogram struct {
	bounds []float64
	counts []uint64 // per bucket, not cumulative
	sum    float64
	n      uint64
}

func newHistogram(bounds []float64) histogram {
	return histogram{bounds: bounds, counts: make([]uint64, len(bounds))}
}

func (h *histogram) observe(v float64) {
	h.sum += v
	h.n++
	for i, b := range h.bounds {
		if v <= b {
			h.counts[i]++
			return
		}
	}
}

// metrics is what /metrics shows: the engine's last stats and latency
// histograms in simulated seconds. The loop writes, handlers read.
type metrics struct {
	mu    sync.Mutex
	eng   engine.Stats
	ttft  histogram
	e2e   histogram
	label string // {engine="0",model_name="..."}
	info  string // vllm:cache_config_info labels
}

func newMetrics(model string, cfg engine.Config) *metrics {
	return &metrics{
		ttft:  newHistogram(ttftBuckets),
		e2e:   newHistogram(e2eBuckets),
		label: `engine="0",model_name="` + escapeLabel(model) + `"`,
		info: `block_size="` + strconv.Itoa(cfg.BlockSize) + `",num_gpu_blocks="` + strconv.Itoa(cfg.KVBlocks) +
			`",enable_prefix_caching="True",prefix_caching_hash_algo="xxhash"`,
	}
}

func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

func (m *metrics) setEngine(st engine.Stats) {
	m.mu.Lock()
	m.eng = st
	m.mu.Unlock()
}

func (m *metrics) observeTTFT(s float64) {
	m.mu.Lock()
	m.ttft.observe(s)
	m.mu.Unlock()
}

func (m *metrics) observeE2E(s float64) {
	m.mu.Lock()
	m.e2e.observe(s)
	m.mu.Unlock()
}

func (m *metrics) stats() engine.Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.eng
}

// appendText appends the Prometheus text exposition.
func (m *metrics) appendText(b []byte) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.eng
	metric := func(name, typ, help string, v float64) {
		b = append(b, "# HELP "+name+" "+help+"\n# TYPE "+name+" "+typ+"\n"+name+"{"+m.label+"} "...)
		b = strconv.AppendFloat(b, v, 'g', -1, 64)
		b = append(b, '\n')
	}
	metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", float64(st.Running))
	metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", float64(st.Waiting))
	metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", st.KVUsage)
	metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", float64(st.PrefixQueries))
	metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", float64(st.PrefixHits))
	metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", float64(st.Preemptions))
	metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", float64(st.PromptTokens))
	metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", float64(st.GenerationTokens))
	b = append(b, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{"+m.label+`,finished_reason="length"} `...)
	b = strconv.AppendUint(b, st.FinishedRequests, 10)
	b = append(b, "\nvllm:request_success_total{"+m.label+`,finished_reason="abort"} `...)
	b = strconv.AppendUint(b, st.AbortedRequests, 10)
	b = append(b, '\n')
	b = m.appendHistogram(b, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (simulated).", &m.ttft)
	b = m.appendHistogram(b, "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds (simulated).", &m.e2e)
	b = append(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{"+m.info+"} 1\n"...)
	return b
}

func (m *metrics) appendHistogram(b []byte, name, help string, h *histogram) []byte {
	b = append(b, "# HELP "+name+" "+help+"\n# TYPE "+name+" histogram\n"...)
	var cum uint64
	for i, bound := range h.bounds {
		cum += h.counts[i]
		b = append(b, name+"_bucket{"+m.label+`,le="`...)
		b = strconv.AppendFloat(b, bound, 'g', -1, 64)
		b = append(b, `"} `...)
		b = strconv.AppendUint(b, cum, 10)
		b = append(b, '\n')
	}
	b = append(b, name+"_bucket{"+m.label+`,le="+Inf"} `...)
	b = strconv.AppendUint(b, h.n, 10)
	b = append(b, "\n"+name+"_sum{"+m.label+"} "...)
	b = strconv.AppendFloat(b, h.sum, 'g', -1, 64)
	b = append(b, "\n"+name+"_count{"+m.label+"} "...)
	b = strconv.AppendUint(b, h.n, 10)
	return append(b, '\n')
}
