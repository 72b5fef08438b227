package gateway

import (
	"sync"
	"time"
)

// A replica whose sidecar failed (an orphan, fleet.Replica.Orphan) may well
// have a healthy engine: it stays in routing by load. Nothing reports on
// that engine any more, so the router asks it itself: GET /health, as the
// sidecar did. An orphan is online while it answers; the table forgets one
// that stops (fleet.TableConfig.ForgetOrphanAfter), so replicas that died
// with their sidecars do not stay listed. Requests that fail to reach an
// orphan eject it meanwhile, as for any replica.

// ProbeOrphans asks every orphan's engine for /health every interval,
// waiting up to timeout for each, until stop closes.
func (g *Gateway) ProbeOrphans(every, timeout time.Duration, stop <-chan struct{}) {
	repeat(every, stop, func() { g.probeOrphans(timeout) })
}

// repeat runs f every interval until stop closes.
func repeat(every time.Duration, stop <-chan struct{}, f func()) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		f()
	}
}

// probeOrphans is one round, the orphans probed at once: a fleet whose
// sidecars died together must not wait for each dead engine in turn.
func (g *Gateway) probeOrphans(timeout time.Duration) {
	snap := g.table.Snapshot()
	var wg sync.WaitGroup
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !r.Orphan {
			continue
		}
		up, err := g.upstream(r)
		if err != nil {
			continue
		}
		wg.Go(func() {
			status, _, err := up.Get("/health", timeout)
			g.table.OrphanProbed(r.Name, err == nil && status == 200, g.now())
		})
	}
	wg.Wait()
}
