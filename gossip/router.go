package gossip

import (
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// RouterConfig configures a router's member.
type RouterConfig struct {
	Config
	// OnClearRoutes, when set, is called with the replicas (nil: all) whose
	// route records another router cleared, so the router can drop its own
	// speculative records too. It runs on the node's loop: do not block.
	OnClearRoutes func(names []string)
	// Tick paces table expiry (default 50 ms: a silent sidecar is out of
	// routing within DropAfter + Tick) and in-flight reports (every other tick).
	Tick time.Duration
	// ResyncEvery rate-limits snapshot requests per replica (default 500 ms);
	// while requests go unanswered the wait doubles, up to 8×, so an
	// overloaded sidecar or network is not buried under snapshot requests.
	ResyncEvery time.Duration
}

// RouterNode feeds a fleet.Table from the sidecars' messages and tells the
// sidecars and the other routers what this router knows.
type RouterNode struct {
	*node
	cfg   RouterConfig
	table *fleet.Table
	now   func() time.Time

	mu       sync.Mutex
	sidecars map[string]*sidecarPeer // by member name
	replicas map[string]*sidecarPeer // by replica name
	routers  map[string]*memberlist.Node
	inflight map[string]inflight // this router's in-flight work, by replica
	ticks    uint64

	stop    chan struct{}
	leaving atomic.Bool // set by the first Leave: stop is closed once
	done    chan struct{}

	// lose, set by tests under mu, drops chosen messages as a lossy network would.
	lose func(*Message) bool
}

type inflight struct{ requests, prefillTokens int }

// sidecarPeer is what the router tracks about one sidecar's stream.
type sidecarPeer struct {
	node   *memberlist.Node
	meta   Meta
	mirror bloom.Mirror

	epoch   uint64 // boot epoch of the state held (0: none yet)
	loadSeq uint64
	// left holds the last epochs this sidecar left (newest at leftNext-1).
	// Epochs are random, so they cannot be ordered, and one process keeps
	// its load sequence across an engine restart: only this memory tells a
	// late record of an old epoch from a new one.
	left     [4]uint64
	leftNext int
	// pending holds deltas of a generation whose snapshot has not arrived.
	pending []bloom.Delta
	// behind counts consecutive load records announcing filter state the
	// mirror lacks; two in a row mean a snapshot or delta was lost.
	behind     int
	lastResync time.Time
	resyncWait time.Duration // current backoff; reset by a snapshot
	// resyncStreak counts resyncs without progress; from the second on the
	// router asks for a snapshot instead of the missing deltas.
	resyncStreak int
	// hidden: the table dropped the filter for silence or a route clear,
	// the mirror kept it; it is shown again once a load record proves it
	// current (after a clear, once the wait for a fresh generation is over).
	hidden bool
	// awaitGen: after a route clear, filter state of generations below it
	// is ignored until the sidecar publishes a fresh one, or until
	// awaitUntil (see clearWait).
	awaitGen   uint64
	awaitUntil time.Time
	// leaving: the sidecar's last load record said it leaves on purpose;
	// when memberlist then reports it gone, its replica leaves routing,
	// where one that failed stays as an orphan (fleet.Table.Orphan).
	leaving bool
	// reported is the in-flight work this router last reported there.
	reported inflight
	inflSeq  uint64
	// idleReports counts the reports of no work still to send: reports go
	// as datagrams, and one lost "done" would leave the other routers
	// counting this router's last work there until the sidecar expires it.
	idleReports int
}

// maxPending bounds the deltas buffered ahead of a snapshot (≈ 6 s of
// deltas at 40 a second).
const maxPending = 256

// clearWait bounds how long a router ignores a sidecar's filter state older
// than the generation it awaits after a route clear. The wait cannot always
// end on its own: the generation the sidecar rebuilt for the clear may have
// reached this router before the clear did (the router then awaits one more,
// which a sidecar without evictions never builds), or the clear never
// reached the sidecar. A sidecar rebuilds at most once a second for clears,
// so its fresh generation is normally here well within this; after it the
// router shows the filter it holds if a load record proves it current, or
// resyncs as for any filter it lacks.
const clearWait = 3 * time.Second

// StartRouter joins the cluster as a router and starts feeding table.
func StartRouter(cfg RouterConfig, table *fleet.Table) (*RouterNode, error) {
	if table == nil {
		return nil, errors.New("gossip: StartRouter needs a table")
	}
	if cfg.Tick <= 0 {
		cfg.Tick = 50 * time.Millisecond
	}
	if cfg.ResyncEvery <= 0 {
		cfg.ResyncEvery = 500 * time.Millisecond
	}
	r := &RouterNode{
		cfg:      cfg,
		table:    table,
		now:      time.Now,
		sidecars: map[string]*sidecarPeer{},
		replicas: map[string]*sidecarPeer{},
		routers:  map[string]*memberlist.Node{},
		inflight: map[string]inflight{},
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
	n, err := start(cfg.Config, Meta{Role: RoleRouter, Name: cfg.Name, SchemeVersion: blockkey.SchemeVersion,
		Capabilities: CapInflightOthers, Epoch: rand.Uint64() | 1})
	if err != nil {
		return nil, err
	}
	r.node = n
	go r.loop()
	return r, nil
}

// ReportInflight sets the work this router has dispatched to replica and not
// yet seen finish: requests, and their uncached prompt tokens. The replica's
// sidecar sums every router's report into the load all routers see.
func (r *RouterNode) ReportInflight(replica string, requests, prefillTokens int) {
	r.mu.Lock()
	if requests <= 0 && prefillTokens <= 0 {
		delete(r.inflight, replica)
	} else {
		r.inflight[replica] = inflight{max(requests, 0), max(prefillTokens, 0)}
	}
	r.mu.Unlock()
}

// ClearRoutes clears route records (filters) of the named replicas, or of
// all when names is empty, here and cluster-wide: the sidecars rebuild and
// republish, the other routers drop their copies too.
func (r *RouterNode) ClearRoutes(names []string) {
	msg := Message{Kind: KindClearRoutes, From: r.d.self, Epoch: r.meta.Epoch, Seq: rand.Uint64(), Names: names}
	r.mu.Lock()
	r.clearLocked(names)
	var targets []*memberlist.Node
	for _, n := range r.routers {
		targets = append(targets, n)
	}
	for _, p := range r.sidecars {
		if len(names) == 0 || slices.Contains(names, p.meta.Name) {
			targets = append(targets, p.node)
		}
	}
	r.mu.Unlock()
	for _, t := range targets {
		go func() {
			if err := r.send(t, &msg, true); err != nil {
				r.log.Warn().Err(err).Str("to", t.Name).Msg("route clear not delivered")
			}
		}()
	}
}

func (r *RouterNode) clearLocked(names []string) {
	cleared := r.table.ClearRoutes(names)
	now := r.now()
	for _, name := range cleared {
		if p := r.replicas[name]; p != nil {
			if st := p.mirror.State(); st != nil {
				p.awaitGen = st.Generation + 1
				p.awaitUntil = now.Add(clearWait)
				// Kept: once the wait is over, it is shown again if a
				// load record proves it current (no snapshot needed).
				p.hidden = true
			}
		}
	}
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
			r.mu.Lock()
			// Messages that came before the event first: a sidecar's
			// leaving record must be read before memberlist's word that
			// it is gone.
			for range len(r.d.inbox) {
				m := <-r.d.inbox
				r.handle(&m)
			}
			r.membership(ev)
			r.mu.Unlock()
		case m := <-r.d.inbox:
			r.mu.Lock()
			r.handle(&m)
			r.mu.Unlock()
		case <-tick.C:
			r.tick()
		}
	}
}

