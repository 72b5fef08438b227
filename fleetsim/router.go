package fleetsim

import (
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/routing"
)

// router is one router: its own replica table fed by a filterstream
// Receiver, its own policy instance (and so its own speculative records),
// its own in-flight accounting, and a Plan it decides every request with.
type router struct {
	name   string
	table  *fleet.Table
	recv   *filterstream.Receiver
	policy routing.Policy
	plan   plan.Plan
	// inflight is this router's work at each replica (by replica index):
	// requests dispatched and not finished, and their uncached prompt
	// tokens until the first token, as the gateway's ledger counts them.
	inflight []inflight
	loads    []plan.Load
}

type inflight struct{ requests, prefill int }

// planLoads returns the router's own figures for each replica of snap, in
// the snapshot's order.
func (r *router) planLoads(snap *fleet.Snapshot, index map[string]int) []plan.Load {
	r.loads = r.loads[:0]
	for i := range snap.Replicas {
		var l plan.Load
		if k, ok := index[snap.Replicas[i].Name]; ok {
			l.Requests, l.PrefillTokens = r.inflight[k].requests, r.inflight[k].prefill
		}
		r.loads = append(r.loads, l)
	}
	return r.loads
}

// account changes the router's in-flight work at replica k and tells its
// receiver, which reports it to the replica's sidecar on its next tick.
func (r *router) account(k int, name string, requests, prefill int) {
	f := &r.inflight[k]
	f.requests += requests
	f.prefill += prefill
	r.recv.SetInflight(name, f.requests, f.prefill)
}
