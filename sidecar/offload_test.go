package sidecar

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/kvevents"
)

// With an offload tier, a block evicted from the GPU but kept on the CPU
// is published under its CPU-salted key, and the filter is sized for both
// tiers; without one, the CPU copy is ignored.
func TestOffloadedBlocksPublishedTierSalted(t *testing.T) {
	for _, tc := range []struct {
		name        string
		offload     int
		wantTiered  bool
		wantFilterN int
	}{
		{"offload tier", 64, true, 128},
		{"no offload tier", 0, false, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := New(Config{Name: "e1", EngineURL: "http://127.0.0.1:1", Capacity: 64, OffloadCapacity: tc.offload})
			if err != nil {
				t.Fatal(err)
			}
			if got, want := s.gens.Snapshot().M, bloom.NewFilter(uint(tc.wantFilterN), 0.01).M(); got != want {
				t.Fatalf("filter of %d bits, want %d (sized for %d keys)", got, want, tc.wantFilterN)
			}
			gpu := storedBatch(1, 2)
			cpu := storedBatch(1, 2)
			cpu.Events[0].Medium, cpu.Events[0].TokenIDs = "CPU", nil // the connector's store names hashes only
			evict := &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved, BlockHashes: []uint64{2}}}, DPRank: -1}
			for i, b := range []*kvevents.Batch{gpu, cpu, evict} {
				s.HandleBatch(uint64(i), b)
			}
			keys := blockkey.Append(nil, blockkey.Seed("", ""), gpu.Events[0].TokenIDs, 16)
			tiered := blockkey.Tiered(keys[1], blockkey.TierSalt("CPU"))
			got := residentKeys(s)
			if !got[keys[0]] || got[keys[1]] || got[tiered] != tc.wantTiered || len(got) != 1+boolInt(tc.wantTiered) {
				t.Fatalf("published %v; want %x and, on the CPU tier, %x: %v", got, keys[0], tiered, tc.wantTiered)
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
