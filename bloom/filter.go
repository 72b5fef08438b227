// Package bloom carries a replica's resident prefix blocks from its sidecar to
// every router: the filter itself, its generations and add-only deltas on the
// sidecar, their wire encoding, the router-side mirror of one sidecar's
// stream, and the prefix walk that scores a prompt against many replicas.
//
// The filter is cache-line blocked: each key selects one 512-bit block and
// sets k bits inside it, so a lookup touches one cache line instead of k.
// That is what keeps a 256-block prompt against 50 replicas within
// microseconds; the price is a few percent more bits than a classic filter
// for the same false-positive rate (367 vs 351 KiB for 300k keys at 1 %),
// which Params computes exactly from the blocked filter's FPR.
//
// Keys are already uniform 64-bit hashes (package blockkey), so a filter does
// not hash them again: the block comes from the key's high bits and the bit
// positions from a cheap remix, computed once per key (Probe) and tested
// against every replica's filter.
//
// The probe scheme and bit layout are part of the wire format (a sidecar's
// snapshot is a router's filter); changing them needs a new wire version.
//
// Concurrency: bits are set with atomic OR and read with atomic loads (plain
// loads on amd64 and arm64), so writers may add keys while any number of
// readers test them, without locks.
package bloom

import (
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/blockkey"
)

// MaxK bounds the number of probes per key; NewFilter never exceeds it.
const MaxK = 16

const (
	blockBits  = 512 // one 64-byte cache line
	blockWords = blockBits / 64
)

// Filter is a blocked Bloom filter over block keys. Add may run concurrently
// with Test, TestProbe and MatchPrefix; concurrent Adds are safe too.
//
// A filter only ever gains bits: MatchPrefix remembers prefixes found in it
// on that ground. Code that would clear or reuse a filter's words must make
// a new Filter instead.
type Filter struct {
	words  []uint64
	blocks uint64
	k      uint
	// view, for a mirror's filter made by a Share, is its place in the
	// chain whose words it reads; behind, that the words hold bits of
	// deltas it has not applied, which its probes mask out.
	view   *view
	behind bool
	_      [64]byte // keeps found's writes off the lines probes read,
	found  foundPrefixes
	_      [64]byte // this filter's and the next object's
}

// NewFilter returns an empty filter sized for capacity keys at false-positive
// rate fpRate (clamped to [1e-9, 0.5]).
func NewFilter(capacity uint, fpRate float64) *Filter {
	blocks, k := Params(capacity, fpRate)
	return &Filter{words: make([]uint64, blocks*blockWords), blocks: blocks, k: k}
}

// Params returns the number of 512-bit blocks and probes per key that hold
// capacity keys at false-positive rate fpRate or better.
func Params(capacity uint, fpRate float64) (blocks uint64, k uint) {
	n := float64(max(capacity, 1))
	p := min(max(fpRate, 1e-9), 0.5)
	// Start from the classic optimum and grow until the blocked filter
	// (whose blocks fill unevenly) reaches the target.
	bitsPerKey := -math.Log(p) / (math.Ln2 * math.Ln2)
	blocks = uint64(math.Ceil(n * bitsPerKey / blockBits))
	for {
		blocks = max(blocks, 1)
		bestK, bestFP := uint(1), 2.0
		for k := uint(1); k <= MaxK; k++ {
			if fp := blockedFPR(n, float64(blocks), k); fp < bestFP {
				bestK, bestFP = k, fp
			}
		}
		if bestFP <= p {
			return blocks, bestK
		}
		blocks += blocks/64 + 1
	}
}

// blockedFPR is the false-positive rate of a blocked filter holding n keys in
// the given number of blocks with k probes: the number of keys in a block is
// Poisson(n/blocks), and a block holding i keys answers a random probe
// falsely with probability (1-(1-1/512)^(k·i))^k.
func blockedFPR(n, blocks float64, k uint) float64 {
	lambda := n / blocks
	hi := int(lambda + 12*math.Sqrt(lambda) + 30)
	lo := max(0, int(lambda-12*math.Sqrt(lambda)-30))
	miss := math.Log1p(-1.0 / blockBits)
	fp := 0.0
	for i := lo; i <= hi; i++ {
		lg, _ := math.Lgamma(float64(i + 1))
		w := math.Exp(-lambda + float64(i)*math.Log(lambda) - lg)
		fp += w * math.Pow(1-math.Exp(float64(k)*float64(i)*miss), float64(k))
	}
	return fp
}

// FromWords returns a filter over words (not copied) with m bits and k probes,
// as received in a snapshot. m must be a whole number of 512-bit blocks.
// The caller must not change words afterwards, but through Add.
func FromWords(words []uint64, m, k uint) (*Filter, error) {
	if k == 0 || k > MaxK {
		return nil, fmt.Errorf("bloom: k=%d out of range 1..%d", k, MaxK)
	}
	if m == 0 || m%blockBits != 0 {
		return nil, fmt.Errorf("bloom: m=%d is not a positive multiple of %d", m, blockBits)
	}
	if uint64(len(words)) != uint64(m)/64 {
		return nil, fmt.Errorf("bloom: %d words cannot hold m=%d bits", len(words), m)
	}
	return &Filter{words: words, blocks: uint64(m) / blockBits, k: k}, nil
}

