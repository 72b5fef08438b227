package fleet

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/bloom"
)

// Selection bounds: a configured selection names 2..MaxSelected replicas.
const (
	MinSelected = 2
	MaxSelected = 50
)

// TableConfig tunes a Table's notion of age.
type TableConfig struct {
	// StaleAfter is the TTL of a replica's state: older state is Stale and
	// routed by load only. Default 350 ms (three missed 10 Hz load records).
	StaleAfter time.Duration
	// DropAfter drops a silent sidecar's filter and its load figures,
	// whatever memberlist thinks of it: its replica is an orphan from then
	// on. Default 500 ms; with Expire run every 50 ms a vanished sidecar's
	// filter is out of routing within 1 s.
	DropAfter time.Duration
	// ForgetOrphanAfter removes an orphan whose engine has not answered a
	// health probe (OrphanProbed) for this long. Default 1 min.
	ForgetOrphanAfter time.Duration
}

func (c TableConfig) withDefaults() TableConfig {
	if c.StaleAfter <= 0 {
		c.StaleAfter = 350 * time.Millisecond
	}
	if c.DropAfter <= 0 {
		c.DropAfter = 500 * time.Millisecond
	}
	if c.ForgetOrphanAfter <= 0 {
		c.ForgetOrphanAfter = time.Minute
	}
	return c
}

// Info is what membership says about a sidecar's replica (its metadata).
type Info struct {
	Name      string
	Models    []string
	URL       string
	Protocol  string
	KVEvents  bool
	BlockSize int
	// DataParallel and DataParallelRank: the replica is that rank of the
	// server at URL (Replica.DataParallel).
	DataParallel     bool
	DataParallelRank int
	// OffloadMedia are the offload tiers its filter holds under
	// blockkey.Tiered keys (Replica.OffloadMedia).
	OffloadMedia []string
	// KVRole is its engine's side of prefill/decode disaggregation.
	KVRole KVRole
}

// Table holds the replicas a router knows, by name. Writers (gossip, config)
// serialise on a mutex; readers take Snapshot, which is an atomic load unless
// something changed since the last one.
type Table struct {
	cfg TableConfig

	mu      sync.Mutex
	entries map[string]*entry
	// sorted is entries by name, nil after a replica came or went: a
	// rebuild (one per load record on a busy router) then does not sort.
	sorted    []*entry
	selection map[string]bool // nil: every replica is selected
	// touched lists the entries changed since the last rebuild, which then
	// copies the previous snapshot and rewrites only them, unless the
	// layout changed since: layout counts the changes of membership (the
	// order of sorted) and selection, after which every entry is rewritten.
	touched []*entry
	layout  uint64
	// released is the snapshot Recycle last handed back; spare the memory
	// of one released and since replaced, which the next rebuild reuses,
	// rewriting the entries touched since it was built (spareTouched,
	// those of the rebuild after it, and touched).
	released     *Snapshot
	spare        *Snapshot
	spareTouched []*entry
	dirty        atomic.Bool
	snap         atomic.Pointer[Snapshot]
}

type entry struct {
	r      Replica
	static bool
	// engineHealthy is the last word on the engine: its sidecar's, or for
	// an orphan (Replica.Orphan) the router's own health probe; answered
	// is when an orphan's engine last answered one. Online = engineHealthy.
	engineHealthy bool
	answered      time.Time
	// pos is the entry's index in sorted; touched that it is in
	// Table.touched.
	pos     int
	touched bool
}

// NewTable returns an empty table.
func NewTable(cfg TableConfig) *Table {
	t := &Table{cfg: cfg.withDefaults(), entries: map[string]*entry{}}
	t.snap.Store(&Snapshot{})
	return t
}

// Config returns the table's effective configuration.
func (t *Table) Config() TableConfig { return t.cfg }

// Snapshot returns a consistent, immutable view. It is cheap: a rebuild
// happens only when the table changed since the previous call.
func (t *Table) Snapshot() *Snapshot {
	if t.dirty.Load() {
		t.mu.Lock()
		if t.dirty.Load() {
			t.rebuildLocked()
		}
		t.mu.Unlock()
	}
	return t.snap.Load()
}

func (t *Table) changedLocked() { t.dirty.Store(true) }

// touchLocked notes that e's replica changed: the next rebuild copies it.
func (t *Table) touchLocked(e *entry) {
	if !e.touched {
		e.touched = true
		t.touched = append(t.touched, e)
	}
}

