package fleetsim

import (
	"cmp"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/routing"
)

// OracleName is the reference policy only the simulator has: at decision
// time it reads every engine's exact prefix cache and prefill queue (zero
// staleness), counts as cached too the blocks of requests already queued
// there (FCFS computes them first), and picks the least predicted time to
// first token. No deployable router can see this much; it bounds what
// routing could gain.
const OracleName = "oracle"

// oracle is a routing.Policy that reads the engines themselves. The
// simulator sets hashes, the prompt's engine block hashes, before each
// decision: candidates name replicas, and the policy looks each one's
// engine up.
type oracle struct {
	engines []*engine.Engine
	byName  map[string]int
	// queued counts, per engine, the requests sent there whose first
	// token has not come yet that hold each block hash: every router's,
	// for the oracle is one instance shared by all.
	queued []map[uint64]int32
	// stepEnds is when each engine's step under way ends: a new request
	// waits for it, and the engine's state already shows its work done.
	stepEnds []time.Time
	// backlogs caches each engine's Backlog, which walks its queues: an
	// engine changes only when a request is added or a step starts, and
	// the simulator marks it stale then (backlogOK false).
	backlogs  []engine.Backlog
	backlogOK []bool
	hashes    []uint64
	ttft      []time.Duration
	scores    []uint64
}

func newOracle(engines []*engine.Engine, names []string) *oracle {
	o := &oracle{engines: engines, byName: map[string]int{}, queued: make([]map[uint64]int32, len(engines)),
		stepEnds: make([]time.Time, len(engines)), backlogs: make([]engine.Backlog, len(engines)), backlogOK: make([]bool, len(engines))}
	for i, n := range names {
		o.byName[n] = i
		o.queued[i] = map[uint64]int32{}
	}
	return o
}

// changed notes that engine i's state changed (a request added, a step
// started).
func (o *oracle) changed(i int) { o.backlogOK[i] = false }

func (o *oracle) backlog(i int) engine.Backlog {
	if !o.backlogOK[i] {
		o.backlogs[i], o.backlogOK[i] = o.engines[i].Backlog(), true
	}
	return o.backlogs[i]
}

// sent records that a request with block hashes went to engine i; done
// that it had its first token there, its blocks computed.
func (o *oracle) sent(i int, hashes []uint64) {
	for _, h := range hashes {
		o.queued[i][h]++
	}
}

func (o *oracle) done(i int, hashes []uint64) {
	q := o.queued[i]
	for _, h := range hashes {
		if q[h]--; q[h] <= 0 {
			delete(q, h)
		}
	}
}

func (o *oracle) Name() string { return OracleName }

// Route predicts each candidate's time to first token from its engine's
// exact state, with the engine's own cost profile, and orders them by it.
func (o *oracle) Route(req *routing.Request, cands []routing.Candidate, d *routing.Decision) {
	d.Order = d.Order[:0]
	o.ttft, o.scores = o.ttft[:0], o.scores[:0]
	matched := make([]int, len(cands))
	for i := range cands {
		k := o.byName[cands[i].Name]
		e, q := o.engines[k], o.queued[k]
		cfg := e.Config()
		hit := 0
		for _, h := range o.hashes[:min(len(o.hashes), routing.CacheableTokens(req.PromptTokens, cfg.BlockSize)/cfg.BlockSize)] {
			if !e.Holds(h) && q[h] == 0 {
				break
			}
			hit++
		}
		matched[i] = hit * cfg.BlockSize
		o.ttft = append(o.ttft, max(o.stepEnds[k].Sub(req.Now), 0)+predictTTFT(cfg, o.backlog(k), req.PromptTokens, matched[i]))
		// Equal predictions (idle, cold replicas) go by rendezvous hashing
		// on the prompt's leading blocks, as kvaware places cold prefixes,
		// so new prefixes spread over the fleet instead of piling on its
		// first names.
		o.scores = append(o.scores, blockkey.Remix(req.AffinityKey^blockkey.Remix(uint64(k)+1)))
		d.Order = append(d.Order, i)
	}
	slices.SortStableFunc(d.Order, func(a, b int) int {
		if c := cmp.Compare(o.ttft[a], o.ttft[b]); c != 0 {
			return c
		}
		return cmp.Compare(o.scores[b], o.scores[a])
	})
	d.Pick, d.Mode, d.Reason, d.Degraded = -1, routing.ModeBalance, "oracle: no candidate", false
	if len(d.Order) == 0 {
		return
	}
	d.Pick = d.Order[0]
	d.PredictedCachedTokens = matched[d.Pick]
	d.PredictedTTFT = o.ttft[d.Pick]
	d.Reason = "oracle: least predicted ttft on exact engine state"
	if matched[d.Pick] > 0 {
		d.Mode = routing.ModePrefix
	}
}

// predictTTFT prices, with an engine's cost profile, the prefill ahead of a
// new request (its backlog b) plus its own uncached tokens, chunked at the
// step token budget, each step also decoding the sequences running there
// over their context.
func predictTTFT(cfg engine.Config, b engine.Backlog, prompt, cached int) time.Duration {
	c := cfg.Cost
	own := max(prompt-cached, 1)
	tokens := b.PrefillTokens + own
	steps := (tokens + cfg.MaxNumBatchedTokens - 1) / cfg.MaxNumBatchedTokens
	ns := c.PrefillUsPerToken*1e3*float64(tokens) +
		c.PrefillNsPerPair*float64(own)*(float64(cached)+float64(own)/2) +
		float64(steps)*(c.FloorMs*1e6+c.DecodeUsPerSeq*1e3*float64(b.Running)+c.DecodeNsPerContextToken*float64(b.DecodeContext))
	return time.Duration(ns)
}
