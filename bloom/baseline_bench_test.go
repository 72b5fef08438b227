package bloom

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	bb "github.com/bits-and-blooms/bloom/v3"
)

// The baseline: bits-and-blooms/bloom/v3, the classic filter this package
// started from, on the same fleet as BenchmarkMatchPrefix256x50 (one replica
// holds the 256-block prompt, four hold 64 blocks, 45 miss at block 0).
// Locations are computed once per key and tested against every filter, the
// fastest way that library allows. Run both side by side:
//
//	go test -run '^$' -bench 'MatchPrefix256x50$|Baseline' ./bloom
func BenchmarkMatchPrefixBaselineBitsAndBlooms256x50(b *testing.B) {
	_, prompt := fixture()
	filters := make([]*bb.BloomFilter, benchReplicas)
	var key [8]byte
	for i := range filters {
		f := bb.NewWithEstimates(benchResident, 0.01)
		for _, k := range randomKeys(uint64(100+i), benchResident-benchBlocks) {
			binary.LittleEndian.PutUint64(key[:], k)
			f.Add(key[:])
		}
		hold := 0
		switch {
		case i == 0:
			hold = benchBlocks
		case i <= 4:
			hold = 64
		}
		for _, k := range prompt[:hold] {
			binary.LittleEndian.PutUint64(key[:], k)
			f.Add(key[:])
		}
		filters[i] = f
	}
	matched := make([]int, len(filters))
	k := filters[0].K()
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for b.Loop() {
		for i := range matched {
			matched[i] = -1
		}
		live := len(filters)
		for j := 0; j < len(prompt) && live > 0; j++ {
			binary.LittleEndian.PutUint64(key[:], prompt[j])
			locs := bb.Locations(key[:], k)
			for i, f := range filters {
				if matched[i] < 0 && !f.TestLocations(locs) {
					matched[i] = j
					live--
				}
			}
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
}

// TestFalsePositiveRateMatchesBaseline checks that the blocked layout costs
// no more than about half a point of false positives over the classic filter
// at the same target, on the same keys.
func TestFalsePositiveRateMatchesBaseline(t *testing.T) {
	const n, probes = 100000, 200000
	r := rand.New(rand.NewPCG(7, 8))
	ours := NewFilter(n, 0.01)
	theirs := bb.NewWithEstimates(n, 0.01)
	var key [8]byte
	for range n {
		k := r.Uint64()
		ours.Add(k)
		binary.LittleEndian.PutUint64(key[:], k)
		theirs.Add(key[:])
	}
	var fpOurs, fpTheirs int
	for range probes {
		k := r.Uint64()
		if ours.Test(k) {
			fpOurs++
		}
		binary.LittleEndian.PutUint64(key[:], k)
		if theirs.Test(key[:]) {
			fpTheirs++
		}
	}
	o, th := float64(fpOurs)/probes, float64(fpTheirs)/probes
	t.Logf("false positives at capacity: blocked %.4f (%d KiB), bits-and-blooms %.4f (%d KiB)",
		o, len(ours.Words())*8/1024, th, theirs.Cap()/8/1024)
	if o > th+0.005 {
		t.Fatalf("blocked filter FPR %.4f vs baseline %.4f", o, th)
	}
}
