// Package flowcontrol holds the requests a router keeps back while the fleet
// is saturated, and says which one goes next when a replica has room.
//
// Three tiers decide the order, as in llm-d's flow control: priority bands
// first (strict: nothing of a lower band leaves while a higher band holds
// anything), then fair share between flows (tenants) within a band, then
// first come, first served within a flow. Fair share is start-time fair
// queuing over tokens: each ticket is tagged with the virtual time at which
// its flow's share of the band would begin serving it, cost/weight after the
// flow's previous ticket, and the smallest tag leaves first. A tenant that
// sends ten times its share therefore waits behind its own backlog while the
// others keep their place; a flow that was idle starts at the band's current
// virtual time, banking no credit for the time it sent nothing.
//
// The queue is a pure state machine, as the rest of kvmesh's cores are: no
// clock (callers pass now), no goroutines, no locks. The router's HTTP shell
// parks each request on its ticket and wakes it when Pop hands it out or
// Expire turns it away.
package flowcontrol

import (
	"container/heap"
	"errors"
	"fmt"
	"time"
)

// Priority is a request's band. Lower values leave first. The names are the
// Gateway API Inference Extension's criticalities.
type Priority uint8

const (
	Critical Priority = iota
	Standard
	Sheddable
	bands
)

func (p Priority) String() string {
	switch p {
	case Critical:
		return "critical"
	case Standard:
		return "standard"
	case Sheddable:
		return "sheddable"
	}
	return fmt.Sprintf("priority%d", uint8(p))
}

// ParsePriority reads a priority name; "" is Standard.
func ParsePriority(s string) (Priority, error) {
	switch s {
	case "critical":
		return Critical, nil
	case "", "standard":
		return Standard, nil
	case "sheddable":
		return Sheddable, nil
	}
	return 0, fmt.Errorf("priority %q: want critical, standard or sheddable", s)
}

// Reason says why a ticket left the queue without being served.
type Reason uint8

const (
	// Served: handed out by Pop.
	Served Reason = iota
	// Saturated: the fleet had no room for it within its band's wait bound
	// (503: the fleet, not the tenant, is at fault).
	Saturated
	// OverShare: it waited out its bound while its flow held more than its
	// weighted share of the band's queued tokens (429: the tenant sends more
	// than its share).
	OverShare
	// Evicted: a request of a higher band took its place in a full queue.
	Evicted
	// Removed: the caller took it out (its client left).
	Removed
)

func (r Reason) String() string {
	switch r {
	case Served:
		return "served"
	case Saturated:
		return "saturated"
	case OverShare:
		return "over_share"
	case Evicted:
		return "evicted"
	case Removed:
		return "removed"
	}
	return fmt.Sprintf("reason%d", uint8(r))
}

// Errors from Push: the ticket was not queued.
var (
	// ErrFlowFull: the ticket's flow already holds its bound in the band
	// (429: the tenant is over its share).
	ErrFlowFull = errors.New("flowcontrol: this tenant's queue is full")
	// ErrBandFull: the band holds its bound and nothing of a lower band can
	// make room (503).
	ErrBandFull = errors.New("flowcontrol: the queue is full")
)

// Limits bound one band.
type Limits struct {
	// MaxQueued bounds the band's tickets; 0 means no ticket is held.
	MaxQueued int
	// MaxPerFlow bounds one flow's tickets in the band; 0 means MaxQueued.
	MaxPerFlow int
	// MaxWait is how long a ticket may wait before Expire turns it away.
	MaxWait time.Duration
}

// Config is a queue's bounds and weights.
type Config struct {
	Bands [bands]Limits
	// MaxQueued bounds all bands together; 0 means the bands' sum. When it
	// is reached, a new ticket takes the place of the newest ticket of the
	// lowest band below its own, if any.
	MaxQueued int
	// Weight returns a flow's share weight (> 0); nil weighs every flow 1.
	Weight func(flow string) float64
}

