package plan

import (
	"slices"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/routing"
)

// prefillPool qualifies a model's name for its prefill pool's decisions.
const prefillPool = "\x00prefill"

// kvHeadroom is the KV usage past which a decode replica is chosen only
// when every other is as full: a decode holds its sequence's KV for the
// whole answer, and a full cache preempts running sequences.
const kvHeadroom = 0.95

// disaggregated reports whether a candidate's engine plays one side of
// prefill/decode disaggregation only: the model is then served by pools.
func (p *Plan) disaggregated(snap *fleet.Snapshot) bool {
	for _, si := range p.snapIdx {
		if snap.Replicas[si].KVRole != fleet.KVBoth {
			return true
		}
	}
	return false
}

// decideSplit plans a request to a disaggregated model. The policy first
// places it whole among the decode-capable replicas (a decode engine
// prefills a request sent without transfer parameters itself); when the
// part of the prompt that replica would compute is short (Settings.Split,
// SplitMinUncached), it is served there whole: its prefill stalls the
// decodes running there little, and a split would add a transfer and a
// hop to its time to first token. Otherwise the policy places its prefill
// among the prefill-capable replicas (prefix-aware: they hold the cache)
// and the decode goes to the least loaded decode-capable replica with KV
// room.
func (p *Plan) decideSplit(in *Input) error {
	snap, ms, st := in.Snapshot, &in.ModelSettings, &in.Settings
	if !p.routeOver(in, fleet.KVRole.Decodes, &p.Decision) {
		// No decode-capable replica is up: every engine can still serve a
		// request whole (vLLM's connector plays both sides whatever its
		// role), so the prefill replicas take it.
		in.Settings.Policy.Route(&p.Request, p.Candidates, &p.Decision)
		return p.targetsFrom(in)
	}
	p.fixMode(&p.Decision)
	uncached := p.Prompt.Tokens - p.Decision.PredictedCachedTokens
	split := st.Split == SplitAlways || st.Split == SplitAuto && p.Prompt.Err == nil && uncached >= st.SplitMinUncached
	spill := ms.SpillAfter > 0 && len(ms.Fallback) > 0 && p.Decision.PredictedTTFT > ms.SpillAfter
	if !split || spill {
		return p.targetsFrom(in)
	}
	whole := p.Decision
	whole.Order = append(p.wholeOrder[:0], whole.Order...)
	p.wholeOrder = whole.Order
	// The prefill pool is a fleet of its own to the policy: kvaware judges
	// imbalance per model, and the decode pool's must not flip it.
	model := p.Request.Model
	p.Request.Model = model + prefillPool
	routed := p.routeOver(in, fleet.KVRole.Prefills, &p.Decision)
	p.Request.Model = model
	if !routed || p.Decision.Pick == whole.Pick {
		// No prefill replica, or the best one is the best decode replica
		// too (a both-role engine): a split there would only add a hop.
		p.Decision = whole
		return p.targetsFrom(in)
	}
	p.fixMode(&p.Decision)
	for _, ci := range p.Decision.Order {
		if len(p.Prefill) >= st.MaxAttempts {
			break
		}
		if i := p.snapIdx[ci]; in.Loads[i].Unusable {
			p.Unusable = append(p.Unusable, i)
			continue
		}
		t := p.target(snap, ci, &p.Decision)
		t.Teaches = false // its answer is one token, not the client's first
		p.Prefill = append(p.Prefill, t)
	}
	if len(p.Prefill) == 0 {
		p.Decision = whole
		return p.targetsFrom(in)
	}
	cached, offloaded := p.Prefill[0].PredictedCached, p.Prefill[0].PredictedOffloaded
	for _, ci := range p.decodeOrder(snap) {
		if len(p.Targets) >= st.MaxAttempts {
			break
		}
		i := p.snapIdx[ci]
		if in.Loads[i].Unusable {
			continue
		}
		c := &p.Candidates[ci]
		p.Targets = append(p.Targets, Target{
			Replica: i, Fallback: -1, Name: c.Name, Mode: routing.ModeSplit, Split: true,
			// What the client's prompt found cached is the prefill's hit;
			// the decode computes nothing of it (the KV crosses over).
			PredictedCached: cached, PredictedOffloaded: offloaded,
			PrefixAware: c.PrefixAware, FilterMatched: c.MatchedTokens,
			Stale: snap.Replicas[i].Stale, Picked: len(p.Targets) == 0,
		})
	}
	if len(p.Targets) == 0 {
		p.Prefill = p.Prefill[:0]
		p.Decision = whole
		return p.targetsFrom(in)
	}
	// Last, the best decode-capable replica serving the request whole: a
	// prefill whose KV no decode replica could read (its engine gone, its
	// blocks expired) is computed again there rather than lost.
	if whole.Pick >= 0 && !in.Loads[p.snapIdx[whole.Pick]].Unusable {
		t := p.target(snap, whole.Pick, &whole)
		t.Picked, t.Teaches = false, false
		p.Targets = append(p.Targets, t)
	}
	p.addFallback(ms)
	return nil
}

