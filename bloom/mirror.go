package bloom

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// ErrStaleSnapshot is returned for a snapshot older than the mirror's state
// (same epoch, earlier generation or sequence): it arrived out of order.
var ErrStaleSnapshot = errors.New("bloom: snapshot older than the mirrored state")

// Mirror follows one sidecar's filter stream on a router: a snapshot, then
// its ordered deltas. The zero value mirrors nothing yet.
//
// Readers never lock: Filter returns a filter whose bits deltas set with
// atomic OR while readers test with atomic loads, and a snapshot swaps in a
// new filter atomically, so a reader holding the old one reads a consistent
// (older) filter. Writers (ApplySnapshot, ApplyDelta, Reset) serialise on a
// mutex among themselves.
type Mirror struct {
	mu    sync.Mutex
	state atomic.Pointer[MirrorState]
}

// MirrorState is what a mirror holds at one moment. Its fields never change
// once published; the filter's bits may grow with later deltas of the same
// generation.
type MirrorState struct {
	Epoch, Generation, Seq uint64
	// Keys counts the keys of the generation: the snapshot's plus every
	// applied delta's (duplicates included, as the sidecar counts them).
	Keys   int
	Filter *Filter
}

// ApplySnapshot replaces the mirrored filter with s, whose Words the mirror
// takes over (do not reuse them). A snapshot of a new epoch always applies;
// within an epoch an earlier generation or sequence is ErrStaleSnapshot.
func (m *Mirror) ApplySnapshot(s Snapshot) error {
	f, err := FromWords(s.Words, s.M, s.K)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrGeometry, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if cur := m.state.Load(); cur != nil && cur.Epoch == s.Epoch &&
		(s.Generation < cur.Generation || s.Generation == cur.Generation && s.Seq < cur.Seq) {
		return fmt.Errorf("%w: generation %d seq %d, have %d/%d", ErrStaleSnapshot,
			s.Generation, s.Seq, cur.Generation, cur.Seq)
	}
	if s.chain != nil {
		s.chain.join(f, s.Seq) // before the old filter leaves, which may let the chain forget the bits f lacks
	}
	m.leaveShare()
	m.state.Store(&MirrorState{Epoch: s.Epoch, Generation: s.Generation, Seq: s.Seq, Keys: s.Keys, Filter: f})
	return nil
}

// ApplyDelta adds d's keys to the mirrored filter. A delta the mirror has
// already covered (sequence not after its own) is ignored and reports true.
// It reports false, applying nothing, when d does not follow on: no snapshot
// yet, another epoch or generation, or a sequence gap. The caller must then
// request a resync snapshot.
func (m *Mirror) ApplyDelta(d Delta) (ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	cur := m.state.Load()
	if cur == nil || d.Epoch != cur.Epoch || d.Generation != cur.Generation {
		return false
	}
	if d.Seq <= cur.Seq {
		return true
	}
	if d.Seq != cur.Seq+1 {
		return false
	}
	if v := cur.Filter.view; v != nil {
		v.c.apply(cur.Filter, d)
	} else {
		for _, key := range d.Keys {
			cur.Filter.Add(key)
		}
	}
	next := *cur
	next.Seq = d.Seq
	next.Keys += len(d.Keys)
	m.state.Store(&next)
	return true
}

// Reset forgets the mirrored state (the sidecar left or fell silent).
func (m *Mirror) Reset() {
	m.mu.Lock()
	m.leaveShare()
	m.state.Store(nil)
	m.mu.Unlock()
}

// leaveShare takes the filter held out of its Share's chain, if in one.
func (m *Mirror) leaveShare() {
	if cur := m.state.Load(); cur != nil && cur.Filter.view != nil {
		cur.Filter.view.c.leave(cur.Filter)
	}
}

// State returns the current state, nil before the first snapshot. Safe to
// call from any goroutine; never blocks.
func (m *Mirror) State() *MirrorState { return m.state.Load() }

// Filter returns the current filter, nil before the first snapshot. It may
// be tested (TestProbe, MatchPrefix) while deltas are applied.
func (m *Mirror) Filter() *Filter {
	if s := m.state.Load(); s != nil {
		return s.Filter
	}
	return nil
}

// Generation returns the mirrored generation, 0 before the first snapshot.
func (m *Mirror) Generation() uint64 {
	if s := m.state.Load(); s != nil {
		return s.Generation
	}
	return 0
}

// Keys returns the number of keys in the mirrored generation.
func (m *Mirror) Keys() int {
	if s := m.state.Load(); s != nil {
		return s.Keys
	}
	return 0
}