func (r *RouterNode) membership(ev event) {
	m := ev.member
	switch m.meta.Role {
	case RoleRouter:
		if ev.kind == evLeave {
			delete(r.routers, m.node.Name)
		} else {
			r.routers[m.node.Name] = m.node
		}
		return
	case RoleSidecar:
	default:
		if ev.kind == evLeave {
			delete(r.routers, m.node.Name)
			if p := r.sidecars[m.node.Name]; p != nil {
				r.sidecarGone(p)
			}
		}
		return
	}
	p := r.sidecars[m.node.Name]
	if ev.kind == evLeave {
		if p != nil {
			r.sidecarGone(p)
		}
		return
	}
	if p == nil {
		p = &sidecarPeer{}
		r.sidecars[m.node.Name] = p
	}
	if p.meta.Name != "" && p.meta.Name != m.meta.Name {
		delete(r.replicas, p.meta.Name)
		r.table.Remove(p.meta.Name)
	}
	blockSizeChanged := p.meta.BlockSize != 0 && p.meta.BlockSize != m.meta.BlockSize
	p.node, p.meta = m.node, m.meta
	r.replicas[m.meta.Name] = p
	r.table.Upsert(fleet.Info{
		Name:      m.meta.Name,
		Models:    m.meta.Models,
		URL:       m.meta.EngineURL,
		Protocol:  m.meta.Protocol,
		KVEvents:  r.usesFilter(p),
		BlockSize: m.meta.BlockSize,
	}, r.now())
	if blockSizeChanged && p.mirror.State() != nil {
		// The table dropped the filter (keys of another block size); the
		// sidecar learned its block size after keying, so ask again.
		p.mirror.Reset()
		p.pending = nil
		r.requestResync(p, r.now(), resyncBlockSize)
	}
}