// M is the number of bits.
func (f *Filter) M() uint { return uint(f.blocks * blockBits) }

// K is the number of probes per key.
func (f *Filter) K() uint { return f.k }

// Words exposes the bit words. Callers must not modify them (a filter only
// gains bits), and may read them plainly only while no Add runs; use
// AppendWords otherwise.
func (f *Filter) Words() []uint64 { return f.words }

// AppendWords appends an atomic-read copy of the bit words to dst.
func (f *Filter) AppendWords(dst []uint64) []uint64 {
	for i := range f.words {
		dst = append(dst, atomic.LoadUint64(&f.words[i]))
	}
	return dst
}

// Copy returns an independent copy.
func (f *Filter) Copy() *Filter {
	return &Filter{words: f.AppendWords(make([]uint64, 0, len(f.words))), blocks: f.blocks, k: f.k}
}

// Add inserts key.
func (f *Filter) Add(key uint64) {
	var p Probe
	p.init(key, 0, f.k)
	f.AddProbe(&p)
}

// AddProbe inserts the key behind p and returns how many bits it newly set
// (which lets a caller track the fill ratio without counting).
func (f *Filter) AddProbe(p *Probe) (newBits int) {
	blk := f.block(p)
	masks := f.masks(p)
	for w, m := range masks {
		if m != 0 && atomic.LoadUint64(&blk[w])&m != m {
			old := atomic.OrUint64(&blk[w], m)
			newBits += bits.OnesCount64(m &^ old)
		}
	}
	return newBits
}

// addUnpublished is AddProbe for a filter no other goroutine can see yet
// (a rebuild in progress): plain writes.
func (f *Filter) addUnpublished(p *Probe) (newBits int) {
	blk := f.block(p)
	masks := f.masks(p)
	for w, m := range masks {
		newBits += bits.OnesCount64(m &^ blk[w])
		blk[w] |= m
	}
	return newBits
}

// masks returns p's per-word bit masks for f's k.
func (f *Filter) masks(p *Probe) [blockWords]uint64 {
	if p.maskK == f.k {
		return p.masks
	}
	var masks [blockWords]uint64
	for _, q := range p.pos[:f.k] {
		masks[(q>>6)&7] |= 1 << (q & 63)
	}
	return masks
}

// Test reports whether key may be in the filter.
func (f *Filter) Test(key uint64) bool {
	var p Probe
	p.init(key, 0, f.k)
	return f.TestProbe(&p)
}

// TestProbe reports whether the key behind p may be in the filter.
func (f *Filter) TestProbe(p *Probe) bool {
	if f.behind {
		blk := f.view.block(f.blockIndex(p))
		masks := f.masks(p)
		var miss uint64
		for w := range blockWords {
			miss |= masks[w] &^ blk[w]
		}
		return miss == 0
	}
	blk := f.block(p)
	if p.maskK == f.k {
		// All k bits at once: 8 loads of one cache line, no data-dependent
		// branches; a hit (the common case in a walk) needs them all anyway.
		var miss uint64
		for w := range blockWords {
			miss |= p.masks[w] &^ atomic.LoadUint64(&blk[w])
		}
		return miss == 0
	}
	for _, q := range p.pos[:f.k] {
		if atomic.LoadUint64(&blk[(q>>6)&7])&(1<<(q&63)) == 0 {
			return false
		}
	}
	return true
}

// block returns the 512-bit block p selects: the high bits of the key scaled
// to the number of blocks (no division).
func (f *Filter) block(p *Probe) *[blockWords]uint64 {
	hi := f.blockIndex(p)
	return (*[blockWords]uint64)(f.words[hi*blockWords : hi*blockWords+blockWords])
}

func (f *Filter) blockIndex(p *Probe) uint64 {
	hi, _ := bits.Mul64(p.h, f.blocks)
	return hi
}

// OnesCount is the number of bits set.
func (f *Filter) OnesCount() int {
	n := 0
	for i := range f.words {
		n += bits.OnesCount64(atomic.LoadUint64(&f.words[i]))
	}
	return n
}

// FillRatio is the fraction of bits set.
func (f *Filter) FillRatio() float64 {
	return float64(f.OnesCount()) / float64(f.M())
}

// Probe holds a key's block selector and in-block bit positions, so one key
// is hashed once and tested against many filters of any size.
type Probe struct {
	h     uint64
	maskK uint // masks hold the first maskK positions; 0 when not built
	masks [blockWords]uint64
	pos   [MaxK]uint16
}

// NewProbe computes key's probe: its block selector is the key itself (keys
// are uniform hashes), its bit positions 9-bit slices of remixes of it.
func NewProbe(key uint64) Probe {
	var p Probe
	p.init(key, MaxK, 0)
	return p
}

