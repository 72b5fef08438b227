package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/hangup"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/quota"
	"github.com/kvmesh/kvmesh/tenant"
)

// Flow control holds requests in the router while their model's fleet is
// saturated, instead of adding them to an engine's queue where every tenant
// and priority waits alike. A held request is bound to a replica only when
// one has room, and then by the same prefix-aware plan as any request, made
// afresh. The order in which held requests leave is package flowcontrol's
// (strict priority bands, fair share by tokens between tenants, first come
// first served within one); this file is the shell around it: when a
// request must wait, parking its handler, the dispatcher that wakes it, and
// the answers of those turned away.
//
// Saturation is read from the plan, so every router sees the same: the
// cost model's predicted wait behind the work already at the best replica
// (its engine's queue and running batch, gossiped, plus every router's
// in-flight prefills) over MaxEngineQueue (scaled by priority: bandBound),
// or every candidate at MaxInflightPerReplica.

// FlowControl configures the router-held queues (Settings.Flow).
type FlowControl struct {
	// Enabled holds requests while their model's fleet is saturated.
	Enabled bool
	// MaxEngineQueue: a fleet is saturated for a request when the best
	// replica's predicted wait behind work queued there is over it
	// (kvaware's estimate; other policies predict none). 0 is
	// DefaultMaxEngineQueue.
	MaxEngineQueue time.Duration
	// MaxInflightPerReplica: saturated also when every candidate holds at
	// least this many requests (running, waiting or in flight from any
	// router); 0 sets no such limit.
	MaxInflightPerReplica int
	// Bands bound each priority's queue, indexed by flowcontrol.Priority;
	// zero fields take DefaultBands'.
	Bands [3]flowcontrol.Limits
}

// DefaultMaxEngineQueue keeps about one scheduler step of prefill queued at
// an engine beyond the one it runs (vLLM's default max_num_batched_tokens,
// 8,192 tokens, at the cost model's default 30 µs a token): enough that it
// never idles, little enough that a critical request dispatched next waits
// behind no more.
const DefaultMaxEngineQueue = 8192 * 30 * time.Microsecond

// DefaultBands are the queue bounds of each priority: sheddable work waits
// least, and is what a full queue evicts first.
var DefaultBands = [3]flowcontrol.Limits{
	flowcontrol.Critical:  {MaxQueued: 1024, MaxWait: 30 * time.Second},
	flowcontrol.Standard:  {MaxQueued: 1024, MaxWait: 15 * time.Second},
	flowcontrol.Sheddable: {MaxQueued: 1024, MaxWait: 5 * time.Second},
}

func (f FlowControl) withDefaults() FlowControl {
	if f.MaxEngineQueue <= 0 {
		f.MaxEngineQueue = DefaultMaxEngineQueue
	}
	for i := range f.Bands {
		b, d := &f.Bands[i], DefaultBands[i]
		if b.MaxQueued <= 0 {
			b.MaxQueued = d.MaxQueued
		}
		if b.MaxWait <= 0 {
			b.MaxWait = d.MaxWait
		}
	}
	return f
}

// dispatchEvery is how often the dispatcher looks for room while requests
// are held, besides when a request ends: load records arrive ten times a
// second, so room can appear without any request of this router ending.
const dispatchEvery = 5 * time.Millisecond

// clientPollEvery is how often a held request checks its client is there:
// one that left frees its place within it.
const clientPollEvery = 100 * time.Millisecond

// Headers of flow control's answers.
var (
	hdrQueueMs       = []byte("X-Kvmesh-Queue-Ms")
	hdrPredictedTTFT = []byte("X-Kvmesh-Predicted-TTFT-Ms")
	hdrRejectReason  = "X-Kvmesh-Reject-Reason"
	hdrPriority      = []byte("X-Kvmesh-Priority")
	hdrTTFTSLO       = []byte("X-Kvmesh-TTFT-SLO-Ms")
)

