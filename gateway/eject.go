package gateway

import (
	"sync"
	"sync/atomic"
	"time"
)

// ejection takes a replica out of routing for a while after a request could
// not reach it (refused, reset, dial or first-byte timeout). Retries already
// keep such requests from failing, but without it every request routed there
// first pays the failed attempt (or a whole dial timeout for a host that
// drops packets), and a dead replica, having nothing in flight, looks the
// least loaded of all. The time out doubles with each ejection in a row, from
// ejectBase up to ejectMax; the first request that reaches the replica again
// resets it. Static upstreams need it most: no sidecar reports them down.
type ejection struct {
	until atomic.Int64 // unix nanoseconds; in routing again from then on
	mu    sync.Mutex
	row   int // ejections since the replica last answered
}

const (
	ejectBase = time.Second
	ejectMax  = 30 * time.Second
)

// out reports whether the replica is ejected at now (unix nanoseconds).
func (e *ejection) out(now int64) bool { return now < e.until.Load() }

// failed records that a request could not reach the replica at now, and
// returns how long it is ejected for (0 when it already was: requests that
// were in flight together count once).
func (e *ejection) failed(now time.Time) time.Duration {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.out(now.UnixNano()) {
		return 0
	}
	d := min(ejectBase<<min(e.row, 5), ejectMax)
	e.row++
	e.until.Store(now.Add(d).UnixNano())
	return d
}

// reached records that a request reached the replica.
func (e *ejection) reached() {
	if e.until.Load() == 0 {
		return // never ejected since it last answered: the common case, lock-free
	}
	e.mu.Lock()
	e.row = 0
	e.until.Store(0)
	e.mu.Unlock()
}
