package gossip

import (
	"errors"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
)

// SidecarConfig configures a sidecar's member.
type SidecarConfig struct {
	Config
	Models    []string // served model names (may be learned later: SetModels)
	EngineURL string
	Protocol  string
	BlockSize int // 0 until learned (engine metrics or KV events)
	// Filter is the sidecar's filter generations; nil announces a load-only
	// replica (no KV events).
	Filter *bloom.Generations
	// OnClearRoutes asks the owner of the exact set to rebuild the filter
	// now (a router cleared this replica's route records). It runs on the
	// node's loop: do not block.
	OnClearRoutes func()

	LoadInterval  time.Duration // load records (default 100 ms)
	DeltaInterval time.Duration // filter delta batches (default 25 ms)
	// InflightTTL expires a router's in-flight report it has not renewed
	// (default 1 s): a router that died takes its share with it.
	InflightTTL time.Duration
}

// EngineLoad is what the sidecar learned from its engine.
type EngineLoad struct {
	Healthy bool
	Waiting int
	Running int
	KVUsage float64
}

// SidecarNode sends its replica's load and filter to every router.
type SidecarNode struct {
	*node
	cfg SidecarConfig

	filter atomic.Pointer[bloom.Generations]
	engine atomic.Pointer[EngineLoad]
	kick   chan struct{} // send a load record now

	mu      sync.Mutex
	routers map[string]*routerPeer
	meta    Meta
	loadSeq uint64
	lastGen genID
	// recent holds the last deltas sent (loop-owned), so a router that lost
	// some gets them again instead of a whole snapshot.
	recent   []sentDelta
	snapMu   sync.Mutex
	snapID   genID
	snapSeq  uint64
	snapWire []byte

	stop    chan struct{}
	leaving atomic.Bool // set by the first stopLoops: stop is closed once
	done    chan struct{}
	wg      sync.WaitGroup
}

type genID struct{ epoch, gen uint64 }

// sentDelta is one delta as sent, kept for resends.
type sentDelta struct {
	id  genID
	seq uint64
	msg Message
}

// maxRecent bounds the deltas kept for resends (≈ 12 s at 40 a second,
// ≤ 1.3 KB each).
const maxRecent = 512

// routerPeer is a router this sidecar feeds.
type routerPeer struct {
	node *memberlist.Node
	// wantSnap (1-deep) wakes the router's snapshot sender.
	wantSnap chan struct{}
	quit     chan struct{}
	// in-flight work the router reported here
	inflight inflight
	// others: the router wants load records without its own share
	// (CapInflightOthers).
	others    bool
	inflSeq   uint64
	inflAt    time.Time
	inflEpoch uint64
}

