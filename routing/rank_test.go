package routing

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestRankedDecisionIsTheSortedOnesHead: with Request.Rank set, kvaware
// selects instead of sorting; its pick, mode, predictions and the first
// Rank entries of its order must be the full sort's, ties and homes
// included.
func TestRankedDecisionIsTheSortedOnesHead(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 2000 {
		n := 1 + rng.IntN(300)
		cands := make([]Candidate, n)
		for i := range cands {
			// Coarse values, so that many candidates tie.
			cands[i] = Candidate{
				Name:                 fmt.Sprintf("r%03d", rng.IntN(1000)*1000+i),
				PrefixAware:          rng.IntN(5) > 0,
				MatchedTokens:        16 * 64 * rng.IntN(3),
				Waiting:              rng.IntN(3),
				Running:              rng.IntN(3),
				PendingPrefillTokens: 1024 * rng.IntN(3),
				InflightRequests:     rng.IntN(4),
			}
		}
		req := Request{Model: "m", PromptTokens: 4000, BlockSize: 16, Now: t0}
		switch rng.IntN(3) {
		case 0:
			req.AffinityKey = rng.Uint64()
		case 1:
			req.Session = rng.Uint64() | 1
		}
		var full, ranked Decision
		mustPolicy(t, "kvaware").Route(&req, cands, &full)
		req.Rank = 1 + rng.IntN(5)
		mustPolicy(t, "kvaware").Route(&req, cands, &ranked)
		head := min(req.Rank, n)
		if ranked.Pick != full.Pick || ranked.Mode != full.Mode || ranked.PredictedCachedTokens != full.PredictedCachedTokens ||
			ranked.PredictedTTFT != full.PredictedTTFT || ranked.SessionHome != full.SessionHome ||
			!slices.Equal(ranked.Order[:head], full.Order[:head]) {
			t.Fatalf("trial %d (%d candidates, rank %d): ranked %+v, sorted %+v", trial, n, req.Rank, ranked, full)
		}
		if got := slices.Sorted(slices.Values(ranked.Order)); len(got) != n || got[0] != 0 || got[n-1] != n-1 {
			t.Fatalf("trial %d: order %v is not a permutation of the candidates", trial, ranked.Order)
		}
	}
}

// TestHomeIsTheBoundedRendezvousHome: home's one pass finds what ordering
// every prefix-aware candidate by rendezvous weight and taking the first
// within the load bound (as chwbl does) finds.
func TestHomeIsTheBoundedRendezvousHome(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	p := newKVAware(Config{}.withDefaults())
	for trial := range 2000 {
		n := 1 + rng.IntN(200)
		cands := make([]Candidate, n)
		for i := range cands {
			cands[i] = Candidate{Name: fmt.Sprintf("r%d", i), PrefixAware: rng.IntN(4) > 0, InflightRequests: rng.IntN(6), Waiting: rng.IntN(3)}
		}
		var aware []int
		for i := range cands {
			if cands[i].PrefixAware {
				aware = append(aware, i)
			}
		}
		key := rng.Uint64() | 1
		d := Decision{}
		fillOrder(&d, n)
		got, ok := p.home(key, cands, make([]time.Duration, n), &d)
		if len(aware) == 0 {
			if ok {
				t.Fatalf("trial %d: a home %d among no prefix-aware candidates", trial, got)
			}
			continue
		}
		rendezvousOrder(aware, cands, key)
		want := aware[boundedHome(aware, cands, p.cfg.LoadBound)]
		if !ok || got != want {
			t.Fatalf("trial %d: home %d (%v), want %d", trial, got, ok, want)
		}
	}
}
