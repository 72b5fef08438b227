package bloom

import (
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	benchReplicas = 50
	benchResident = 300000
	benchBlocks   = 256
)

var (
	benchOnce    sync.Once
	benchFilters []*Filter // each holds benchResident random keys
	benchPrompt  []uint64
)

// fixture builds 50 replica filters sized and filled as a 300k-block engine's.
func fixture() ([]*Filter, []uint64) {
	benchOnce.Do(func() {
		benchPrompt = randomKeys(1, benchBlocks)
		for i := range benchReplicas {
			f := NewFilter(benchResident, 0.01)
			for _, k := range randomKeys(uint64(100+i), benchResident-benchBlocks) {
				f.Add(k)
			}
			benchFilters = append(benchFilters, f)
		}
	})
	return benchFilters, benchPrompt
}

// withPrompt returns copies of the fixture's filters where replica i holds
// the prompt's first hold(i) blocks.
func withPrompt(b *testing.B, hold func(i int) int) []*Filter {
	base, prompt := fixture()
	filters := make([]*Filter, len(base))
	for i, f := range base {
		filters[i] = f.Copy()
		for _, k := range prompt[:hold(i)] {
			filters[i].Add(k)
		}
	}
	return filters
}

// benchMatch walks the fixture's prompt over filters again and again: as
// "walked", every key probed (the filters forget, off the clock, the
// prefixes they were found to hold); as "remembered", each filter's walk
// starts after the prefix found there before (foundPrefixes), as it does
// for prompts sharing a system prompt.
func benchMatch(b *testing.B, filters []*Filter) {
	for _, mode := range []string{"walked", "remembered"} {
		b.Run(mode, func(b *testing.B) { benchMatchMode(b, filters, mode == "walked") })
	}
}

func benchMatchMode(b *testing.B, filters []*Filter, forget bool) {
	_, prompt := fixture()
	matched := make([]int, len(filters))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for b.Loop() {
		if forget {
			b.StopTimer()
			for _, f := range filters {
				f.found.reset()
			}
			b.StartTimer()
		}
		MatchPrefix(prompt, filters, matched)
	}
	b.StopTimer()
	// The machine is shared: CPU time per op shows the cost without the
	// time other processes held the core.
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
	sum := 0
	for _, m := range matched {
		sum += m
	}
	b.ReportMetric(float64(sum), "matched-blocks")
}

// One replica holds the whole 256-block prompt, four hold its first 64, the
// other 45 miss at block 0 (bar false positives): a realistic fleet.
func BenchmarkMatchPrefix256x50(b *testing.B) {
	benchMatch(b, withPrompt(b, func(i int) int {
		switch {
		case i == 0:
			return benchBlocks
		case i <= 4:
			return 64
		}
		return 0
	}))
}

// The same shape with 512 different prompts in turn, each warm at its own
// replica: the filter lines a walk touches are rarely still in cache, as in
// a router serving many conversations.
func BenchmarkMatchPrefix256x50Cold(b *testing.B) {
	base, _ := fixture()
	filters := make([]*Filter, len(base))
	for i, f := range base {
		filters[i] = f.Copy()
	}
	prompts := make([][]uint64, 512)
	for i := range prompts {
		prompts[i] = randomKeys(uint64(1000+i), benchBlocks)
		for _, k := range prompts[i] {
			filters[i%benchReplicas].Add(k)
		}
		for r := 1; r <= 4; r++ {
			for _, k := range prompts[i][:64] {
				filters[(i+r)%benchReplicas].Add(k)
			}
		}
	}
	matched := make([]int, len(filters))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		MatchPrefix(prompts[n%len(prompts)], filters, matched)
		n++
	}
	b.StopTimer()
	reportCPU(b, cpu0)
}

// Worst case: every replica holds the whole prompt.
func BenchmarkMatchPrefix256x50AllHold(b *testing.B) {
	benchMatch(b, withPrompt(b, func(int) int { return benchBlocks }))
}

func BenchmarkTestProbeHit(b *testing.B) {
	filters, _ := fixture()
	f := filters[0].Copy()
	f.Add(12345)
	p := NewProbe(12345)
	for b.Loop() {
		if !f.TestProbe(&p) {
			b.Fatal("miss")
		}
	}
}

func BenchmarkGenerationsAdd(b *testing.B) {
	g := NewGenerations(GenerationConfig{Capacity: benchResident}, 1, t0)
	keys := randomKeys(3, 1<<16)
	b.ReportAllocs()
	i := 0
	cpu0 := cpuTime()
	defer func() { reportCPU(b, cpu0) }()
	for b.Loop() {
		g.Add(keys[i&(1<<16-1)])
		if i++; i&1023 == 0 {
			g.TakeDelta()
		}
	}
}