// rebuildLocked publishes a snapshot of every entry as it is now. While
// the same replicas are listed, that is the previous snapshot with the
// entries touched since rewritten: a busy router's table changes a few
// entries between two requests (a load record each), and a thousand-replica
// fleet's snapshot need not be assembled entry by entry for each.
func (t *Table) rebuildLocked() {
	prev := t.snap.Load()
	if t.sorted == nil {
		t.sorted = make([]*entry, 0, len(t.entries))
		for _, e := range t.entries {
			t.sorted = append(t.sorted, e)
		}
		slices.SortFunc(t.sorted, func(a, b *entry) int { return strings.Compare(a.r.Name, b.r.Name) })
		for i, e := range t.sorted {
			e.pos = i
		}
		t.layout++
	}
	n := len(t.sorted)
	incremental := prev.layout == t.layout && len(prev.Replicas) == n
	var s *Snapshot
	switch spare := t.spare; {
	case spare != nil && incremental && spare.layout == t.layout && spare.gen+1 == prev.gen && 2*(len(t.spareTouched)+len(t.touched)) < n:
		// The spare was the snapshot before prev: what changed since is
		// what prev's rebuild touched and what was touched since.
		s = spare
		t.fillTouched(s, t.spareTouched)
		t.fillTouched(s, t.touched)
	case spare != nil && len(spare.Replicas) == n:
		s = spare
		for _, e := range t.sorted {
			t.fill(s, e)
		}
	case incremental && 2*len(t.touched) < n:
		s = &Snapshot{Replicas: slices.Clone(prev.Replicas), filters: slices.Clone(prev.filters)}
		t.fillTouched(s, t.touched)
	default:
		s = &Snapshot{Replicas: make([]Replica, n), filters: make([]*bloom.Filter, n)}
		for _, e := range t.sorted {
			t.fill(s, e)
		}
	}
	s.gen, s.layout = prev.gen+1, t.layout
	t.spare = nil
	if t.released == prev {
		// Replaced now: no caller reads it any more, nor anything in it.
		t.spare, t.released = prev, nil
	}
	for _, e := range t.touched {
		e.touched = false
	}
	// The touched list becomes the spare's: the next rebuild into it
	// rewrites them too.
	clear(t.spareTouched)
	t.spareTouched, t.touched = t.touched, t.spareTouched[:0]
	t.snap.Store(s)
	t.dirty.Store(false)
}

// Recycle says the caller is done for good with s, a snapshot of t, and
// anything in it: once Snapshot has returned another one, a later snapshot
// may be built in its memory. Only the one goroutine that takes the
// table's snapshots may call it, holding no other copy of s (a simulator
// deciding one request at a time, where a thousand-replica snapshot for
// every decision would be most of what it allocates); a router, whose
// requests share snapshots, does not.
func (t *Table) Recycle(s *Snapshot) {
	t.mu.Lock()
	if s == t.snap.Load() {
		t.released = s
	} else if t.spare == nil && s.gen < t.snap.Load().gen {
		t.spare = s
	}
	t.mu.Unlock()
}

func (t *Table) fillTouched(s *Snapshot, touched []*entry) {
	for _, e := range touched {
		if e.pos < len(t.sorted) && t.sorted[e.pos] == e {
			t.fill(s, e)
		}
	}
}

// fill sets e's replica in s, at its place in sorted.
func (t *Table) fill(s *Snapshot, e *entry) {
	// Models is shared, not copied: an entry's Models is replaced whole,
	// never written into, and snapshots are read-only.
	r := &s.Replicas[e.pos]
	*r = e.r
	r.Selected = t.selection == nil || t.selection[r.Name]
	s.filters[e.pos] = nil
	if r.Online && r.Selected && r.KVEvents && !r.Stale {
		s.filters[e.pos] = r.Filter
	}
}

// Upsert adds a sidecar's replica or updates its metadata (membership join or
// update). A new replica starts online with no filter and no state age.
func (t *Table) Upsert(info Info, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[info.Name]
	if e == nil {
		e = &entry{engineHealthy: true}
		e.r.Name = info.Name
		e.r.UpdatedAt = now
		t.entries[info.Name] = e
		t.sorted = nil
	}
	t.touchLocked(e)
	e.static = false
	e.r.Models = slices.Clone(info.Models)
	e.r.ModelsLearned = false
	e.r.URL = info.URL
	e.r.Protocol = info.Protocol
	e.r.KVEvents = info.KVEvents
	e.r.DataParallel, e.r.DataParallelRank = info.DataParallel, info.DataParallelRank
	e.r.OffloadMedia = slices.Clone(info.OffloadMedia)
	e.r.KVRole = info.KVRole
	if info.BlockSize != e.r.BlockSize {
		// Keys of another block size mean nothing here: wait for a snapshot.
		// A size announced for the first time changes nothing: the sidecar
		// keyed its blocks with the size its events carried all along.
		if e.r.BlockSize != 0 {
			e.dropFilter()
		}
		e.r.BlockSize = info.BlockSize
	}
	e.refreshOnline()
	t.changedLocked()
}

