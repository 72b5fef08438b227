package residentset

import (
	"runtime"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/kvevents"
)

func rootBlock(h uint64) *kvevents.Event {
	return stored([]uint64{h}, nil, seq(int(h)*4, 4))
}

func TestMaxBlocksRefusesStoresPastCapacity(t *testing.T) {
	s, rec := New(Options{MaxBlocks: 4}), newRecorder(t)
	for h := uint64(1); h <= 4; h++ {
		s.Apply(rootBlock(h), rec)
	}
	if s.Overfull() {
		t.Fatal("overfull at the bound, before any refusal")
	}
	s.Apply(rootBlock(5), rec)
	// A chain of three past the bound: all three refused with the first.
	s.Apply(stored([]uint64{6, 7, 8}, nil, seq(60, 12)), rec)
	st := s.Stats()
	if s.Blocks() != 4 || s.Len() != 4 || st.RefusedFull != 4 || !s.Overfull() {
		t.Fatalf("blocks %d len %d refused %d overfull %v, want 4 4 4 true", s.Blocks(), s.Len(), st.RefusedFull, s.Overfull())
	}
	if len(rec.keys) != 4 {
		t.Fatalf("observer heard %d keys, want 4", len(rec.keys))
	}
	// A duplicate of a held hash takes no slot: counted, not refused.
	s.Apply(rootBlock(2), rec)
	if st := s.Stats(); st.Duplicates != 1 || st.RefusedFull != 4 {
		t.Fatalf("duplicates %d refused %d, want 1 4", st.Duplicates, st.RefusedFull)
	}
	// A removal makes room; the refused block's child is an orphan (its
	// parent is unknown), which is how a router sees it too: a miss.
	s.Apply(removed(1), rec)
	s.Apply(rootBlock(9), rec)
	s.Apply(stored([]uint64{10}, ptr(5), seq(0, 4)), rec)
	if s.Blocks() != 4 || s.Stats().Orphans != 1 || s.Stats().RefusedFull != 4 {
		t.Fatalf("after a removal: blocks %d orphans %d refused %d, want 4 1 4", s.Blocks(), s.Stats().Orphans, s.Stats().RefusedFull)
	}
	// Keys that several blocks share still leave with their last block.
	for _, h := range []uint64{2, 2, 3, 4, 9} {
		s.Apply(removed(h), rec)
	}
	if s.Blocks() != 0 || s.Len() != 0 || len(rec.keys) != 0 || len(s.tiers) != 0 {
		t.Fatalf("emptied: blocks %d len %d observer %d tiers %d", s.Blocks(), s.Len(), len(rec.keys), len(s.tiers))
	}
	if !s.Overfull() {
		t.Fatal("overfull forgotten before a clear")
	}
	s.Apply(&kvevents.Event{Kind: kvevents.KindAllBlocksCleared}, rec)
	if s.Overfull() {
		t.Fatal("overfull survives a clear")
	}
}

func TestSetMaxBlocksAppliesToLaterStores(t *testing.T) {
	s := New(Options{MaxBlocks: 2})
	for h := uint64(1); h <= 3; h++ {
		s.Apply(rootBlock(h), nil)
	}
	s.SetMaxBlocks(3)
	s.Apply(rootBlock(3), nil)
	s.SetMaxBlocks(1) // lowered below what is held: nothing dropped
	s.Apply(rootBlock(4), nil)
	if s.Blocks() != 3 || s.Stats().RefusedFull != 2 {
		t.Fatalf("blocks %d refused %d, want 3 2", s.Blocks(), s.Stats().RefusedFull)
	}
	s.SetMaxBlocks(0)
	s.Apply(rootBlock(4), nil)
	if s.Blocks() != 4 {
		t.Fatalf("unbounded: blocks %d, want 4", s.Blocks())
	}
}

