package gossip

import (
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
)

// RouterConfig configures a router's member.
type RouterConfig struct {
	Config
	// OnClearRoutes, when set, is called with the replicas (nil: all) whose
	// route records another router cleared, so the router can drop its own
	// speculative records too. It runs on the node's loop: do not block.
	OnClearRoutes func(names []string)
	// OnTenantUsage, when set, is called with another router's per-tenant
	// report (ShareTenantUsage), for quotas. It runs on the node's loop: do
	// not block.
	OnTenantUsage func(from string, usage []filterstream.TenantUsage)
	// Tick paces table expiry (default 50 ms: a silent sidecar is out of
	// routing within DropAfter + Tick) and in-flight reports (every other tick).
	Tick time.Duration
	// ResyncEvery rate-limits snapshot requests per replica (default 500 ms);
	// while requests go unanswered the wait doubles, up to 8×, so an
	// overloaded sidecar or network is not buried under snapshot requests.
	ResyncEvery time.Duration
}

// RouterNode feeds a fleet.Table from the sidecars' messages and tells the
// sidecars and the other routers what this router knows: it carries a
// filterstream.Receiver's messages over memberlist.
type RouterNode struct {
	*node
	cfg RouterConfig

	mu      sync.Mutex
	recv    *filterstream.Receiver
	members map[string]*memberlist.Node // every live member, by name

	stop    chan struct{}
	leaving atomic.Bool // set by the first Leave: stop is closed once
	done    chan struct{}
}

// StartRouter joins the cluster as a router and starts feeding table.
func StartRouter(cfg RouterConfig, table *fleet.Table) (*RouterNode, error) {
	if table == nil {
		return nil, errors.New("gossip: StartRouter needs a table")
	}
	if cfg.Tick <= 0 {
		cfg.Tick = 50 * time.Millisecond
	}
	meta := filterstream.Meta{Role: filterstream.RoleRouter, Name: cfg.Name, SchemeVersion: blockkey.SchemeVersion,
		Capabilities: filterstream.CapInflightOthers | filterstream.CapTenantUsage, Epoch: rand.Uint64() | 1}
	n, err := start(cfg.Config, meta)
	if err != nil {
		return nil, err
	}
	r := &RouterNode{
		node: n,
		cfg:  cfg,
		recv: filterstream.NewReceiver(filterstream.ReceiverConfig{Self: n.d.self, Epoch: meta.Epoch,
			ResyncEvery: cfg.ResyncEvery}, table),
		members: map[string]*memberlist.Node{},
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	go r.loop()
	return r, nil
}

// ReportInflight sets the work this router has dispatched to replica and not
// yet seen finish: requests, and their uncached prompt tokens. The replica's
// sidecar sums every router's report into the load all routers see.
func (r *RouterNode) ReportInflight(replica string, requests, prefillTokens int) {
	r.mu.Lock()
	r.recv.SetInflight(replica, requests, prefillTokens)
	r.mu.Unlock()
}

// ClearRoutes clears route records (filters) of the named replicas, or of
// all when names is empty, here and cluster-wide: the sidecars rebuild and
// republish, the other routers drop their copies too.
func (r *RouterNode) ClearRoutes(names []string) {
	r.mu.Lock()
	out := r.recv.ClearRoutes(names, rand.Uint64(), time.Now())
	sends := r.resolve(&out)
	r.mu.Unlock()
	r.deliver(sends)
}

// ShareTenantUsage sends this router's per-tenant report to the other
// routers (quotas across routers, package quota).
func (r *RouterNode) ShareTenantUsage(usage []filterstream.TenantUsage) {
	r.mu.Lock()
	out := r.recv.ShareUsage(usage)
	sends := r.resolve(&out)
	r.mu.Unlock()
	r.deliver(sends)
}

// Leave announces departure, waits up to timeout for it to spread, and stops.
func (r *RouterNode) Leave(timeout time.Duration) error {
	if !r.leaving.CompareAndSwap(false, true) {
		return nil // another call leaves (shutdown and a signal may race)
	}
	close(r.stop)
	<-r.done
	return r.leave(timeout)
}

// Stats returns the node's counters.
func (r *RouterNode) Stats() StatsSnapshot { return r.node.stats() }

func (r *RouterNode) loop() {
	defer close(r.done)
	tick := time.NewTicker(r.cfg.Tick)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case ev := <-r.d.evq:
			// Messages that came before the event first: a sidecar's
			// leaving record must be read before memberlist's word that
			// it is gone.
			for range len(r.d.inbox) {
				m := <-r.d.inbox
				r.handle(&m)
			}
			r.membership(ev)
		case m := <-r.d.inbox:
			r.handle(&m)
		case <-tick.C:
			r.step(func(now time.Time) filterstream.Output { return r.recv.Tick(now) })
		}
	}
}

// step feeds the receiver one input under the lock and carries out what
// it asks.
func (r *RouterNode) step(input func(now time.Time) filterstream.Output) {
	r.mu.Lock()
	out := input(time.Now())
	sends := r.resolve(&out)
	r.mu.Unlock()
	r.count(&out)
	for _, name := range out.Silent {
		r.log.Info().Str("replica", name).Msg("sidecar silent: replica routed by load while its engine answers")
	}
	for _, name := range out.Orphaned {
		r.log.Info().Str("replica", name).Msg("sidecar failed: replica routed by load while its engine answers")
	}
	if out.Cleared && r.cfg.OnClearRoutes != nil {
		r.cfg.OnClearRoutes(out.ClearedNames)
	}
	if out.Usage != nil && r.cfg.OnTenantUsage != nil {
		r.cfg.OnTenantUsage(out.Usage.From, out.Usage.Usage)
	}
	r.deliver(sends)
}

func (r *RouterNode) handle(m *filterstream.Message) {
	r.step(func(now time.Time) filterstream.Output { return r.recv.Handle(m, now) })
}

func (r *RouterNode) membership(ev event) {
	name := ev.member.node.Name
	r.step(func(now time.Time) filterstream.Output {
		if ev.kind == evLeave {
			out := r.recv.Gone(name, now)
			delete(r.members, name)
			return out
		}
		r.members[name] = ev.member.node
		return r.recv.Member(name, ev.member.meta, now)
	})
}

// resolve finds the member each send goes to (under r.mu).
func (r *RouterNode) resolve(out *filterstream.Output) []outgoing {
	return resolveSends(out.Sends, func(name string) *memberlist.Node { return r.members[name] })
}