// StartSidecar joins the cluster as a sidecar.
func StartSidecar(cfg SidecarConfig) (*SidecarNode, error) {
	if cfg.LoadInterval <= 0 {
		cfg.LoadInterval = 100 * time.Millisecond
	}
	if cfg.DeltaInterval <= 0 {
		cfg.DeltaInterval = 25 * time.Millisecond
	}
	if cfg.InflightTTL <= 0 {
		cfg.InflightTTL = time.Second
	}
	s := &SidecarNode{
		cfg:     cfg,
		kick:    make(chan struct{}, 1),
		routers: map[string]*routerPeer{},
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	s.engine.Store(&EngineLoad{Healthy: true})
	// Every process draws its own epoch, a load-only one too: its load
	// sequence restarts at 1, and a router that has not yet seen the old
	// process leave (a container restarted under the same name) would
	// otherwise take every new record for a duplicate of the old process's.
	epoch := rand.Uint64() | 1
	if cfg.Filter != nil {
		s.filter.Store(cfg.Filter)
		epoch = cfg.Filter.Stats().Epoch
	}
	s.meta = Meta{
		Role:          RoleSidecar,
		Name:          cfg.Name,
		Models:        slices.Clone(cfg.Models),
		EngineURL:     cfg.EngineURL,
		Protocol:      cfg.Protocol,
		BlockSize:     cfg.BlockSize,
		SchemeVersion: blockkey.SchemeVersion,
		Capabilities:  CapInflight | CapInflightOthers,
		Epoch:         epoch,
	}
	if cfg.Filter != nil {
		s.meta.Capabilities |= CapKVEvents
	}
	n, err := start(cfg.Config, s.meta)
	if err != nil {
		return nil, err
	}
	s.node = n
	go s.loop()
	return s, nil
}

// SetEngineLoad records the engine's latest health and load. A change of
// health is announced to every router at once.
func (s *SidecarNode) SetEngineLoad(l EngineLoad) {
	old := s.engine.Swap(&l)
	if old == nil || old.Healthy != l.Healthy {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// SetFilter switches to another filter (a new epoch after an engine
// restart); every router gets its snapshot.
func (s *SidecarNode) SetFilter(g *bloom.Generations) {
	s.filter.Store(g)
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// SetModels announces the served models and block size (learned from the
// engine) in the node's metadata, if they changed.
func (s *SidecarNode) SetModels(models []string, blockSize int) error {
	s.mu.Lock()
	m := s.meta
	if slices.Equal(m.Models, models) && m.BlockSize == blockSize {
		s.mu.Unlock()
		return nil
	}
	m.Models, m.BlockSize = slices.Clone(models), blockSize
	s.mu.Unlock()
	// memberlist gives up waiting for the broadcast after a timeout; the
	// change is then remembered as not announced, so that calling again
	// broadcasts it again rather than trusting a lost datagram.
	if err := s.updateMeta(m); err != nil {
		return err
	}
	s.mu.Lock()
	s.meta = m
	s.mu.Unlock()
	return nil
}

// Routers counts the routers this sidecar feeds.
func (s *SidecarNode) Routers() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.routers)
}

// Inflight is the in-flight work summed over every router's live report.
func (s *SidecarNode) Inflight() (requests, prefillTokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.inflightLocked(time.Now())
	return f.requests, f.prefillTokens
}

// Stats returns the node's counters.
func (s *SidecarNode) Stats() StatsSnapshot { return s.node.stats() }

// Leave tells the routers this replica is going (a leaving load record:
// they take it out of routing), announces departure to the cluster, waits
// up to timeout, and stops.
func (s *SidecarNode) Leave(timeout time.Duration) error {
	if !s.stopLoops() {
		return nil // another call leaves (shutdown and a signal may race)
	}
	s.wg.Wait()
	return s.leave(timeout)
}

// stopLoops ends the main loop and every per-router sender.
// stopLoops stops the node's loops, once: it reports false when they were
// stopped already.
func (s *SidecarNode) stopLoops() bool {
	if !s.leaving.CompareAndSwap(false, true) {
		return false
	}
	close(s.stop)
	<-s.done
	s.mu.Lock()
	for _, rp := range s.routers {
		close(rp.quit)
	}
	s.routers = map[string]*routerPeer{}
	s.mu.Unlock()
	return true
}

func (s *SidecarNode) loop() {
	defer close(s.done)
	loadTick := time.NewTicker(s.cfg.LoadInterval)
	defer loadTick.Stop()
	deltaTick := time.NewTicker(s.cfg.DeltaInterval)
	defer deltaTick.Stop()
	for {
		select {
		case <-s.stop:
			s.sendLoad(true) // last word: routers take the replica out at once
			return
		case ev := <-s.d.evq:
			s.membership(ev)
		case m := <-s.d.inbox:
			s.handle(&m)
		case <-deltaTick.C:
			s.flushFilter()
		case <-loadTick.C:
			s.flushFilter()
			s.sendLoad(false)
		case <-s.kick:
			s.flushFilter()
			s.sendLoad(false)
		}
	}
}

func (s *SidecarNode) membership(ev event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	name := ev.member.node.Name
	rp := s.routers[name]
	if ev.kind == evLeave || ev.member.meta.Role != RoleRouter {
		if rp != nil {
			close(rp.quit)
			delete(s.routers, name)
		}
		return
	}
	if rp == nil {
		rp = &routerPeer{wantSnap: make(chan struct{}, 1), quit: make(chan struct{})}
		s.routers[name] = rp
		s.wg.Add(1)
		go s.snapshotSender(rp)
	}
	rp.node = ev.member.node
	rp.others = ev.member.meta.Capabilities&CapInflightOthers != 0
	if ev.kind == evJoin {
		rp.want()
	}
}

func (rp *routerPeer) want() {
	select {
	case rp.wantSnap <- struct{}{}:
	default:
	}
}

func (s *SidecarNode) handle(m *Message) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m.Kind == KindClearRoutes {
		// Needs no answer, so also from a router whose membership has not
		// reached this sidecar yet: it is sent once, and the routers wait
		// for the generation it makes the sidecar rebuild.
		if (len(m.Names) == 0 || slices.Contains(m.Names, s.cfg.Name)) && s.cfg.OnClearRoutes != nil {
			s.cfg.OnClearRoutes()
		}
		return
	}
	rp := s.routers[m.From]
	if rp == nil {
		return
	}
	switch m.Kind {
	case KindResync:
		s.d.stats.Resyncs.Add(1)
		if !s.resendLocked(rp, m) {
			rp.want()
		}
	case KindInflight:
		if m.Epoch != rp.inflEpoch || m.Seq > rp.inflSeq {
			rp.inflEpoch, rp.inflSeq = m.Epoch, m.Seq
			rp.inflight = inflight{m.Requests, m.PrefillTokens}
			rp.inflAt = time.Now()
		}
	}
}

// resendLocked answers a resync with the deltas the router misses, when it
// holds the current generation and they are all still kept; it reports
// false when only a snapshot will do.
func (s *SidecarNode) resendLocked(rp *routerPeer, m *Message) bool {
	if m.Gen == 0 || len(s.recent) == 0 {
		return false
	}
	want := genID{m.Epoch, m.Gen}
	last := s.recent[len(s.recent)-1]
	if last.id != want || m.Seq >= last.seq {
		return false // another generation by now, or nothing to resend
	}
	i := sort.Search(len(s.recent), func(i int) bool {
		r := s.recent[i]
		return r.id == want && r.seq > m.Seq
	})
	if i == len(s.recent) || s.recent[i].id != want || s.recent[i].seq != m.Seq+1 {
		return false // the first missing delta is gone
	}
	for _, r := range s.recent[i:] {
		_ = s.send(rp.node, &r.msg, false)
	}
	s.d.stats.Resends.Add(uint64(len(s.recent) - i))
	return true
}

func (s *SidecarNode) inflightLocked(now time.Time) inflight {
	var sum inflight
	for _, rp := range s.routers {
		if now.Sub(rp.inflAt) > s.cfg.InflightTTL {
			rp.inflight = inflight{}
			continue
		}
		sum.requests += rp.inflight.requests
		sum.prefillTokens += rp.inflight.prefillTokens
	}
	return sum
}

// targets returns the routers to send to now.
func (s *SidecarNode) targets() []*routerPeer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*routerPeer, 0, len(s.routers))
	for _, rp := range s.routers {
		out = append(out, rp)
	}
	return out
}