func BenchmarkRebuild300k(b *testing.B) {
	keys := randomKeys(5, benchResident)
	g := NewGenerations(GenerationConfig{Capacity: benchResident}, 1, t0)
	seq := func(yield func(uint64) bool) {
		for _, k := range keys {
			if !yield(k) {
				return
			}
		}
	}
	b.ReportAllocs()
	cpu0 := cpuTime()
	for b.Loop() {
		g.Rebuild(t0, seq)
	}
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N)/1e6, "cpu-ms/rebuild")
}

func snapshot300k() Snapshot {
	g := NewGenerations(GenerationConfig{Capacity: benchResident}, 1, t0)
	for _, k := range randomKeys(6, benchResident) {
		g.Add(k)
	}
	g.TakeDelta()
	return g.Snapshot()
}

func BenchmarkSnapshotEncode300k(b *testing.B) {
	s := snapshot300k()
	buf := make([]byte, 0, SnapshotSize(s.M))
	b.SetBytes(int64(SnapshotSize(s.M)))
	b.ReportAllocs()
	cpu0 := cpuTime()
	defer func() { reportCPU(b, cpu0) }()
	for b.Loop() {
		buf = s.AppendBinary(buf[:0])
	}
}

func BenchmarkSnapshotDecode300k(b *testing.B) {
	s := snapshot300k()
	enc := s.AppendBinary(nil)
	b.SetBytes(int64(len(enc)))
	b.ReportAllocs()
	cpu0 := cpuTime()
	defer func() { reportCPU(b, cpu0) }()
	for b.Loop() {
		if _, err := DecodeSnapshot(enc); err != nil {
			b.Fatal(err)
		}
	}
}

// What copy-on-write per delta would cost a router instead of atomic ORs
// into the live filter (BenchmarkMirrorApplyDelta150).
func BenchmarkFilterCopy300k(b *testing.B) {
	f := NewFilter(benchResident, 0.01)
	b.SetBytes(int64(len(f.words) * 8))
	b.ReportAllocs()
	cpu0 := cpuTime()
	defer func() { reportCPU(b, cpu0) }()
	for b.Loop() {
		_ = f.Copy()
	}
}

// A router applies a full delta packet (150 keys) to one replica's mirror.
func BenchmarkMirrorApplyDelta150(b *testing.B) {
	g := NewGenerations(GenerationConfig{Capacity: benchResident}, 1, t0)
	var m Mirror
	if err := m.ApplySnapshot(g.Snapshot()); err != nil {
		b.Fatal(err)
	}
	keys := randomKeys(9, 150)
	b.ReportAllocs()
	seq := uint64(0)
	cpu0 := cpuTime()
	defer func() { reportCPU(b, cpu0) }()
	for b.Loop() {
		seq++
		if !m.ApplyDelta(Delta{Epoch: 1, Generation: 1, Seq: seq, Keys: keys}) {
			b.Fatal("refused")
		}
	}
}

// Router memory for the filters of 50 replicas × 300k resident blocks, as
// decoded from their snapshots and held by mirrors.
func TestRouterFilterMemory50x300k(t *testing.T) {
	g := NewGenerations(GenerationConfig{Capacity: benchResident}, 1, time.Now())
	for _, k := range randomKeys(7, 1000) {
		g.Add(k)
	}
	s := g.Snapshot()
	enc := s.AppendBinary(nil)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	mirrors := make([]Mirror, benchReplicas)
	for i := range mirrors {
		d, err := DecodeSnapshot(enc)
		if err != nil {
			t.Fatal(err)
		}
		d.Epoch = uint64(i)
		if err := mirrors[i].ApplySnapshot(d); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	used := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	runtime.KeepAlive(mirrors)
	runtime.KeepAlive(g)
	runtime.KeepAlive(enc)
	t.Logf("%d mirrors of a %d-key filter (%d KiB snapshot): %.1f MiB heap", benchReplicas, benchResident, len(enc)>>10, float64(used)/(1<<20))
	if used > 64<<20 {
		t.Fatalf("filters of 50 replicas × 300k blocks take %d MiB, budget 64", used>>20)
	}
	if used < int64(benchReplicas*len(s.Words)*8) {
		t.Fatalf("measured %d B, less than the words alone: measurement broken", used)
	}
}

// cpuTime is the process's user+system CPU time in nanoseconds.
func cpuTime() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// reportCPU adds CPU time per op to a benchmark's figures.
func reportCPU(b *testing.B, cpu0 int64) {
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
}
