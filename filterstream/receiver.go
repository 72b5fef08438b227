package filterstream

import (
	"slices"
	"time"
	"unsafe"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// ReceiverConfig configures a router's side of the stream.
type ReceiverConfig struct {
	Self  string // this router's member name: the From of what it sends
	Epoch uint64 // this router's boot epoch
	// ResyncEvery rate-limits resync requests per replica (default 500 ms);
	// while requests go unanswered the wait doubles, up to 8×, so an
	// overloaded sidecar or network is not buried under snapshot requests.
	ResyncEvery time.Duration
	// Share, when set, is shared with the other receivers of one process,
	// which then keep one copy of the bits of a snapshot message they all
	// received and decode a delta message once (bloom.Share: each mirror
	// still sees exactly what it applied). For a simulator running many routers in one goroutine;
	// a router leaves it nil.
	Share *bloom.Share
}

// Receiver is a router's side of the filter stream: it feeds a fleet.Table
// from the sidecars' messages and says what to tell the sidecars and the
// other routers. It is not safe for concurrent use.
type Receiver struct {
	cfg      ReceiverConfig
	table    *fleet.Table
	sidecars map[string]*sidecarPeer // by member name
	replicas map[string]*sidecarPeer // by replica name
	routers  map[string]uint32       // the other routers' capabilities, by member name
	inflight map[string]inflight     // this router's in-flight work, by replica
	ticks    uint64
}

type inflight struct{ requests, prefillTokens int }

// sidecarPeer is what the router tracks about one sidecar's stream.
type sidecarPeer struct {
	member string
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
	// mirror lacks; three in a row mean a snapshot or delta was lost.
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
	// when it is then gone, its replica leaves routing, where one that
	// failed stays as an orphan (fleet.Table.Orphan).
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

// idleRepeats is how many reports of no work follow a router's last work at
// a replica.
const idleRepeats = 3

// NewReceiver returns a receiver feeding table.
func NewReceiver(cfg ReceiverConfig, table *fleet.Table) *Receiver {
	if cfg.ResyncEvery <= 0 {
		cfg.ResyncEvery = 500 * time.Millisecond
	}
	return &Receiver{
		cfg:      cfg,
		table:    table,
		sidecars: map[string]*sidecarPeer{},
		replicas: map[string]*sidecarPeer{},
		routers:  map[string]uint32{},
		inflight: map[string]inflight{},
	}
}

// Routers counts the other routers it tells of route clears.
func (r *Receiver) Routers() int { return len(r.routers) }

// Footprint is the memory a Receiver holds for its sidecars: the bits of
// their mirrored filters, the deltas it buffers ahead of a snapshot, and
// the rest of its per-sidecar state (sequences, backoffs, metadata), not
// counting map overhead.
type Footprint struct {
	Sidecars     int
	FilterBytes  int
	PendingBytes int
	StateBytes   int
}

// Footprint measures what the receiver holds now.
func (r *Receiver) Footprint() Footprint {
	var fp Footprint
	for _, p := range r.sidecars {
		fp.Sidecars++
		if f := p.mirror.Filter(); f != nil {
			fp.FilterBytes += 8 * len(f.Words())
		}
		for _, d := range p.pending {
			fp.PendingBytes += int(unsafe.Sizeof(d)) + 8*len(d.Keys)
		}
		fp.StateBytes += int(unsafe.Sizeof(*p)) + len(p.member) + len(p.meta.Name) + len(p.meta.EngineURL) + len(p.meta.Protocol)
		for _, m := range p.meta.Models {
			fp.StateBytes += int(unsafe.Sizeof(m)) + len(m)
		}
	}
	return fp
}

// SetInflight sets the work this router has dispatched to replica and not
// yet seen finish: requests, and their uncached prompt tokens. Tick reports
// it to the replica's sidecar, which sums every router's report into the
// load all routers see.
func (r *Receiver) SetInflight(replica string, requests, prefillTokens int) {
	if requests <= 0 && prefillTokens <= 0 {
		delete(r.inflight, replica)
	} else {
		r.inflight[replica] = inflight{max(requests, 0), max(prefillTokens, 0)}
	}
}

// ClearRoutes clears route records (filters) of the named replicas, or of
// all when names is empty, here, and asks for the same cluster-wide: the
// sidecars rebuild and republish, the other routers drop their copies.
// id names the clear.
func (r *Receiver) ClearRoutes(names []string, id uint64, now time.Time) (out Output) {
	r.clear(names, now)
	msg := Message{Kind: KindClearRoutes, From: r.cfg.Self, Epoch: r.cfg.Epoch, Seq: id, Names: names}
	for name := range r.routers {
		out.Sends = append(out.Sends, Send{To: name, Msg: msg, Reliable: true})
	}
	for _, p := range r.sidecars {
		if len(names) == 0 || slices.Contains(names, p.meta.Name) {
			out.Sends = append(out.Sends, Send{To: p.member, Msg: msg, Reliable: true})
		}
	}
	return out
}

func (r *Receiver) clear(names []string, now time.Time) {
	for _, name := range r.table.ClearRoutes(names) {
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

// Member records a member that joined or announced new metadata.
func (r *Receiver) Member(name string, meta Meta, now time.Time) (out Output) {
	switch meta.Role {
	case RoleRouter:
		r.routers[name] = meta.Capabilities
		return out
	case RoleSidecar:
	default:
		return out
	}
	p := r.sidecars[name]
	if p == nil {
		p = &sidecarPeer{member: name}
		r.sidecars[name] = p
	}
	if p.meta.Name != "" && p.meta.Name != meta.Name {
		delete(r.replicas, p.meta.Name)
		r.table.Remove(p.meta.Name)
	}
	blockSizeChanged := p.meta.BlockSize != 0 && p.meta.BlockSize != meta.BlockSize
	p.meta = meta
	r.replicas[meta.Name] = p
	r.table.Upsert(fleet.Info{
		Name:      meta.Name,
		Models:    meta.Models,
		URL:       meta.EngineURL,
		Protocol:  meta.Protocol,
		KVEvents:  usesFilter(p),
		BlockSize: meta.BlockSize,

		DataParallel:     meta.DataParallel,
		DataParallelRank: meta.DataParallelRank,
		OffloadMedia:     offloadMedia(meta),
		KVRole:           fleet.KVRole(meta.KVRole),
	}, now)
	if blockSizeChanged && p.mirror.State() != nil {
		// The table dropped the filter (keys of another block size); the
		// sidecar learned its block size after keying, so ask again.
		p.mirror.Reset()
		p.pending = nil
		r.requestResync(p, now, ResyncBlockSize, &out)
	}
	return out
}

// Gone forgets a member no longer in the cluster. A sidecar's replica
// leaves the table if the sidecar said it was leaving; one that failed
// (crashed, partitioned, or declared dead by a forged message) may have a
// healthy engine behind it: the replica stays, an orphan routed by load.
func (r *Receiver) Gone(name string, now time.Time) (out Output) {
	delete(r.routers, name)
	p := r.sidecars[name]
	if p == nil {
		return out
	}
	delete(r.sidecars, name)
	if r.replicas[p.meta.Name] != p {
		return out
	}
	delete(r.replicas, p.meta.Name)
	if p.leaving {
		r.table.Remove(p.meta.Name)
		return out
	}
	r.table.Orphan(p.meta.Name, now)
	out.Orphaned = append(out.Orphaned, p.meta.Name)
	return out
}

// usesFilter: routers ignore filters of sidecars that compute keys with
// another scheme; they are load-balanced only.
func usesFilter(p *sidecarPeer) bool {
	return p.meta.Capabilities&CapKVEvents != 0 && p.meta.SchemeVersion == blockkey.SchemeVersion
}

// ShareUsage sends this router's per-tenant report to every other router
// that reads one (CapTenantUsage), as datagrams while it fits one (the next
// report, an interval later, replaces a lost one), else reliably.
func (r *Receiver) ShareUsage(usage []TenantUsage) (out Output) {
	msg := Message{Kind: KindTenantUsage, From: r.cfg.Self, Epoch: r.cfg.Epoch, Usage: usage}
	for name, caps := range r.routers {
		if caps&CapTenantUsage != 0 {
			out.Sends = append(out.Sends, Send{To: name, Msg: msg, Reliable: len(usage) > 32})
		}
	}
	return out
}

// Handle takes one message from another member.
func (r *Receiver) Handle(m *Message, now time.Time) (out Output) {
	if m.Kind == KindTenantUsage {
		if _, ok := r.routers[m.From]; ok {
			out.Usage = &UsageReport{From: m.From, Usage: m.Usage}
		}
		return out
	}
	if m.Kind == KindClearRoutes {
		r.clear(m.Names, now)
		out.Cleared, out.ClearedNames = true, slices.Clone(m.Names)
		return out
	}
	p := r.sidecars[m.From]
	if p == nil {
		return out // membership has not arrived yet; the next record will do
	}
	if m.Epoch != p.epoch {
		if p.epoch != 0 && m.Kind != KindLoad || p.hasLeft(m.Epoch) {
			// Epochs are random, so they cannot be ordered: the load
			// record (10 Hz) is the authority on the current one, and a
			// late filter message of another epoch must not win, nor a
			// late load record of an epoch already left.
			return out
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
		r.onLoad(p, m, now, &out)
	case KindSnapshot:
		r.onSnapshot(p, m, now, &out)
	case KindDelta:
		r.onDelta(p, m, now, &out)
	}
	return out
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

func (r *Receiver) onLoad(p *sidecarPeer, m *Message, now time.Time, out *Output) {
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
	if !usesFilter(p) || p.awaiting(l.FilterGen, now) {
		return
	}
	st := p.mirror.State()
	if st == nil || st.Generation < l.FilterGen || st.Generation == l.FilterGen && st.Seq < l.FilterSeq {
		p.behind++
		if p.behind >= 3 {
			r.requestResync(p, now, ResyncBehind, out)
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

func (r *Receiver) onSnapshot(p *sidecarPeer, m *Message, now time.Time, out *Output) {
	var s bloom.Snapshot
	var err error
	if r.cfg.Share != nil {
		s, err = r.cfg.Share.DecodeSharedSnapshot(m.From, m.Payload)
	} else {
		s, err = bloom.DecodeSnapshot(m.Payload)
	}
	if err != nil || s.Epoch != m.Epoch {
		out.Bad++
		return
	}
	r.table.Heard(p.meta.Name, now)
	if p.awaiting(s.Generation, now) || !usesFilter(p) {
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
	slices.SortFunc(pending, compareDeltas)
	for _, d := range pending {
		if d.Generation == s.Generation && d.Seq > s.Seq {
			if !p.mirror.ApplyDelta(d) {
				r.requestResync(p, now, ResyncGap, out)
				break
			}
		}
	}
	r.publish(p, now)
}

// compareDeltas orders deltas by generation, then sequence.
func compareDeltas(a, b bloom.Delta) int {
	if a.Generation != b.Generation {
		return cmpUint(a.Generation, b.Generation)
	}
	return cmpUint(a.Seq, b.Seq)
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

func (r *Receiver) onDelta(p *sidecarPeer, m *Message, now time.Time, out *Output) {
	var d bloom.Delta
	var err error
	if r.cfg.Share != nil {
		d, err = r.cfg.Share.DecodeSharedDelta(m.From, m.Payload)
	} else {
		d, err = bloom.DecodeDelta(m.Payload)
	}
	if err != nil || d.Epoch != m.Epoch {
		out.Bad++
		return
	}
	r.table.Heard(p.meta.Name, now)
	if p.awaiting(d.Generation, now) || !usesFilter(p) {
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
		r.requestResync(p, now, ResyncGap, out)
	}
}

// drainPending applies buffered deltas that now follow on (a resent delta
// filled the hole before them) and forgets those already covered.
func (r *Receiver) drainPending(p *sidecarPeer) {
	slices.SortFunc(p.pending, compareDeltas)
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
func (r *Receiver) publish(p *sidecarPeer, now time.Time) {
	if st := p.mirror.State(); st != nil {
		r.table.SetFilter(p.meta.Name, st.Filter, st.Generation, st.Keys, now)
	}
}

func (r *Receiver) requestResync(p *sidecarPeer, now time.Time, why ResyncReason, out *Output) {
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
	out.Resyncs++
	out.ResyncReasons[why]++
	// First ask for just the missing deltas (the sidecar keeps recent ones);
	// when that did not help, or nothing is held, ask for a snapshot.
	msg := Message{Kind: KindResync, From: r.cfg.Self}
	if st := p.mirror.State(); st != nil && st.Epoch == p.epoch && p.resyncStreak < 2 {
		msg.Epoch, msg.Gen, msg.Seq = st.Epoch, st.Generation, st.Seq
	}
	p.resyncStreak++
	out.Sends = append(out.Sends, Send{To: p.member, Msg: msg})
}

// Tick paces the table's expiry of silent sidecars and, every other call,
// the in-flight reports to the sidecars that sum them.
func (r *Receiver) Tick(now time.Time) (out Output) {
	for _, name := range r.table.Expire(now) {
		if p := r.replicas[name]; p != nil {
			// The table no longer shows the filter; the mirror keeps it in
			// case the sidecar was only slow (see onLoad).
			p.hidden = true
			p.behind = 0
			out.Silent = append(out.Silent, name)
		}
	}
	r.ticks++
	if r.ticks%2 != 0 { // in-flight reports at half the tick rate
		return out
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
		out.Sends = append(out.Sends, Send{To: p.member, Msg: Message{
			Kind: KindInflight, From: r.cfg.Self, Epoch: r.cfg.Epoch, Seq: p.inflSeq,
			Requests: cur.requests, PrefillTokens: cur.prefillTokens,
		}})
	}
	return out
}

// offloadMedia are the offload tiers a sidecar's filter publishes, none
// unless it announces CapTiers.
func offloadMedia(m Meta) []string {
	if m.Capabilities&CapTiers == 0 {
		return nil
	}
	return m.OffloadMedia
}
