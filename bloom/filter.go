// Package bloom holds the Bloom filters that carry a replica's resident
// prefix blocks from its sidecar to every router.
//
// Keys are already uniform 64-bit hashes (package blockkey), so a filter does
// not hash them again: probe locations come from double hashing the key
// itself, computed once per key and tested against every replica's filter.
// Storage, sizing and the bit layout are bits-and-blooms/bloom/v3's.
package bloom

import (
	"fmt"

	bb "github.com/bits-and-blooms/bloom/v3"
)

// MaxK bounds the number of probes per key; NewFilter never exceeds it.
const MaxK = 16

// Filter is a Bloom filter over block keys. It is not safe for concurrent
// writes; a filter published to readers must no longer be written to.
type Filter struct {
	bf *bb.BloomFilter
}

// NewFilter returns an empty filter sized for capacity keys at false-positive
// rate fpRate.
func NewFilter(capacity uint, fpRate float64) *Filter {
	if capacity == 0 {
		capacity = 1
	}
	m, k := bb.EstimateParameters(capacity, fpRate)
	return &Filter{bf: bb.New(m, min(k, MaxK))}
}

// FromWords returns a filter over words (not copied) with m bits and k probes,
// as received in a snapshot.
func FromWords(words []uint64, m, k uint) (*Filter, error) {
	if k == 0 || k > MaxK {
		return nil, fmt.Errorf("bloom: k=%d out of range 1..%d", k, MaxK)
	}
	if m == 0 || uint64(len(words)) != (uint64(m)+63)/64 {
		return nil, fmt.Errorf("bloom: %d words cannot hold m=%d bits", len(words), m)
	}
	return &Filter{bf: bb.FromWithM(words, m, k)}, nil
}

// M is the number of bits, K the number of probes per key.
func (f *Filter) M() uint { return f.bf.Cap() }

// K is the number of probes per key.
func (f *Filter) K() uint { return f.bf.K() }

// Words exposes the bit words, for snapshots. Callers must not modify them.
func (f *Filter) Words() []uint64 { return f.bf.BitSet().Words() }

// Copy returns an independent copy.
func (f *Filter) Copy() *Filter { return &Filter{bf: f.bf.Copy()} }

// Add inserts key.
func (f *Filter) Add(key uint64) {
	p := NewProbe(key)
	m := uint64(f.bf.Cap())
	bits := f.bf.BitSet()
	for i := range f.bf.K() {
		bits.Set(uint(p.locs[i] % m))
	}
}

// Test reports whether key may be in the filter.
func (f *Filter) Test(key uint64) bool {
	p := NewProbe(key)
	return f.TestProbe(&p)
}

// TestProbe reports whether the key behind p may be in the filter.
func (f *Filter) TestProbe(p *Probe) bool {
	return f.bf.TestLocations(p.locs[:f.bf.K()])
}

// FillRatio is the fraction of bits set.
func (f *Filter) FillRatio() float64 {
	return float64(f.bf.BitSet().Count()) / float64(f.bf.Cap())
}

// Probe holds a key's probe locations before reduction modulo a filter's
// size, so one key is hashed once and tested against many filters.
type Probe struct {
	locs [MaxK]uint64
}

// NewProbe computes key's probe locations by double hashing.
func NewProbe(key uint64) Probe {
	var p Probe
	h1 := key
	h2 := mix64(key) | 1
	for i := range p.locs {
		p.locs[i] = h1 + uint64(i)*h2
	}
	return p
}

// mix64 is splitmix64's finalizer: a second, independent-looking hash of key.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// MatchPrefix sets matched[i] to the number of leading keys that filters[i]
// may contain, stopping at each filter's first miss: keys are chained, so a
// miss at block j means nothing after j can be resident there. A nil filter
// matches nothing. len(matched) must equal len(filters).
func MatchPrefix(keys []uint64, filters []*Filter, matched []int) {
	live := 0
	for i, f := range filters {
		matched[i] = -1 // still walking
		if f == nil {
			matched[i] = 0
			continue
		}
		live++
	}
	for j := 0; j < len(keys) && live > 0; j++ {
		p := NewProbe(keys[j])
		for i, f := range filters {
			if matched[i] >= 0 {
				continue
			}
			if !f.TestProbe(&p) {
				matched[i] = j
				live--
			}
		}
	}
	for i := range matched {
		if matched[i] < 0 {
			matched[i] = len(keys)
		}
	}
}
