package enginesim

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/kvevents"
)

// errShutdown fails requests still in flight when the engine loop stops.
var errShutdown = errors.New("engine is shutting down")

// call is one request's link between its HTTP handler and the engine loop.
// The loop appends tokens under mu and pokes notify; the handler drains.
type call struct {
	req  engine.Request
	loop *loop // the rank's loop serving it

	mu       sync.Mutex
	tokens   []uint32
	cached   int
	finished engine.FinishReason
	err      error
	notify   chan struct{} // capacity 1: "something changed"
	// stream callers want every token; others only the end.
	stream bool
	// held are the blocks the finished request holds for a remote decode.
	held []int32
	// received, for a remote prefill, is closed by the loop at its first
	// token, its KV in; nil otherwise.
	received chan struct{}
	// remote is where its KV came from, to notify; notified once done
	// (both the handler's).
	remote   *remoteKV
	notified bool

	arrival time.Duration // simulated clock when the loop took it
}

func newCall(req engine.Request) *call {
	return &call{req: req, notify: make(chan struct{}, 1)}
}

func (c *call) poke() {
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

// take appends the tokens produced since the last take to dst and reports
// whether the call is over.
func (c *call) take(dst []uint32, from int) (toks []uint32, cached int, done bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append(dst, c.tokens[from:]...), c.cached, c.finished != engine.NotFinished || c.err != nil, c.err
}

// heldBlocks are the blocks the finished call holds for a remote decode.
func (c *call) heldBlocks() []int32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.held
}

// loop owns the engine: one goroutine steps it and sleeps each step's
// simulated duration times the time scale, so the engine itself never sees
// a clock. Handlers talk to it only through channels.
type loop struct {
	eng   *engine.Engine
	rank  int // data_parallel_rank of every batch published
	scale float64
	sink  engine.EventSink
	onErr func(error)

	submit  chan *call
	abort   chan uint64
	control chan func()

	calls map[uint64]*call

	// holdFor bounds how long a prefill's blocks stay held (simulated);
	// held are those blocks and their deadlines by request, heldOrder the
	// requests by deadline (the order they were held in, the bound being
	// one and the clock monotonic).
	holdFor   time.Duration
	held      map[uint64]heldKV
	heldOrder []uint64

	// Simulated clock, and the real instant it was last anchored to.
	sim        time.Duration
	anchorReal time.Time
	anchorSim  time.Duration

	metrics *metrics
}

func newLoop(eng *engine.Engine, rank int, scale float64, sink engine.EventSink, m *metrics, onErr func(error)) *loop {
	return &loop{
		eng: eng, rank: rank, scale: scale, sink: sink, onErr: onErr, metrics: m,
		submit:  make(chan *call, 4096),
		abort:   make(chan uint64, 4096),
		control: make(chan func(), 16),
		calls:   make(map[uint64]*call),
		held:    make(map[uint64]heldKV),
	}
}

// heldKV is a finished prefill's blocks kept for a remote decode.
type heldKV struct {
	blocks   []int32
	deadline time.Duration // simulated
}

// expireHeld frees the held blocks whose bound has passed, as vLLM's
// prefill side releases expired blocks no decode engine read
// (NixlConnectorWorker.get_finished), and returns the next deadline, if
// any.
func (l *loop) expireHeld() (next time.Duration, ok bool) {
	for len(l.heldOrder) > 0 {
		id := l.heldOrder[0]
		if h, held := l.held[id]; held {
			if h.deadline > l.sim {
				return h.deadline, true
			}
			delete(l.held, id)
			l.eng.Release(id)
		}
		l.heldOrder[0] = 0
		l.heldOrder = l.heldOrder[1:]
	}
	return 0, false
}

// holds reports whether request id still holds exactly blocks, and with
// free frees them, for a decode engine done with them.
func (l *loop) holds(id uint64, blocks []int32, free bool) bool {
	l.expireHeld()
	h, ok := l.held[id]
	if !ok || !slices.Equal(h.blocks, blocks) {
		return false
	}
	if !free {
		return true
	}
	delete(l.held, id)
	l.eng.Release(id)
	l.publishStats()
	return true
}

func (l *loop) run(ctx context.Context) {
	defer l.failAll()
	for {
		if !l.eng.HasWork() && !l.wait(ctx, false) {
			return
		}
		if ctx.Err() != nil {
			return
		}
		l.drain()
		l.expireHeld()
		if !l.eng.HasWork() {
			continue
		}
		res := l.eng.Step(0)
		l.sim += res.Duration
		l.sleep()
		// Events and gauges first, tokens last: whoever sees a token can
		// count on the step's events having been published and /metrics
		// reflecting it.
		if res.Events != nil {
			l.publish(res.Events)
		}
		l.publishStats()
		l.deliver(res.Outputs)
		// A step that scheduled nothing and waited for nothing: the
		// blocks prefills hold for remote decodes leave no room, and
		// only their expiry or a new call can change that.
		if res.Scheduled == 0 && res.Duration == 0 && !l.wait(ctx, true) {
			return
		}
	}
}

