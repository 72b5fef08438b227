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

// metrics is what /metrics shows of one rank: the engine's last stats and
// latency histograms in simulated seconds. The loop writes, handlers read.
type metrics struct {
	mu    sync.Mutex
	eng   engine.Stats
	ttft  histogram
	e2e   histogram
	label string // {engine="0",model_name="..."}
	info  string // vllm:cache_config_info labels
	// external: the engine has a host tier or plays a side of
	// disaggregation, whose hits vLLM counts as a connector's
	// (vllm:external_prefix_cache_*).
	external bool
	// connector: the engine plays a side of disaggregation, as vLLM's
	// NixlConnector, whose failed reads it counts.
	connector       bool
	failedTransfers uint64
}

// newMetrics makes rank's metrics. vLLM labels every sample with its
// engine index; with several ranks its cache_config_info carries the
// engine label too (PrometheusStatLogger.log_metrics_info in
// vllm/v1/metrics/loggers.py, one sample per engine index).
func newMetrics(model string, cfg engine.Config, rank int, dataParallel, connector bool) *metrics {
	engineLabel := `engine="` + strconv.Itoa(rank) + `"`
	m := &metrics{
		external:  cfg.CPUBlocks > 0 || connector,
		connector: connector,
		ttft:      newHistogram(ttftBuckets),
		e2e:       newHistogram(e2eBuckets),
		label:     engineLabel + `,model_name="` + escapeLabel(model) + `"`,
		info: `block_size="` + strconv.Itoa(cfg.BlockSize) + `",num_gpu_blocks="` + strconv.Itoa(cfg.KVBlocks) +
			`",enable_prefix_caching="True",prefix_caching_hash_algo="xxhash"`,
	}
	if dataParallel {
		m.info += "," + engineLabel
	}
	return m
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

// countFailedTransfer counts a remote prefill's KV that could not be read.
func (m *metrics) countFailedTransfer() {
	m.mu.Lock()
	m.failedTransfers++
	m.mu.Unlock()
}

func (m *metrics) stats() engine.Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.eng
}

// appendMetricsText appends the Prometheus text exposition of every
// rank's metrics: each family's HELP and TYPE once, then one sample (or
// histogram series) per rank, as prometheus_client lays out vLLM's
// per-engine labels.
func appendMetricsText(b []byte, ms []*metrics) []byte {
	for _, m := range ms {
		m.mu.Lock()
		defer m.mu.Unlock()
	}
	family := func(name, typ, help string, v func(st *engine.Stats) float64) {
		b = append(b, "# HELP "+name+" "+help+"\n# TYPE "+name+" "+typ+"\n"...)
		for _, m := range ms {
			b = append(b, name+"{"+m.label+"} "...)
			b = strconv.AppendFloat(b, v(&m.eng), 'g', -1, 64)
			b = append(b, '\n')
		}
	}
	family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", func(st *engine.Stats) float64 { return float64(st.Running) })
	family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", func(st *engine.Stats) float64 { return float64(st.Waiting) })
	family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", func(st *engine.Stats) float64 { return st.KVUsage })
	family("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", func(st *engine.Stats) float64 { return float64(st.PrefixQueries) })
	family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", func(st *engine.Stats) float64 { return float64(st.PrefixHits) })
	if ms[0].external {
		family("vllm:external_prefix_cache_queries_total", "counter", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", func(st *engine.Stats) float64 { return float64(st.ExternalQueries) })
		family("vllm:external_prefix_cache_hits_total", "counter", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", func(st *engine.Stats) float64 { return float64(st.ExternalHits) })
	}
	family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", func(st *engine.Stats) float64 { return float64(st.Preemptions) })
	family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", func(st *engine.Stats) float64 { return float64(st.PromptTokens) })
	family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", func(st *engine.Stats) float64 { return float64(st.GenerationTokens) })
	if ms[0].connector {
		// NixlPromMetrics' counter, named by prometheus_client with _total.
		b = append(b, "# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.\n# TYPE vllm:nixl_num_failed_transfers_total counter\n"...)
		for _, m := range ms {
			b = append(b, "vllm:nixl_num_failed_transfers_total{"+m.label+"} "...)
			b = strconv.AppendUint(b, m.failedTransfers, 10)
			b = append(b, '\n')
		}
	}
	b = append(b, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n"...)
	for _, m := range ms {
		b = append(b, "vllm:request_success_total{"+m.label+`,finished_reason="length"} `...)
		b = strconv.AppendUint(b, m.eng.FinishedRequests, 10)
		b = append(b, "\nvllm:request_success_total{"+m.label+`,finished_reason="abort"} `...)
		b = strconv.AppendUint(b, m.eng.AbortedRequests, 10)
		b = append(b, '\n')
	}
	b = appendHistograms(b, ms, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds (simulated).", func(m *metrics) *histogram { return &m.ttft })
	b = appendHistograms(b, ms, "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds (simulated).", func(m *metrics) *histogram { return &m.e2e })
	b = append(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"...)
	for _, m := range ms {
		b = append(b, "vllm:cache_config_info{"+m.info+"} 1\n"...)
	}
	return b
}

func appendHistograms(b []byte, ms []*metrics, name, help string, of func(*metrics) *histogram) []byte {
	b = append(b, "# HELP "+name+" "+help+"\n# TYPE "+name+" histogram\n"...)
	for _, m := range ms {
		h := of(m)
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
		b = append(b, '\n')
	}
	return b
}
