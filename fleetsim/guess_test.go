package fleetsim

import (
	"testing"

	"github.com/kvmesh/kvmesh/routing"
)

// router-guess follows only its own router's past decisions: a prompt goes
// where its prefix went before, a new one to the smallest tree, an
// imbalance to the least loaded, and another router's guesses are its own.
func TestRouterGuessFollowsItsOwnDecisions(t *testing.T) {
	byName := map[string]int{"a": 0, "b": 1, "c": 2}
	cands := []routing.Candidate{{Name: "a"}, {Name: "b"}, {Name: "c"}}
	keys := func(from, n int) []uint64 {
		ks := make([]uint64, n)
		for i := range ks {
			ks[i] = uint64(from + i)
		}
		return ks
	}
	route := func(g *routerGuess, ks []uint64) routing.Decision {
		var d routing.Decision
		g.Route(&routing.Request{Keys: ks, BlockSize: 16, PromptTokens: 16*len(ks) + 5}, cands, &d)
		return d
	}
	own := make([]inflight, 3)
	g := newRouterGuess(own, byName)
	first := route(g, keys(1, 10))
	if first.Mode != routing.ModeCold || first.Pick != 0 {
		t.Fatalf("first prompt: pick %d mode %s, want the smallest tree a, cold", first.Pick, first.Mode)
	}
	second := route(g, keys(100, 10)) // a's tree is bigger now
	if second.Pick != 1 || second.Mode != routing.ModeCold {
		t.Fatalf("second prompt: pick %d mode %s, want b, cold", second.Pick, second.Mode)
	}
	again := route(g, append(keys(1, 8), keys(500, 2)...)) // 8 of 10 blocks guessed at a
	if again.Pick != 0 || again.Mode != routing.ModePrefix || again.PredictedCachedTokens != 128 {
		t.Fatalf("follow-up: pick %d mode %s cached %d, want a, prefix, 128", again.Pick, again.Mode, again.PredictedCachedTokens)
	}
	if d := route(g, append(keys(1, 4), keys(600, 6)...)); d.Mode == routing.ModePrefix {
		t.Fatalf("4 of 10 blocks guessed (under half) still routed by prefix to %d", d.Pick)
	}
	own[0].requests = 40 // a: 40 in flight, the others none
	if d := route(g, keys(1, 10)); d.Pick == 0 || d.Mode != routing.ModeBalance {
		t.Fatalf("imbalanced: pick %d mode %s, want not a, balance", d.Pick, d.Mode)
	}
	other := newRouterGuess(make([]inflight, 3), byName)
	other.insert(keys(1, 10), 2)
	if d := route(other, keys(1, 10)); d.Pick != 2 {
		t.Fatalf("another router's guesses: pick %d, want c (its own)", d.Pick)
	}
}