// wait blocks until a submission, abort or control call arrives or the
// first held blocks expire, moving the simulated clock over the time
// waited, and reports false once ctx ends. At time scale 0 idle time does
// not pass, so held blocks expire at the next activity past their
// deadline; but a stalled engine (no room but what held blocks take)
// would wait forever, and its clock jumps to the first expiry instead.
func (l *loop) wait(ctx context.Context, stalled bool) bool {
	l.publishStats()
	next, held := l.expireHeld()
	if stalled && held && l.scale <= 0 {
		l.sim = max(l.sim, next)
		l.expireHeld()
		return true
	}
	idleSince := time.Now()
	var expiry <-chan time.Time
	if held && l.scale > 0 {
		timer := time.NewTimer(time.Duration(float64(next-l.sim) * l.scale))
		defer timer.Stop()
		expiry = timer.C
	}
	select {
	case <-expiry:
		l.advanceIdle(idleSince)
	case c := <-l.submit:
		l.advanceIdle(idleSince)
		l.add(c)
	case id := <-l.abort:
		l.eng.Abort(id)
		delete(l.calls, id)
	case f := <-l.control:
		l.advanceIdle(idleSince)
		f()
	case <-ctx.Done():
		return false
	}
	l.anchorReal, l.anchorSim = time.Now(), l.sim
	return true
}

// advanceIdle moves the simulated clock over an idle spell, so simulated
// latencies of later requests do not start in the past.
func (l *loop) advanceIdle(since time.Time) {
	if l.scale > 0 {
		l.sim += time.Duration(float64(time.Since(since)) / l.scale)
	}
}

// sleep waits until the real time the simulated clock stands for. Sleeping
// to an absolute target keeps timer overshoot from accumulating.
func (l *loop) sleep() {
	if l.scale <= 0 {
		return
	}
	target := l.anchorReal.Add(time.Duration(float64(l.sim-l.anchorSim) * l.scale))
	if d := time.Until(target); d > 0 {
		time.Sleep(d)
	}
}

// drain takes every pending submission, abort and control call without
// blocking, so arrivals during a step join the next one.
func (l *loop) drain() {
	for {
		select {
		case c := <-l.submit:
			l.add(c)
		case id := <-l.abort:
			l.eng.Abort(id)
			delete(l.calls, id)
		case f := <-l.control:
			f()
		default:
			return
		}
	}
}

func (l *loop) add(c *call) {
	if err := l.eng.Add(c.req); err != nil {
		c.mu.Lock()
		c.err = err
		c.mu.Unlock()
		c.poke()
		return
	}
	c.arrival = l.sim
	l.calls[c.req.ID] = c
}

func (l *loop) deliver(outs []engine.Output) {
	for _, o := range outs {
		if o.HeldBlocks != nil {
			l.held[o.ID] = heldKV{blocks: o.HeldBlocks, deadline: l.sim + l.holdFor}
			l.heldOrder = append(l.heldOrder, o.ID)
		}
		c := l.calls[o.ID]
		if c == nil {
			continue
		}
		if o.First {
			l.metrics.observeTTFT((l.sim - c.arrival).Seconds())
			if c.received != nil {
				close(c.received)
			}
		}
		c.mu.Lock()
		if o.HasToken {
			c.tokens = append(c.tokens, o.Token)
		}
		c.cached = o.CachedTokens
		c.finished = o.Finished
		c.held = o.HeldBlocks
		c.mu.Unlock()
		if c.stream || o.Finished != engine.NotFinished {
			c.poke()
		}
		if o.Finished != engine.NotFinished {
			l.metrics.observeE2E((l.sim - c.arrival).Seconds())
			delete(l.calls, o.ID)
		}
	}
}

func (l *loop) publish(b *kvevents.Batch) {
	if l.sink == nil {
		return
	}
	// vLLM stamps batches with time.time() when it publishes them, and
	// each rank's publisher with its data_parallel_rank.
	b.TS = float64(time.Now().UnixNano()) / 1e9
	b.DPRank = l.rank
	if err := l.sink.Publish(b); err != nil && l.onErr != nil {
		l.onErr(err)
	}
}

func (l *loop) publishStats() { l.metrics.setEngine(l.eng.Stats()) }

func (l *loop) failAll() {
	for id, c := range l.calls {
		c.mu.Lock()
		c.err = errShutdown
		c.mu.Unlock()
		c.poke()
		delete(l.calls, id)
	}
	// Requests submitted after the loop stopped fail too.
	for {
		select {
		case c := <-l.submit:
			c.mu.Lock()
			c.err = errShutdown
			c.mu.Unlock()
			c.poke()
		default:
			return
		}
	}
}