// usesFilter: routers ignore filters of sidecars that compute keys with
// another scheme; they are load-balanced only.
func (r *RouterNode) usesFilter(p *sidecarPeer) bool {
	return p.meta.Capabilities&CapKVEvents != 0 && p.meta.SchemeVersion == blockkey.SchemeVersion
}

// sidecarGone forgets a sidecar memberlist no longer lists. Its replica
// leaves the table if the sidecar said it was leaving; one that failed
// (crashed, partitioned, or declared dead by a forged message) may have a
// healthy engine behind it: the replica stays, an orphan routed by load.
func (r *RouterNode) sidecarGone(p *sidecarPeer) {
	delete(r.sidecars, p.node.Name)
	if r.replicas[p.meta.Name] != p {
		return
	}
	delete(r.replicas, p.meta.Name)
	if p.leaving {
		r.table.Remove(p.meta.Name)
		return
	}
	r.table.Orphan(p.meta.Name, r.now())
	r.log.Info().Str("replica", p.meta.Name).Msg("sidecar failed: replica routed by load while its engine answers")
}

func (r *RouterNode) handle(m *Message) {
	if r.lose != nil && r.lose(m) {
		return
	}
	if m.Kind == KindClearRoutes {
		r.clearLocked(m.Names)
		if r.cfg.OnClearRoutes != nil {
			r.cfg.OnClearRoutes(slices.Clone(m.Names))
		}
		return
	}
	p := r.sidecars[m.From]
	if p == nil {
		return // membership has not arrived yet; the next record will do
	}
	now := r.now()
	if m.Epoch != p.epoch {
		if p.epoch != 0 && m.Kind != KindLoad || p.hasLeft(m.Epoch) {
			// Epochs are random, so they cannot be ordered: the load
			// record (10 Hz) is the authority on the current one, and a
			// late filter message of another epoch must not win, nor a
			// late load record of an epoch already left.
			return
		}
		// A new boot or a new epoch after an engine restart: nothing held
		// for the old one is true any more.
		p.leave(p.epoch)
		p.epoch, p.loadSeq, p.behind, p.awaitGen = m.Epoch, 0, 0, 0
		p.mirror.Reset()
		p.pending = nil
		r.table.SetFilter(p.meta.Name, nil, 0, 0, now)
	}
	switch m.Kind {
	case KindLoad:
		r.onLoad(p, m, now)
	case KindSnapshot:
		r.onSnapshot(p, m, now)
	case KindDelta:
		r.onDelta(p, m, now)
	}
}

// leave remembers an epoch the sidecar left. 0 is not an epoch (nothing
// held yet, or an older load-only sidecar, which always sends 0).
func (p *sidecarPeer) leave(epoch uint64) {
	if epoch != 0 {
		p.left[p.leftNext] = epoch
		p.leftNext = (p.leftNext + 1) % len(p.left)
	}
}

func (p *sidecarPeer) hasLeft(epoch uint64) bool {
	return epoch != 0 && slices.Contains(p.left[:], epoch)
}

// awaiting reports whether filter state of generation gen is still ignored
// after a route clear; once clearWait has passed, nothing is.
func (p *sidecarPeer) awaiting(gen uint64, now time.Time) bool {
	if p.awaitGen != 0 && !now.Before(p.awaitUntil) {
		p.awaitGen = 0
	}
	return gen < p.awaitGen
}

