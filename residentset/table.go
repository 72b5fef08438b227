package residentset

import (
	"math/bits"
	"slices"

	"github.com/kvmesh/kvmesh/blockkey"
)

// table is the one hash table behind a Set's indexes: open addressing with
// linear probing and backward-shift deletion (no tombstones, so an engine's
// endless store/evict churn never degrades it). Keys are probed in a dense
// slice of their own, 8 bytes a slot; values sit in a parallel slice read
// only on a hit, so a set of keys (V = struct{}) costs nothing more. A slot
// whose key is 0 is empty; the key 0 itself lives beside the slots.
type table[V any] struct {
	keys []uint64
	vals []V
	n    int // occupied slots
	// the entry for key 0
	hasZero bool
	zero    V
}

const (
	maxLoadNum, maxLoadDen = 4, 5 // grow past 80 % full
	minSlots               = 64
)

// home is the slot where a probe for k starts: a remix of k scaled to n
// slots (keys may be engine hashes of any quality).
func home(k uint64, n int) int {
	hi, _ := bits.Mul64(blockkey.Remix(k), uint64(n))
	return int(hi)
}

func (t *table[V]) len() int {
	if t.hasZero {
		return t.n + 1
	}
	return t.n
}

// find returns the slot of k (not 0), or -1.
func (t *table[V]) find(k uint64) int {
	if len(t.keys) == 0 {
		return -1
	}
	i := home(k, len(t.keys))
	for {
		switch t.keys[i] {
		case k:
			return i
		case 0:
			return -1
		}
		if i++; i == len(t.keys) {
			i = 0
		}
	}
}

// get returns k's value and whether k is present.
func (t *table[V]) get(k uint64) (v V, ok bool) {
	if k == 0 {
		return t.zero, t.hasZero
	}
	if i := t.find(k); i >= 0 {
		return t.vals[i], true
	}
	return v, false
}

func (t *table[V]) contains(k uint64) bool {
	if k == 0 {
		return t.hasZero
	}
	return t.find(k) >= 0
}

// put sets k's value and reports whether it added k.
func (t *table[V]) put(k uint64, v V) (added bool) {
	if k == 0 {
		added = !t.hasZero
		t.zero, t.hasZero = v, true
		return added
	}
	if i := t.find(k); i >= 0 {
		t.vals[i] = v
		return false
	}
	if (t.n+1)*maxLoadDen > len(t.keys)*maxLoadNum {
		t.grow()
	}
	t.insert(k, v)
	return true
}

// insert adds k, which is absent and not 0, where there is room.
func (t *table[V]) insert(k uint64, v V) {
	i := home(k, len(t.keys))
	for t.keys[i] != 0 {
		if i++; i == len(t.keys) {
			i = 0
		}
	}
	t.keys[i], t.vals[i] = k, v
	t.n++
}

func (t *table[V]) grow() {
	oldKeys, oldVals := t.keys, t.vals
	size := max(minSlots, len(oldKeys)+len(oldKeys)/2)
	t.keys, t.vals, t.n = make([]uint64, size), make([]V, size), 0
	for i, k := range oldKeys {
		if k != 0 {
			t.insert(k, oldVals[i])
		}
	}
}

// del removes k and reports whether it was present.
func (t *table[V]) del(k uint64) bool {
	var none V
	if k == 0 {
		was := t.hasZero
		t.zero, t.hasZero = none, false
		return was
	}
	i := t.find(k)
	if i < 0 {
		return false
	}
	// Backward shift: move later entries of the cluster into the hole
	// unless their home lies cyclically in (hole, their slot].
	n := len(t.keys)
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		kj := t.keys[j]
		if kj == 0 {
			break
		}
		h := home(kj, n)
		if i <= j && i < h && h <= j || i > j && (i < h || h <= j) {
			continue
		}
		t.keys[i], t.vals[i] = kj, t.vals[j]
		i = j
	}
	t.keys[i], t.vals[i] = 0, none
	t.n--
	return true
}

// appendKeys appends every key to dst, in slot order.
func (t *table[V]) appendKeys(dst []uint64) []uint64 {
	dst = slices.Grow(dst, t.len())
	if t.hasZero {
		dst = append(dst, 0)
	}
	for _, k := range t.keys {
		if k != 0 {
			dst = append(dst, k)
		}
	}
	return dst
}

// hashEntry is what a tier holds for one engine hash: the kvmesh key it
// names and the stores not yet removed (with the taint bit). The key is kept
// in halves so that the entry is 4-byte aligned, 12 bytes rather than 16: a
// tier's slot, most of a resident block's memory, is then 20 bytes, not 24.
type hashEntry struct {
	keyLo, keyHi uint32
	refs         uint32
}

func entry(key uint64, refs uint32) hashEntry {
	return hashEntry{uint32(key), uint32(key >> 32), refs}
}

func (e hashEntry) key() uint64 { return uint64(e.keyHi)<<32 | uint64(e.keyLo) }

// hashIndex maps engine hash → (kvmesh key, reference count), for one tier.
type hashIndex = table[hashEntry]

// keyCounts is the set of resident kvmesh keys, each with the number of
// resident engine hashes naming it. Almost every key has one; the few with
// more keep their count in a small map, so a slot is just the key.
type keyCounts struct {
	set   table[struct{}]
	extra map[uint64]uint32 // count-1 of keys named by more than one hash
}

func (c *keyCounts) len() int                       { return c.set.len() }
func (c *keyCounts) contains(k uint64) bool         { return c.set.contains(k) }
func (c *keyCounts) appendTo(dst []uint64) []uint64 { return c.set.appendKeys(dst) }
func (c *keyCounts) reset()                         { *c = keyCounts{} }

// inc counts one more hash naming k and reports whether k is new.
func (c *keyCounts) inc(k uint64) (added bool) {
	if c.set.put(k, struct{}{}) {
		return true
	}
	if c.extra == nil {
		c.extra = make(map[uint64]uint32)
	}
	c.extra[k]++
	return false
}

// dec counts one hash fewer naming k and reports whether k left the set.
func (c *keyCounts) dec(k uint64) (removed bool) {
	if n, ok := c.extra[k]; ok {
		if n > 1 {
			c.extra[k] = n - 1
		} else {
			delete(c.extra, k)
		}
		return false
	}
	return c.set.del(k)
}

func (c *keyCounts) count(k uint64) uint32 {
	if !c.set.contains(k) {
		return 0
	}
	return 1 + c.extra[k]
}
