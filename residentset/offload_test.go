package residentset

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

func on(medium string, ev *kvevents.Event) *kvevents.Event {
	ev.Medium = medium
	return ev
}

// A key is published as itself while a GPU block holds it, and tier-salted
// while only an offload tier does: write-through offload, eviction from the
// GPU, reload, and the CPU tier's own eviction, as vLLM's OffloadingConnector
// sends them (the CPU store carries the tokens, or only the hashes).
func TestOffloadTiersPublishedApart(t *testing.T) {
	k := routerKeys(seq(1, 8)) // blocks 10 (tokens 1-4) and 11 (5-8)
	cpu := func(key uint64) uint64 { return blockkey.Tiered(key, blockkey.TierSalt("CPU")) }
	disk := func(key uint64) uint64 { return blockkey.Tiered(key, blockkey.TierSalt("DISK")) }
	gpuStore := stored([]uint64{10, 11}, nil, seq(1, 8))
	cpuStore := on("CPU", stored([]uint64{10, 11}, nil, seq(1, 8)))
	cpuHashesOnly := on("cpu", stored([]uint64{10, 11}, nil, nil))
	for _, tc := range []struct {
		name   string
		events []*kvevents.Event
		want   []uint64
	}{
		{"gpu only", []*kvevents.Event{gpuStore}, []uint64{k[0], k[1]}},
		{"write-through stays gpu", []*kvevents.Event{gpuStore, cpuHashesOnly}, []uint64{k[0], k[1]}},
		{"evicted from gpu, kept on cpu", []*kvevents.Event{gpuStore, cpuHashesOnly, removed(11)},
			[]uint64{k[0], cpu(k[1])}},
		{"cpu then gpu", []*kvevents.Event{cpuStore, gpuStore}, []uint64{k[0], k[1]}},
		{"cpu alone", []*kvevents.Event{cpuStore}, []uint64{cpu(k[0]), cpu(k[1])}},
		{"cpu evicts", []*kvevents.Event{gpuStore, cpuStore, removed(10, 11), on("CPU", removed(11))},
			[]uint64{cpu(k[0])}},
		{"cpu preferred to disk", []*kvevents.Event{on("DISK", stored([]uint64{10, 11}, nil, seq(1, 8))), cpuStore},
			[]uint64{cpu(k[0]), cpu(k[1])}},
		{"disk after cpu evicts", []*kvevents.Event{on("DISK", stored([]uint64{10, 11}, nil, seq(1, 8))), cpuStore, on("CPU", removed(10))},
			[]uint64{disk(k[0]), cpu(k[1])}},
		{"other media ignored", []*kvevents.Event{on("NVME", stored([]uint64{10}, nil, seq(1, 4)))}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, rec := New(Options{Offload: []string{"cpu", "DISK"}}), newRecorder(t)
			for _, ev := range tc.events {
				s.Apply(ev, rec)
			}
			wantSet(t, s, rec, tc.want...)
		})
	}
}

// Without Offload, blocks on other media are ignored as before.
func TestOffloadTiersOffByDefault(t *testing.T) {
	s, rec := New(Options{}), newRecorder(t)
	s.Apply(on("CPU", stored([]uint64{10}, nil, seq(1, 4))), rec)
	wantSet(t, s, rec)
	if st := s.Stats(); st.OtherMedia != 1 {
		t.Fatalf("other media %d, want 1", st.OtherMedia)
	}
}