func (r *RouterNode) onLoad(p *sidecarPeer, m *Message, now time.Time) {
	if m.Seq <= p.loadSeq {
		r.table.Heard(p.meta.Name, now)
		return // reordered or duplicated
	}
	p.loadSeq = m.Seq
	l := &m.Load
	p.leaving = l.Leaving
	// The other routers' in-flight work there. A sidecar without
	// CapInflightOthers sums every report: take out this router's last one
	// (exact unless the sum predates it).
	others := inflight{max(l.InflightRequests, 0), max(l.InflightPrefillTokens, 0)}
	if p.meta.Capabilities&CapInflightOthers == 0 {
		others = inflight{max(l.InflightRequests-p.reported.requests, 0), max(l.InflightPrefillTokens-p.reported.prefillTokens, 0)}
	}
	load := fleet.Load{
		Waiting:                     l.Waiting,
		Running:                     l.Running,
		KVUsage:                     float64(l.KVUsage),
		OthersInflightRequests:      others.requests,
		OthersInflightPrefillTokens: others.prefillTokens,
	}
	r.table.SetLoad(p.meta.Name, load, l.Healthy, now)
	if !l.Healthy {
		p.mirror.Reset()
		p.pending = nil
		p.behind = 0
		return
	}
	if !r.usesFilter(p) || p.awaiting(l.FilterGen, now) {
		return
	}
	st := p.mirror.State()
	if st == nil || st.Generation < l.FilterGen || st.Generation == l.FilterGen && st.Seq < l.FilterSeq {
		p.behind++
		if p.behind >= 3 {
			r.requestResync(p, now, resyncBehind)
		}
		return
	}
	p.behind = 0
	if p.hidden {
		// Back from silence with nothing missed: show the filter again.
		p.hidden = false
		r.publish(p, now)
	}
}