// AddStatic adds (or replaces) an upstream without a sidecar: always online,
// never stale, routed by load only. Without models it takes any model until
// LearnStatic says which it serves. Re-adding it at the same URL without
// models (every config reload does) keeps what was learned: resetting it would
// let it take, until rediscovery answers, models it does not serve. Configured
// models or another URL replace what was learned.
func (t *Table) AddStatic(name, url string, models []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.entries[name]; e != nil && e.static && e.r.ModelsLearned && e.r.URL == url && len(models) == 0 {
		return
	}
	t.sorted = nil
	t.entries[name] = &entry{
		static:        true,
		engineHealthy: true,
		r: Replica{
			Name:     name,
			Models:   slices.Clone(models),
			URL:      url,
			Protocol: ProtocolStatic,
			Online:   true,
		},
	}
	t.changedLocked()
}

// LearnStatic sets the models that static upstream name, added without
// models, serves at url (as its /v1/models says). It changes nothing and
// reports false when name is no longer a static at url or has been given
// models since: the configuration, reloaded while the upstream was being
// asked, wins.
func (t *Table) LearnStatic(name, url string, models []string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[name]
	if e == nil || !e.static || e.r.URL != url || (len(e.r.Models) > 0 && !e.r.ModelsLearned) {
		return false
	}
	e.r.Models = slices.Clone(models)
	e.r.ModelsLearned = true
	t.touchLocked(e)
	t.changedLocked()
	return true
}

// Remove forgets a replica (its sidecar left on purpose).
func (t *Table) Remove(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.entries[name]; !ok {
		return false
	}
	delete(t.entries, name)
	t.sorted = nil
	t.changedLocked()
	return true
}

// RemoveStatic forgets every static upstream not in keep (config reload).
func (t *Table) RemoveStatic(keep map[string]bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for n, e := range t.entries {
		if e.static && !keep[n] {
			delete(t.entries, n)
			t.sorted = nil
			t.changedLocked()
		}
	}
}

// SetLoad records a sidecar's load record. An unhealthy engine takes the
// replica offline at once and drops its filter. It reports false for an
// unknown replica (its membership has not arrived yet).
func (t *Table) SetLoad(name string, load Load, engineHealthy bool, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[name]
	if e == nil || e.static {
		return false
	}
	t.touchLocked(e)
	e.r.Load = load
	e.engineHealthy = engineHealthy
	e.heard(now)
	if !engineHealthy {
		e.dropFilter()
	}
	t.changedLocked()
	return true
}

// SetFilter publishes a replica's filter (nil drops it) with its generation
// and exact key count. f must be safe for concurrent reads from then on; the
// table only hands it to readers (whose prefix walks note, atomically, the
// prefixes they found in it).
func (t *Table) SetFilter(name string, f *bloom.Filter, gen uint64, keys int, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[name]
	if e == nil || e.static {
		return false
	}
	t.touchLocked(e)
	e.r.Filter, e.r.FilterGeneration, e.r.FilterKeys = f, gen, keys
	e.heard(now)
	t.changedLocked()
	return true
}

// Heard notes that a replica's sidecar spoke (any message), keeping it fresh.
func (t *Table) Heard(name string, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.entries[name]; e != nil && !e.static {
		// Touched even when nothing routing reads changed: the next
		// snapshot shows the new UpdatedAt, as one built afresh would.
		t.touchLocked(e)
		wasStale, wasOrphan := e.r.Stale, e.r.Orphan
		e.heard(now)
		if wasStale || wasOrphan {
			t.changedLocked()
		}
	}
}

// Orphan notes that a replica's sidecar failed (memberlist declared it dead,
// as opposed to leaving): the engine may well still serve, so the replica
// stays, routed by load only (no filter, no load figures: the router's own
// in-flight counts), while it answers the router's health probes. It
// reports false for an unknown or static replica.
func (t *Table) Orphan(name string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[name]
	if e == nil || e.static {
		return false
	}
	if !e.r.Orphan {
		t.touchLocked(e)
		e.orphan(now)
		e.r.Stale = true
		t.changedLocked()
	}
	return true
}

// OrphanProbed records whether an orphan's engine answered a health probe
// at now: its replica is online while it does; one that has not answered
// for ForgetOrphanAfter is removed. It reports false when name is not an
// orphan (its sidecar is back, or it was removed).
func (t *Table) OrphanProbed(name string, ok bool, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[name]
	if e == nil || !e.r.Orphan {
		return false
	}
	if ok {
		e.answered = now
	} else if now.Sub(e.answered) >= t.cfg.ForgetOrphanAfter {
		delete(t.entries, name)
		t.sorted = nil
		t.changedLocked()
		return false
	}
	if e.engineHealthy != ok {
		t.touchLocked(e)
		e.engineHealthy = ok
		e.refreshOnline()
		t.changedLocked()
	}
	return true
}

