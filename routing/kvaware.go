package routing

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/costfit"
)

// kvaware picks the replica with the smallest predicted time to first token.
// It keeps two pieces of state, both bounded: speculative records (recently
// routed blocks, trusted until the replica's own events confirm them) and
// which models are in least-load mode because their replicas are badly
// imbalanced.
type kvaware struct {
	cfg Config

	mu   sync.Mutex
	spec specRecords

	// degraded holds the models in least-load mode now, under degradedMu.
	// It is kept per model because models may be served by different
	// replicas: one flag would be set by one model's fleet and cleared by
	// another's. nDegraded is its size, read without the lock so that the
	// common decision (no model degraded, none entering) takes none.
	degradedMu   sync.Mutex
	degraded     map[string]struct{}
	nDegraded    atomic.Int32
	degradations atomic.Uint64

	// costs holds a *modelCost per model.
	costs     sync.Map
	costCount atomic.Int32
}

// modelCost is one model's learned cost: fit takes observations under mu;
// cur is its latest answer, read by every decision without a lock.
type modelCost struct {
	mu  sync.Mutex
	fit *costfit.Fit
	cur atomic.Pointer[costfit.Coefficients]
}

// maxCostModels bounds the models costs are learned for. Model names come
// from the fleet (requests for others never reach a decision), so the bound
// only guards against a fleet that renames its models without end.
const maxCostModels = 1024

// maxDegradedModels bounds the models in least-load mode at once. A model
// only enters it for an imbalance among replicas that serve it, so the
// names come from the fleet too; past the bound a model is routed by
// predicted ttft instead.
const maxDegradedModels = 1024

// specRecord names its replica by an index into specRecords.names, so the
// record maps hold no pointers: at a million records, a map of strings
// would be scanned by every GC cycle.
type specRecord struct {
	replica uint32
	expires int64 // UnixNano
}

// The optional contracts kvaware offers: the gateway finds them by type
// assertion, so a renamed method must fail here rather than silently drop a
// metric or a clear.
var (
	_ Recorder    = (*kvaware)(nil)
	_ Learner     = (*kvaware)(nil)
	_ Clearer     = (*kvaware)(nil)
	_ Degrader    = (*kvaware)(nil)
	_ CostModeler = (*kvaware)(nil)
)

func newKVAware(cfg Config) *kvaware {
	return &kvaware{cfg: cfg, spec: newSpecRecords(cfg.SpeculativeTTL, cfg.SpeculativeMaxKeys), degraded: map[string]struct{}{}}
}

func (*kvaware) Name() string { return "kvaware" }

// Degradations counts switches into least-load mode, of every model.
func (p *kvaware) Degradations() uint64 { return p.degradations.Load() }

// Degraded reports whether any model is in least-load mode now.
func (p *kvaware) Degraded() bool { return p.nDegraded.Load() > 0 }

// ClearRecords forgets speculative records for the named replicas (all when
// names is empty), as after a model update or a canary switch.
func (p *kvaware) ClearRecords(names []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.spec.clear(names)
}

const stackCands = 64

func (p *kvaware) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	if len(cands) == 0 {
		return
	}
	var matchedBuf [stackCands]int
	var ttftBuf [stackCands]time.Duration
	matched, ttft := matchedBuf[:0], ttftBuf[:0]
	if len(cands) > stackCands {
		matched, ttft = make([]int, 0, len(cands)), make([]time.Duration, 0, len(cands))
	}
	matched = matched[:len(cands)]
	ttft = ttft[:len(cands)]

	p.speculativeMatches(req, cands, matched)
	k := p.costOf(req.Model)
	bestMatched := 0
	for i := range cands {
		c := &cands[i]
		if !c.PrefixAware {
			matched[i] = 0
		} else {
			matched[i] = min(matched[i], req.PromptTokens)
		}
		bestMatched = max(bestMatched, matched[i])
		ttft[i] = p.cfg.ttft(k, c, req.PromptTokens, matched[i]) + p.cfg.loadTime(k, c, matched[i])
	}

	if p.checkImbalance(req.Model, k, cands) {
		sortByLoad(d.Order, cands, &p.cfg, k)
		finish(d, cands, ModeBalance)
		d.Degraded = true
		d.PredictedCachedTokens = matched[d.Pick]
		d.PredictedOffloadedTokens = offloaded(&cands[d.Pick], matched[d.Pick])
		d.PredictedTTFT, d.Queue = ttft[d.Pick], p.cfg.queue(k, &cands[d.Pick])
		d.Reason = "imbalanced fleet: least-load mode"
		return
	}

	// Ties fall to the candidate order: a total order, so the faster
	// unstable sort gives what a stable one would, and the first Rank of a
	// selection are the first Rank of the sort.
	rank := func(a, b int) int {
		if c := cmp.Compare(ttft[a], ttft[b]); c != 0 {
			return c
		}
		if c := cmp.Compare(matched[b], matched[a]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	}
	if req.Rank > 0 && req.Rank < len(d.Order) {
		selectFirst(d.Order, req.Rank, rank)
	} else {
		slices.SortFunc(d.Order, rank)
	}
	// A session is placed on its home whether or not the prompt is cold:
	// its next turn then finds its prefix wherever it started.
	if home, ok := p.home(req.Session, cands, ttft, d); ok {
		d.SessionHome = true
		moveToFront(d.Order, slices.Index(d.Order, home))
	} else if bestMatched == 0 && req.Session == 0 {
		if home, ok := p.home(req.AffinityKey, cands, ttft, d); ok {
			moveToFront(d.Order, slices.Index(d.Order, home))
		}
	}
	mode := ModePrefix
	switch {
	case bestMatched == 0:
		mode = ModeCold
	case matched[d.Order[0]] == 0:
		mode = ModeBalance
	}
	finish(d, cands, mode)
	d.PredictedCachedTokens = matched[d.Pick]
	d.PredictedOffloadedTokens = offloaded(&cands[d.Pick], matched[d.Pick])
	d.PredictedTTFT, d.Queue = ttft[d.Pick], p.cfg.queue(k, &cands[d.Pick])
	d.Reason = "smallest predicted ttft"
	if d.SessionHome {
		d.Reason = "session home within cold slack"
	}
}

