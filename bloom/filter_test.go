package bloom

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func randomKeys(seed uint64, n int) []uint64 {
	r := rand.New(rand.NewPCG(seed, seed^0x5eed))
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = r.Uint64()
	}
	return keys
}

func TestFilterHasNoFalseNegativesAndMeetsItsFalsePositiveRate(t *testing.T) {
	for _, c := range []struct {
		n  int
		fp float64
	}{{1000, 0.01}, {30000, 0.01}, {30000, 0.001}, {5000, 0.05}} {
		t.Run(fmt.Sprintf("n=%d,fp=%g", c.n, c.fp), func(t *testing.T) {
			f := NewFilter(uint(c.n), c.fp)
			keys := randomKeys(uint64(c.n), c.n)
			for _, k := range keys {
				f.Add(k)
			}
			for _, k := range keys {
				if !f.Test(k) {
					t.Fatalf("false negative for %x", k)
				}
			}
			const probes = 200000
			fp := 0
			for _, k := range randomKeys(99, probes) {
				if f.Test(k) {
					fp++
				}
			}
			// 200k probes at 1 %: σ ≈ 0.02 %; allow 15 % over target.
			if rate := float64(fp) / probes; rate > c.fp*1.15 {
				t.Fatalf("false-positive rate %.5f at capacity, target %g (m=%d k=%d)", rate, c.fp, f.M(), f.K())
			}
		})
	}
}

func TestParamsFor300kAt1Percent(t *testing.T) {
	blocks, k := Params(300000, 0.01)
	size := blocks * blockBits / 8
	// The classic filter needs 351 KiB; blocking costs some more bits.
	if size < 351<<10 || size > 420<<10 || k < 5 || k > 9 {
		t.Fatalf("300k keys at 1%%: %d KiB, k=%d", size>>10, k)
	}
	t.Logf("300k keys at 1%%: %d blocks, %d KiB, k=%d, model FPR %.4f", blocks, size>>10, k, blockedFPR(300000, float64(blocks), k))
}

// The probe scheme and bit layout are a wire contract between sidecars and
// routers of different builds: changing them must bump the wire version.
func TestBitLayoutIsStable(t *testing.T) {
	for _, c := range []struct {
		fp   float64
		m, k uint
		want []int
	}{
		{0.01, 10240, 7, []int{4151, 4160, 4385, 4434, 4494, 4519, 4568}},
		{0.0001, 22016, 12, []int{9743, 9783, 9792, 10017, 10066, 10076, 10083, 10126, 10151, 10200, 10230}}, // 11: two probes coincide
	} {
		f := NewFilter(1000, c.fp)
		f.Add(0x7132c13eb4fd2630)
		var set []int
		for i, w := range f.Words() {
			for b := range 64 {
				if w&(1<<b) != 0 {
					set = append(set, i*64+b)
				}
			}
		}
		if f.M() != c.m || f.K() != c.k || !slices.Equal(set, c.want) {
			t.Errorf("NewFilter(1000, %g): m=%d k=%d, key 0x7132c13eb4fd2630 sets %v; want m=%d k=%d %v",
				c.fp, f.M(), f.K(), set, c.m, c.k, c.want)
		}
	}
}

func TestAddProbeCountsNewBits(t *testing.T) {
	f := NewFilter(5000, 0.01)
	total := 0
	for _, k := range randomKeys(3, 5000) {
		p := NewProbe(k)
		total += f.AddProbe(&p)
		if again := f.AddProbe(&p); again != 0 {
			t.Fatalf("re-adding a key set %d new bits", again)
		}
	}
	if got := f.OnesCount(); got != total {
		t.Fatalf("AddProbe reported %d new bits, filter has %d", total, got)
	}
	if r := f.FillRatio(); r < 0.3 || r > 0.7 {
		t.Fatalf("fill ratio at capacity %.3f, want about one half", r)
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
	if want := []int{4, 2, 0, 0}; !slices.Equal(matched, want) {
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
	for _, c := range []struct {
		words []uint64
		m, k  uint
	}{
		{f.Words()[:1], f.M(), f.K()},
		{f.Words(), f.M(), 0},
		{f.Words(), f.M(), MaxK + 1},
		{f.Words()[:len(f.Words())-1], f.M() - 64, f.K()}, // not whole blocks
		{nil, 0, 3},
	} {
		if _, err := FromWords(c.words, c.m, c.k); err == nil {
			t.Fatalf("FromWords(%d words, m=%d, k=%d) accepted", len(c.words), c.m, c.k)
		}
	}
}

// Filters of different k (replicas configured differently) in one walk.
func TestMatchPrefixMixedK(t *testing.T) {
	keys := randomKeys(21, 40)
	a, b := NewFilter(1000, 0.01), NewFilter(1000, 0.0001)
	if a.K() == b.K() {
		t.Fatal("test needs filters of different k")
	}
	for _, k := range keys[:30] {
		a.Add(k)
	}
	for _, k := range keys[:10] {
		b.Add(k)
	}
	matched := make([]int, 3)
	MatchPrefix(keys, []*Filter{b, a, b}, matched)
	if want := []int{10, 30, 10}; !slices.Equal(matched, want) {
		t.Fatalf("matched %v, want %v", matched, want)
	}
}

// More filters than one stack chunk.
func TestMatchPrefixManyFilters(t *testing.T) {
	keys := randomKeys(22, 20)
	filters := make([]*Filter, 300)
	for i := range filters {
		filters[i] = NewFilter(100, 0.0001)
		for _, k := range keys[:i%21] {
			filters[i].Add(k)
		}
	}
	matched := make([]int, len(filters))
	MatchPrefix(keys, filters, matched)
	for i, m := range matched {
		if m != i%21 {
			t.Fatalf("filter %d matched %d, want %d", i, m, i%21)
		}
	}
}