func TestGroupsOutsideTheBoundAreRefused(t *testing.T) {
	s, rec := New(Options{MaxGroups: 2}), newRecorder(t)
	for _, g := range []int{0, 1, 2, -1, 1 << 40} {
		ev := rootBlock(uint64(10 + g&0xff))
		ev.GroupIdx = g
		s.Apply(ev, rec)
	}
	if st := s.Stats(); s.Blocks() != 2 || st.RefusedGroup != 3 {
		t.Fatalf("blocks %d refused %d, want 2 3", s.Blocks(), st.RefusedGroup)
	}
	rm := removed(10)
	rm.GroupIdx = 5
	s.Apply(rm, rec)
	if st := s.Stats(); st.RefusedGroup != 4 || st.UnknownRemovals != 0 {
		t.Fatalf("removal in a refused group: refused %d unknown %d, want 4 0", st.RefusedGroup, st.UnknownRemovals)
	}
	if New(Options{}).maxGroups != DefaultMaxGroups {
		t.Fatal("MaxGroups 0 is not the default")
	}
}

// An outsider naming 100k groups once made every orphan (a lookup of an
// unknown parent walks every tier) cost 36 ms; groups are now bounded and
// empty tiers forgotten, so an orphan costs a few lookups.
func TestOrphanCostBoundedUnderManyGroups(t *testing.T) {
	s := New(Options{})
	ev := rootBlock(1)
	for g := range 100_000 {
		ev.BlockHashes[0], ev.GroupIdx = uint64(g+1), g
		s.Apply(ev, nil)
	}
	if len(s.tiers) != DefaultMaxGroups {
		t.Fatalf("%d tiers, want %d", len(s.tiers), DefaultMaxGroups)
	}
	orphan := stored([]uint64{1 << 50}, ptr(1<<60), seq(0, 4))
	const n = 20_000
	start := time.Now()
	for i := range n {
		orphan.BlockHashes[0] = uint64(1<<50 + i)
		s.Apply(orphan, nil)
	}
	per := time.Since(start) / n
	t.Logf("orphan event with %d tiers: %v", len(s.tiers), per)
	if s.Stats().Orphans != n {
		t.Fatalf("orphans %d, want %d", s.Stats().Orphans, n)
	}
	if per > time.Millisecond { // 36 ms before; ~2 µs now, leave room for -race
		t.Fatalf("orphan event costs %v", per)
	}
	// Emptied tiers are dropped, not kept for lookups to walk.
	rm := removed(0)
	for g := range DefaultMaxGroups {
		rm.BlockHashes[0], rm.GroupIdx = uint64(g+1), g
		s.Apply(rm, nil)
	}
	if len(s.tiers) != 0 || s.Blocks() != 0 {
		t.Fatalf("%d tiers and %d blocks left after removing every block", len(s.tiers), s.Blocks())
	}
}

// A flood of distinct stores at a small engine: memory stays that of the
// bound, whatever the count.
func TestFloodOfDistinctStoresStaysBounded(t *testing.T) {
	const bound, flood = 2560, 500_000
	s := New(Options{MaxBlocks: bound})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ev := stored([]uint64{0, 0}, nil, seq(0, 8))
	for i := range flood {
		ev.BlockHashes[0], ev.BlockHashes[1] = uint64(2*i+1), uint64(2*i+2)
		ev.TokenIDs[0] = uint32(i)
		s.Apply(ev, nil)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d stores of 2 blocks, bound %d: %d held, %d refused, heap +%d KiB", flood, bound, s.Blocks(), s.Stats().RefusedFull, grown>>10)
	if s.Blocks() != bound || s.Stats().RefusedFull != 2*flood-bound {
		t.Fatalf("blocks %d refused %d", s.Blocks(), s.Stats().RefusedFull)
	}
	if grown > 1<<20 {
		t.Fatalf("heap grew %d KiB for %d held blocks", grown>>10, bound)
	}
	runtime.KeepAlive(s)
}