// rejection is a request turned away for overload: 429 when its tenant is
// at fault (over its share or quota), 503 when the fleet is.
type rejection struct {
	status     int
	reason     string // X-Kvmesh-Reject-Reason and rejected_total{reason}
	message    string
	retryAfter time.Duration
}

func (r *rejection) Error() string { return r.message }

func overShare(reason, msg string, retry time.Duration) *rejection {
	return &rejection{status: 429, reason: reason, message: msg, retryAfter: retry}
}

func saturated(reason, msg string, retry time.Duration) *rejection {
	return &rejection{status: 503, reason: reason, message: msg, retryAfter: retry}
}

// errClientLeft: a held request's client hung up; nothing is answered.
var errClientLeft = errors.New("client left while queued")

// flowGate is the router's held requests, one queue per model, and the
// dispatcher that lets them go.
type flowGate struct {
	g *Gateway

	mu    sync.Mutex
	pools map[string]*flowcontrol.Queue[*waiter]
	cfg   flowcontrol.Config
	// running: the dispatcher runs, which it does exactly while requests
	// are held. Written under mu; read without it by mustWait, so a request
	// on a fleet with nothing held takes no lock.
	running atomic.Bool
	kick    chan struct{}
	// pushed: a request was held since the last dispatch; lastSnap is the
	// table it looked at.
	pushed   bool
	lastSnap *fleet.Snapshot
	expired  []*flowcontrol.Ticket[*waiter]

	quotaMu sync.Mutex
	quota   *quota.Ledger
}

// waiter is one held request: its ledger (whose plan the dispatcher makes
// afresh when it lets it go) and the channel its handler waits on.
type waiter struct {
	l      *ledger
	ticket flowcontrol.Ticket[*waiter]
	done   chan struct{}
	// err is a decision that failed when the dispatcher let it go (the
	// model gone meanwhile): the handler answers it.
	err error
}

func (w *waiter) wake() {
	select {
	case w.done <- struct{}{}:
	default:
	}
}

// UsageReportEvery is how often a router tells the others its per-tenant
// usage; quota's bounds follow from it: a report arrives within
// usageMaxLag on a LAN, and a router silent for three intervals and that
// lag no longer shares the limits.
const (
	UsageReportEvery = 500 * time.Millisecond
	usageMaxLag      = 500 * time.Millisecond
)

func newFlowGate(g *Gateway) *flowGate {
	return &flowGate{g: g, pools: map[string]*flowcontrol.Queue[*waiter]{}, kick: make(chan struct{}, 1),
		quota: quota.New(quota.Config{PeerTTL: 3*UsageReportEvery + usageMaxLag, MaxLag: usageMaxLag})}
}

// ReportTenantUsage tells the cluster this router's per-tenant usage every
// interval until stop closes (an empty report too: it counts this router
// among those sharing the limits). Without a cluster it returns at once.
func (g *Gateway) ReportTenantUsage(every time.Duration, stop <-chan struct{}) {
	if g.cluster == nil {
		return
	}
	var buf []quota.TenantUsage
	var out []filterstream.TenantUsage
	repeat(every, stop, func() {
		f := g.flow
		f.quotaMu.Lock()
		buf = f.quota.Report(g.now(), buf[:0])
		f.quotaMu.Unlock()
		out = out[:0]
		for _, u := range buf {
			out = append(out, filterstream.TenantUsage{Tenant: u.Tenant, Requests: u.Used.Requests, Tokens: u.Used.Tokens,
				ReservedRequests: u.Reserved.Requests, ReservedTokens: u.Reserved.Tokens})
		}
		g.cluster.ShareTenantUsage(out)
	})
}