// fixMode makes a cold placement of a prompt without tokens a load one.
func (p *Plan) fixMode(d *routing.Decision) {
	if p.Prompt.Err != nil && d.Mode == routing.ModeCold {
		d.Mode = routing.ModeBalance
	}
}

// routeOver runs the policy over the candidates whose role passes in
// into d, its Pick and Order indexes of p.Candidates; false when no
// candidate passes.
func (p *Plan) routeOver(in *Input, role func(fleet.KVRole) bool, d *routing.Decision) bool {
	p.pool, p.poolIdx = p.pool[:0], p.poolIdx[:0]
	for ci, si := range p.snapIdx {
		if role(in.Snapshot.Replicas[si].KVRole) {
			p.pool = append(p.pool, p.Candidates[ci])
			p.poolIdx = append(p.poolIdx, ci)
		}
	}
	if len(p.pool) == 0 {
		return false
	}
	*d = routing.Decision{Order: d.Order[:0]}
	in.Settings.Policy.Route(&p.Request, p.pool, d)
	if d.Pick >= 0 {
		d.Pick = p.poolIdx[d.Pick]
	}
	for k, ci := range d.Order {
		d.Order[k] = p.poolIdx[ci]
	}
	return true
}

// decodeOrder orders the decode-capable candidates for a split's decode:
// those with KV room first, then by the requests they run, queue and have
// on the way; equal ones in an order the request's prefix rotates, so that
// routers deciding at once on the same figures spread their decodes.
func (p *Plan) decodeOrder(snap *fleet.Snapshot) []int {
	p.poolIdx = p.poolIdx[:0]
	for ci, si := range p.snapIdx {
		if snap.Replicas[si].KVRole.Decodes() {
			p.poolIdx = append(p.poolIdx, ci)
		}
	}
	spread := blockkey.Remix(p.Request.AffinityKey ^ p.Request.Session ^ uint64(p.Prompt.Tokens))
	full := func(ci int) bool { return snap.Replicas[p.snapIdx[ci]].Load.KVUsage >= kvHeadroom }
	load := func(ci int) int {
		c := &p.Candidates[ci]
		return c.Waiting + c.Running + c.InflightRequests
	}
	slices.SortFunc(p.poolIdx, func(a, b int) int {
		if fa, fb := full(a), full(b); fa != fb {
			if fa {
				return 1
			}
			return -1
		}
		if la, lb := load(a), load(b); la != lb {
			return la - lb
		}
		ra, rb := blockkey.Remix(spread^uint64(a)), blockkey.Remix(spread^uint64(b))
		switch {
		case ra < rb:
			return -1
		case ra > rb:
			return 1
		}
		return a - b
	})
	return p.poolIdx
}