// costOf is the cost model for model's decisions: learned, or configured.
func (p *kvaware) costOf(model string) *costfit.Coefficients {
	if p.cfg.Calibrate {
		if mc, ok := p.costs.Load(model); ok {
			return mc.(*modelCost).cur.Load()
		}
	}
	return &p.cfg.cost
}

// Learn implements Learner: the observation goes to req.Model's fit; with
// Config.Calibrate the next decisions for that model use its answer.
func (p *kvaware) Learn(req *Request, c *Candidate, cachedTokens int, ttft time.Duration) {
	if c.Static {
		return // a static upstream's load is unknown: nothing to fit
	}
	v, ok := p.costs.Load(req.Model)
	if !ok {
		if p.costCount.Load() >= maxCostModels {
			return
		}
		mc := &modelCost{fit: costfit.New(p.cfg.cost)}
		mc.cur.Store(&p.cfg.cost)
		if v, ok = p.costs.LoadOrStore(req.Model, mc); !ok {
			p.costCount.Add(1)
		}
	}
	mc := v.(*modelCost)
	tokens := p.cfg.queuedTokens(c) + max(req.PromptTokens-cachedTokens, 0)
	mc.mu.Lock()
	mc.fit.Add(tokens, c.Running, ttft)
	k := mc.fit.Coefficients()
	mc.cur.Store(&k)
	mc.mu.Unlock()
}

// CostModels calls yield with each model's learned cost model and the
// weight of the observations behind it.
func (p *kvaware) CostModels(yield func(model string, k costfit.Coefficients, observations float64)) {
	p.costs.Range(func(key, v any) bool {
		mc := v.(*modelCost)
		mc.mu.Lock()
		k, n := mc.fit.Coefficients(), mc.fit.Observations()
		mc.mu.Unlock()
		yield(key.(string), k, n)
		return true
	})
}

// home returns the consistent-hash home of key among the candidates whose
// blocks routers can see (a prefix placed on a load-only replica could never
// be found again), bounded by load, when it is nearly as good as the best
// (within ColdSlack of d.Order[0]'s predicted time to first token): routers
// that have not yet seen each other's choices then still agree. It is the
// first of their rendezvous order within the load bound (boundedHome's
// answer), found in one pass without ordering them all.
func (p *kvaware) home(key uint64, cands []Candidate, ttft []time.Duration, d *Decision) (int, bool) {
	if key == 0 || len(d.Order) == 0 {
		return 0, false
	}
	total, n := 0, 0
	for i := range cands {
		if cands[i].PrefixAware {
			total += outstanding(&cands[i])
			n++
		}
	}
	if n == 0 {
		return 0, false
	}
	capacity := homeCapacity(p.cfg.LoadBound, total, n)
	first, fit := -1, -1
	var firstW, fitW uint64
	for i := range cands {
		c := &cands[i]
		if !c.PrefixAware {
			continue
		}
		w := rendezvousWeight(c, key)
		if first < 0 || rendezvousBefore(w, c, firstW, &cands[first]) {
			first, firstW = i, w
		}
		if float64(outstanding(c)+1) <= capacity && (fit < 0 || rendezvousBefore(w, c, fitW, &cands[fit])) {
			fit, fitW = i, w
		}
	}
	h := fit
	if h < 0 {
		h = first
	}
	if ttft[h] > ttft[d.Order[0]]+p.cfg.ColdSlack {
		return 0, false
	}
	return h, true
}

