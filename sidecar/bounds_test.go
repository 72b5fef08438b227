package sidecar

import (
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/kvevents"
)

// A capacity whose filter no gossip message can carry would leave every
// router without this replica's filter, silently: New refuses it and names
// the largest that works.
func TestCapacityGossipCannotCarryIsRefused(t *testing.T) {
	largest := bloom.MaxCapacity(0.01, filterstream.MaxFilterPayload)
	_, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 18_000_000})
	if err == nil || !strings.Contains(err.Error(), "--capacity 18000000") || !strings.Contains(err.Error(), "is "+strconv.Itoa(largest)) {
		t.Fatalf("capacity 18M: %v, want a refusal naming %d", err, largest)
	}
	s, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: largest})
	if err != nil {
		t.Fatalf("largest capacity %d refused: %v", largest, err)
	}
	if size := bloom.SnapshotSize(s.gens.Stats().M); size > filterstream.MaxFilterPayload {
		t.Fatalf("filter of %d bytes, gossip carries %d", size, filterstream.MaxFilterPayload)
	}
	// A coarser filter fits more keys.
	if _, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 18_000_000, FilterFPR: 0.02}); err != nil {
		t.Fatalf("18M at 2 %%: %v", err)
	}
}

// rootsBatch is n one-block prompts (block size 16), hashes from first on.
func rootsBatch(first uint64, n int) *kvevents.Batch {
	b := &kvevents.Batch{DPRank: -1}
	for i := range n {
		h := first + uint64(i)
		b.Events = append(b.Events, kvevents.Event{Kind: kvevents.KindBlockStored, BlockSize: 16, BlockHashes: []uint64{h},
			TokenIDs: tokens(int(h%1e9)*16, 16)})
	}
	return b
}

func metricsText(t *testing.T, s *Sidecar) string {
	t.Helper()
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	return string(body)
}

// An engine that stores more blocks than its capacity with slack (a flood
// from whoever reaches the event socket, or lost removals) is refused past
// the limit, counted, and flagged until its next clear; the engine's own
// capacity, once reported, replaces --capacity.
func TestResidentSetBoundedByEngineCapacity(t *testing.T) {
	s, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 1000, ResidentSlack: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	for b := range 30 {
		s.HandleBatch(uint64(b), rootsBatch(uint64(b*100+1), 100))
	}
	st := s.Status()
	if st.ResidentLimit != 1100 || st.ResidentEngineBlocks != 1100 || st.ResidentBlocks != 1100 || st.RefusedFull != 1900 || !st.EngineOverfull {
		t.Fatalf("limit %d held %d keys %d refused %d overfull %v, want 1100 1100 1100 1900 true",
			st.ResidentLimit, st.ResidentEngineBlocks, st.ResidentBlocks, st.RefusedFull, st.EngineOverfull)
	}
	group := rootsBatch(1<<40, 1)
	group.Events[0].GroupIdx = 1 << 20
	s.HandleBatch(31, group)
	m := metricsText(t, s)
	for _, want := range []string{
		`kvmesh_sidecar_refused_blocks_total{reason="full"} 1900`,
		`kvmesh_sidecar_refused_blocks_total{reason="group"} 1`,
		"kvmesh_sidecar_engine_overfull 1",
		"kvmesh_sidecar_resident_limit_blocks 1100",
		"kvmesh_sidecar_resident_engine_blocks 1100",
		"kvmesh_sidecar_engine_capacity_blocks 0",
	} {
		if !strings.Contains(m, want+"\n") {
			t.Errorf("metrics lack %q", want)
		}
	}

	// The engine says it holds 2000: its figure rules.
	s.engineCapacity(2000)
	s.HandleBatch(32, rootsBatch(1<<41, 1500))
	if st := s.Status(); st.ResidentLimit != 2200 || st.ResidentEngineBlocks != 2200 || st.EngineCapacity != 2000 {
		t.Fatalf("after the engine's capacity: limit %d held %d capacity %d, want 2200 2200 2000", st.ResidentLimit, st.ResidentEngineBlocks, st.EngineCapacity)
	}
	s.HandleBatch(33, &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindAllBlocksCleared}}})
	if st := s.Status(); st.EngineOverfull || st.ResidentEngineBlocks != 0 {
		t.Fatalf("after a clear: overfull %v held %d", st.EngineOverfull, st.ResidentEngineBlocks)
	}
}

// The sidecar learns the engine's capacity from its metrics (enginesim
// reports num_gpu_blocks as vLLM does).
func TestEngineReportedCapacityBoundsTheSet(t *testing.T) {
	url, _ := startEngine(t, nil) // 4096 blocks
	r := startSidecar(t, Config{Name: "e1", EngineURL: url})
	waitFor(t, settle, "engine capacity", func() bool { return r.s.Status().EngineCapacity == 4096 })
	if st := r.s.Status(); st.ResidentLimit != 5120 {
		t.Fatalf("resident limit %d, want 4096 + 25 %% = 5120", st.ResidentLimit)
	}
}

// /status does not wait for a whole outsized batch: intake lets go of the
// lock every applyChunk events.
func TestStatusAnswersDuringAnOutsizedBatch(t *testing.T) {
	s, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	big := rootsBatch(1, 200_000)
	done := make(chan time.Duration)
	go func() {
		t0 := time.Now()
		s.HandleBatch(1, big)
		done <- time.Since(t0)
	}()
	var worst time.Duration
	for took := time.Duration(0); took == 0; {
		select {
		case took = <-done:
			t.Logf("batch of %d events applied in %v; slowest /status meanwhile %v", len(big.Events), took, worst)
			if worst > took/4 {
				t.Errorf("a status waited %v of a %v batch", worst, took)
			}
		default:
			t0 := time.Now()
			s.Status()
			worst = max(worst, time.Since(t0))
			time.Sleep(200 * time.Microsecond)
		}
	}
}

// After an outsized batch, the next hands the buffers its decode dropped
// back to the OS instead of leaving them to the runtime for minutes.
func TestOutsizedBatchMemoryIsReleased(t *testing.T) {
	s, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 1000})
	if err != nil {
		t.Fatal(err)
	}
	var b kvevents.Batch
	decodeAndHandle := func(seq uint64, src *kvevents.Batch) {
		t.Helper()
		if err := kvevents.DecodeBatch(kvevents.AppendBatch(nil, src, kvevents.FormatVLLMArray), &b); err != nil {
			t.Fatal(err)
		}
		s.HandleBatch(seq, &b)
	}
	decodeAndHandle(1, rootsBatch(1, 50_000))
	if !s.releaseNext {
		t.Fatal("a 50k-event batch is not outsized")
	}
	decodeAndHandle(2, rootsBatch(1<<20, 1))
	if s.releaseNext {
		t.Fatal("a one-event batch is outsized")
	}
	waitFor(t, settle, "release", func() bool { return !s.releasing.Load() })
}
