package sidecar

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// metricNames are the Prometheus series a protocol's engine exposes for
// queued requests, running requests and KV-cache usage (0..1). Usage lists
// fallbacks in order: vLLM before 0.10 only had gpu_cache_usage_perc.
// config is an info series whose block_size label gives the KV block size.
// rankLabel is the label naming the data-parallel rank a sample is of.
type metricNames struct {
	waiting, running string
	usage            []string
	config           string
	rankLabel        string
}

var protocolMetrics = map[string]metricNames{
	"vllm": {
		waiting: "vllm:num_requests_waiting",
		running: "vllm:num_requests_running",
		usage:   []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
		config:  "vllm:cache_config_info",
		// PrometheusStatLogger labels every sample with its engine
		// index, the DP rank (vllm/v1/metrics/loggers.py, v0.26).
		rankLabel: "engine",
	},
	"sglang": {
		waiting: "sglang:num_queue_reqs",
		running: "sglang:num_running_reqs",
		usage:   []string{"sglang:token_usage"},
		// The scheduler's collector adds dp_rank when there is one
		// (SchedulerMetricsMixin.init_metrics, sglang/srt/managers/
		// scheduler_metrics_mixin.py).
		rankLabel: "dp_rank",
	},
}

// EngineMetrics is what the sidecar reads from an engine's /metrics.
type EngineMetrics struct {
	Waiting, Running int
	KVUsage          float64
	// BlockSize is the KV block size in the engine's cache configuration
	// (vLLM's cache_config_info), 0 where the engine does not say.
	BlockSize int
	// CapacityBlocks is the engine's KV capacity in blocks (vLLM's
	// num_gpu_blocks in cache_config_info; the largest of several ranks'),
	// 0 where the engine does not say.
	CapacityBlocks int
}

// ParseMetrics reads the load figures out of Prometheus text exposition for
// protocol ("vllm" or "sglang"). Counts are summed over label sets (several
// engines or data-parallel ranks behind one server); usage is the largest.
// Missing series read as zero; a body with none of them is an error.
func ParseMetrics(body []byte, protocol string) (EngineMetrics, error) {
	return parseMetrics(body, protocol, "")
}

// ParseRankMetrics is ParseMetrics for data-parallel rank rank of the
// server: only the samples labelled with that rank (vLLM's engine="R",
// SGLang's dp_rank="R") and those labelled with no rank count.
func ParseRankMetrics(body []byte, protocol string, rank int) (EngineMetrics, error) {
	return parseMetrics(body, protocol, strconv.Itoa(rank))
}

// parseMetrics reads the samples of rank ("" for all).
func parseMetrics(body []byte, protocol, rank string) (EngineMetrics, error) {
	names, ok := protocolMetrics[protocol]
	if !ok {
		return EngineMetrics{}, fmt.Errorf("sidecar: unknown protocol %q", protocol)
	}
	var m EngineMetrics
	found := false
	usage := make([]float64, len(names.usage))
	usageSeen := make([]bool, len(names.usage))
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, value, ok := sample(line)
		if !ok || name == "" { // "" would match sglang's absent config series
			continue
		}
		if rank != "" {
			if r := labelValue(line, names.rankLabel); r != "" && r != rank {
				continue
			}
		}
		switch name {
		case names.config:
			if v, err := strconv.Atoi(labelValue(line, "block_size")); err == nil && v > 0 && v <= 1<<20 {
				m.BlockSize = v
			}
			if v, err := strconv.Atoi(labelValue(line, "num_gpu_blocks")); err == nil && v > 0 && v <= math.MaxInt32 {
				m.CapacityBlocks = max(m.CapacityBlocks, v)
			}
		case names.waiting:
			m.Waiting = addCount(m.Waiting, value)
			found = true
		case names.running:
			m.Running = addCount(m.Running, value)
			found = true
		default:
			for i, u := range names.usage {
				if name == u {
					usage[i] = max(usage[i], clampUnit(value))
					usageSeen[i] = true
					found = true
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return EngineMetrics{}, fmt.Errorf("sidecar: read metrics: %w", err)
	}
	if !found {
		if rank != "" {
			return EngineMetrics{}, fmt.Errorf("sidecar: no %s load metrics (%s, %s) of data-parallel rank %s (%s=%q) in /metrics", protocol, names.waiting, names.running, rank, names.rankLabel, rank)
		}
		return EngineMetrics{}, fmt.Errorf("sidecar: no %s load metrics (%s, %s) in /metrics", protocol, names.waiting, names.running)
	}
	for i := range usage {
		if usageSeen[i] {
			m.KVUsage = usage[i]
			break
		}
	}
	return m, nil
}

// sample splits one exposition line into metric name and value.
func sample(line string) (string, float64, bool) {
	var name, rest string
	if i := strings.IndexByte(line, '{'); i >= 0 {
		j := strings.LastIndexByte(line, '}')
		if j < i {
			return "", 0, false
		}
		name, rest = line[:i], line[j+1:]
	} else {
		i := strings.IndexAny(line, " \t")
		if i < 0 {
			return "", 0, false
		}
		name, rest = line[:i], line[i:]
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return "", 0, false
	}
	return strings.TrimSpace(name), v, true
}

// labelValue returns the value of label key in an exposition line's label
// set, "" when absent. Escapes in values are kept as they are: the values
// read here are numbers.
func labelValue(line, key string) string {
	i := strings.IndexByte(line, '{')
	if i < 0 {
		return ""
	}
	rest := line[i+1:]
	for {
		rest = strings.TrimLeft(rest, " ,")
		eq := strings.IndexByte(rest, '=')
		if eq < 0 || len(rest) < eq+2 || rest[eq+1] != '"' {
			return ""
		}
		name, val := strings.TrimSpace(rest[:eq]), rest[eq+2:]
		end := 0
		for end < len(val) && val[end] != '"' {
			if val[end] == '\\' {
				end++
			}
			end++
		}
		if end >= len(val) {
			return ""
		}
		if name == key {
			return val[:end]
		}
		rest = val[end+1:]
	}
}

func clampCount(v float64) int {
	if !(v > 0) { // also NaN
		return 0
	}
	return int(min(v, math.MaxInt32))
}

// addCount adds one series' count to a sum (engines with several
// data-parallel ranks report one series each) and keeps the sum within what
// a load record carries: routers reject a record over it, and the replica
// would fall silent.
func addCount(sum int, v float64) int {
	return min(sum+clampCount(v), math.MaxInt32)
}

func clampUnit(v float64) float64 {
	if !(v > 0) {
		return 0
	}
	return min(v, 1)
}

// ParseModels reads the served model ids from an OpenAI /v1/models body:
// the base model first, then LoRA adapters, as the engine lists them.
func ParseModels(body []byte) ([]string, error) {
	var resp struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		return nil, fmt.Errorf("sidecar: /v1/models: %w", err)
	}
	var out []string
	for _, d := range resp.Data {
		if d.ID != "" {
			out = append(out, d.ID)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("sidecar: /v1/models lists no model")
	}
	return out, nil
}
