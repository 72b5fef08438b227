package engine

import "github.com/kvmesh/kvmesh/kvevents"

// pool is vLLM's BlockPool: a fixed set of physical blocks, a map from block
// hash to the cached blocks carrying it, and a free queue ordered for
// eviction. A block whose reference count drops to zero keeps its hash and
// stays reusable (a prefix hit) until the allocator hands its slot to someone
// else; only then is it evicted and a BlockRemoved emitted. That is the lazy
// eviction consumers of vLLM's events see.
type pool struct {
	ref    []int32
	hash   []uint64
	hashed []bool
	// Free queue: a doubly linked list over block ids with sentinel n.
	// Allocation takes from the front (least recently freed); freed blocks go
	// to the back.
	prev, next []int32
	inFree     []bool
	numFree    int

	// cached maps a hash to a block holding it, extra to any further
	// copies. vLLM does not deduplicate: two sequences computing the same
	// block at once both cache it, and each copy is stored and later
	// removed on its own. Copies are rare, so the common case is one map
	// entry and no allocation.
	cached    map[uint64]int32
	extra     map[uint64][]int32
	numCached int // blocks holding a hash

	events *[]kvevents.Event
}

func newPool(n int, events *[]kvevents.Event) *pool {
	p := &pool{
		ref:    make([]int32, n),
		hash:   make([]uint64, n),
		hashed: make([]bool, n),
		prev:   make([]int32, n+1),
		next:   make([]int32, n+1),
		inFree: make([]bool, n),
		cached: make(map[uint64]int32),
		extra:  make(map[uint64][]int32),
		events: events,
	}
	s := int32(n)
	p.prev[s], p.next[s] = s, s
	for b := int32(0); b < s; b++ {
		p.pushBack(b)
	}
	return p
}

func (p *pool) sentinel() int32 { return int32(len(p.ref)) }

func (p *pool) pushBack(b int32) {
	s := p.sentinel()
	last := p.prev[s]
	p.next[last], p.prev[b] = b, last
	p.next[b], p.prev[s] = s, b
	p.inFree[b] = true
	p.numFree++
}

func (p *pool) unlink(b int32) {
	p.next[p.prev[b]] = p.next[b]
	p.prev[p.next[b]] = p.prev[b]
	p.inFree[b] = false
	p.numFree--
}

// lookup returns a cached block with hash h.
func (p *pool) lookup(h uint64) (int32, bool) {
	b, ok := p.cached[h]
	return b, ok
}

// copies is how many blocks hold hash h.
func (p *pool) copies(h uint64) int {
	if _, ok := p.cached[h]; !ok {
		return 0
	}
	return 1 + len(p.extra[h])
}

// touch takes a reference on a cached block (a prefix hit), pulling it out
// of the free queue if nobody held it.
func (p *pool) touch(b int32) {
	if p.ref[b] == 0 {
		p.unlink(b)
	}
	p.ref[b]++
}

// alloc takes n blocks from the front of the free queue, evicting their old
// hashes. The caller has checked numFree ≥ n.
func (p *pool) alloc(dst []int32, n int) []int32 {
	s := p.sentinel()
	for range n {
		b := p.next[s]
		p.unlink(b)
		if p.hashed[b] {
			p.evict(b)
		}
		p.ref[b] = 1
		dst = append(dst, b)
	}
	return dst
}

func (p *pool) evict(b int32) {
	h := p.hash[b]
	more := p.extra[h]
	switch {
	case p.cached[h] == b && len(more) == 0:
		delete(p.cached, h)
	case p.cached[h] == b:
		p.cached[h] = more[len(more)-1]
		more = more[:len(more)-1]
	default:
		for i, x := range more {
			if x == b {
				more = append(more[:i], more[i+1:]...)
				break
			}
		}
	}
	if len(more) == 0 {
		delete(p.extra, h)
	} else {
		p.extra[h] = more
	}
	p.hashed[b] = false
	p.numCached--
	*p.events = append(*p.events, kvevents.Event{
		Kind:        kvevents.KindBlockRemoved,
		BlockHashes: []uint64{h},
		Medium:      "GPU",
		HasGroupIdx: true,
	})
}

// cache marks block b as holding hash h (it just filled).
func (p *pool) cache(b int32, h uint64) {
	p.hash[b], p.hashed[b] = h, true
	if _, dup := p.cached[h]; dup {
		p.extra[h] = append(p.extra[h], b)
	} else {
		p.cached[h] = b
	}
	p.numCached++
}

// free drops one reference on each block, last block first, so that when
// they become evictable a sequence's tail goes before its head (vLLM's
// order: the head is the part other prompts are likely to share).
func (p *pool) free(blocks []int32) {
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		p.ref[b]--
		if p.ref[b] == 0 {
			p.pushBack(b)
		}
	}
}

// reset forgets every cached hash; it fails while any block is referenced,
// as vLLM's reset_prefix_cache does.
func (p *pool) reset() bool {
	if p.numFree != len(p.ref) {
		return false
	}
	clear(p.cached)
	clear(p.extra)
	clear(p.hashed)
	p.numCached = 0
	*p.events = append(*p.events, kvevents.Event{Kind: kvevents.KindAllBlocksCleared})
	return true
}

// used is the number of referenced blocks.
func (p *pool) used() int { return len(p.ref) - p.numFree }
