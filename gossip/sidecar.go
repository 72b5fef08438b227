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
	"github.com/kvmesh/kvmesh/filterstream"
)

// SidecarConfig configures a sidecar's member.
type SidecarConfig struct {
	Config
	Models    []string // served model names (may be learned later: SetModels)
	EngineURL string
	Protocol  string
	BlockSize int // 0 until learned (engine metrics or KV events)
	// DataParallel and DataParallelRank announce the data-parallel rank of
	// the server at EngineURL this sidecar follows (filterstream.Meta).
	DataParallel     bool
	DataParallelRank int
	// OffloadMedia are the offload tiers whose blocks the filter holds
	// under blockkey.Tiered keys (announced with filterstream.CapTiers).
	OffloadMedia []string
	// KVRole is the engine's side of prefill/decode disaggregation
	// (fleet.KVRole; 0: both).
	KVRole uint8
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

// SidecarNode sends its replica's load and filter to every router: it
// carries a filterstream.Sender's messages over memberlist.
type SidecarNode struct {
	*node
	cfg SidecarConfig

	filter atomic.Pointer[bloom.Generations]
	engine atomic.Pointer[EngineLoad]
	kick   chan struct{} // send a load record now
	// inflightDirty: a router's in-flight report changed since the last
	// load record; the next echo tick sends one early (loop only).
	inflightDirty bool

	mu     sync.Mutex
	stream *filterstream.Sender
	links  map[string]*routerLink // by member name
	meta   filterstream.Meta

	snapMu   sync.Mutex
	snapID   [2]uint64 // epoch, generation
	snapSeq  uint64
	snapWire []byte

	stop    chan struct{}
	leaving atomic.Bool // set by the first stopLoops: stop is closed once
	done    chan struct{}
	wg      sync.WaitGroup
}

// routerLink carries snapshots to one router, one at a time.
type routerLink struct {
	node *memberlist.Node
	// wantSnap (1-deep) wakes the router's snapshot sender.
	wantSnap chan struct{}
	quit     chan struct{}
}

// StartSidecar joins the cluster as a sidecar.
func StartSidecar(cfg SidecarConfig) (*SidecarNode, error) {
	if cfg.LoadInterval <= 0 {
		cfg.LoadInterval = 100 * time.Millisecond
	}
	if cfg.DeltaInterval <= 0 {
		cfg.DeltaInterval = 25 * time.Millisecond
	}
	s := &SidecarNode{
		cfg:   cfg,
		kick:  make(chan struct{}, 1),
		links: map[string]*routerLink{},
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
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
	s.meta = filterstream.Meta{
		Role:          filterstream.RoleSidecar,
		Name:          cfg.Name,
		Models:        slices.Clone(cfg.Models),
		EngineURL:     cfg.EngineURL,
		Protocol:      cfg.Protocol,
		BlockSize:     cfg.BlockSize,
		SchemeVersion: blockkey.SchemeVersion,
		Capabilities:  filterstream.CapInflight | filterstream.CapInflightOthers,
		Epoch:         epoch,

		DataParallel:     cfg.DataParallel,
		DataParallelRank: cfg.DataParallelRank,
		KVRole:           cfg.KVRole,
	}
	if cfg.Filter != nil {
		s.meta.Capabilities |= filterstream.CapKVEvents
		if len(cfg.OffloadMedia) > 0 {
			s.meta.Capabilities |= filterstream.CapTiers
			s.meta.OffloadMedia = slices.Clone(cfg.OffloadMedia)
		}
	}
	n, err := start(cfg.Config, s.meta)
	if err != nil {
		return nil, err
	}
	s.node = n
	s.stream = filterstream.NewSender(filterstream.SenderConfig{Self: n.d.self, Name: cfg.Name, Epoch: epoch,
		InflightTTL: cfg.InflightTTL})
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
	return s.stream.Routers()
}

// Inflight is the in-flight work summed over every router's live report.
func (s *SidecarNode) Inflight() (requests, prefillTokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stream.Inflight(time.Now())
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

// stopLoops stops the node's loops, once: it reports false when they were
// stopped already.
func (s *SidecarNode) stopLoops() bool {
	if !s.leaving.CompareAndSwap(false, true) {
		return false
	}
	close(s.stop)
	<-s.done
	s.mu.Lock()
	for name, l := range s.links {
		close(l.quit)
		s.stream.Gone(name)
	}
	s.links = map[string]*routerLink{}
	s.mu.Unlock()
	return true
}

// inflightEcho is how soon after a router's in-flight report the other
// routers hear of it in a load record, rather than at the next LoadInterval:
// routers holding requests under flow control dispatch into the room they
// see, and the sooner they see each other's dispatches the less they
// overfill an engine together.
const inflightEcho = 20 * time.Millisecond

func (s *SidecarNode) loop() {
	defer close(s.done)
	loadTick := time.NewTicker(s.cfg.LoadInterval)
	defer loadTick.Stop()
	deltaTick := time.NewTicker(s.cfg.DeltaInterval)
	defer deltaTick.Stop()
	echoTick := time.NewTicker(inflightEcho)
	defer echoTick.Stop()
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
			s.inflightDirty = false
		case <-echoTick.C:
			if s.inflightDirty {
				s.inflightDirty = false
				s.sendLoad(false)
			}
		case <-s.kick:
			s.flushFilter()
			s.sendLoad(false)
		}
	}
}

// step feeds the sender one input under the lock and carries out what it
// asks.
func (s *SidecarNode) step(input func() filterstream.Output) {
	s.mu.Lock()
	out := input()
	sends := resolveSends(out.Sends, func(name string) *memberlist.Node {
		if l := s.links[name]; l != nil {
			return l.node
		}
		return nil
	})
	for _, name := range out.Snapshots {
		if l := s.links[name]; l != nil {
			l.want()
		}
	}
	s.mu.Unlock()
	s.count(&out)
	if out.Cleared && s.cfg.OnClearRoutes != nil {
		s.cfg.OnClearRoutes()
	}
	s.deliver(sends)
}

func (s *SidecarNode) membership(ev event) {
	name := ev.member.node.Name
	s.step(func() filterstream.Output {
		l := s.links[name]
		if ev.kind == evLeave || ev.member.meta.Role != filterstream.RoleRouter {
			if l != nil {
				close(l.quit)
				delete(s.links, name)
			}
			s.stream.Gone(name)
			return filterstream.Output{}
		}
		if l == nil {
			l = &routerLink{wantSnap: make(chan struct{}, 1), quit: make(chan struct{})}
			s.links[name] = l
			s.wg.Add(1)
			go s.snapshotSender(l)
		}
		l.node = ev.member.node
		return s.stream.Member(name, ev.member.meta, ev.kind == evJoin)
	})
}

func (l *routerLink) want() {
	select {
	case l.wantSnap <- struct{}{}:
	default:
	}
}

func (s *SidecarNode) handle(m *filterstream.Message) {
	s.step(func() filterstream.Output {
		out := s.stream.Handle(m, time.Now())
		s.inflightDirty = s.inflightDirty || out.InflightChanged
		return out
	})
}

// flushFilter snapshots a new generation to every router and sends the
// deltas taken since the last flush.
func (s *SidecarNode) flushFilter() {
	if g := s.filter.Load(); g != nil {
		s.step(func() filterstream.Output { return s.stream.Flush(g) })
	}
}

// sendLoad sends every router a load record; leaving marks the last one.
func (s *SidecarNode) sendLoad(leaving bool) {
	e := s.engine.Load()
	engine := filterstream.Load{Healthy: e.Healthy, Waiting: e.Waiting, Running: e.Running,
		KVUsage: float32(min(max(e.KVUsage, 0), 1))}
	g := s.filter.Load()
	s.step(func() filterstream.Output { return s.stream.Load(engine, g, leaving, time.Now()) })
}

// snapshotSender sends a router the current snapshot each time it is
// wanted, one at a time (requests coalesce while one is in flight).
func (s *SidecarNode) snapshotSender(l *routerLink) {
	defer s.wg.Done()
	for {
		select {
		case <-l.quit:
			return
		case <-l.wantSnap:
		}
		msg, err := s.snapshotMessage()
		if err != nil {
			continue
		}
		s.mu.Lock()
		to := l.node
		s.mu.Unlock()
		if err := s.send(to, msg, true); err != nil {
			s.log.Debug().Err(err).Str("to", to.Name).Msg("snapshot not delivered; retrying")
			select {
			case <-l.quit:
				return
			case <-time.After(200 * time.Millisecond):
				l.want()
			}
		}
	}
}

var errNoFilter = errors.New("gossip: no filter")

// snapshotMessage encodes the current snapshot once for all routers.
func (s *SidecarNode) snapshotMessage() (*filterstream.Message, error) {
	g := s.filter.Load()
	if g == nil {
		return nil, errNoFilter
	}
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	st := g.Stats()
	if [2]uint64{st.Epoch, st.Generation} != s.snapID || st.Seq != s.snapSeq || s.snapWire == nil {
		snap := g.Snapshot()
		s.snapID, s.snapSeq = [2]uint64{snap.Epoch, snap.Generation}, snap.Seq
		s.snapWire = filterstream.SnapshotMessage(s.d.self, snap).Payload
	}
	return &filterstream.Message{Kind: filterstream.KindSnapshot, From: s.d.self, Epoch: s.snapID[0], Payload: s.snapWire}, nil
}
