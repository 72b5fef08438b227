package residentset

import (
	"math/bits"
	"slices"

	"github.com/kvmesh/kvmesh/blockkey"
)

// The two indexes of a Set are open-addressing hash tables with linear
// probing and backward-shift deletion (no tombstones, so an engine's endless
// store/evict churn never degrades them, and slots are 16 and 8 bytes). A
// slot whose key is 0 is empty; the key 0 itself lives beside the slots.

const (
	maxLoadNum, maxLoadDen = 4, 5 // grow past 80 % full
	minSlots               = 64
)

// home is the slot where a probe for h starts: a remix of h scaled to n
// slots (keys may be engine hashes of any quality).
func home(h uint64, n int) int {
	hi, _ := bits.Mul64(blockkey.Remix(h), uint64(n))
	return int(hi)
}

func grownSize(n int) int { return max(minSlots, n+n/2) }

// hashSlot maps an engine hash to its kvmesh key.
type hashSlot struct{ hash, key uint64 }

// hashIndex maps engine hash → (kvmesh key, reference count).
type hashIndex struct {
	slots []hashSlot
	refs  []uint32 // parallel to slots; read only on a hit
	n     int      // occupied slots
	// the entry for engine hash 0, which cannot live in a slot
	zeroKey  uint64
	zeroRefs uint32
}

func (t *hashIndex) len() int {
	if t.zeroRefs > 0 {
		return t.n + 1
	}
	return t.n
}

// find returns the slot of h, or -1.
func (t *hashIndex) find(h uint64) int {
	if len(t.slots) == 0 {
		return -1
	}
	i := home(h, len(t.slots))
	for {
		switch t.slots[i].hash {
		case h:
			return i
		case 0:
			return -1
		}
		if i++; i == len(t.slots) {
			i = 0
		}
	}
}

// get returns h's key and reference count (0 when absent).
func (t *hashIndex) get(h uint64) (key uint64, refs uint32) {
	if h == 0 {
		return t.zeroKey, t.zeroRefs
	}
	if i := t.find(h); i >= 0 {
		return t.slots[i].key, t.refs[i]
	}
	return 0, 0
}

// put sets h's entry; refs must be > 0.
func (t *hashIndex) put(h, key uint64, refs uint32) {
	if h == 0 {
		t.zeroKey, t.zeroRefs = key, refs
		return
	}
	if i := t.find(h); i >= 0 {
		t.slots[i].key, t.refs[i] = key, refs
		return
	}
	if (t.n+1)*maxLoadDen > len(t.slots)*maxLoadNum {
		t.grow()
	}
	t.insert(h, key, refs)
}

func (t *hashIndex) insert(h, key uint64, refs uint32) {
	i := home(h, len(t.slots))
	for t.slots[i].hash != 0 {
		if i++; i == len(t.slots) {
			i = 0
		}
	}
	t.slots[i], t.refs[i] = hashSlot{h, key}, refs
	t.n++
}

func (t *hashIndex) grow() {
	old, oldRefs := t.slots, t.refs
	size := grownSize(len(old))
	t.slots, t.refs, t.n = make([]hashSlot, size), make([]uint32, size), 0
	for i, s := range old {
		if s.hash != 0 {
			t.insert(s.hash, s.key, oldRefs[i])
		}
	}
}

// del removes h, which must be present.
func (t *hashIndex) del(h uint64) {
	if h == 0 {
		t.zeroKey, t.zeroRefs = 0, 0
		return
	}
	i := t.find(h)
	if i < 0 {
		return
	}
	// Backward shift: move later entries of the cluster into the hole
	// unless their home lies cyclically in (hole, their slot].
	n := len(t.slots)
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		s := t.slots[j]
		if s.hash == 0 {
			break
		}
		k := home(s.hash, n)
		if i <= j && i < k && k <= j || i > j && (i < k || k <= j) {
			continue
		}
		t.slots[i], t.refs[i] = s, t.refs[j]
		i = j
	}
	t.slots[i], t.refs[i] = hashSlot{}, 0
	t.n--
}

func (t *hashIndex) reset() { *t = hashIndex{} }

// keyCounts is the set of resident kvmesh keys, each with the number of
// resident engine hashes naming it. Almost every key has one; the few with
// more keep their count in a small map, so a slot is just the key.
type keyCounts struct {
	slots   []uint64
	n       int
	hasZero bool
	extra   map[uint64]uint32 // count-1 of keys named by more than one hash
}

func (t *keyCounts) len() int {
	if t.hasZero {
		return t.n + 1
	}
	return t.n
}

func (t *keyCounts) find(k uint64) int {
	if len(t.slots) == 0 {
		return -1
	}
	i := home(k, len(t.slots))
	for {
		switch t.slots[i] {
		case k:
			return i
		case 0:
			return -1
		}
		if i++; i == len(t.slots) {
			i = 0
		}
	}
}

func (t *keyCounts) contains(k uint64) bool {
	if k == 0 {
		return t.hasZero
	}
	return t.find(k) >= 0
}

// inc counts one more hash naming k and reports whether k is new.
func (t *keyCounts) inc(k uint64) (added bool) {
	if t.contains(k) {
		if t.extra == nil {
			t.extra = make(map[uint64]uint32)
		}
		t.extra[k]++
		return false
	}
	if k == 0 {
		t.hasZero = true
		return true
	}
	if (t.n+1)*maxLoadDen > len(t.slots)*maxLoadNum {
		old := t.slots
		t.slots, t.n = make([]uint64, grownSize(len(old))), 0
		for _, s := range old {
			if s != 0 {
				t.insert(s)
			}
		}
	}
	t.insert(k)
	return true
}

func (t *keyCounts) insert(k uint64) {
	i := home(k, len(t.slots))
	for t.slots[i] != 0 {
		if i++; i == len(t.slots) {
			i = 0
		}
	}
	t.slots[i] = k
	t.n++
}

// dec counts one hash fewer naming k and reports whether k left the set.
func (t *keyCounts) dec(k uint64) (removed bool) {
	if c, ok := t.extra[k]; ok {
		if c > 1 {
			t.extra[k] = c - 1
		} else {
			delete(t.extra, k)
		}
		return false
	}
	if k == 0 {
		t.hasZero = false
		return true
	}
	i := t.find(k)
	if i < 0 {
		return false
	}
	n := len(t.slots)
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		s := t.slots[j]
		if s == 0 {
			break
		}
		h := home(s, n)
		if i <= j && i < h && h <= j || i > j && (i < h || h <= j) {
			continue
		}
		t.slots[i] = s
		i = j
	}
	t.slots[i] = 0
	t.n--
	return true
}

func (t *keyCounts) count(k uint64) uint32 {
	if !t.contains(k) {
		return 0
	}
	return 1 + t.extra[k]
}

func (t *keyCounts) appendTo(dst []uint64) []uint64 {
	dst = slices.Grow(dst, t.len())
	if t.hasZero {
		dst = append(dst, 0)
	}
	for _, k := range t.slots {
		if k != 0 {
			dst = append(dst, k)
		}
	}
	return dst
}

func (t *keyCounts) reset() { *t = keyCounts{} }
