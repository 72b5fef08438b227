package fleetsim

import (
	"container/heap"
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
	a    int
	msg  *filterstream.Message
}

// queue is the simulator's event heap, earliest first.
type queue struct {
	items []event
	seq   uint64
}

func (q *queue) Len() int { return len(q.items) }
func (q *queue) Less(i, j int) bool {
	a, b := &q.items[i], &q.items[j]
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}
func (q *queue) Swap(i, j int) { q.items[i], q.items[j] = q.items[j], q.items[i] }
func (q *queue) Push(x any)    { q.items = append(q.items, x.(event)) }
func (q *queue) Pop() any {
	n := len(q.items) - 1
	e := q.items[n]
	q.items[n] = event{}
	q.items = q.items[:n]
	return e
}

// at schedules e at time t.
func (q *queue) at(t time.Duration, k kind, a int, msg *filterstream.Message) {
	q.seq++
	heap.Push(q, event{at: t, seq: q.seq, kind: k, a: a, msg: msg})
}

func (q *queue) next() event { return heap.Pop(q).(event) }
