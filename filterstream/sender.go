package filterstream

import (
	"slices"
	"sort"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
)

// SenderConfig configures a sidecar's side of the stream.
type SenderConfig struct {
	Self string // this sidecar's member name: the From of what it sends
	Name string // its replica name, which route clears name
	// Epoch is the boot epoch a load-only sidecar (no filter) announces;
	// with a filter, the filter's epoch is announced.
	Epoch uint64
	// InflightTTL expires a router's in-flight report it has not renewed
	// (default 1 s): a router that died takes its share with it.
	InflightTTL time.Duration
}

// Sender is a sidecar's side of the filter stream: it says which load
// records, deltas and snapshots to send each router, and answers the
// routers' resyncs, route clears and in-flight reports. It is not safe for
// concurrent use.
type Sender struct {
	cfg     SenderConfig
	routers map[string]*routerPeer // by member name
	loadSeq uint64
	lastGen genID
	// recent holds the last deltas sent, so a router that lost some gets
	// them again instead of a whole snapshot.
	recent []sentDelta
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

// leavingCopies is how many times the leaving load record goes to each
// router: a datagram, lost, the router would take the leave for a failure
// and keep routing to the draining engine while it answers. Copies share
// the sequence: the router reads one.
const leavingCopies = 3

// routerPeer is what a sidecar tracks about one router.
type routerPeer struct {
	// in-flight work the router reported here
	inflight inflight
	// others: the router wants load records without its own share
	// (CapInflightOthers).
	others    bool
	inflSeq   uint64
	inflAt    time.Time
	inflEpoch uint64
}

// NewSender returns a sender that feeds no router yet.
func NewSender(cfg SenderConfig) *Sender {
	if cfg.InflightTTL <= 0 {
		cfg.InflightTTL = time.Second
	}
	return &Sender{cfg: cfg, routers: map[string]*routerPeer{}}
}

// Member records a router that joined (joined) or announced new metadata;
// a member of another role is forgotten as Gone.
func (s *Sender) Member(name string, meta Meta, joined bool) (out Output) {
	if meta.Role != RoleRouter {
		s.Gone(name)
		return out
	}
	rp := s.routers[name]
	if rp == nil {
		rp = &routerPeer{}
		s.routers[name] = rp
	}
	rp.others = meta.Capabilities&CapInflightOthers != 0
	if joined {
		out.Snapshots = append(out.Snapshots, name)
	}
	return out
}

// Gone forgets a router no longer in the cluster.
func (s *Sender) Gone(name string) { delete(s.routers, name) }

// Routers counts the routers fed.
func (s *Sender) Routers() int { return len(s.routers) }

// Handle takes one message from a router.
func (s *Sender) Handle(m *Message, now time.Time) (out Output) {
	if m.Kind == KindClearRoutes {
		// Needs no answer, so also from a router not known yet: it is
		// sent once, and the routers wait for the generation it makes the
		// sidecar rebuild.
		out.Cleared = len(m.Names) == 0 || slices.Contains(m.Names, s.cfg.Name)
		return out
	}
	rp := s.routers[m.From]
	if rp == nil {
		return out
	}
	switch m.Kind {
	case KindResync:
		out.Resyncs++
		if !s.resend(m, &out) {
			out.Snapshots = append(out.Snapshots, m.From)
		}
	case KindInflight:
		if m.Epoch != rp.inflEpoch || m.Seq > rp.inflSeq {
			rp.inflEpoch, rp.inflSeq = m.Epoch, m.Seq
			cur := inflight{m.Requests, m.PrefillTokens}
			out.InflightChanged = cur != rp.inflight
			rp.inflight = cur
			rp.inflAt = now
		}
	}
	return out
}

// resend answers a resync with the deltas the router misses, when it holds
// the current generation and they are all still kept; it reports false
// when only a snapshot will do.
func (s *Sender) resend(m *Message, out *Output) bool {
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
		out.Sends = append(out.Sends, Send{To: m.From, Msg: r.msg})
	}
	out.Resends += len(s.recent) - i
	return true
}

// Inflight is the in-flight work summed over every router's live report.
func (s *Sender) Inflight(now time.Time) (requests, prefillTokens int) {
	f := s.inflightSum(now)
	return f.requests, f.prefillTokens
}

func (s *Sender) inflightSum(now time.Time) inflight {
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

// Flush sends every router the deltas g made since the last flush, and asks
// for a snapshot to each when g moved to another generation.
func (s *Sender) Flush(g *bloom.Generations) (out Output) {
	st := g.Stats()
	if id := (genID{st.Epoch, st.Generation}); id != s.lastGen {
		s.lastGen = id
		s.wantAll(&out)
	}
	// Bounded: a burst beyond this waits for the next flush.
	for range 256 {
		d, ok := g.TakeDelta()
		if !ok {
			break
		}
		msg := Message{Kind: KindDelta, From: s.cfg.Self, Epoch: d.Epoch}
		msg.Payload = d.AppendBinary(make([]byte, 0, bloom.DeltaSize(len(d.Keys))))
		for name := range s.routers {
			out.Sends = append(out.Sends, Send{To: name, Msg: msg})
		}
		if len(s.recent) == maxRecent {
			copy(s.recent, s.recent[1:])
			s.recent = s.recent[:maxRecent-1]
		}
		s.recent = append(s.recent, sentDelta{genID{d.Epoch, d.Generation}, d.Seq, msg})
		if d.Epoch != s.lastGen.epoch || d.Generation != s.lastGen.gen {
			s.lastGen = genID{d.Epoch, d.Generation}
			s.wantAll(&out)
		}
	}
	return out
}

func (s *Sender) wantAll(out *Output) {
	for name := range s.routers {
		out.Snapshots = append(out.Snapshots, name)
	}
}

// Load sends every router a load record: engine's health and load, the
// other routers' in-flight work, and the filter state of g (nil: a
// load-only sidecar). leaving marks the sidecar's last record as it leaves
// on purpose; it goes leavingCopies times.
func (s *Sender) Load(engine Load, g *bloom.Generations, leaving bool, now time.Time) (out Output) {
	s.loadSeq++
	f := s.inflightSum(now)
	msg := Message{Kind: KindLoad, From: s.cfg.Self, Epoch: s.cfg.Epoch, Seq: s.loadSeq, Load: Load{
		Healthy:               engine.Healthy && !leaving,
		Leaving:               leaving,
		Waiting:               engine.Waiting,
		Running:               engine.Running,
		KVUsage:               engine.KVUsage,
		InflightRequests:      f.requests,
		InflightPrefillTokens: f.prefillTokens,
	}}
	if g != nil {
		st := g.Stats()
		msg.Epoch = st.Epoch
		msg.Load.FilterGen, msg.Load.FilterSeq, msg.Load.FilterKeys = st.Generation, st.Seq, st.Keys
	}
	copies := 1
	if leaving {
		copies = leavingCopies
	}
	for name, rp := range s.routers {
		m := msg
		if rp.others {
			// Its own share left out (zeroed by inflightSum once expired).
			m.Load.InflightRequests -= rp.inflight.requests
			m.Load.InflightPrefillTokens -= rp.inflight.prefillTokens
		}
		for range copies {
			out.Sends = append(out.Sends, Send{To: name, Msg: m})
		}
	}
	return out
}

// SnapshotMessage is the message that carries snap from member from.
func SnapshotMessage(from string, snap bloom.Snapshot) Message {
	return Message{Kind: KindSnapshot, From: from, Epoch: snap.Epoch,
		Payload: snap.AppendBinary(make([]byte, 0, bloom.SnapshotSize(snap.M)))}
}