// Ticket is one held request. The caller fills the exported fields before
// Push and reads Reason once the ticket has left.
type Ticket[T any] struct {
	Flow     string
	Priority Priority
	// Cost is what the request takes from its flow's share, in tokens
	// (the prompt's uncached tokens plus the answer's expected ones); at
	// least 1 is charged.
	Cost  int64
	Value T

	// Queued is when Push took it; Deadline when Expire turns it away.
	Queued, Deadline time.Time
	// Reason is why it left; meaningful once InQueue is false.
	Reason Reason

	start, finish float64 // virtual-time tags
	flow          *flow[T]
	prev, next    *Ticket[T] // within the flow, oldest first
	deadlineAt    int        // index in the deadline heap; -1 when not queued
}

// InQueue reports whether t is held.
func (t *Ticket[T]) InQueue() bool { return t.flow != nil }

// Wait is how long t has been held at now.
func (t *Ticket[T]) Wait(now time.Time) time.Duration { return now.Sub(t.Queued) }

type flow[T any] struct {
	name       string
	band       *band[T]
	weight     float64
	head, tail *Ticket[T]
	n          int
	cost       int64   // queued cost
	finish     float64 // finish tag of the last ticket pushed
	heapAt     int     // index in the band's flow heap; -1 when empty
}

type band[T any] struct {
	limits  Limits
	virtual float64 // start tag of the ticket served last
	// flows holds the active flows and idle ones whose last finish tag is
	// still ahead of virtual (served recently: their next ticket must not
	// start earlier); idle ones are swept once they outnumber the rest.
	flows   map[string]*flow[T]
	idle    int // idle flows in flows
	sweepAt int // idle count that triggers the next sweep
	// maxFinish is the largest finish tag served: virtual jumps to it when
	// the band empties, as start-time fair queuing's virtual time does at
	// the end of a busy period.
	maxFinish float64
	active    indexed[*flow[T]] // flows holding tickets, by their head's start tag
	n         int
	cost      int64
	weights   float64 // sum of the active flows' weights
}

// Queue is the held requests of one pool of replicas (one model).
type Queue[T any] struct {
	cfg       Config
	bands     [bands]band[T]
	deadlines indexed[*Ticket[T]] // every ticket held, by deadline
	n         int
}

// New returns an empty queue.
func New[T any](cfg Config) *Queue[T] {
	q := &Queue[T]{cfg: cfg}
	q.deadlines = indexed[*Ticket[T]]{less: byDeadline[T], at: func(t *Ticket[T], i int) { t.deadlineAt = i }}
	for i := range q.bands {
		q.bands[i].active = indexed[*flow[T]]{less: byHeadStart[T], at: func(f *flow[T], i int) { f.heapAt = i }}
	}
	q.Reconfigure(cfg)
	return q
}

// Reconfigure changes the queue's bounds and weights, keeping what it holds
// (a config reload drops no queued request). New bounds apply to tickets
// pushed from now on and new waits to their deadlines; weights to tags
// computed from now on.
func (q *Queue[T]) Reconfigure(cfg Config) {
	q.cfg = cfg
	for i := range q.bands {
		b := &q.bands[i]
		b.limits = cfg.Bands[i]
		if b.limits.MaxPerFlow <= 0 || b.limits.MaxPerFlow > b.limits.MaxQueued {
			b.limits.MaxPerFlow = b.limits.MaxQueued
		}
		if b.flows == nil {
			b.flows = map[string]*flow[T]{}
		}
	}
}

func (q *Queue[T]) maxQueued() int {
	if q.cfg.MaxQueued > 0 {
		return q.cfg.MaxQueued
	}
	n := 0
	for i := range q.bands {
		n += q.bands[i].limits.MaxQueued
	}
	return n
}

func (q *Queue[T]) weight(name string) float64 {
	if q.cfg.Weight == nil {
		return 1
	}
	if w := q.cfg.Weight(name); w > 0 {
		return w
	}
	return 1
}

// Len is the number of tickets held.
func (q *Queue[T]) Len() int { return q.n }

// BandLen is the number of tickets held in band p.
func (q *Queue[T]) BandLen(p Priority) int { return q.bands[p].n }

// FlowLen is the number of flow's tickets held in band p.
func (q *Queue[T]) FlowLen(p Priority, name string) int {
	if f := q.bands[p].flows[name]; f != nil {
		return f.n
	}
	return 0
}

