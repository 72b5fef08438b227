package fleetsim

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/routing"
)

// The oracle reads the engines themselves: the replica whose cache holds
// the prompt wins while idle, a queued copy of the prompt counts as held,
// and a long enough queue sends the request to an idle cold replica.
func TestOracleReadsExactEngineState(t *testing.T) {
	cfg := engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 32768, Cost: engine.DefaultCost}
	prompt := make([]uint32, 1000)
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	hashes := blockkey.Append(nil, engine.DefaultHashSeed, prompt, 16)
	newEngines := func() []*engine.Engine {
		var es []*engine.Engine
		for range 3 {
			e, err := engine.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
		}
		return es
	}
	cands := []routing.Candidate{{Name: "a"}, {Name: "b"}, {Name: "c"}}
	req := &routing.Request{PromptTokens: len(prompt), AffinityKey: hashes[3]}
	route := func(o *oracle) routing.Decision {
		var d routing.Decision
		o.hashes = hashes
		o.Route(req, cands, &d)
		return d
	}

	es := newEngines()
	if err := es[1].Add(engine.Request{ID: 1, Prompt: prompt, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	for es[1].HasWork() {
		es[1].Step(0)
	}
	o := newOracle(es, []string{"a", "b", "c"})
	if d := route(o); d.Pick != 1 || d.PredictedCachedTokens != 992 || d.Mode != routing.ModePrefix {
		t.Fatalf("warm idle replica b: got pick %d, %d cached, mode %s", d.Pick, d.PredictedCachedTokens, d.Mode)
	}

	es = newEngines()
	o = newOracle(es, []string{"a", "b", "c"})
	o.sent(2, hashes) // queued at c, not prefilled yet
	if d := route(o); d.Pick != 2 || d.PredictedCachedTokens != 992 {
		t.Fatalf("prompt queued at c: got pick %d, %d cached", d.Pick, d.PredictedCachedTokens)
	}
	o.done(2, hashes)
	if len(o.queued[2]) != 0 {
		t.Fatalf("%d hashes left queued", len(o.queued[2]))
	}

	// b holds the prefix but has 40,000 tokens of other prompts queued.
	es = newEngines()
	if err := es[1].Add(engine.Request{ID: 1, Prompt: prompt, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	for es[1].HasWork() {
		es[1].Step(0)
	}
	for id := range 5 {
		other := make([]uint32, 8000)
		for i := range other {
			other[i] = uint32(100000*(id+1) + i)
		}
		if err := es[1].Add(engine.Request{ID: uint64(10 + id), Prompt: other, MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
	}
	o = newOracle(es, []string{"a", "b", "c"})
	if d := route(o); d.Pick == 1 || d.Mode != routing.ModeBalance {
		t.Fatalf("busy warm replica b still picked (pick %d, mode %s)", d.Pick, d.Mode)
	}
}
