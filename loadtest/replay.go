package loadtest

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// ReplayOptions pace a workload against targets.
type ReplayOptions struct {
	Targets   []string // base URLs; request i goes to Targets[i % len]
	TimeScale float64  // wall seconds per simulated second (arrivals scale by it)
	// RequestTimeout bounds one request in wall time (default 2 min).
	RequestTimeout time.Duration
	// Drain bounds the wait for in-flight requests after the last arrival
	// (wall; default 1 min). What is still running then is cancelled and
	// recorded as an error.
	Drain time.Duration
	// MaxInFlight caps concurrent requests; an arrival over the cap is
	// recorded as an error instead of silently turning the open loop into
	// a closed one (default 4096).
	MaxInFlight int
}

// ReplayResult holds every request's record, in workload order.
type ReplayResult struct {
	Records []report.Record
	// MaxLag is the worst delay of a send behind its schedule: a large
	// value means the load generator itself was starved of CPU.
	MaxLag time.Duration
	Wall   time.Duration
}

// ErrOverCap marks arrivals dropped because MaxInFlight was reached.
var ErrOverCap = errors.New("client in-flight cap reached")

// Replay sends w's requests at their arrival times (scaled to wall time)
// through c, open loop: an arrival never waits for an earlier answer,
// except the one it names in After (an agent's previous turn), which it
// follows as soon as that one is done. It returns when every request has
// finished or been cancelled.
func Replay(ctx context.Context, c *Client, w workload.Workload, o ReplayOptions) ReplayResult {
	if o.TimeScale <= 0 {
		o.TimeScale = 1
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = 2 * time.Minute
	}
	if o.Drain <= 0 {
		o.Drain = time.Minute
	}
	if o.MaxInFlight <= 0 {
		o.MaxInFlight = 4096
	}
	res := ReplayResult{Records: make([]report.Record, len(w.Requests))}
	if len(o.Targets) == 0 {
		for i := range res.Records {
			res.Records[i] = report.Record{Key: w.Requests[i].Key, Err: "no targets"}
		}
		return res
	}
	span := time.Duration(float64(w.Span()) * o.TimeScale)
	ctx, cancel := context.WithTimeoutCause(ctx, span+o.Drain, errors.New("drain deadline passed"))
	defer cancel()

	// done[key] is closed once a request of that key has its record.
	done := map[string]*doneSignal{}
	for _, r := range w.Requests {
		if r.After != "" {
			done[r.After] = &doneSignal{ch: make(chan struct{})}
		}
	}
	slots := make(chan struct{}, o.MaxInFlight)
	var wg sync.WaitGroup
	begin := time.Now()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for i, r := range w.Requests {
		due := time.Duration(float64(r.At) * o.TimeScale)
		if wait := due - time.Since(begin); wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-ctx.Done():
			}
		}
		sent := time.Since(begin)
		res.MaxLag = max(res.MaxLag, sent-due)
		target := o.Targets[i%len(o.Targets)]
		if ctx.Err() != nil {
			res.Records[i] = report.Record{Router: target, Key: r.Key, Start: sent, Err: "not sent: " + context.Cause(ctx).Error()}
			done[r.Key].close()
			continue
		}
		select {
		case slots <- struct{}{}:
		default:
			res.Records[i] = report.Record{Router: target, Key: r.Key, Start: sent, Err: ErrOverCap.Error()}
			done[r.Key].close()
			continue
		}
		after, mine := done[r.After], done[r.Key]
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			defer mine.close()
			start := sent
			if after != nil {
				select {
				case <-after.ch:
				case <-ctx.Done():
				}
				start = time.Since(begin)
			}
			rctx, rcancel := context.WithTimeoutCause(ctx, o.RequestTimeout, errors.New("request timeout"))
			defer rcancel()
			rec := c.Do(rctx, target, r)
			rec.Start = start
			res.Records[i] = rec
		}()
	}
	wg.Wait()
	res.Wall = time.Since(begin)
	return res
}

// doneSignal is closed once, however many requests share its key.
type doneSignal struct {
	ch   chan struct{}
	once sync.Once
}

// close closes the signal; a nil one (a key nothing waits for) is a no-op.
func (d *doneSignal) close() {
	if d != nil {
		d.once.Do(func() { close(d.ch) })
	}
}
