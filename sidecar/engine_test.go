package sidecar

import (
	"math"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/filterstream"
)

const vllmMetrics = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.5
vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.9
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 1234
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{cache_dtype="auto",engine="0",hash_block_size="64",kv_offloading_backend="say \"x\", block_size=\"8\"",block_size="16",enable_prefix_caching="True",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256_cbor"} 1.0
`

func TestParseMetrics(t *testing.T) {
	got, err := ParseMetrics([]byte(vllmMetrics), "vllm")
	if err != nil {
		t.Fatal(err)
	}
	// Counts sum over engines; usage is the busiest engine's, preferring the current name.
	// The block size is the block_size label's, not hash_block_size's nor
	// text inside another label's value.
	if want := (EngineMetrics{Waiting: 7, Running: 5, KVUsage: 0.5, BlockSize: 16, CapacityBlocks: 2048}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	old := "vllm:num_requests_waiting 1\nvllm:num_requests_running 0\nvllm:gpu_cache_usage_perc 0.75 1700000000000\n"
	if got, err := ParseMetrics([]byte(old), "vllm"); err != nil || got != (EngineMetrics{Waiting: 1, KVUsage: 0.75}) {
		t.Fatalf("pre-0.9.2 names: %+v %v", got, err)
	}
	sg := `sglang:num_queue_reqs{model_name="q",tp_rank="0"} 4
sglang:num_running_reqs{model_name="q",tp_rank="0"} 9
sglang:token_usage{model_name="q",tp_rank="0"} 0.125
{block_size="16"} 1
`
	if got, err := ParseMetrics([]byte(sg), "sglang"); err != nil || got != (EngineMetrics{Waiting: 4, Running: 9, KVUsage: 0.125}) {
		t.Fatalf("sglang: %+v %v", got, err)
	}
	if _, err := ParseMetrics([]byte("up 1\n"), "vllm"); err == nil {
		t.Fatal("metrics without load series accepted")
	}
	for line, want := range map[string]int{
		`vllm:cache_config_info{block_size="32"} 1`:                32,
		`vllm:cache_config_info{engine="0", block_size="32"} 1`:    32,
		`vllm:cache_config_info{x="a\\",block_size="64"} 1`:        64,
		`vllm:cache_config_info{block_size="None",engine="0"} 1`:   0,
		`vllm:cache_config_info{block_size="-16"} 1`:               0,
		`vllm:cache_config_info{block_size="99999999999"} 1`:       0,
		`vllm:cache_config_info{hash_block_size="16"} 1`:           0,
		`vllm:cache_config_info{x="unterminated,block_size="8"} 1`: 0,
		`{block_size="16"} 1`:                                      0,
	} {
		got, err := ParseMetrics([]byte("vllm:num_requests_waiting 0\n"+line+"\n"), "vllm")
		if err != nil || got.BlockSize != want {
			t.Errorf("%s: block size %d (%v), want %d", line, got.BlockSize, err, want)
		}
	}
	// Several ranks: each rank's own capacity (the largest); nonsense ignored.
	ranks := "vllm:num_requests_waiting 0\n" +
		`vllm:cache_config_info{engine="0",num_gpu_blocks="4096"} 1` + "\n" +
		`vllm:cache_config_info{engine="1",num_gpu_blocks="8192"} 1` + "\n" +
		`vllm:cache_config_info{engine="2",num_gpu_blocks="None"} 1` + "\n" +
		`vllm:cache_config_info{engine="3",num_gpu_blocks="99999999999"} 1` + "\n"
	if got, err := ParseMetrics([]byte(ranks), "vllm"); err != nil || got.CapacityBlocks != 8192 {
		t.Fatalf("num_gpu_blocks over ranks: %+v %v, want 8192", got, err)
	}
	bad := "vllm:num_requests_waiting NaN\nvllm:num_requests_running -3\nvllm:kv_cache_usage_perc 7\n"
	if got, err := ParseMetrics([]byte(bad), "vllm"); err != nil || got != (EngineMetrics{KVUsage: 1}) {
		t.Fatalf("clamping: %+v %v", got, err)
	}
	// Each series within the bound, their sum not: the sum is clamped too,
	// or every router would reject the load record that carries it.
	huge := "vllm:num_requests_waiting{engine=\"0\"} 3e9\nvllm:num_requests_waiting{engine=\"1\"} 3e9\nvllm:num_requests_running 1\n"
	got, err = ParseMetrics([]byte(huge), "vllm")
	if err != nil || got.Waiting != math.MaxInt32 {
		t.Fatalf("summed counts: %+v %v, want waiting clamped to %d", got, err, math.MaxInt32)
	}
	rec := filterstream.Message{Kind: filterstream.KindLoad, From: "sidecar/a", Seq: 1, Load: filterstream.Load{Healthy: true, Waiting: got.Waiting, Running: got.Running}}
	if _, err := filterstream.Decode(rec.Append(nil)); err != nil {
		t.Fatalf("the load record routers receive is rejected: %v", err)
	}
}

func TestParseModels(t *testing.T) {
	body := `{"object":"list","data":[{"id":"llama","object":"model","root":"/m","parent":null},{"id":"sql-lora","parent":"llama"}]}`
	got, err := ParseModels([]byte(body))
	if err != nil || !reflect.DeepEqual(got, []string{"llama", "sql-lora"}) {
		t.Fatalf("%v %v", got, err)
	}
	for _, b := range []string{`{"data":[]}`, `nope`, `{"data":[{"id":""}]}`} {
		if _, err := ParseModels([]byte(b)); err == nil {
			t.Fatalf("%s accepted", b)
		}
	}
}

func FuzzParseMetrics(f *testing.F) {
	f.Add([]byte(vllmMetrics))
	f.Add([]byte("vllm:num_requests_waiting{a=\"}\"} 1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseMetrics(b, "vllm")
		if err != nil {
			return
		}
		if m.Waiting < 0 || m.Running < 0 || !(m.KVUsage >= 0 && m.KVUsage <= 1) || m.BlockSize < 0 || m.BlockSize > 1<<20 {
			t.Fatalf("out of range: %+v", m)
		}
	})
}

func FuzzParseModels(f *testing.F) {
	f.Add([]byte(`{"data":[{"id":"a"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if ms, err := ParseModels(b); err == nil && len(ms) == 0 {
			t.Fatal("no models and no error")
		}
	})
}