// flushFilter snapshots a new generation to every router and sends the
// deltas taken since the last flush.
func (s *SidecarNode) flushFilter() {
	g := s.filter.Load()
	if g == nil {
		return
	}
	st := g.Stats()
	routers := s.targets()
	if id := (genID{st.Epoch, st.Generation}); id != s.lastGen {
		s.lastGen = id
		for _, rp := range routers {
			rp.want()
		}
	}
	// Bounded: a burst beyond this waits for the next tick.
	for range 256 {
		d, ok := g.TakeDelta()
		if !ok {
			break
		}
		msg := Message{Kind: KindDelta, From: s.d.self, Epoch: d.Epoch}
		msg.Payload = d.AppendBinary(make([]byte, 0, bloom.DeltaSize(len(d.Keys))))
		for _, rp := range routers {
			_ = s.send(rp.node, &msg, false)
		}
		if len(s.recent) == maxRecent {
			copy(s.recent, s.recent[1:])
			s.recent = s.recent[:maxRecent-1]
		}
		s.recent = append(s.recent, sentDelta{genID{d.Epoch, d.Generation}, d.Seq, msg})
		if d.Epoch != s.lastGen.epoch || d.Generation != s.lastGen.gen {
			s.lastGen = genID{d.Epoch, d.Generation}
			for _, rp := range routers {
				rp.want()
			}
		}
	}
}

