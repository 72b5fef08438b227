package bloom

import (
	"math/rand/v2"
	"sync"
	"testing"
)

// walk is MatchPrefix without remembered prefixes: Test key by key.
func walk(keys []uint64, f *Filter) int {
	if f == nil {
		return 0
	}
	for j, k := range keys {
		if !f.Test(k) {
			return j
		}
	}
	return len(keys)
}

// prompts returns chained-looking prompts that share prefixes: every prompt
// extends, or branches off, an earlier one (conversations that grow, system
// prompts with new turns).
func prompts(r *rand.Rand, n int) [][]uint64 {
	out := [][]uint64{randomKeys(r.Uint64(), 1+r.IntN(40))}
	for len(out) < n {
		base := out[r.IntN(len(out))]
		cut := r.IntN(len(base) + 1)
		p := append(append([]uint64(nil), base[:cut]...), randomKeys(r.Uint64(), r.IntN(30))...)
		out = append(out, p)
	}
	return out
}

// TestRememberedPrefixesChangeNoResult walks prompts sharing prefixes over
// filters that keep gaining keys (some of the prompts' blocks, at random):
// every MatchPrefix equals a plain walk of each filter, and walks do start
// late (the remembered prefixes are used).
func TestRememberedPrefixesChangeNoResult(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	ps := prompts(r, 200)
	filters := make([]*Filter, 20)
	for i := range filters {
		if i == 3 {
			continue // a replica without a filter
		}
		filters[i] = NewFilter(2000, []float64{0.01, 0.3}[i%2]) // false positives too
	}
	matched := make([]int, len(filters))
	skipped := 0
	for round := range 3000 {
		// Some replicas cache a prefix of some prompt.
		for range r.IntN(3) {
			f, p := filters[r.IntN(len(filters))], ps[r.IntN(len(ps))]
			if f != nil {
				for _, k := range p[:r.IntN(len(p)+1)] {
					f.Add(k)
				}
			}
		}
		p := ps[r.IntN(len(ps))]
		for _, f := range filters {
			if f != nil {
				if n, _ := f.found.longest(p); n > 0 {
					skipped++
				}
			}
		}
		MatchPrefix(p, filters, matched)
		for i, f := range filters {
			if want := walk(p, f); matched[i] != want {
				t.Fatalf("round %d filter %d: matched %d, a plain walk %d", round, i, matched[i], want)
			}
		}
	}
	if skipped < 1000 {
		t.Fatalf("remembered prefixes used %d times in 3,000 walks", skipped)
	}
}

// TestRememberedPrefixesUnderConcurrentWalks: walks and adds from many
// goroutines (run with -race); each result is at least a plain walk's
// before it and at most one after it (filters only gain keys meanwhile).
func TestRememberedPrefixesUnderConcurrentWalks(t *testing.T) {
	ps := prompts(rand.New(rand.NewPCG(9, 10)), 50)
	filters := make([]*Filter, 8)
	for i := range filters {
		filters[i] = NewFilter(5000, 0.01)
	}
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(2)
		go func() { // a sidecar's deltas
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for range 300 {
				p := ps[r.IntN(len(ps))]
				for _, k := range p[:r.IntN(len(p)+1)] {
					filters[r.IntN(len(filters))].Add(k)
				}
			}
		}()
		go func() { // a router's decisions
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 2))
			matched := make([]int, len(filters))
			for range 2000 {
				p := ps[r.IntN(len(ps))]
				before := make([]int, len(filters))
				for i, f := range filters {
					before[i] = walk(p, f)
				}
				MatchPrefix(p, filters, matched)
				for i, f := range filters {
					if after := walk(p, f); matched[i] < before[i] || matched[i] > after {
						t.Errorf("filter %d: matched %d, plain walks %d before and %d after", i, matched[i], before[i], after)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
}

// TestFoundSlotAfterCounterWraps: the round-robin counter past 2³¹ (where a
// 32-bit int goes negative) still picks a slot in range. Only a 32-bit
// build (GOARCH=386 go test ./bloom) can fail it.
func TestFoundSlotAfterCounterWraps(t *testing.T) {
	var f foundPrefixes
	f.next.Store(1<<31 - 2)
	for i := range 2 * foundSlots {
		f.add(uint64(100+i), i+1, -1)
	}
	if n, slot := f.longest([]uint64{0, 0, 0, 0, 0, 0, 0, 107}); n != 8 || slot < 0 {
		t.Fatalf("longest = %d in slot %d, want the last prefix added", n, slot)
	}
}

// reset forgets every prefix (the benchmarks' walked mode).
func (f *foundPrefixes) reset() {
	for i := range f.slots {
		f.slots[i].blocks.Store(0)
	}
}