// init computes the first k positions (k may be 0) and, if maskK > 0, the
// per-word masks of the first maskK positions. Position i is bits 9(i%7)..
// of blockkey.Remix(key + (i/7)·φ): 7 slices of 9 bits per remix.
func (p *Probe) init(key uint64, k, maskK uint) {
	p.h = key
	g, left, round := blockkey.Remix(key), 7, uint64(0)
	for i := range k {
		if left == 0 {
			round++
			g, left = blockkey.Remix(key+round*0x9e3779b97f4a7c15), 7
		}
		p.pos[i] = uint16(g & (blockBits - 1))
		g >>= 9
		left--
	}
	p.maskK = maskK
	if maskK == 0 {
		return
	}
	p.masks = [blockWords]uint64{}
	g, left, round = blockkey.Remix(key), 7, 0
	for range maskK {
		if left == 0 {
			round++
			g, left = blockkey.Remix(key+round*0x9e3779b97f4a7c15), 7
		}
		p.masks[(g>>6)&7] |= 1 << (g & 63)
		g >>= 9
		left--
	}
}

// MatchPrefix sets matched[i] to the number of leading keys that filters[i]
// may contain, stopping at each filter's first miss: keys are chained, so a
// miss at block j means nothing after j can be resident there. A nil filter
// matches nothing. len(matched) must be at least len(filters). It does not
// allocate and may run while other goroutines add keys to the filters.
//
// Each filter remembers the last prefixes found in it (foundPrefixes, the
// one thing MatchPrefix writes, atomically), so the walk of a prompt that
// shares one starts after it. That relies on the keys being chained
// (package blockkey): a key must stand for its whole prefix.
func MatchPrefix(keys []uint64, filters []*Filter, matched []int) {
	matched = matched[:len(filters)]
	for lo := 0; lo < len(filters); lo += matchChunk {
		hi := min(lo+matchChunk, len(filters))
		matchPrefix(keys, filters[lo:hi], matched[lo:hi])
	}
}

// matchChunk bounds the filters walked together, so the list of those still
// matching lives on the stack.
const matchChunk = 128

func matchPrefix(keys []uint64, filters []*Filter, matched []int) {
	// Each filter's walk starts after the longest prefix it is known to
	// hold (foundPrefixes); filters join the key-major walk in that order.
	var start [matchChunk]int32
	var from [matchChunk]int8   // the foundPrefixes slot start came from
	var order [matchChunk]uint8 // filters to walk, by start
	total := 0
	var kpos, kmask uint
	for i, f := range filters {
		if f == nil {
			matched[i] = 0
			continue
		}
		n, slot := f.found.longest(keys)
		start[i], from[i] = int32(n), int8(slot)
		matched[i] = len(keys) // unless the walk misses
		x := total
		for ; x > 0 && start[order[x-1]] > start[i]; x-- {
			order[x] = order[x-1]
		}
		order[x] = uint8(i)
		total++
		if kmask == 0 {
			kmask = f.k // replicas share a configuration: build masks for it
		} else if f.k != kmask {
			kpos = max(kpos, f.k) // and positions for any other
		}
	}
	// Walk the keys in segments: each starts where more filters join.
	var live [matchChunk]uint8 // indexes of filters that matched every key so far
	n, next := 0, 0
	for pos := 0; ; {
		for next < total && int(start[order[next]]) <= pos {
			live[n] = order[next]
			n++
			next++
		}
		end := len(keys)
		if next < total {
			end = int(start[order[next]])
		}
		n = walkKeys(keys, pos, end, filters, &live, n, matched, kpos, kmask)
		if next == total {
			break
		}
		pos = end
	}
	for _, i := range order[:total] {
		if m := matched[i]; m > int(start[i]) {
			filters[i].found.add(keys[m-1], m, int(from[i]))
		}
	}
}

// walkKeys tests keys[first:end] against the n live filters, key by key,
// dropping each at its first miss (matched[i] = that key's index); it
// returns how many are still live.
func walkKeys(keys []uint64, first, end int, filters []*Filter, live *[matchChunk]uint8, n int, matched []int, kpos, kmask uint) int {
	var p Probe
	for j := first; j < end && n > 0; j++ {
		p.init(keys[j], kpos, kmask)
		for x := 0; x < n; {
			i := live[x]
			f := filters[i]
			var hit bool
			if f.k == kmask && !f.behind { // TestProbe's mask path, inlined: this loop is the router's hottest
				hi, _ := bits.Mul64(p.h, f.blocks)
				blk := (*[blockWords]uint64)(f.words[hi*blockWords : hi*blockWords+blockWords])
				miss := p.masks[0]&^atomic.LoadUint64(&blk[0]) |
					p.masks[1]&^atomic.LoadUint64(&blk[1]) |
					p.masks[2]&^atomic.LoadUint64(&blk[2]) |
					p.masks[3]&^atomic.LoadUint64(&blk[3]) |
					p.masks[4]&^atomic.LoadUint64(&blk[4]) |
					p.masks[5]&^atomic.LoadUint64(&blk[5]) |
					p.masks[6]&^atomic.LoadUint64(&blk[6]) |
					p.masks[7]&^atomic.LoadUint64(&blk[7])
				hit = miss == 0
			} else {
				hit = f.TestProbe(&p)
			}
			if hit {
				x++
				continue
			}
			matched[i] = j
			n--
			live[x] = live[n]
		}
	}
	return n
}
