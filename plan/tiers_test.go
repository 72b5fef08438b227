package plan

import (
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// tieredReplica holds the prompt's first gpu blocks on its GPU and the
// next cpu blocks only in host memory, published as its sidecar does
// (blockkey.Tiered under "CPU"); announced says whether its metadata names
// the tier (a sidecar that predates tiers does not).
type tieredReplica struct {
	name      string
	gpu, cpu  int
	announced bool
	waiting   int
}

func tieredFleet(t *testing.T, reps []tieredReplica, keys []uint64) *fleet.Snapshot {
	t.Helper()
	table := fleet.NewTable(fleet.TableConfig{StaleAfter: time.Minute, DropAfter: time.Hour})
	salt := blockkey.TierSalt("CPU")
	for _, r := range reps {
		info := fleet.Info{Name: r.name, Models: []string{model}, URL: "http://127.0.0.1:1", Protocol: fleet.ProtocolVLLM, KVEvents: true, BlockSize: 16}
		if r.announced {
			info.OffloadMedia = []string{"CPU"}
		}
		table.Upsert(info, t0)
		table.SetLoad(r.name, fleet.Load{Waiting: r.waiting}, true, t0)
		f := bloom.NewFilter(1024, 0.0001)
		for _, k := range keys[:r.gpu] {
			f.Add(k)
		}
		for _, k := range keys[r.gpu : r.gpu+r.cpu] {
			f.Add(blockkey.Tiered(k, salt))
		}
		table.SetFilter(r.name, f, 1, r.gpu+r.cpu, t0)
	}
	table.Expire(t0)
	return table.Snapshot()
}

// The planner matches GPU blocks, then where they stop the blocks a tier
// holds; kvaware prices those at the load cost, between a GPU hit and a
// recompute; a replica that does not announce its tier (or a router told
// to ignore tiers) is matched on its GPU blocks only.
func TestTieredMatch(t *testing.T) {
	keys, promptTokens := keysOf(longPrompt, "")
	n := len(keys)
	if n < 8 {
		t.Fatalf("prompt of %d blocks, want 8 or more", n)
	}
	top := (&routing.Request{PromptTokens: promptTokens}).MaxCachedTokens(16) // what a full hit can claim
	type tw struct {
		name              string
		cached, offloaded int
	}
	for _, tc := range []struct {
		name        string
		reps        []tieredReplica
		ignoreTiers bool
		offloadCost time.Duration
		want        []tw // targets in order
	}{
		{"gpu beats the same prefix on cpu",
			[]tieredReplica{{name: "a", gpu: 2, cpu: n - 2, announced: true}, {name: "b", gpu: n}}, false, 0,
			[]tw{{"b", top, 0}, {"a", top, top - 32}}},
		{"cpu prefix beats a shorter gpu one",
			[]tieredReplica{{name: "a", gpu: 1, cpu: n - 1, announced: true}, {name: "b", gpu: 4}}, false, 0,
			[]tw{{"a", top, top - 16}, {"b", 64, 0}}},
		{"load priced as recompute: the gpu prefix wins",
			[]tieredReplica{{name: "a", gpu: 1, cpu: n - 1, announced: true}, {name: "b", gpu: 4}}, false, time.Second,
			[]tw{{"b", 64, 0}, {"a", top, top - 16}}},
		{"tier not announced (old sidecar): gpu only",
			[]tieredReplica{{name: "a", gpu: 1, cpu: n - 1}, {name: "b", gpu: 4}}, false, 0,
			[]tw{{"b", 64, 0}, {"a", 16, 0}}},
		{"router ignoring tiers: gpu only",
			[]tieredReplica{{name: "a", gpu: 1, cpu: n - 1, announced: true}, {name: "b", gpu: 4}}, true, 0,
			[]tw{{"b", 64, 0}, {"a", 16, 0}}},
		{"all on cpu",
			[]tieredReplica{{name: "a", cpu: n, announced: true}, {name: "b", waiting: 1}}, false, 0,
			[]tw{{"a", top, top}, {"b", 0, 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			policy, err := routing.New("kvaware", routing.Config{OffloadPerToken: tc.offloadCost})
			if err != nil {
				t.Fatal(err)
			}
			snap := tieredFleet(t, tc.reps, keys)
			in := Input{Snapshot: snap, Loads: make([]Load, len(snap.Replicas)), Request: completion(t, longPrompt, ""), Model: model, Now: t0,
				ModelSettings: Model{Tokenizer: tokenize.Builtin{}},
				Settings:      Settings{Policy: policy, MaxPrefixTokens: 1024, MaxPrefixBytes: 1 << 20, MaxAttempts: 3, IgnoreTiers: tc.ignoreTiers}}
			var p Plan
			if err := p.Decide(&in); err != nil {
				t.Fatal(err)
			}
			var got []tw
			for _, tg := range p.Targets {
				got = append(got, tw{tg.Name, tg.PredictedCached, tg.PredictedOffloaded})
			}
			if len(got) != len(tc.want) {
				t.Fatalf("targets %+v, want %+v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("targets %+v, want %+v", got, tc.want)
				}
			}
		})
	}
}