// selectFirst puts the first n of order by cmp, in order, at its front; the
// rest follow in no particular order. A total order's first n are then the
// first n a sort would give.
func selectFirst(order []int, n int, cmp func(a, b int) int) {
	insertionSort(order[:n], cmp)
	for k := n; k < len(order); k++ {
		v := order[k]
		if cmp(v, order[n-1]) >= 0 {
			continue
		}
		order[k] = order[n-1]
		j := n - 1
		for ; j > 0 && cmp(v, order[j-1]) < 0; j-- {
			order[j] = order[j-1]
		}
		order[j] = v
	}
}

func insertionSort(s []int, cmp func(a, b int) int) {
	for i := 1; i < len(s); i++ {
		v, j := s[i], i
		for ; j > 0 && cmp(v, s[j-1]) < 0; j-- {
			s[j] = s[j-1]
		}
		s[j] = v
	}
}

// checkImbalance updates model's least-load mode: enter when the longest
// queue among its candidates is over ImbalanceEnter × the mean of the
// others' (and at least ImbalanceMinQueue), leave when it is back under
// ImbalanceExit × that mean or under half the minimum.
func (p *kvaware) checkImbalance(model string, k *costfit.Coefficients, cands []Candidate) bool {
	if len(cands) < 2 {
		return false
	}
	// The longest queues are the mean of the top eighth of the fleet (the
	// single longest up to 15 replicas): over hundreds of replicas the
	// longest of many busy queues is always far above the mean by chance
	// alone, and one outlier would hold the whole model in least-load mode.
	top := max(len(cands)/8, 1)
	var heapBuf [stackCands]time.Duration
	longestQ := topQueueSet{q: heapBuf[:0], k: top}
	var total time.Duration
	for i := range cands {
		q := p.cfg.queue(k, &cands[i])
		total += q
		longestQ = longestQ.push(q)
	}
	longest := longestQ.mean()
	others := float64(total-longestQ.sum()) / float64(len(cands)-len(longestQ.q))
	enter := float64(longest) > p.cfg.ImbalanceEnter*others && longest >= p.cfg.ImbalanceMinQueue
	if !enter && p.nDegraded.Load() == 0 {
		return false
	}
	p.degradedMu.Lock()
	defer p.degradedMu.Unlock()
	if _, ok := p.degraded[model]; ok {
		if float64(longest) <= p.cfg.ImbalanceExit*others || longest < p.cfg.ImbalanceMinQueue/2 {
			delete(p.degraded, model)
			p.nDegraded.Add(-1)
			return false
		}
		return true
	}
	if !enter || len(p.degraded) >= maxDegradedModels {
		return false
	}
	p.degraded[strings.Clone(model)] = struct{}{} // the key outlives the request
	p.nDegraded.Add(1)
	p.degradations.Add(1)
	return true
}

// topQueueSet keeps the k largest queue estimates pushed (a min-heap).
type topQueueSet struct {
	q []time.Duration
	k int
}

// push returns t with v pushed. It takes and returns t by value so that a
// set over a caller's stack array stays there: through a pointer, escape
// analysis moves the array to the heap.
func (t topQueueSet) push(v time.Duration) topQueueSet {
	if len(t.q) < t.k {
		t.q = append(t.q, v)
		for i := len(t.q) - 1; i > 0 && t.q[(i-1)/2] > t.q[i]; i = (i - 1) / 2 {
			t.q[i], t.q[(i-1)/2] = t.q[(i-1)/2], t.q[i]
		}
		return t
	}
	if v <= t.q[0] {
		return t
	}
	t.q[0] = v
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < len(t.q) && t.q[l] < t.q[m] {
			m = l
		}
		if r < len(t.q) && t.q[r] < t.q[m] {
			m = r
		}
		if m == i {
			return t
		}
		t.q[i], t.q[m] = t.q[m], t.q[i]
		i = m
	}
}

func (t *topQueueSet) sum() (s time.Duration) {
	for _, v := range t.q {
		s += v
	}
	return s
}

func (t *topQueueSet) mean() time.Duration { return t.sum() / time.Duration(len(t.q)) }