// Push holds t from now. It fails with ErrFlowFull or ErrBandFull, leaving t
// out. To make room it may evict a ticket of a lower band, which it returns
// with Reason Evicted; the caller answers that request.
func (q *Queue[T]) Push(t *Ticket[T], now time.Time) (evicted *Ticket[T], err error) {
	if t.Priority >= bands {
		t.Priority = Sheddable
	}
	b := &q.bands[t.Priority]
	if b.n >= b.limits.MaxQueued {
		return nil, ErrBandFull
	}
	f := b.flows[t.Flow]
	if f != nil && f.n >= b.limits.MaxPerFlow {
		return nil, ErrFlowFull
	}
	if q.n >= q.maxQueued() {
		if evicted = q.lowestNewest(t.Priority); evicted == nil {
			return nil, ErrBandFull
		}
		q.remove(evicted, Evicted)
	}
	switch {
	case f == nil:
		f = &flow[T]{name: t.Flow, band: b, heapAt: -1}
		b.flows[t.Flow] = f
		f.weight = q.weight(t.Flow)
	case f.n == 0:
		b.idle--
		f.weight = q.weight(t.Flow)
	}
	// An idle flow starts at the band's present: no credit banked.
	t.start = max(b.virtual, f.finish)
	t.finish = t.start + float64(max(t.Cost, 1))/f.weight
	f.finish = t.finish
	t.Queued, t.Deadline, t.Reason = now, now.Add(b.limits.MaxWait), Served
	t.flow, t.prev, t.next = f, f.tail, nil
	if f.tail != nil {
		f.tail.next = t
	} else {
		f.head = t
	}
	f.tail = t
	f.n++
	f.cost += max(t.Cost, 1)
	b.n++
	b.cost += max(t.Cost, 1)
	q.n++
	if f.heapAt < 0 {
		b.weights += f.weight
		heap.Push(&b.active, f)
	}
	heap.Push(&q.deadlines, t)
	return evicted, nil
}

// lowestNewest returns the newest ticket of the lowest band below p, or nil.
func (q *Queue[T]) lowestNewest(p Priority) *Ticket[T] {
	for i := bands - 1; i > p; i-- {
		var newest *Ticket[T]
		for _, f := range q.bands[i].active.items {
			if newest == nil || f.tail.Queued.After(newest.Queued) {
				newest = f.tail
			}
		}
		if newest != nil {
			return newest
		}
	}
	return nil
}

// Peek returns the ticket Pop would hand out, or nil when none is held.
func (q *Queue[T]) Peek() *Ticket[T] {
	for i := range q.bands {
		if b := &q.bands[i]; b.active.Len() > 0 {
			return b.active.items[0].head
		}
	}
	return nil
}

// PeekBand returns the ticket of band p that leaves next, or nil.
func (q *Queue[T]) PeekBand(p Priority) *Ticket[T] {
	if b := &q.bands[p]; b.active.Len() > 0 {
		return b.active.items[0].head
	}
	return nil
}

// Pop hands out the next ticket (Reason Served), or nil when none is held.
func (q *Queue[T]) Pop() *Ticket[T] {
	t := q.Peek()
	if t == nil {
		return nil
	}
	b := t.flow.band
	b.virtual = max(b.virtual, t.start)
	b.maxFinish = max(b.maxFinish, t.finish)
	q.remove(t, Served)
	if b.n == 0 {
		b.virtual = b.maxFinish
		b.sweep()
	}
	return t
}

// Remove takes t out (Reason Removed): its client left. It reports whether t
// was held.
func (q *Queue[T]) Remove(t *Ticket[T]) bool {
	if !t.InQueue() {
		return false
	}
	q.remove(t, Removed)
	return true
}

// UnderShare reports whether t's flow holds less than its weighted share
// of its band's queued tokens while other flows hold some too: a tenant
// sending within its share, held behind the band's heavy users.
func (q *Queue[T]) UnderShare(t *Ticket[T]) bool {
	f := t.flow
	if f == nil || f.band.active.Len() < 2 {
		return false
	}
	// f.cost/b.cost < f.weight/b.weights, without dividing.
	return float64(f.cost)*f.band.weights < f.weight*float64(f.band.cost)
}

