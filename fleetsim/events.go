package fleetsim

import (
	"time"

	"github.com/kvmesh/kvmesh/filterstream"
)

// kind says what an event does when its time comes.
type kind uint8

const (
	evArrival        kind = iota // request a arrives at its router
	evStepDone                   // replica a's engine step ends
	evSidecarFlush               // replica a's sidecar sends its filter deltas
	evSidecarLoad                // replica a's sidecar sends its load record
	evSidecarScrape              // replica a's sidecar reads its engine's load
	evSidecarRebuild             // replica a's sidecar checks whether a rebuild is due
	evRouterTick                 // router a's receiver ticks
	evToRouter                   // msg reaches router a
	evToSidecar                  // msg reaches replica a's sidecar
)

// event is one thing that happens at a simulated instant. seq orders
// events of the same instant by when they were scheduled, so a run is a
// function of its inputs alone.
type event struct {
	at   time.Duration
	seq  uint64
	kind kind
	// owned: msg is the simulator's, to reuse once handled.
	owned bool
	a     int
	msg   *filterstream.Message
}

// queue is the simulator's event heap, earliest first: a binary heap of
// event values (container/heap would box every event in an interface).
type queue struct {
	items []event
	seq   uint64
}

func (q *queue) Len() int { return len(q.items) }

func (q *queue) less(i, j int) bool { return before(&q.items[i], &q.items[j]) }

func before(a, b *event) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}

// at schedules e at time t.
func (q *queue) at(t time.Duration, k kind, a int, msg *filterstream.Message) {
	q.put(t, k, a, msg, false)
}

// put schedules e at time t; owned says msg is the simulator's.
func (q *queue) put(t time.Duration, k kind, a int, msg *filterstream.Message, owned bool) {
	q.seq++
	q.items = append(q.items, event{at: t, seq: q.seq, kind: k, a: a, msg: msg, owned: owned})
	for i := len(q.items) - 1; i > 0; {
		p := (i - 1) / 2
		if !q.less(i, p) {
			break
		}
		q.items[i], q.items[p] = q.items[p], q.items[i]
		i = p
	}
}

// peek returns the earliest event; the queue must not be empty.
func (q *queue) peek() *event { return &q.items[0] }

// next removes and returns the earliest event.
func (q *queue) next() event {
	e := q.items[0]
	n := len(q.items) - 1
	q.items[0] = q.items[n]
	q.items[n] = event{}
	q.items = q.items[:n]
	for i := 0; ; {
		l := 2*i + 1
		if l >= n {
			break
		}
		c := l
		if r := l + 1; r < n && q.less(r, l) {
			c = r
		}
		if !q.less(c, i) {
			break
		}
		q.items[i], q.items[c] = q.items[c], q.items[i]
		i = c
	}
	return e
}
