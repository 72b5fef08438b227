package sidecar

import (
	"testing"
)

// dpMetrics is /metrics of a server with two data-parallel ranks, as vLLM
// and SGLang label their samples.
const dpMetrics = `vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2048"} 1
sglang:num_queue_reqs{dp_rank="0",model_name="q",tp_rank="0"} 4
sglang:num_queue_reqs{dp_rank="1",model_name="q",tp_rank="1"} 6
sglang:num_running_reqs{dp_rank="0",model_name="q",tp_rank="0"} 9
sglang:num_running_reqs{dp_rank="1",model_name="q",tp_rank="1"} 5
sglang:token_usage{dp_rank="0",model_name="q",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",model_name="q",tp_rank="1"} 0.125
`

func TestParseRankMetrics(t *testing.T) {
	for _, c := range []struct {
		protocol string
		rank     int
		want     EngineMetrics
	}{
		{"vllm", 0, EngineMetrics{Waiting: 7, Running: 3, KVUsage: 0.75, BlockSize: 16, CapacityBlocks: 4096}},
		{"vllm", 1, EngineMetrics{Waiting: 1, Running: 2, KVUsage: 0.25, BlockSize: 16, CapacityBlocks: 2048}},
		{"sglang", 0, EngineMetrics{Waiting: 4, Running: 9, KVUsage: 0.5}},
		{"sglang", 1, EngineMetrics{Waiting: 6, Running: 5, KVUsage: 0.125}},
	} {
		got, err := ParseRankMetrics([]byte(dpMetrics), c.protocol, c.rank)
		if err != nil || got != c.want {
			t.Errorf("%s rank %d: %+v, %v; want %+v", c.protocol, c.rank, got, err, c.want)
		}
	}
	// Samples without a rank label are the whole server's: they count.
	if got, err := ParseRankMetrics([]byte("vllm:num_requests_waiting 2\n"), "vllm", 3); err != nil || got.Waiting != 2 {
		t.Errorf("unlabelled sample: %+v, %v; want waiting 2", got, err)
	}
	// A rank the server does not have is an error, not an idle rank.
	if got, err := ParseRankMetrics([]byte(dpMetrics), "vllm", 2); err == nil {
		t.Errorf("rank 2 of 2: %+v accepted", got)
	}
}

// TestEventsOfAnotherRankAreRefused: a sidecar of rank 1 applies batches
// stamped 1 or with no rank, refuses and counts those of rank 0; without
// --data-parallel-rank every batch is applied.
func TestEventsOfAnotherRankAreRefused(t *testing.T) {
	for _, c := range []struct {
		name                string
		dp                  bool
		ranks               []int // of the batches, in order
		resident, mismatch  int
		eventsRank, ownRank *int
	}{
		{name: "rank 1 follows rank 1", dp: true, ranks: []int{1, -1, 1}, resident: 3, eventsRank: ptr(1), ownRank: ptr(1)},
		{name: "rank 1 refuses rank 0", dp: true, ranks: []int{0, 1, 0}, resident: 1, mismatch: 2, eventsRank: ptr(0), ownRank: ptr(1)},
		{name: "not data-parallel", ranks: []int{0, 2, -1}, resident: 3, eventsRank: ptr(2)},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := New(Config{Name: "e", EngineURL: "http://127.0.0.1:1", DataParallel: c.dp, DataParallelRank: 1, Logger: testLog()})
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range c.ranks {
				b := storedBatch(uint64(i*10+1), 1)
				b.Events[0].HasParent = false
				b.DPRank = r
				s.HandleBatch(uint64(i), b)
			}
			st := s.Status()
			if st.ResidentBlocks != c.resident || st.RankMismatches != uint64(c.mismatch) ||
				!equalPtr(st.EventsDataParallelRank, c.eventsRank) || !equalPtr(st.DataParallelRank, c.ownRank) {
				t.Fatalf("resident %d, mismatches %d, events rank %v, rank %v; want %d, %d, %v, %v", st.ResidentBlocks, st.RankMismatches,
					deref(st.EventsDataParallelRank), deref(st.DataParallelRank), c.resident, c.mismatch, deref(c.eventsRank), deref(c.ownRank))
			}
		})
	}
	if _, err := New(Config{Name: "e", EngineURL: "http://127.0.0.1:1", DataParallel: true, DataParallelRank: -1}); err == nil {
		t.Fatal("rank -1 accepted")
	}
}

func ptr(v int) *int { return &v }

func equalPtr(a, b *int) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }

func deref(p *int) any {
	if p == nil {
		return nil
	}
	return *p
}
