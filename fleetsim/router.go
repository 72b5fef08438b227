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
	// orderNames and orderIdx cache order's answer for a list of names.
	orderNames []string
	orderIdx   []int
}

type inflight struct{ requests, prefill int }

// planLoads returns the router's own figures for each replica of snap, in
// the snapshot's order.
func (r *router) planLoads(snap *fleet.Snapshot, index map[string]int) []plan.Load {
	r.loads = r.loads[:0]
	for _, k := range r.order(snap, index) {
		var l plan.Load
		if k >= 0 {
			l.Requests, l.PrefillTokens = r.inflight[k].requests, r.inflight[k].prefill
		}
		r.loads = append(r.loads, l)
	}
	return r.loads
}

// order returns the replica index of each of snap's replicas (-1 for one
// that is no replica), looked up by name only when the snapshot lists other
// names than the last one: membership changes rarely, loads every request.
func (r *router) order(snap *fleet.Snapshot, index map[string]int) []int {
	same := len(r.orderNames) == len(snap.Replicas)
	for i := 0; same && i < len(snap.Replicas); i++ {
		same = snap.Replicas[i].Name == r.orderNames[i]
	}
	if same {
		return r.orderIdx
	}
	r.orderNames, r.orderIdx = r.orderNames[:0], r.orderIdx[:0]
	for i := range snap.Replicas {
		name := snap.Replicas[i].Name
		k, ok := index[name]
		if !ok {
			k = -1
		}
		r.orderNames, r.orderIdx = append(r.orderNames, name), append(r.orderIdx, k)
	}
	return r.orderIdx
}

// account changes the router's in-flight work at replica k and tells its
// receiver, which reports it to the replica's sidecar on its next tick.
func (r *router) account(k int, name string, requests, prefill int) {
	f := &r.inflight[k]
	f.requests += requests
	f.prefill += prefill
	r.recv.SetInflight(name, f.requests, f.prefill)
}