// MergeTenantUsage takes another router's per-tenant report.
func (g *Gateway) MergeTenantUsage(from string, usage []filterstream.TenantUsage) {
	in := make([]quota.TenantUsage, len(usage))
	for i, u := range usage {
		in[i] = quota.TenantUsage{Tenant: u.Tenant, Used: quota.Usage{Requests: u.Requests, Tokens: u.Tokens},
			Reserved: quota.Usage{Requests: u.ReservedRequests, Tokens: u.ReservedTokens}}
	}
	f := g.flow
	f.quotaMu.Lock()
	f.quota.Merge(from, g.now(), in)
	f.quotaMu.Unlock()
}

// configure installs s's bounds and tenant weights; held requests keep
// their places.
func (f *flowGate) configure(s *Settings) {
	cfg := flowcontrol.Config{Weight: s.Tenants.Weight}
	for i, b := range s.Flow.Bands {
		cfg.Bands[i] = b
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cfg = cfg
	for _, q := range f.pools {
		q.Reconfigure(cfg)
	}
}

// freed tells the dispatcher a request ended or got its first token: its
// replica may have room.
func (f *flowGate) freed() {
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// mustWait reports whether l's request waits: its fleet is saturated, or
// requests of its priority or a higher one are held already (it must not
// overtake them).
func (f *flowGate) mustWait(l *ledger) bool {
	if f.saturated(l, false) {
		return true
	}
	if !f.running.Load() {
		return false // nothing held to overtake
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	q := f.pools[l.model]
	if q == nil {
		return false
	}
	for p := flowcontrol.Critical; p <= l.priority; p++ {
		if q.BandLen(p) > 0 {
			return true
		}
	}
	return false
}

// saturated reports whether l's plan finds no room: see the file's doc. A
// plan whose first target is a fallback endpoint is never held: the
// fallback exists to take what the fleet cannot. A held request of a
// tenant under its fair share (underShare) finds room at twice the bound:
// the heavy users of its band keep the engines' queues at the bound, so it
// leaves as soon as it is the next to, on any router, rather than waiting
// for a queue other routers refill before this one sees it drain.
func (f *flowGate) saturated(l *ledger, underShare bool) bool {
	pl, fc := &l.plan, &l.s.Flow
	if len(pl.Targets) == 0 || pl.Targets[0].Replica < 0 {
		return false
	}
	bound := bandBound(fc.MaxEngineQueue, l.priority)
	if underShare {
		bound *= 2
	}
	if pl.Decision.Queue > bound {
		return true
	}
	if fc.MaxInflightPerReplica <= 0 || len(pl.Candidates) == 0 {
		return false
	}
	limit := max(int(bandBound(time.Duration(fc.MaxInflightPerReplica), l.priority)), 1)
	for i := range pl.Candidates {
		c := &pl.Candidates[i]
		if max(c.InflightRequests, c.Waiting+c.Running) < limit {
			return false
		}
	}
	return true
}

// bandBound is the engine-queue (or in-flight) bound a request of priority
// p is held at: twice the configured one for critical work, half for
// sheddable. Lower
// bands stop short of filling the engines, so a critical request arriving
// at a saturated fleet finds room at once instead of waiting for a replica
// to drain; with engine priority (Model.EnginePriority) it then also
// passes the queued work there.
func bandBound(bound time.Duration, p flowcontrol.Priority) time.Duration {
	switch p {
	case flowcontrol.Critical:
		return 2 * bound
	case flowcontrol.Sheddable:
		return bound / 2
	}
	return bound
}

// hold parks the handler of l's request until the dispatcher lets it go
// (nil: l holds a fresh plan, its first target reserved), it waits past its
// bound or is evicted (a *rejection), or its client leaves (errClientLeft).
func (f *flowGate) hold(ctx *fasthttp.RequestCtx, l *ledger, cost int64) error {
	w := &waiter{l: l, done: make(chan struct{}, 1)}
	t := &w.ticket
	t.Flow, t.Priority, t.Cost, t.Value = l.tenant.Name, l.priority, cost, w
	now := f.g.now()
	f.mu.Lock()
	q := f.pools[l.model]
	if q == nil {
		q = flowcontrol.New[*waiter](f.cfg)
		f.pools[l.model] = q
	}
	evicted, err := q.Push(t, now)
	f.pushed = f.pushed || err == nil
	if err == nil && !f.running.Load() {
		f.running.Store(true)
		go f.loop()
	}
	f.mu.Unlock()
	switch {
	case errors.Is(err, flowcontrol.ErrFlowFull):
		return overShare("queue_full", fmt.Sprintf("tenant %s holds as many %s requests for %s as the router queues for one tenant; retry later", l.tenant.Name, l.priority, l.model), time.Second)
	case err != nil:
		return saturated("queue_full", fmt.Sprintf("the router's %s queue for %s is full; retry later", l.priority, l.model), time.Second)
	}
	if evicted != nil {
		evicted.Value.wake()
	}
	m := f.g.metrics
	depth := m.queueDepth.WithLabelValues(l.tenant.Name, l.priority.String())
	depth.Inc()
	defer depth.Dec()
	poll := time.NewTicker(clientPollEvery)
	defer poll.Stop()
	for {
		select {
		case <-w.done:
		case <-poll.C:
			if !hangup.Gone(ctx.Conn()) {
				continue
			}
			f.mu.Lock()
			removed := q.Remove(t)
			f.mu.Unlock()
			if !removed {
				continue // it left meanwhile: its wake is on the way
			}
			m.rejected.WithLabelValues("client_left").Inc()
			return errClientLeft
		}
		break
	}
	l.queued = f.g.now().Sub(t.Queued)
	m.queueWait.WithLabelValues(t.Priority.String()).Observe(l.queued.Seconds())
	switch t.Reason {
	case flowcontrol.Served:
		return w.err
	case flowcontrol.OverShare:
		return overShare("over_share", fmt.Sprintf("tenant %s sends more than its share of a saturated fleet: held %s, the %s bound; retry later", l.tenant.Name, l.queued.Round(time.Millisecond), l.priority), retryAfter(l.s.Flow.Bands[t.Priority].MaxWait))
	case flowcontrol.Evicted:
		return saturated("evicted", fmt.Sprintf("the fleet for %s is saturated and higher-priority requests took this one's place; retry later", l.model), time.Second)
	default:
		return saturated("saturated", fmt.Sprintf("the fleet for %s is saturated: held %s, the %s bound; retry later", l.model, l.queued.Round(time.Millisecond), l.priority), retryAfter(l.s.Flow.Bands[t.Priority].MaxWait))
	}
}

// retryAfter suggests a retry a fraction of the wait bound later: by then
// the requests ahead have left or been turned away.
func retryAfter(bound time.Duration) time.Duration { return max(bound/4, time.Second) }

// loop runs the dispatcher while any request is held.
func (f *flowGate) loop() {
	tick := time.NewTicker(dispatchEvery)
	defer tick.Stop()
	for {
		kicked := false
		select {
		case <-tick.C:
		case <-f.kick:
			kicked = true
		}
		if !f.dispatch(kicked) {
			return
		}
	}
}

// dispatch turns away what waited past its bound and lets go, pool by
// pool, every request the fleet has room for, in the queue's order. Room is
// looked for only when something that makes it may have changed: a request
// here ended or got its first token (kicked), one was held, or a new load
// record changed the table; otherwise planning the heads again would find
// what it found 5 ms ago. It reports whether any request is still held;
// when none is, the loop ends.
func (f *flowGate) dispatch(kicked bool) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.g.now()
	snap := f.g.table.Snapshot()
	look := kicked || f.pushed || snap != f.lastSnap
	f.pushed, f.lastSnap = false, snap
	held := 0
	for model, q := range f.pools {
		f.expired = q.Expire(now, f.expired[:0])
		for _, t := range f.expired {
			t.Value.wake()
		}
		clear(f.expired)
		for look {
			t := q.Peek()
			if t == nil || !f.room(q, t.Value) {
				break
			}
			q.Pop()
			t.Value.wake()
		}
		if q.Len() == 0 {
			delete(f.pools, model) // a pool per model asked for, not kept for good
		}
		held += q.Len()
	}
	if held == 0 {
		f.running.Store(false)
	}
	return held > 0
}

// room plans w's request afresh and reports whether it goes now; if so its
// first target's in-flight entry counts it at once (the reservation
// Attempt takes over), so the next one planned sees it. A plan that fails
// goes too, to be answered.
func (f *flowGate) room(q *flowcontrol.Queue[*waiter], w *waiter) bool {
	l := w.l
	l.targets = l.targets[:0]
	if err := l.decide(f.g.table.Snapshot(), l.req); err != nil {
		w.err = err
		return true
	}
	if f.saturated(l, q.UnderShare(&w.ticket)) {
		return false
	}
	if rl := l.load(0); rl != nil && len(l.targets) > 0 {
		rl.requests.Add(1)
		rl.prefill.Add(int64(l.plan.Targets[0].Uncached))
		l.reserved = true
	}
	return true
}

// admitQuota checks l's tenant's quota for a request of tokens, charging it
// when admitted.
func (f *flowGate) admitQuota(l *ledger, tokens int64) error {
	lim := l.tenant.Quota
	if lim.RequestsPerMinute <= 0 && lim.TokensPerMinute <= 0 {
		return nil
	}
	now := f.g.now()
	u := quota.Usage{Requests: 1, Tokens: tokens}
	f.quotaMu.Lock()
	v := f.quota.Admit(l.tenant.Name, lim, u, now)
	if v.OK {
		f.quota.Charge(l.tenant.Name, u, now)
	}
	f.quotaMu.Unlock()
	if v.Isolated {
		f.g.metrics.quotaIsolated.Inc()
	}
	if !v.OK {
		return overShare("quota", fmt.Sprintf("tenant %s is over its quota (%s); retry after %s", l.tenant.Name, quotaText(lim), v.RetryAfter.Round(time.Second)), v.RetryAfter)
	}
	l.charged, l.quotaHeld = tokens, true
	return nil
}

// correctQuota replaces the tokens charged at admission by the engine's
// count once the answer gave one.
func (f *flowGate) correctQuota(l *ledger, tokens int64) {
	if !l.quotaHeld || tokens == l.charged {
		return
	}
	f.quotaMu.Lock()
	f.quota.Charge(l.tenant.Name, quota.Usage{Tokens: tokens - l.charged}, f.g.now())
	f.quotaMu.Unlock()
}

// refundQuota takes back what admission charged a request that was then
// turned away.
func (f *flowGate) refundQuota(l *ledger) {
	if !l.quotaHeld {
		return
	}
	f.quotaMu.Lock()
	f.quota.Charge(l.tenant.Name, quota.Usage{Requests: -1, Tokens: -l.charged}, f.g.now())
	f.quotaMu.Unlock()
	l.charged, l.quotaHeld = 0, false
}

func quotaText(lim quota.Limits) string {
	var b []byte
	if lim.RequestsPerMinute > 0 {
		b = fmt.Appendf(b, "%d requests a minute", lim.RequestsPerMinute)
	}
	if lim.TokensPerMinute > 0 {
		if len(b) > 0 {
			b = append(b, ", "...)
		}
		b = fmt.Appendf(b, "%d tokens a minute", lim.TokensPerMinute)
	}
	return string(b)
}

// reject answers r, OpenAI-shaped, with Retry-After and the reason.
func (g *Gateway) reject(ctx *fasthttp.RequestCtx, r *rejection) {
	g.metrics.rejected.WithLabelValues(r.reason).Inc()
	ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, strconv.Itoa(int(math.Ceil(max(r.retryAfter, time.Second).Seconds()))))
	ctx.Response.Header.Set(hdrRejectReason, r.reason)
	typ := "service_unavailable"
	if r.status == 429 {
		typ = "rate_limit_exceeded"
	}
	proxy.WriteError(ctx, r.status, typ, r.message)
}

// admission reads what a request says of itself for flow control: its
// tenant (401 when keys are required and it presents none of them), the
// priority it asks for, bounded by its tenant's ceiling, and its TTFT SLO.
func (s *Settings) admission(ctx *fasthttp.RequestCtx) (*tenant.Tenant, flowcontrol.Priority, time.Duration, error) {
	h := &ctx.Request.Header
	key, _ := bytes.CutPrefix(h.Peek(fasthttp.HeaderAuthorization), []byte("Bearer "))
	var named []byte
	if name := s.Tenants.Header(); name != "" {
		named = h.Peek(name)
	}
	tn, ok := s.Tenants.Identify(key, named)
	if !ok {
		return nil, 0, 0, errUnauthorized
	}
	prio := flowcontrol.Standard
	if v := h.PeekBytes(hdrPriority); len(v) > 0 {
		p, err := flowcontrol.ParsePriority(string(v))
		if err != nil {
			return nil, 0, 0, invalidHeader("X-Kvmesh-Priority", err.Error())
		}
		prio, _ = tn.Bound(p)
	} else {
		prio, _ = tn.Bound(prio)
	}
	var slo time.Duration
	if v := h.PeekBytes(hdrTTFTSLO); len(v) > 0 {
		ms, err := strconv.ParseFloat(string(v), 64)
		if err != nil || !(ms > 0) || ms > 1e9 {
			return nil, 0, 0, invalidHeader("X-Kvmesh-TTFT-SLO-Ms", fmt.Sprintf("%q: want a positive number of milliseconds", v))
		}
		slo = time.Duration(ms * float64(time.Millisecond))
	}
	return tn, prio, slo, nil
}

// queueView is one model's held requests as /admin/queues shows them.
type queueView struct {
	Model string `json:"model"`
	Held  int    `json:"held"`
	// ByPriority and ByTenant count the held requests.
	ByPriority map[string]int `json:"by_priority"`
	ByTenant   map[string]int `json:"by_tenant"`
}

// queuesView is the body of GET /admin/queues.
type queuesView struct {
	FlowControl    bool        `json:"flow_control"`
	MaxEngineQueue string      `json:"max_engine_queue"`
	Queues         []queueView `json:"queues"`
	// QuotaIsolated: this router hears from no other router it knew and
	// enforces its own share of each quota alone.
	QuotaIsolated bool `json:"quota_isolated"`
}

func (g *Gateway) serveQueues(ctx *fasthttp.RequestCtx) {
	s := g.Settings()
	f := g.flow
	out := queuesView{FlowControl: s.Flow.Enabled, MaxEngineQueue: s.Flow.MaxEngineQueue.String(), Queues: []queueView{}}
	names := s.Tenants.Names()
	f.mu.Lock()
	for model, q := range f.pools {
		v := queueView{Model: model, Held: q.Len(), ByPriority: map[string]int{}, ByTenant: map[string]int{}}
		for p := flowcontrol.Critical; p <= flowcontrol.Sheddable; p++ {
			if n := q.BandLen(p); n > 0 {
				v.ByPriority[p.String()] = n
			}
			for _, name := range names {
				if n := q.FlowLen(p, name); n > 0 {
					v.ByTenant[name] += n
				}
			}
		}
		out.Queues = append(out.Queues, v)
	}
	f.mu.Unlock()
	slices.SortFunc(out.Queues, func(a, b queueView) int { return strings.Compare(a.Model, b.Model) })
	f.quotaMu.Lock()
	out.QuotaIsolated = f.quota.Isolated(g.now())
	f.quotaMu.Unlock()
	writeJSON(ctx, out)
}
