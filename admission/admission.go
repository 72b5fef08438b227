// Package admission decides which items are worth caching: those offered
// before. Most prompts a router sees are one-offs (a single-turn request, the
// newest turn of a chat); caching them on first sight evicts entries that
// would be reused and, for caches of pointerful values, lengthens every
// garbage-collection mark phase. A multi-turn chat re-sends its earlier
// turns, so they are admitted on their second sighting and hit from the
// third on.
package admission

import "sync/atomic"

// Doorkeeper remembers recently offered hashes in a direct-mapped table
// without pointers (8 bytes a slot): a collision makes it forget one of the
// two, which costs an item one more sighting, never a wrong answer. It is
// safe for concurrent use; a nil *Doorkeeper admits everything.
type Doorkeeper struct {
	slots []atomic.Uint64
	mask  uint64
}

// New returns a doorkeeper with at least slots slots (a power of two).
func New(slots int) *Doorkeeper {
	n := 1
	for n < slots {
		n <<= 1
	}
	return &Doorkeeper{slots: make([]atomic.Uint64, n), mask: uint64(n - 1)}
}

// Admit reports whether h was offered before; if not, it remembers h. h
// must be a well-mixed hash (its low bits pick the slot).
func (d *Doorkeeper) Admit(h uint64) bool {
	if d == nil {
		return true
	}
	if h == 0 {
		h = 1 // 0 marks an empty slot
	}
	s := &d.slots[h&d.mask]
	if s.Load() == h {
		return true
	}
	s.Store(h)
	return false
}
