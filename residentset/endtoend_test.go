package residentset

import (
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Engine events → exact set → filter generation → wire → router mirror →
// prefix walk over the keys the router computes from the prompt itself.
func TestRouterSeesWhatTheEngineStored(t *testing.T) {
	now := time.Now()
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 4096}, 42, now)
	obs := generations{g}
	s := New(Options{})
	var m bloom.Mirror
	send := func() {
		for {
			d, ok := g.TakeDelta()
			if !ok {
				return
			}
			back, err := bloom.DecodeDelta(d.AppendBinary(nil))
			if err != nil || !m.ApplyDelta(back) {
				t.Fatalf("delta %d: %v", d.Seq, err)
			}
		}
	}
	snap := g.Snapshot()
	wire, err := bloom.DecodeSnapshot(snap.AppendBinary(nil))
	if err != nil || m.ApplySnapshot(wire) != nil {
		t.Fatal("snapshot", err)
	}

	const bs = 16
	system := seq(1000, 6*bs)                         // a shared system prompt: 6 blocks
	user := append(seq(1000, 6*bs), seq(5000, 40)...) // + 2 full blocks and a partial one
	// The engine stores the system prompt, then the user turn on top of it.
	s.Apply(&kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: []uint64{1, 2, 3, 4, 5, 6},
		TokenIDs: system, BlockSize: bs}, obs)
	s.Apply(&kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: []uint64{7, 8},
		ParentHash: 6, HasParent: true, TokenIDs: user[6*bs : 8*bs], BlockSize: bs}, obs)
	send()

	walk := func(tokens []uint32) int {
		keys := blockkey.Append(nil, blockkey.Seed("", ""), tokens, bs)
		matched := make([]int, 1)
		bloom.MatchPrefix(keys, []*bloom.Filter{m.Filter()}, matched)
		return matched[0]
	}
	if got := walk(user); got != 8 {
		t.Fatalf("router matches %d blocks of the user prompt, want 8", got)
	}
	other := append(seq(1000, 6*bs), seq(9000, 32)...)
	if got := walk(other); got != 6 {
		t.Fatalf("router matches %d blocks of another user's prompt, want the 6 shared", got)
	}
	// The engine evicts the user turn; after a rebuild the router stops
	// claiming it.
	s.Apply(&kvevents.Event{Kind: kvevents.KindBlockRemoved, BlockHashes: []uint64{8, 7}}, obs)
	if !g.NeedsRebuild(now) {
		t.Fatal("2 of 8 keys removed: no rebuild")
	}
	g.Rebuild(now, slices.Values(s.AppendKeys(nil)))
	wire, err = bloom.DecodeSnapshot(func() []byte { sn := g.Snapshot(); return sn.AppendBinary(nil) }())
	if err != nil || m.ApplySnapshot(wire) != nil {
		t.Fatal("rebuilt snapshot", err)
	}
	if got := walk(user); got != 6 {
		t.Fatalf("after eviction and rebuild the router matches %d blocks, want 6", got)
	}
	if m.Generation() != 2 || m.Keys() != s.Len() {
		t.Fatalf("mirror at generation %d with %d keys, sidecar has %d resident", m.Generation(), m.Keys(), s.Len())
	}
}