// NextDeadline is the earliest deadline held, for the caller's timer; zero
// when nothing is held.
func (q *Queue[T]) NextDeadline() time.Time {
	if q.deadlines.Len() == 0 {
		return time.Time{}
	}
	return q.deadlines.items[0].Deadline
}

// Expire takes out every ticket whose deadline is not after now, appending
// them to out with their Reason: OverShare when its flow held more than its
// weighted share of the band's queued tokens, else Saturated.
//
// Shares are judged on the queue as it stood at now, before any of them
// left: tickets of one flow expiring together are judged alike.
func (q *Queue[T]) Expire(now time.Time, out []*Ticket[T]) []*Ticket[T] {
	first := len(out)
	for q.deadlines.Len() > 0 && !q.deadlines.items[0].Deadline.After(now) {
		t := heap.Pop(&q.deadlines).(*Ticket[T])
		f, b := t.flow, t.flow.band
		t.Reason = Saturated
		// f.cost/b.cost > f.weight/b.weights, without dividing.
		if float64(f.cost)*b.weights > f.weight*float64(b.cost) {
			t.Reason = OverShare
		}
		out = append(out, t)
	}
	for _, t := range out[first:] {
		q.remove(t, t.Reason)
	}
	return out
}

func (q *Queue[T]) remove(t *Ticket[T], why Reason) {
	f := t.flow
	b := f.band
	wasHead := f.head == t
	if t.prev != nil {
		t.prev.next = t.next
	} else {
		f.head = t.next
	}
	if t.next != nil {
		t.next.prev = t.prev
	} else {
		f.tail = t.prev
	}
	f.n--
	f.cost -= max(t.Cost, 1)
	b.n--
	b.cost -= max(t.Cost, 1)
	q.n--
	if t.deadlineAt >= 0 {
		heap.Remove(&q.deadlines, t.deadlineAt)
	}
	switch {
	case f.n == 0:
		heap.Remove(&b.active, f.heapAt)
		b.weights -= f.weight
		if why != Served {
			// What it never got served does not count against its share.
			f.finish = min(f.finish, b.virtual)
		}
		if f.finish <= b.virtual {
			delete(b.flows, f.name)
		} else {
			b.idle++
			b.sweep()
		}
	case wasHead:
		heap.Fix(&b.active, f.heapAt)
	}
	t.flow, t.prev, t.next, t.Reason = nil, nil, nil, why
}

// sweep forgets idle flows with nothing ahead of the band's virtual time
// once idle flows have doubled since the last sweep, so memory stays bounded
// by what is held and recently served, at amortised constant cost.
func (b *band[T]) sweep() {
	if b.idle < b.sweepAt {
		return
	}
	for name, f := range b.flows {
		if f.n == 0 && f.finish <= b.virtual {
			delete(b.flows, name)
		}
	}
	b.idle = len(b.flows) - b.active.Len()
	b.sweepAt = 2*b.idle + 16
}

// indexed is a binary heap that tells each element its index, so an
// element can leave from the middle (a client gone, a flow emptied).
type indexed[E any] struct {
	items []E
	less  func(a, b E) bool
	at    func(e E, i int) // records e's index; -1 once out
}

func (h *indexed[E]) Len() int           { return len(h.items) }
func (h *indexed[E]) Less(i, j int) bool { return h.less(h.items[i], h.items[j]) }
func (h *indexed[E]) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.at(h.items[i], i)
	h.at(h.items[j], j)
}
func (h *indexed[E]) Push(x any) {
	e := x.(E)
	h.at(e, len(h.items))
	h.items = append(h.items, e)
}
func (h *indexed[E]) Pop() any {
	n := len(h.items) - 1
	e := h.items[n]
	var zero E
	h.items[n] = zero
	h.items = h.items[:n]
	h.at(e, -1)
	return e
}

// byHeadStart orders a band's active flows by their head's start tag, ties
// by arrival, so equal tags leave first come, first served.
func byHeadStart[T any](a, b *flow[T]) bool {
	x, y := a.head, b.head
	if x.start != y.start {
		return x.start < y.start
	}
	return x.Queued.Before(y.Queued)
}

func byDeadline[T any](a, b *Ticket[T]) bool { return a.Deadline.Before(b.Deadline) }
