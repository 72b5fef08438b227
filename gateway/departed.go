package gateway

import (
	"time"

	"github.com/kvmesh/kvmesh/proxy"
)

// What the router keeps per replica name — in-flight counts, a connection
// pool, per-replica metric series — is not the table's, so the table
// dropping a replica that left does not free it. Where replicas come and go
// under new names (a Kubernetes rollout makes new pods), it would grow with
// every rollout. ForgetDeparted removes it once a replica has been gone a
// while and nothing of it is in flight.

// ForgetDeparted forgets replicas absent from the table for at least
// after, checking every interval, until stop closes.
func (g *Gateway) ForgetDeparted(every, after time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(every)
	defer t.Stop()
	missing := map[string]time.Time{}
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		g.forgetDeparted(missing, g.now(), after)
	}
}

// forgetDeparted is one check: missing remembers since when each name has
// been absent. It returns the names forgotten.
func (g *Gateway) forgetDeparted(missing map[string]time.Time, now time.Time, after time.Duration) []string {
	snap := g.table.Snapshot()
	var gone []string
	g.inflight.each(func(name string, l *replicaLoad) {
		if snap.Find(name) >= 0 {
			delete(missing, name)
			return
		}
		since, seen := missing[name]
		if !seen {
			missing[name] = now
			return
		}
		if now.Sub(since) >= after && l.requests.Load() == 0 && l.prefill.Load() == 0 {
			gone = append(gone, name)
		}
	})
	for _, name := range gone {
		delete(missing, name)
		if g.table.Snapshot().Find(name) >= 0 {
			continue // back just now
		}
		g.inflight.remove(name)
		g.dropUpstream(name)
		g.metrics.forget(name)
	}
	return gone
}

// dropUpstream closes and removes the connection pool of replica name.
func (g *Gateway) dropUpstream(name string) {
	g.upMu.Lock()
	defer g.upMu.Unlock()
	cur := *g.upstreams.Load()
	u := cur[name]
	if u == nil {
		return
	}
	next := make(map[string]*proxy.Upstream, len(cur))
	for k, v := range cur {
		if k != name {
			next[k] = v
		}
	}
	g.upstreams.Store(&next)
	u.Close()
}