// sendLoad sends every router a load record; leaving marks the last one.
func (s *SidecarNode) sendLoad(leaving bool) {
	e := s.engine.Load()
	now := time.Now()
	s.mu.Lock()
	s.loadSeq++
	f := s.inflightLocked(now)
	msg := Message{Kind: KindLoad, From: s.d.self, Seq: s.loadSeq, Load: Load{
		Healthy:               e.Healthy && !leaving,
		Leaving:               leaving,
		Waiting:               e.Waiting,
		Running:               e.Running,
		KVUsage:               float32(min(max(e.KVUsage, 0), 1)),
		InflightRequests:      f.requests,
		InflightPrefillTokens: f.prefillTokens,
	}}
	type target struct {
		node *memberlist.Node
		own  inflight // left out of the sums sent to it
	}
	targets := make([]target, 0, len(s.routers))
	for _, rp := range s.routers {
		t := target{node: rp.node}
		if rp.others {
			t.own = rp.inflight // zeroed by inflightLocked once expired
		}
		targets = append(targets, t)
	}
	msg.Epoch = s.meta.Epoch // SetModels replaces meta under s.mu
	s.mu.Unlock()
	if g := s.filter.Load(); g != nil {
		st := g.Stats()
		msg.Epoch = st.Epoch
		msg.Load.FilterGen, msg.Load.FilterSeq, msg.Load.FilterKeys = st.Generation, st.Seq, st.Keys
	}
	copies := 1
	if leaving {
		// A datagram: lost, the router would take the leave for a failure
		// and keep routing to the draining engine while it answers.
		// Copies share the sequence: the router reads one.
		copies = leavingCopies
	}
	for _, t := range targets {
		m := msg
		m.Load.InflightRequests -= t.own.requests
		m.Load.InflightPrefillTokens -= t.own.prefillTokens
		for range copies {
			_ = s.send(t.node, &m, false)
		}
	}
}

// leavingCopies is how many times the leaving record goes to each router.
const leavingCopies = 3

// snapshotSender sends a router the current snapshot each time it is
// wanted, one at a time (requests coalesce while one is in flight).
func (s *SidecarNode) snapshotSender(rp *routerPeer) {
	defer s.wg.Done()
	for {
		select {
		case <-rp.quit:
			return
		case <-rp.wantSnap:
		}
		msg, err := s.snapshotMessage()
		if err != nil {
			continue
		}
		s.mu.Lock()
		to := rp.node
		s.mu.Unlock()
		if err := s.send(to, msg, true); err != nil {
			s.log.Debug().Err(err).Str("to", to.Name).Msg("snapshot not delivered; retrying")
			select {
			case <-rp.quit:
				return
			case <-time.After(200 * time.Millisecond):
				rp.want()
			}
		}
	}
}

var errNoFilter = errors.New("gossip: no filter")

// snapshotMessage encodes the current snapshot once for all routers.
func (s *SidecarNode) snapshotMessage() (*Message, error) {
	g := s.filter.Load()
	if g == nil {
		return nil, errNoFilter
	}
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	st := g.Stats()
	if (genID{st.Epoch, st.Generation}) != s.snapID || st.Seq != s.snapSeq || s.snapWire == nil {
		snap := g.Snapshot()
		s.snapID, s.snapSeq = genID{snap.Epoch, snap.Generation}, snap.Seq
		s.snapWire = snap.AppendBinary(make([]byte, 0, bloom.SnapshotSize(snap.M)))
	}
	return &Message{Kind: KindSnapshot, From: s.d.self, Epoch: s.snapID.epoch, Payload: s.snapWire}, nil
}
