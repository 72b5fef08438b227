package fleetsim

import (
	"github.com/kvmesh/kvmesh/loadtest/workload"
	"github.com/kvmesh/kvmesh/routing"
)

// GuessName is the reference policy that guesses caches from a router's
// own past decisions, with no engine events, as SGLang's cache-aware
// router does (sgl-router v0.4: one approximate prefix tree per worker of
// the requests sent there, read for its algorithm, not copied). Each
// router keeps its own guesses, so they diverge as routers multiply: the
// comparison kvmesh's shared engine truth is measured against.
const GuessName = "router-guess"

// The thresholds are sgl-router's launch_router defaults: the highest
// match wins when it covers more than half the prompt; the load is
// imbalanced, and the least-loaded worker wins, when the busiest has more
// than 32 requests more than the idlest and more than 1.0001 times as many.
const (
	guessCacheThreshold = 0.5
	guessBalanceAbs     = 32
	guessBalanceRel     = 1.0001
)

// routerGuess is one router's approximate trees. Keys are chained (each
// names its whole prefix), so a tree of blocks is a set of keys: holders
// maps a block key to the replicas (indexes) it was sent to.
type routerGuess struct {
	inflight []inflight // the router's own, by replica index
	byName   map[string]int
	holders  map[uint64][]int32
	size     []int // keys per replica: the tree size
	matched  []int // scratch, per candidate
}

func newRouterGuess(inflight []inflight, byName map[string]int) *routerGuess {
	return &routerGuess{inflight: inflight, byName: byName, holders: map[uint64][]int32{}, size: make([]int, len(inflight))}
}

func (g *routerGuess) Name() string { return GuessName }

// Route balances by the router's own in-flight counts when they are
// imbalanced; otherwise it takes the longest guessed match when it covers
// more than cacheThreshold of the prompt, else the replica with the
// smallest tree. The pick's tree then gains the prompt's blocks (the
// guess is made at selection, as in sgl-router).
func (g *routerGuess) Route(req *routing.Request, cands []routing.Candidate, d *routing.Decision) {
	d.Order, d.Pick, d.Degraded, d.PredictedCachedTokens = d.Order[:0], -1, false, 0
	if len(cands) == 0 {
		d.Mode, d.Reason = routing.ModeBalance, "router-guess: no candidate"
		return
	}
	load := func(i int) int { return g.inflight[g.byName[cands[i].Name]].requests }
	lo, hi := 0, 0
	for i := range cands {
		if load(i) < load(lo) {
			lo = i
		}
		if load(i) > load(hi) {
			hi = i
		}
	}
	switch {
	case load(hi)-load(lo) > guessBalanceAbs && float64(load(hi)) > float64(load(lo))*guessBalanceRel:
		d.Pick, d.Mode, d.Reason = lo, routing.ModeBalance, "router-guess: imbalanced, least loaded"
	default:
		best := g.match(req, cands)
		bs := req.BlockSize
		if bs == 0 {
			bs = workload.BlockSize // what plan keys prompts with when no filter says
		}
		if blocks := g.matched[best]; req.PromptTokens > 0 && float64(blocks*bs) > guessCacheThreshold*float64(req.PromptTokens) {
			d.Pick, d.Mode, d.Reason = best, routing.ModePrefix, "router-guess: highest guessed match"
			d.PredictedCachedTokens = min(blocks*bs, req.MaxCachedTokens(bs))
			break
		}
		small := 0
		for i := range cands {
			if g.size[g.byName[cands[i].Name]] < g.size[g.byName[cands[small].Name]] {
				small = i
			}
		}
		d.Pick, d.Mode, d.Reason = small, routing.ModeCold, "router-guess: smallest tree"
	}
	d.Order = append(d.Order, d.Pick)
	for i := range cands {
		if i != d.Pick {
			d.Order = append(d.Order, i)
		}
	}
	g.insert(req.Keys, int32(g.byName[cands[d.Pick].Name]))
}

// match fills g.matched with each candidate's guessed leading blocks and
// returns the first candidate with the most.
func (g *routerGuess) match(req *routing.Request, cands []routing.Candidate) int {
	g.matched = append(g.matched[:0], make([]int, len(cands))...)
	best := 0
	for i := range cands {
		k := int32(g.byName[cands[i].Name])
		n := 0
		for _, key := range req.Keys {
			if !holds(g.holders[key], k) {
				break
			}
			n++
		}
		g.matched[i] = n
		if n > g.matched[best] {
			best = i
		}
	}
	return best
}

func holds(hs []int32, k int32) bool {
	for _, h := range hs {
		if h == k {
			return true
		}
	}
	return false
}

// insert adds keys to replica k's tree. Trees are never trimmed: sgl-
// router bounds each at 2^24 nodes, which no run here comes near.
func (g *routerGuess) insert(keys []uint64, k int32) {
	for _, key := range keys {
		if hs := g.holders[key]; !holds(hs, k) {
			g.holders[key] = append(hs, k)
			g.size[k]++
		}
	}
}
