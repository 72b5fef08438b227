package bloom

import (
	"iter"
	"math"
	"sync"
	"time"
)

// GenerationConfig sizes a sidecar's filters and says when to rebuild them.
// Zero fields take the defaults noted.
type GenerationConfig struct {
	// Capacity is the number of keys a filter is sized for: the engine's KV
	// capacity in blocks (default 65536). A rebuild grows the filter when
	// more keys than that are resident.
	Capacity int
	// MaxKeys caps that growth (0: none): a rebuild never sizes a filter for
	// more than max(Capacity, MaxKeys) keys, so that every snapshot fits the
	// message that carries it (see MaxCapacity).
	MaxKeys int
	// FPRate is the target false-positive rate at Capacity (default 0.01).
	FPRate float64
	// RebuildRemovedFraction triggers a rebuild once the keys removed since
	// the generation began exceed this fraction of the keys in it (default 0.1).
	RebuildRemovedFraction float64
	// RebuildFillRatio triggers a rebuild once this fraction of bits is set
	// (default: the fill at which the false-positive rate doubles the target).
	RebuildFillRatio float64
	// MaxAge triggers a rebuild of a generation this old that has seen any
	// removal (default 30 s): stale positives never live longer.
	MaxAge time.Duration
	// MaxDeltaKeys caps the keys of one delta; TakeDelta leaves the rest for
	// the next call (0 = no cap).
	MaxDeltaKeys int
	// FirstGeneration numbers the first generation (default 1). A sidecar
	// that starts a new epoch after an engine restart continues its old
	// numbering, so operators see generations only grow.
	FirstGeneration uint64
}

func (c GenerationConfig) withDefaults() GenerationConfig {
	if c.Capacity <= 0 {
		c.Capacity = 1 << 16
	}
	if c.FPRate <= 0 || c.FPRate >= 1 {
		c.FPRate = 0.01
	}
	if c.RebuildRemovedFraction <= 0 {
		c.RebuildRemovedFraction = 0.1
	}
	if c.MaxAge <= 0 {
		c.MaxAge = 30 * time.Second
	}
	return c
}

// Generations is a sidecar's filter: generation g built from the exact
// resident set, plus the keys added since, handed out as ordered deltas.
// Removals cannot be applied to a Bloom filter; they are counted until a
// rebuild publishes generation g+1.
//
// All methods are safe for concurrent use. Call Add, Remove, Clear and
// Rebuild from the goroutine that owns the exact set, so Rebuild's key
// iteration sees the same set the adds described.
type Generations struct {
	cfg  GenerationConfig
	fill float64 // effective RebuildFillRatio

	// sizing remembers Params for the last capacity (Rebuild runs often,
	// Params costs ~1 ms); guarded by mu.
	sizedFor uint
	blocks   uint64
	k        uint

	mu       sync.Mutex
	epoch    uint64
	gen      uint64
	seq      uint64 // sequence of the last delta taken
	filter   *Filter
	ones     int         // bits set in filter
	inserted int         // keys put in this generation as of the last delta taken
	pending  []uint64    // added since the last delta taken
	removed  int         // removals since the generation began
	live     int         // resident keys, as Add/Remove/Clear describe them
	cleared  bool        // a Clear happened since the generation began
	dropped  int         // delta batches dropped because nobody took them
	started  time.Time   // when the generation began
	job      *RebuildJob // rebuild in progress, recording changes
}

// NewGenerations returns generation 1 of an empty filter for boot epoch
// epoch.
func NewGenerations(cfg GenerationConfig, epoch uint64, now time.Time) *Generations {
	cfg = cfg.withDefaults()
	g := &Generations{cfg: cfg, epoch: epoch, gen: max(cfg.FirstGeneration, 1), started: now}
	g.filter = NewFilter(uint(cfg.Capacity), cfg.FPRate)
	g.fill = cfg.RebuildFillRatio
	if g.fill <= 0 || g.fill > 1 {
		g.fill = math.Pow(2*cfg.FPRate, 1/float64(g.filter.K()))
	}
	return g
}