// ClearRoutes drops the filters of the named replicas (all when names is
// empty) until their next snapshot, and returns the names cleared.
func (t *Table) ClearRoutes(names []string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var cleared []string
	clear := func(n string, e *entry) {
		if e.static {
			return
		}
		t.touchLocked(e)
		e.dropFilter()
		cleared = append(cleared, n)
	}
	if len(names) == 0 {
		for n, e := range t.entries {
			clear(n, e)
		}
	} else {
		for _, n := range names {
			if e := t.entries[n]; e != nil {
				clear(n, e)
			}
		}
	}
	sort.Strings(cleared)
	t.changedLocked()
	return cleared
}

// Select sets the replicas that take part in prefix matching: nil or empty
// selects all (the default), otherwise MinSelected..MaxSelected names, which
// need not be known yet.
func (t *Table) Select(names []string) error {
	var sel map[string]bool
	if len(names) > 0 {
		sel = map[string]bool{}
		for _, n := range names {
			sel[n] = true
		}
		if len(sel) < MinSelected || len(sel) > MaxSelected {
			return fmt.Errorf("fleet: a selection names %d..%d distinct replicas, got %d", MinSelected, MaxSelected, len(sel))
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.selection = sel
	t.layout++
	t.changedLocked()
	return nil
}

// Expire ages every sidecar's state at now: state older than StaleAfter is
// Stale; a replica whose sidecar is silent for DropAfter becomes an orphan
// (see Orphan). It returns the replicas orphaned by this call. Run it every
// ~100 ms.
func (t *Table) Expire(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var dropped []string
	for n, e := range t.entries {
		if e.static {
			continue
		}
		age := now.Sub(e.r.UpdatedAt)
		if stale := age > t.cfg.StaleAfter; stale != e.r.Stale {
			t.touchLocked(e)
			e.r.Stale = stale
			t.changedLocked()
		}
		if age > t.cfg.DropAfter && !e.r.Orphan {
			t.touchLocked(e)
			e.orphan(now)
			dropped = append(dropped, n)
			t.changedLocked()
		}
	}
	sort.Strings(dropped)
	return dropped
}

func (e *entry) heard(now time.Time) {
	if now.After(e.r.UpdatedAt) {
		e.r.UpdatedAt = now
	}
	e.r.Stale = false
	e.r.Orphan = false
	e.refreshOnline()
}

// orphan drops what only the sidecar could keep current: the filter and
// the engine's load figures.
func (e *entry) orphan(now time.Time) {
	e.r.Orphan = true
	e.answered = now
	e.r.Load = Load{}
	e.dropFilter()
}

func (e *entry) refreshOnline() { e.r.Online = e.engineHealthy }

func (e *entry) dropFilter() {
	e.r.Filter, e.r.FilterGeneration, e.r.FilterKeys = nil, 0, 0
}

// Snapshot is an immutable view of the table for one routing decision.
type Snapshot struct {
	// Replicas are sorted by name. Offline replicas are listed (for admin
	// views) but must not be routed to.
	Replicas []Replica
	// filters[i] is Replicas[i].Filter when it may be used for matching
	// (online, selected, fresh, with KV events), else nil.
	filters []*bloom.Filter
	// gen numbers the table's snapshots; layout is the table's layout it
	// was built in.
	gen, layout uint64
}

// MatchPrefix sets matched[i] to the number of leading keys Replicas[i] may
// hold, 0 for replicas that do not take part in matching. len(matched) must
// equal len(Replicas). It does not allocate.
func (s *Snapshot) MatchPrefix(keys []uint64, matched []int) {
	bloom.MatchPrefix(keys, s.filters, matched)
}

// MatchTier continues Replicas[i]'s match of keys past from, on the
// offload tier salt names (blockkey.TierSalt): it returns how many keys
// from keys[from] on its filter holds as blockkey.Tiered, 0 for a replica
// that takes no part in matching. It does not allocate.
func (s *Snapshot) MatchTier(i int, keys []uint64, from int, salt uint64) int {
	f := s.filters[i]
	if f == nil {
		return 0
	}
	n := 0
	for _, k := range keys[min(from, len(keys)):] {
		if !f.Test(blockkey.Tiered(k, salt)) {
			break
		}
		n++
	}
	return n
}

// Find returns the index of the named replica, or -1.
func (s *Snapshot) Find(name string) int {
	i := sort.Search(len(s.Replicas), func(i int) bool { return s.Replicas[i].Name >= name })
	if i < len(s.Replicas) && s.Replicas[i].Name == name {
		return i
	}
	return -1
}
