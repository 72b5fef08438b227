package residentset

import (
	"runtime"
	"testing"

	"github.com/kvmesh/kvmesh/kvevents"
)

// chainEvents returns BlockStored events for chains of 64 blocks of 16
// tokens, 16 blocks per event (vLLM stores a prompt's blocks in batches),
// with engine hashes numbered from firstHash.
func chainEvents(blocks int, firstHash uint64) []kvevents.Event {
	const bs, perEvent, perChain = 16, 16, 64
	var evs []kvevents.Event
	h := firstHash
	for b := 0; b < blocks; b += perEvent {
		ev := kvevents.Event{Kind: kvevents.KindBlockStored, BlockSize: bs}
		if b%perChain != 0 {
			ev.ParentHash, ev.HasParent = h-1, true
		}
		for i := range perEvent {
			ev.BlockHashes = append(ev.BlockHashes, h)
			h++
			for j := range bs {
				ev.TokenIDs = append(ev.TokenIDs, uint32(h*31+uint64(i*bs+j)))
			}
		}
		evs = append(evs, ev)
	}
	return evs
}

// Memory per resident block: the brief's budget is ~64 B (300k blocks ≤ 20 MB).
func TestMemoryPerResidentBlock(t *testing.T) {
	const blocks = 300000
	evs := chainEvents(blocks, 1)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s := New(Options{})
	for i := range evs {
		s.Apply(&evs[i], nil)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if s.Len() != blocks {
		t.Fatalf("Len %d, want %d", s.Len(), blocks)
	}
	used := float64(after.HeapAlloc) - float64(before.HeapAlloc)
	perBlock := used / blocks
	t.Logf("%d resident blocks: %.1f MiB, %.1f B/block", blocks, used/(1<<20), perBlock)
	runtime.KeepAlive(s)
	runtime.KeepAlive(evs)
	if perBlock > 72 {
		t.Fatalf("%.1f B per resident block, budget ~64", perBlock)
	}
}

// Steady state of a full engine: every store of 16 blocks evicts 16 old ones.
func BenchmarkApplySteadyState(b *testing.B) {
	const resident = 300000
	s := New(Options{})
	warm := chainEvents(resident, 1)
	for i := range warm {
		s.Apply(&warm[i], nil)
	}
	fresh := chainEvents(resident, resident+1)
	removals := make([]kvevents.Event, len(warm))
	for i := range warm {
		removals[i] = kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: warm[i].BlockHashes}
	}
	b.ReportAllocs()
	b.ResetTimer()
	n := 0
	for b.Loop() {
		i := n % len(fresh)
		if n > 0 && i == 0 { // wrapped: swap roles so every event stays valid
			fresh, warm = warm, fresh
			for j := range warm {
				removals[j].BlockHashes = warm[j].BlockHashes
			}
		}
		s.Apply(&removals[i], nil)
		s.Apply(&fresh[i], nil)
		n++
	}
	b.ReportMetric(float64(2*b.N)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(float64(32*b.N)/b.Elapsed().Seconds(), "blocks/s")
}