// Add records that key entered the exact set: it is set in the filter at
// once and queued for the next delta.
func (g *Generations) Add(key uint64) {
	var p Probe
	g.mu.Lock()
	p.init(key, 0, g.filter.k)
	g.ones += g.filter.AddProbe(&p)
	if len(g.pending) >= max(g.cfg.Capacity, 4096) {
		// Nobody is taking deltas (no routers yet?): stop queueing. The
		// dropped keys become a skipped sequence number, so any mirror sees
		// a gap and resyncs from a snapshot, which holds them.
		g.inserted += len(g.pending)
		g.pending = g.pending[:0]
		g.seq++
		g.dropped++
	}
	g.pending = append(g.pending, key)
	g.live++
	if g.job != nil {
		g.job.adds = append(g.job.adds, key)
	}
	g.mu.Unlock()
}

// Remove records that key left the exact set. Its bits stay set until the
// next generation; the removal counts toward the rebuild trigger.
func (g *Generations) Remove(key uint64) {
	g.mu.Lock()
	g.removed++
	g.live = max(g.live-1, 0)
	if g.job != nil {
		g.job.removed++
	}
	g.mu.Unlock()
}

// Clear records that every key left the exact set; NeedsRebuild then
// reports true.
func (g *Generations) Clear() {
	g.mu.Lock()
	g.removed += g.live
	g.live = 0
	g.cleared = true
	if g.job != nil {
		g.job.abandoned = true
		g.job = nil
	}
	g.mu.Unlock()
}

// NeedsRebuild reports whether the current generation carries too many stale
// or crowded bits: after a Clear, when removals exceed the configured
// fraction, when the fill ratio passes its limit, or when a generation that
// has seen removals reaches MaxAge.
func (g *Generations) NeedsRebuild(now time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.cleared:
		return true
	case g.removed == 0 && float64(g.ones) < g.fill*float64(g.filter.M()):
		return false
	case float64(g.removed) > g.cfg.RebuildRemovedFraction*float64(max(g.inserted+len(g.pending), 1)):
		return true
	case float64(g.ones) >= g.fill*float64(g.filter.M()):
		return true
	default:
		return now.Sub(g.started) >= g.cfg.MaxAge
	}
}

// Rebuild starts generation g+1 from the exact set that keys iterates. The
// new filter is sized for max(Capacity, resident keys × 1.25). Pending delta
// keys are dropped: the new generation's snapshot holds them.
func (g *Generations) Rebuild(now time.Time, keys iter.Seq[uint64]) {
	job := g.BeginRebuild()
	job.Build(keys)
	g.Install(now, job)
}

// RebuildJob is a rebuild split in three, so that the owner of the exact
// set holds its lock only while it copies the keys, not for the ≈20 ms of
// filling a 300k-key filter:
//
//	owner locked:   job := g.BeginRebuild(); copy the keys
//	unlocked:       job.Build(copied keys)
//	owner locked:   g.Install(now, job)
//
// Adds and removes between BeginRebuild and Install are recorded in the job
// and carried into the new generation.
type RebuildJob struct {
	filter    *Filter
	ones, n   int
	adds      []uint64 // added meanwhile
	removed   int      // removed meanwhile (they may be among the copied keys)
	abandoned bool     // a Clear came meanwhile: the copied keys are all stale
}

// BeginRebuild starts recording changes for a rebuild and sizes its filter
// for the keys resident now. A job begun earlier and not installed is
// abandoned.
func (g *Generations) BeginRebuild() *RebuildJob {
	g.mu.Lock()
	defer g.mu.Unlock()
	capacity := g.cfg.Capacity
	if g.live > capacity {
		capacity = g.live + g.live/4
		if g.cfg.MaxKeys > 0 {
			capacity = max(min(capacity, g.cfg.MaxKeys), g.cfg.Capacity)
		}
	}
	if uint(capacity) != g.sizedFor {
		g.sizedFor = uint(capacity)
		g.blocks, g.k = Params(uint(capacity), g.cfg.FPRate)
	}
	if g.job != nil {
		g.job.abandoned = true
	}
	g.job = &RebuildJob{filter: &Filter{words: make([]uint64, g.blocks*blockWords), blocks: g.blocks, k: g.k}}
	return g.job
}