func (r *RouterNode) onSnapshot(p *sidecarPeer, m *Message, now time.Time) {
	s, err := bloom.DecodeSnapshot(m.Payload)
	if err != nil || s.Epoch != m.Epoch {
		r.d.stats.BadMessages.Add(1)
		return
	}
	r.table.Heard(p.meta.Name, now)
	if p.awaiting(s.Generation, now) || !r.usesFilter(p) {
		return
	}
	if err := p.mirror.ApplySnapshot(s); err != nil {
		return // older than what we hold
	}
	p.awaitGen = 0
	p.behind = 0
	p.resyncWait = 0
	p.resyncStreak = 0
	p.hidden = false
	// Replay deltas that overtook the snapshot.
	pending := p.pending
	p.pending = nil
	slices.SortFunc(pending, func(a, b bloom.Delta) int {
		return cmpUint(a.Generation, b.Generation)*2 + cmpUint(a.Seq, b.Seq)
	})
	for _, d := range pending {
		if d.Generation == s.Generation && d.Seq > s.Seq {
			if !p.mirror.ApplyDelta(d) {
				r.requestResync(p, now, resyncGap)
				break
			}
		}
	}
	r.publish(p, now)
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (r *RouterNode) onDelta(p *sidecarPeer, m *Message, now time.Time) {
	d, err := bloom.DecodeDelta(m.Payload)
	if err != nil || d.Epoch != m.Epoch {
		r.d.stats.BadMessages.Add(1)
		return
	}
	r.table.Heard(p.meta.Name, now)
	if p.awaiting(d.Generation, now) || !r.usesFilter(p) {
		return
	}
	if p.mirror.ApplyDelta(d) {
		if len(p.pending) > 0 {
			r.drainPending(p)
		}
		r.publish(p, now)
		return
	}
	st := p.mirror.State()
	if st != nil && d.Generation < st.Generation {
		return // from a generation already replaced
	}
	// Keep it for the snapshot that will cover what is missing: the next
	// generation's snapshot still on its way (TCP) while its deltas (UDP)
	// overtook it, or the answer to a resync for a hole in this one.
	if len(p.pending) < maxPending {
		p.pending = append(p.pending, d)
	}
	if st != nil && d.Generation == st.Generation || len(p.pending) >= maxPending {
		// A hole in the current generation: only a snapshot can fill it.
		r.requestResync(p, now, resyncGap)
	}
}

// drainPending applies buffered deltas that now follow on (a resent delta
// filled the hole before them) and forgets those already covered.
func (r *RouterNode) drainPending(p *sidecarPeer) {
	slices.SortFunc(p.pending, func(a, b bloom.Delta) int {
		return cmpUint(a.Generation, b.Generation)*2 + cmpUint(a.Seq, b.Seq)
	})
	st := p.mirror.State()
	keep := p.pending[:0]
	for _, d := range p.pending {
		switch {
		case st == nil || d.Generation > st.Generation:
			keep = append(keep, d) // its snapshot is still to come
		case d.Generation < st.Generation || d.Seq <= st.Seq:
			// covered
		case d.Seq == st.Seq+1 && p.mirror.ApplyDelta(d):
			st = p.mirror.State()
			p.resyncStreak = 0
		default:
			keep = append(keep, d) // after another hole
		}
	}
	clear(p.pending[len(keep):])
	p.pending = keep
}

// publish hands the mirror's current filter to the table.
func (r *RouterNode) publish(p *sidecarPeer, now time.Time) {
	if st := p.mirror.State(); st != nil {
		r.table.SetFilter(p.meta.Name, st.Filter, st.Generation, st.Keys, now)
	}
}

// Why a router asked for a snapshot (counted in Stats.ResyncReasons).
const (
	resyncGap       = iota // a delta is missing
	resyncBehind           // load records announce state the mirror lacks
	resyncBlockSize        // the sidecar announced another block size
	resyncReasons
)

func (r *RouterNode) requestResync(p *sidecarPeer, now time.Time, why int) {
	if p.resyncWait == 0 {
		p.resyncWait = r.cfg.ResyncEvery
	}
	if now.Sub(p.lastResync) < p.resyncWait {
		return
	}
	if !p.lastResync.IsZero() && now.Sub(p.lastResync) < 4*p.resyncWait {
		p.resyncWait = min(2*p.resyncWait, 8*r.cfg.ResyncEvery)
	} else {
		p.resyncWait = r.cfg.ResyncEvery
	}
	p.lastResync = now
	p.behind = 0
	r.d.stats.Resyncs.Add(1)
	r.d.stats.ResyncReasons[why].Add(1)
	// First ask for just the missing deltas (the sidecar keeps recent ones);
	// when that did not help, or nothing is held, ask for a snapshot.
	msg := Message{Kind: KindResync, From: r.d.self}
	if st := p.mirror.State(); st != nil && st.Epoch == p.epoch && p.resyncStreak < 2 {
		msg.Epoch, msg.Gen, msg.Seq = st.Epoch, st.Generation, st.Seq
	}
	p.resyncStreak++
	to := p.node
	go func() {
		if err := r.send(to, &msg, false); err != nil {
			r.log.Debug().Err(err).Str("to", to.Name).Msg("resync request not sent")
		}
	}()
}

// idleRepeats is how many reports of no work follow a router's last work at
// a replica.
const idleRepeats = 3

func (r *RouterNode) tick() {
	type report struct {
		to  *memberlist.Node
		msg Message
	}
	var reports []report
	r.mu.Lock()
	now := r.now()
	for _, name := range r.table.Expire(now) {
		if p := r.replicas[name]; p != nil {
			// The table no longer shows the filter; the mirror keeps it in
			// case the sidecar was only slow (see onLoad).
			p.hidden = true
			p.behind = 0
			r.log.Info().Str("replica", name).Msg("sidecar silent: replica routed by load while its engine answers")
		}
	}
	r.ticks++
	if r.ticks%2 != 0 { // in-flight reports at half the tick rate
		r.mu.Unlock()
		return
	}
	for _, p := range r.sidecars {
		if p.meta.Capabilities&CapInflight == 0 {
			continue
		}
		cur := r.inflight[p.meta.Name]
		switch {
		case cur != (inflight{}):
			p.idleReports = idleRepeats
		case p.idleReports == 0:
			continue
		default:
			p.idleReports--
		}
		p.inflSeq++
		p.reported = cur
		reports = append(reports, report{p.node, Message{
			Kind: KindInflight, From: r.d.self, Epoch: r.meta.Epoch, Seq: p.inflSeq,
			Requests: cur.requests, PrefillTokens: cur.prefillTokens,
		}})
	}
	r.mu.Unlock()
	for i := range reports {
		_ = r.send(reports[i].to, &reports[i].msg, false)
	}
}
