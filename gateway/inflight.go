package gateway

import (
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
)

// replicaLoad is this router's in-flight work at one replica: requests
// dispatched and not finished, and their uncached prompt tokens until the
// first byte comes back (the prefill the engine still has to do).
type replicaLoad struct {
	requests  atomic.Int64
	prefill   atomic.Int64
	observers [2]atomic.Value // prometheus.Observer: upstream latency, ttft (see metrics.latency)
	eject     ejection        // out of routing after failing to answer
}

// clusterView adds this router's exact counts to the other routers'
// in-flight work the replica's sidecar last gossiped, as the planner does.
func (l *replicaLoad) clusterView(gossiped fleet.Load) (requests, prefillTokens int) {
	return gossiped.OthersInflightRequests + int(l.requests.Load()), gossiped.OthersInflightPrefillTokens + int(l.prefill.Load())
}

type inflightTable struct {
	mu sync.RWMutex
	m  map[string]*replicaLoad
}

func (t *inflightTable) init() { t.m = map[string]*replicaLoad{} }

func (t *inflightTable) get(name string) *replicaLoad {
	t.mu.RLock()
	l := t.m[name]
	t.mu.RUnlock()
	if l != nil {
		return l
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if l = t.m[name]; l == nil {
		l = &replicaLoad{}
		t.m[name] = l
	}
	return l
}

func (t *inflightTable) remove(name string) {
	t.mu.Lock()
	delete(t.m, name)
	t.mu.Unlock()
}

// loadIndex holds the in-flight entries of one snapshot's replicas, in the
// snapshot's order, so a decision reads each candidate's entry by index
// instead of looking fifty names up under a lock.
type loadIndex struct {
	snap  *fleet.Snapshot
	loads []*replicaLoad
	// unusable[i]: replica i's URL cannot be dialled (proxy.CheckURL).
	unusable []bool
}

// loadsOf returns the in-flight entries of snap's replicas (index i is
// snap.Replicas[i]). Snapshots are immutable, so the index is built once per
// snapshot; entries are removed only for replicas no snapshot has held for
// minutes (ForgetDeparted), so it stays valid.
func (g *Gateway) loadsOf(snap *fleet.Snapshot) *loadIndex {
	if li := g.loadIdx.Load(); li != nil && li.snap == snap {
		return li
	}
	li := &loadIndex{snap: snap, loads: make([]*replicaLoad, len(snap.Replicas)), unusable: make([]bool, len(snap.Replicas))}
	for i := range snap.Replicas {
		li.loads[i] = g.inflight.get(snap.Replicas[i].Name)
		li.unusable[i] = proxy.CheckURL(snap.Replicas[i].URL) != nil
	}
	g.loadIdx.Store(li)
	return li
}

// figures returns in dst (reused) what the planner reads of each replica at
// now (unix nanoseconds).
func (li *loadIndex) figures(dst []plan.Load, now int64) []plan.Load {
	dst = dst[:0]
	for i, l := range li.loads {
		dst = append(dst, plan.Load{
			Requests: int(l.requests.Load()), PrefillTokens: int(l.prefill.Load()),
			Ejected: l.eject.out(now), Unusable: li.unusable[i],
		})
	}
	return dst
}

// each calls f for every replica in name order.
func (t *inflightTable) each(f func(name string, l *replicaLoad)) {
	t.mu.RLock()
	names := make([]string, 0, len(t.m))
	for n := range t.m {
		names = append(names, n)
	}
	t.mu.RUnlock()
	sort.Strings(names)
	for _, n := range names {
		f(n, t.get(n))
	}
}

// ReportInflight tells the cluster this router's in-flight work every
// interval until stop closes. Without a cluster it returns at once.
func (g *Gateway) ReportInflight(every time.Duration, stop <-chan struct{}) {
	if g.cluster == nil {
		return
	}
	repeat(every, stop, func() {
		// The cluster node decides what goes on the wire (nothing for
		// a replica where this router has had no work for a while).
		g.inflight.each(func(name string, l *replicaLoad) {
			g.cluster.ReportInflight(name, int(l.requests.Load()), int(l.prefill.Load()))
		})
	})
}

// Inflight returns this router's in-flight requests summed over replicas.
func (g *Gateway) Inflight() int {
	n := 0
	g.inflight.each(func(_ string, l *replicaLoad) { n += int(l.requests.Load()) })
	return n
}