// Build puts keys (the exact set as it was at BeginRebuild) in the job's
// filter. It takes no lock: call it without holding the owner's.
func (j *RebuildJob) Build(keys iter.Seq[uint64]) {
	if keys == nil {
		return
	}
	var p Probe
	for key := range keys {
		p.init(key, 0, j.filter.k)
		j.ones += j.filter.addUnpublished(&p)
		j.n++
	}
}

// Install publishes the job's filter as generation g+1, with the keys added
// since BeginRebuild; removals since count toward the next rebuild. It
// reports false, changing nothing, when the job was abandoned (a Clear, or
// a newer BeginRebuild).
func (g *Generations) Install(now time.Time, j *RebuildJob) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.job != j || j.abandoned {
		return false
	}
	g.job = nil
	var p Probe
	for _, key := range j.adds {
		p.init(key, 0, j.filter.k)
		j.ones += j.filter.addUnpublished(&p)
	}
	g.gen++
	g.seq = 0
	g.filter = j.filter
	g.ones = j.ones
	g.inserted = j.n + len(j.adds)
	g.pending = nil
	g.removed = j.removed
	g.live = max(j.n+len(j.adds)-j.removed, 0)
	g.cleared = false
	g.started = now
	return true
}

// Snapshot returns a copy of the current generation. Seq is the last delta
// taken: a mirror applying this snapshot continues with delta Seq+1. The
// words may already hold keys of that next delta; adding them twice is
// harmless.
func (g *Generations) Snapshot() Snapshot {
	g.mu.Lock()
	defer g.mu.Unlock()
	return Snapshot{
		Epoch:      g.epoch,
		Generation: g.gen,
		Seq:        g.seq,
		M:          g.filter.M(),
		K:          g.filter.K(),
		Keys:       g.inserted,
		Words:      g.filter.AppendWords(make([]uint64, 0, len(g.filter.words))),
	}
}

// TakeDelta returns the keys added since the last call (at most MaxDeltaKeys)
// under the next sequence number of the current generation, or false when
// none were added.
func (g *Generations) TakeDelta() (Delta, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.pending) == 0 {
		return Delta{}, false
	}
	keys := g.pending
	if c := g.cfg.MaxDeltaKeys; c > 0 && len(keys) > c {
		keys = keys[:c:c]
		g.pending = append([]uint64(nil), g.pending[c:]...)
	} else {
		g.pending = nil
	}
	g.seq++
	g.inserted += len(keys)
	return Delta{Epoch: g.epoch, Generation: g.gen, Seq: g.seq, Keys: keys}, true
}

// GenerationStats describe the current generation, for status pages.
type GenerationStats struct {
	Epoch, Generation, Seq uint64
	// Keys is the number of keys in the generation as of delta Seq, the
	// figure a mirror at Seq reports too.
	Keys int
	// Pending keys are added but not yet taken in a delta.
	Pending int
	// Removed counts removals since the generation began.
	Removed int
	// DroppedDeltas counts batches of pending keys dropped because no
	// TakeDelta came for Capacity keys (the sequence skips them).
	DroppedDeltas int
	// FillRatio is the fraction of bits set; M is the filter's size in bits.
	FillRatio float64
	M, K      uint
	Started   time.Time
}

// Stats returns the current generation's figures without copying the filter.
func (g *Generations) Stats() GenerationStats {
	g.mu.Lock()
	defer g.mu.Unlock()
	return GenerationStats{
		Epoch: g.epoch, Generation: g.gen, Seq: g.seq,
		Keys: g.inserted, Pending: len(g.pending), Removed: g.removed, DroppedDeltas: g.dropped,
		FillRatio: float64(g.ones) / float64(g.filter.M()),
		M:         g.filter.M(), K: g.filter.K(), Started: g.started,
	}
}
