package residentset

import (
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
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
	cpu0 := cpuTime()
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
	b.ReportMetric(float64(32*b.N)/(float64(cpuTime()-cpu0)/1e9), "blocks/cpu-s")
}

// generations adapts bloom.Generations to Observer, as the sidecar does.
type generations struct{ g *bloom.Generations }

func (o generations) Added(k uint64)   { o.g.Add(k) }
func (o generations) Removed(k uint64) { o.g.Remove(k) }
func (o generations) Cleared()         { o.g.Clear() }

// The sidecar's whole event path: exact set plus filter generation, with
// deltas taken and rebuilds done as they fall due.
func BenchmarkSidecarPipeline(b *testing.B) {
	const resident = 300000
	now := time.Now()
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: resident, MaxDeltaKeys: 150}, 1, now)
	obs := generations{g}
	s := New(Options{})
	warm := chainEvents(resident, 1)
	for i := range warm {
		s.Apply(&warm[i], obs)
	}
	g.Rebuild(now, slices.Values(s.AppendKeys(nil)))
	fresh := chainEvents(resident, resident+1)
	removals := make([]kvevents.Event, len(warm))
	for i := range warm {
		removals[i] = kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: warm[i].BlockHashes}
	}
	rebuilds := 0
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		i := n % len(fresh)
		if n > 0 && i == 0 {
			fresh, warm = warm, fresh
			for j := range warm {
				removals[j].BlockHashes = warm[j].BlockHashes
			}
		}
		s.Apply(&removals[i], obs)
		s.Apply(&fresh[i], obs)
		if n%8 == 7 { // a publish tick every 8 event pairs (~256 blocks)
			for {
				if _, ok := g.TakeDelta(); !ok {
					break
				}
			}
			if g.NeedsRebuild(now) {
				g.Rebuild(now, slices.Values(s.AppendKeys(nil)))
				rebuilds++
			}
		}
		n++
	}
	cpu := float64(cpuTime() - cpu0)
	b.ReportMetric(float64(32*b.N)/(cpu/1e9), "blocks/cpu-s")
	b.ReportMetric(float64(rebuilds), "rebuilds")
}

// Rebuilding a 300k-key generation from the exact set itself.
func BenchmarkRebuildFromSet300k(b *testing.B) {
	const resident = 300000
	s := New(Options{})
	evs := chainEvents(resident, 1)
	for i := range evs {
		s.Apply(&evs[i], nil)
	}
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: resident}, 1, time.Now())
	b.ReportAllocs()
	cpu0 := cpuTime()
	var keys []uint64
	for b.Loop() {
		keys = s.AppendKeys(keys[:0]) // as the sidecar does: copy, then fill
		g.Rebuild(time.Now(), slices.Values(keys))
	}
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N)/1e6, "cpu-ms/rebuild")
}

// cpuTime is the process's user+system CPU time in nanoseconds (the
// machine is shared: wall time includes other processes' turns).
func cpuTime() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}
