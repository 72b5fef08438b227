package fleetsim

import (
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/residentset"
)

// replica is one engine and its sidecar: the engine core steps in
// simulated time, its KV events feed the sidecar's exact resident set, the
// set's changes feed the Bloom generations, and the filterstream Sender
// says what goes to each router.
type replica struct {
	name, member string
	eng          *engine.Engine
	// busy: a step is under way; it ends at the evStepDone already queued.
	busy bool
	// outputs and events are the running step's, copied from its result
	// (the engine reuses its buffers).
	outputs []engine.Output
	events  []kvevents.Event

	set    *residentset.Set
	gens   *bloom.Generations
	sender *filterstream.Sender
	// load is the engine load as last scraped (the sidecar reads the
	// engine's metrics every scrape interval, not at every step).
	load    filterstream.Load
	keysBuf []uint64
	// snap caches the encoded snapshot of the filter state it names, so
	// every router that asks for the same one shares it.
	snap    *filterstream.Message
	snapID  [3]uint64
	rebuilt int
}

// observer carries the resident set's changes into the filter, as the
// sidecar's does.
type observer struct{ g *bloom.Generations }

func (o observer) Added(k uint64)   { o.g.Add(k) }
func (o observer) Removed(k uint64) { o.g.Remove(k) }
func (o observer) Cleared()         { o.g.Clear() }

// snapshot is the message carrying the current filter snapshot.
func (r *replica) snapshot() *filterstream.Message {
	st := r.gens.Stats()
	id := [3]uint64{st.Epoch, st.Generation, st.Seq}
	if r.snap == nil || id != r.snapID {
		m := filterstream.SnapshotMessage(r.member, r.gens.Snapshot())
		r.snap, r.snapID = &m, id
	}
	return r.snap
}

// apply feeds one step's KV events to the sidecar and rebuilds the filter
// when a rebuild is due, as the sidecar's event intake asks for one.
func (r *replica) apply(events []kvevents.Event, now time.Time) {
	obs := observer{r.gens}
	for i := range events {
		r.set.Apply(&events[i], obs)
	}
	r.maybeRebuild(now)
}

func (r *replica) maybeRebuild(now time.Time) {
	if r.gens.NeedsRebuild(now) {
		r.rebuild(now)
	}
}

// rebuild starts the next filter generation from the exact set.
func (r *replica) rebuild(now time.Time) {
	r.keysBuf = r.set.AppendKeys(r.keysBuf[:0])
	r.gens.Rebuild(now, slices.Values(r.keysBuf))
	r.rebuilt++
}

// scrape reads the engine's gauges as the sidecar's metrics scrape does.
func (r *replica) scrape() {
	st := r.eng.Stats()
	r.load = filterstream.Load{Healthy: true, Waiting: st.Waiting, Running: st.Running, KVUsage: float32(min(max(st.KVUsage, 0), 1))}
}