// speculativeMatches sets matched[i] to the leading blocks candidate i's
// filter shows, extended by the blocks recently routed to it that the filter
// may not show yet. Records are kept only past what the chosen replica's
// filter showed (see Record), so each walk starts where the filter stops:
// a request whose prefix is already visible costs one lookup, not one per
// block.
func (p *kvaware) speculativeMatches(req *Request, cands []Candidate, matched []int) {
	for i := range cands {
		matched[i] = cands[i].MatchedTokens
	}
	bs := req.BlockSize
	if bs <= 0 || len(req.Keys) == 0 {
		return
	}
	now := req.Now.UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.spec.cur)+len(p.spec.prev) == 0 {
		return
	}
	// Most candidates stop at the same block (often the first): look each
	// starting key up once.
	type probe struct {
		at    int
		owner uint32
		ok    bool
	}
	var memo [4]probe
	memoN := 0
	for i := range cands {
		c := &cands[i]
		if !c.PrefixAware {
			continue
		}
		j := c.MatchedTokens / bs
		if j >= len(req.Keys) {
			continue
		}
		var first probe
		found := false
		for _, m := range memo[:memoN] {
			if m.at == j {
				first, found = m, true
				break
			}
		}
		if !found {
			r, ok := p.spec.get(req.Keys[j])
			first = probe{at: j, owner: r.replica, ok: ok && r.expires >= now}
			if memoN < len(memo) {
				memo[memoN] = first
				memoN++
			}
		}
		if !first.ok || p.spec.names[first.owner] != c.Name {
			continue
		}
		for j++; j < len(req.Keys); j++ {
			r, ok := p.spec.get(req.Keys[j])
			if !ok || r.expires < now || r.replica != first.owner {
				break
			}
		}
		matched[i] = max(matched[i], min(j*bs, req.MaxCachedTokens(bs)))
	}
}

// Record implements Recorder: req's blocks past those the replica's filter
// already showed (filterMatchedTokens) will be resident there from time at.
// (The gateway does not record requests routed in least-load mode, where
// prefixes did not steer them.)
func (p *kvaware) Record(req *Request, replica string, filterMatchedTokens int, at time.Time) {
	if req.BlockSize <= 0 {
		return
	}
	from := filterMatchedTokens / req.BlockSize
	if from >= len(req.Keys) {
		return
	}
	keys := req.Keys[max(from, 0):]
	expires := at.Add(p.cfg.SpeculativeTTL).UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.spec.rotate(at.UnixNano(), len(keys))
	r := specRecord{replica: p.spec.intern(replica), expires: expires}
	for _, k := range keys {
		p.spec.cur[k] = r
	}
}

// specRecords keeps speculative records in two generations: new records go
// to cur; when cur is older than the TTL or full, prev is dropped whole and
// cur becomes prev. Every record thus lives at least one TTL (or until the
// bound forces a rotation) and memory stays bounded without ever scanning.
type specRecords struct {
	ttl       int64
	maxKeys   int
	cur, prev map[uint64]specRecord
	curSince  int64
	names     []string          // replica names records refer to
	index     map[string]uint32 // name → position in names
}

func newSpecRecords(ttl time.Duration, maxKeys int) specRecords {
	return specRecords{ttl: int64(ttl), maxKeys: max(maxKeys/2, 1), cur: map[uint64]specRecord{}, prev: map[uint64]specRecord{},
		index: map[string]uint32{}}
}

// maxSpecNames bounds the replica names records may refer to. A fleet has
// few replicas at a time, but rollouts bring new names (new pods) and the
// old ones stay referable until every record is cleared: past the bound,
// all records are dropped (they are hints that live seconds).
const maxSpecNames = 4096

// intern returns the index of replica in names, adding it if new.
func (s *specRecords) intern(replica string) uint32 {
	if i, ok := s.index[replica]; ok {
		return i
	}
	if len(s.names) >= maxSpecNames {
		s.clear(nil)
	}
	i := uint32(len(s.names))
	s.names = append(s.names, replica)
	s.index[replica] = i
	return i
}

func (s *specRecords) get(k uint64) (specRecord, bool) {
	if r, ok := s.cur[k]; ok {
		return r, true
	}
	r, ok := s.prev[k]
	return r, ok
}

// rotate makes room for n more records at time now.
func (s *specRecords) rotate(now int64, n int) {
	if s.curSince == 0 {
		s.curSince = now
	}
	if now-s.curSince < s.ttl && len(s.cur)+n <= s.maxKeys {
		return
	}
	s.prev, s.cur = s.cur, s.prev
	clear(s.cur)
	s.curSince = now
}

func (s *specRecords) clear(names []string) {
	if len(names) == 0 {
		clear(s.cur)
		clear(s.prev)
		s.names, s.index = s.names[:0], map[string]uint32{}
		return
	}
	for _, m := range []map[uint64]specRecord{s.cur, s.prev} {
		for k, r := range m {
			if slices.Contains(names, s.names[r.replica]) {
				delete(m, k)
			}
		}
	}
}
