package bloom

import "unsafe"

// Share lets the mirrors of one sidecar's stream held in one process (a
// simulator's routers, each with its own receiver) keep one copy of the
// filter bits where a real fleet's routers each keep their own. Every
// mirror still has exactly its own state: a snapshot it received, then the
// deltas it applied, in order. Mirrors that received the same snapshot
// message (the same payload, not an equal one) share a chain: the
// snapshot's words with every delta any of them applied so far, and for
// each delta past the slowest of them the bits it newly set, which a
// mirror not yet at that delta does not see. A mirror more than
// maxShareLag deltas behind the chain takes a copy of its own bits and
// goes on alone.
//
// A Share and the filters it makes are for one goroutine: a filter of a
// chain changes its words when it leaves the chain. Routers serving
// requests concurrently have no use for it.
type Share struct {
	chains map[string]*chain      // by sidecar member, the latest snapshot's
	deltas map[string]sharedDelta // by sidecar member, the latest delta decoded
}

// sharedDelta is a delta payload, by identity, and what it decoded to.
// Holding the payload keeps its memory from carrying another message.
type sharedDelta struct {
	payload *byte
	d       Delta
}

// NewShare returns an empty share.
func NewShare() *Share {
	return &Share{chains: map[string]*chain{}, deltas: map[string]sharedDelta{}}
}

// DecodeSharedDelta is DecodeDelta for the mirrors of member's stream: a
// payload just decoded for another mirror (the same bytes in memory) is
// not decoded again, and its keys are shared, for reading only.
func (sh *Share) DecodeSharedDelta(member string, b []byte) (Delta, error) {
	if len(b) > 0 {
		if e, ok := sh.deltas[member]; ok && e.payload == unsafe.SliceData(b) {
			return e.d, nil
		}
	}
	d, err := DecodeDelta(b)
	if err == nil && len(b) > 0 {
		sh.deltas[member] = sharedDelta{payload: unsafe.SliceData(b), d: d}
	}
	return d, err
}

// maxShareLag bounds the deltas a mirror may be behind its chain: each
// probe of a mirror behind masks out the bits of every delta it lacks.
const maxShareLag = 4

// chain is the shared bits of one snapshot message and the deltas applied
// after it.
type chain struct {
	payload *byte // the snapshot message's payload, by identity
	words   []uint64
	// top is the last delta applied to words; undo[i] the bits the delta
	// undoFrom+i newly set, kept while a view has not applied it.
	top      uint64
	undoFrom uint64
	undo     [][]undoBits
	views    []*Filter
}

// undoBits are bits one delta newly set in one word.
type undoBits struct {
	word uint32
	mask uint64
}

// view is a filter's place in its chain: the last delta it applied.
type view struct {
	c   *chain
	seq uint64
}

// DecodeSharedSnapshot is DecodeSnapshot for a mirror of member's stream
// that applies its result through ApplySnapshot: a payload already decoded
// for another mirror (the same bytes in memory) is not decoded again, and
// the mirror's filter shares its words.
func (sh *Share) DecodeSharedSnapshot(member string, b []byte) (Snapshot, error) {
	var key *byte
	if len(b) > 0 {
		key = unsafe.SliceData(b)
	}
	if c := sh.chains[member]; c != nil && c.payload == key && key != nil {
		s, err := decodeSnapshotHeader(b)
		if err != nil {
			return s, err
		}
		// The chain can take a mirror at the snapshot's own seq while it
		// still knows the bits of every delta after it; once every mirror
		// has moved past them, a latecomer starts a chain of its own.
		if s.Seq+1 >= c.undoFrom {
			s.Words, s.chain = c.words, c
			return s, nil
		}
	}
	s, err := DecodeSnapshot(b)
	if err != nil {
		return s, err
	}
	c := &chain{payload: key, words: s.Words, top: s.Seq, undoFrom: s.Seq + 1}
	sh.chains[member] = c
	s.chain = c
	return s, nil
}

// join makes f, a filter over c's words, a view of c as of delta seq.
func (c *chain) join(f *Filter, seq uint64) {
	f.view, f.behind = &view{c: c, seq: seq}, seq != c.top
	c.views = append(c.views, f)
	c.settle()
}

// leave takes f out of c (its mirror holds another state now), with bits
// of its own for whoever still reads it.
func (c *chain) leave(f *Filter) {
	for i, v := range c.views {
		if v == f {
			c.views = append(c.views[:i], c.views[i+1:]...)
			break
		}
	}
	f.words = c.bitsAt(f.view.seq)
	f.view, f.behind = nil, false
	c.settle()
}

// apply makes f's view take delta d, the one after its own: its bits are
// in the chain already when another view took it first.
func (c *chain) apply(f *Filter, d Delta) {
	v := f.view
	if d.Seq > c.top {
		var undo []undoBits
		var p Probe
		for _, key := range d.Keys {
			p.init(key, 0, f.k)
			hi := f.blockIndex(&p)
			masks := f.masks(&p)
			for w, m := range masks {
				i := hi*blockWords + uint64(w)
				if set := m &^ c.words[i]; set != 0 {
					c.words[i] |= set
					undo = append(undo, undoBits{word: uint32(i), mask: set})
				}
			}
		}
		c.undo = append(c.undo, undo)
		c.top = d.Seq
		for _, o := range c.views {
			o.behind = true
		}
	}
	v.seq = d.Seq
	f.behind = v.seq != c.top
	c.settle()
}

// settle drops the undo bits every view has applied and sends views too
// far behind off with bits of their own.
func (c *chain) settle() {
	low := c.top
	for i := 0; i < len(c.views); {
		f := c.views[i]
		if c.top-f.view.seq > maxShareLag {
			f.words = c.bitsAt(f.view.seq)
			f.view, f.behind = nil, false
			c.views = append(c.views[:i], c.views[i+1:]...)
			continue
		}
		low = min(low, f.view.seq)
		i++
	}
	if n := int(low + 1 - c.undoFrom); n > 0 {
		clear(c.undo[:n])
		c.undo = c.undo[n:]
		c.undoFrom = low + 1
	}
}

// bitsAt returns a copy of the chain's words as of delta seq.
func (c *chain) bitsAt(seq uint64) []uint64 {
	words := append([]uint64(nil), c.words...)
	for s := seq + 1; s <= c.top; s++ {
		for _, u := range c.undo[s-c.undoFrom] {
			words[u.word] &^= u.mask
		}
	}
	return words
}

// block returns the 512-bit block hi of the view's bits: the chain's,
// without those of the deltas it has not applied.
func (v *view) block(hi uint64) [blockWords]uint64 {
	c := v.c
	var blk [blockWords]uint64
	copy(blk[:], c.words[hi*blockWords:hi*blockWords+blockWords])
	lo, end := uint32(hi*blockWords), uint32(hi*blockWords+blockWords)
	for s := v.seq + 1; s <= c.top; s++ {
		for _, u := range c.undo[s-c.undoFrom] {
			if u.word >= lo && u.word < end {
				blk[u.word-lo] &^= u.mask
			}
		}
	}
	return blk
}
