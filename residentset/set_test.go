package residentset

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

func TestStoredChainMatchesRouterKeys(t *testing.T) {
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	s := New(Options{})
	s.Apply(&kvevents.Event{Kind: kvevents.KindBlockStored, BlockHashes: []uint64{100, 101}, TokenIDs: tokens[:8], BlockSize: 4}, nil)
	want := blockkey.Append(nil, blockkey.Seed("", ""), tokens, 4)
	if s.Len() != 2 || !s.Contains(want[0]) || !s.Contains(want[1]) {
		t.Fatalf("set has %d keys, want the router's %x", s.Len(), want)
	}
}
