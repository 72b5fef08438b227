package bloom

import (
	"math/rand/v2"
	"testing"
)

func TestFilterHasNoFalseNegativesAndBoundedFalsePositives(t *testing.T) {
	f := NewFilter(10000, 0.01)
	r := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, 10000)
	for i := range keys {
		keys[i] = r.Uint64()
		f.Add(keys[i])
	}
	for _, k := range keys {
		if !f.Test(k) {
			t.Fatalf("false negative for %x", k)
		}
	}
	fp := 0
	for range 100000 {
		if f.Test(r.Uint64()) {
			fp++
		}
	}
	if rate := float64(fp) / 100000; rate > 0.02 {
		t.Fatalf("false-positive rate %.4f at capacity, want about 0.01", rate)
	}
}

func TestMatchPrefixStopsAtFirstMiss(t *testing.T) {
	keys := []uint64{11, 22, 33, 44}
	full, half, none := NewFilter(100, 0.001), NewFilter(100, 0.001), NewFilter(100, 0.001)
	for _, k := range keys {
		full.Add(k)
	}
	half.Add(11)
	half.Add(22)
	half.Add(44) // after a miss at 33: must not count
	matched := make([]int, 4)
	MatchPrefix(keys, []*Filter{full, half, none, nil}, matched)
	if want := []int{4, 2, 0, 0}; matched[0] != want[0] || matched[1] != want[1] || matched[2] != want[2] || matched[3] != want[3] {
		t.Fatalf("matched %v, want %v", matched, want)
	}
}

func TestFromWordsSharesBits(t *testing.T) {
	f := NewFilter(1000, 0.01)
	f.Add(42)
	g, err := FromWords(append([]uint64(nil), f.Words()...), f.M(), f.K())
	if err != nil {
		t.Fatal(err)
	}
	if !g.Test(42) {
		t.Fatal("snapshot lost a key")
	}
	if _, err := FromWords(f.Words()[:1], f.M(), f.K()); err == nil {
		t.Fatal("short word slice accepted")
	}
}
