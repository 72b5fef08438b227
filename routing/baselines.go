package routing

import (
	"cmp"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"

	"github.com/kvmesh/kvmesh/costfit"
)

// fillOrder resets d and lists every candidate in d.Order.
func fillOrder(d *Decision, n int) {
	d.Order = d.Order[:0]
	for i := range n {
		d.Order = append(d.Order, i)
	}
	d.Pick, d.Mode, d.PredictedCachedTokens, d.PredictedOffloadedTokens, d.Degraded, d.Reason = -1, ModeBalance, 0, 0, false, ""
	d.PredictedTTFT, d.Queue = 0, 0
}

// finish sets Pick from the head of Order and the mode for static upstreams.
func finish(d *Decision, cands []Candidate, mode Mode) {
	if len(d.Order) == 0 {
		d.Pick = -1
		return
	}
	d.Pick = d.Order[0]
	d.Mode = mode
	if cands[d.Pick].Static {
		d.Mode = ModeStatic
	}
}

type random struct{}

func newRandom() random { return random{} }

func (random) Name() string { return "random" }

func (random) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	rand.Shuffle(len(d.Order), func(i, j int) { d.Order[i], d.Order[j] = d.Order[j], d.Order[i] })
	finish(d, cands, ModeBalance)
	d.Reason = "random"
}

// roundRobin keeps a counter per model: one policy serves every model, and
// with a shared counter two models taking turns would each see only every
// other value (all of a model's requests on half its replicas).
type roundRobin struct {
	next   sync.Map // model → *atomic.Uint64
	models atomic.Int32
	shared atomic.Uint64 // for models past maxCounters
}

// maxCounters bounds the models with their own counter; the names come
// from the fleet, this only guards against one that renames without end.
const maxCounters = 1024

func (*roundRobin) Name() string { return "round-robin" }

func (r *roundRobin) counter(model string) *atomic.Uint64 {
	if c, ok := r.next.Load(model); ok {
		return c.(*atomic.Uint64)
	}
	if r.models.Load() >= maxCounters {
		return &r.shared
	}
	c, loaded := r.next.LoadOrStore(strings.Clone(model), new(atomic.Uint64))
	if !loaded {
		r.models.Add(1)
	}
	return c.(*atomic.Uint64)
}

func (r *roundRobin) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	if n := len(cands); n > 0 {
		start := int(r.counter(req.Model).Add(1) % uint64(n))
		for i := range d.Order {
			d.Order[i] = (start + i) % n
		}
	}
	finish(d, cands, ModeBalance)
	d.Reason = "round-robin"
}

type leastLoaded struct{ cfg Config }

func (leastLoaded) Name() string { return "least-loaded" }

func (p leastLoaded) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	sortByLoad(d.Order, cands, &p.cfg, &p.cfg.cost)
	finish(d, cands, ModeBalance)
	d.Reason = "fewest outstanding requests"
}

// sortByLoad orders idx by outstanding requests, then queued engine time
// under cost k.
func sortByLoad(idx []int, cands []Candidate, cfg *Config, k *costfit.Coefficients) {
	slices.SortStableFunc(idx, func(a, b int) int {
		ca, cb := &cands[a], &cands[b]
		if c := cmp.Compare(outstanding(ca), outstanding(cb)); c != 0 {
			return c
		}
		return cmp.Compare(cfg.queue(k, ca), cfg.queue(k, cb))
	})
}

// rendezvousOrder orders idx by highest-random-weight hashing of key: every
// router computes the same order for the same key and replica names.
func rendezvousOrder(idx []int, cands []Candidate, key uint64) {
	// Each candidate's weight is hashed once, not at every comparison.
	var buf [stackCands]uint64
	weight := buf[:]
	if len(cands) > len(buf) {
		weight = make([]uint64, len(cands))
	}
	for _, i := range idx {
		weight[i] = rendezvousWeight(&cands[i], key)
	}
	slices.SortFunc(idx, func(a, b int) int {
		if c := cmp.Compare(weight[b], weight[a]); c != 0 {
			return c
		}
		return strings.Compare(cands[a].Name, cands[b].Name)
	})
}

// rendezvousWeight is c's weight for key in a rendezvous order.
func rendezvousWeight(c *Candidate, key uint64) uint64 {
	return mix(xxhash.Sum64String(c.Name) ^ key)
}

// rendezvousBefore reports whether a (of weight wa) comes before b (of
// weight wb) in a rendezvous order: heavier first, ties by name.
func rendezvousBefore(wa uint64, a *Candidate, wb uint64, b *Candidate) bool {
	if wa != wb {
		return wa > wb
	}
	return a.Name < b.Name
}

// boundedHome returns the position in order (a rendezvous order) of the
// first candidate whose load is within the bound, homeCapacity.
func boundedHome(order []int, cands []Candidate, bound float64) int {
	total := 0
	for _, i := range order {
		total += outstanding(&cands[i])
	}
	capacity := homeCapacity(bound, total, len(order))
	for pos, i := range order {
		if float64(outstanding(&cands[i])+1) <= capacity {
			return pos
		}
	}
	return 0
}

// homeCapacity is CHWBL's capacity of each of n replicas holding total
// requests: ceil(bound × (total+1) / n), counting this request. Rounding
// up is what lets an idle replica take the request when the whole fleet
// holds fewer requests than replicas (without it, no replica fits and the
// busy home keeps everything); it also means the least-loaded one always
// fits.
func homeCapacity(bound float64, total, n int) float64 {
	return math.Ceil(bound*float64(total+1)/float64(n) - 1e-9)
}

// mix is murmur3's fmix64. It is not blockkey.Remix on purpose: it places
// cold prefixes, and changing it would move every prefix's home between two
// router versions running side by side during an upgrade.
func mix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// chwbl is consistent hashing with bounded loads on the prompt's affinity
// key (KubeAI's policy): same prefix, same replica, unless it is overloaded.
type chwbl struct{ cfg Config }

func (chwbl) Name() string { return "chwbl" }

func (p chwbl) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	rendezvousOrder(d.Order, cands, req.AffinityKey)
	if h := boundedHome(d.Order, cands, p.cfg.LoadBound); h > 0 {
		moveToFront(d.Order, h)
	}
	finish(d, cands, ModeCold)
	d.Reason = "consistent hash, bounded load"
}

func moveToFront(order []int, pos int) {
	v := order[pos]
	copy(order[1:pos+1], order[:pos])
	order[0] = v
}

// prefixPin sends a request to the replica holding its longest prefix,
// whatever its load; a prefix nobody holds goes to its consistent-hash home.
type prefixPin struct{ cfg Config }

func (prefixPin) Name() string { return "prefix-pin" }

func (p prefixPin) Route(req *Request, cands []Candidate, d *Decision) {
	fillOrder(d, len(cands))
	rendezvousOrder(d.Order, cands, req.AffinityKey)
	matched := func(i int) int {
		if cands[i].PrefixAware {
			return cands[i].MatchedTokens
		}
		return 0
	}
	slices.SortStableFunc(d.Order, func(a, b int) int { return cmp.Compare(matched(b), matched(a)) })
	mode := ModeCold
	if len(d.Order) > 0 && matched(d.Order[0]) > 0 {
		mode = ModePrefix
	}
	finish(d, cands, mode)
	if d.Pick >= 0 {
		d.PredictedCachedTokens = matched(d.Pick)
		d.PredictedOffloadedTokens = offloaded(&cands[d.Pick], d.PredictedCachedTokens)
	}
	d.Reason = "longest prefix"
}
