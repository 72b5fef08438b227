package gateway

import (
	"errors"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/storedchain"
	"github.com/kvmesh/kvmesh/tenant"
)

// ledger is one request's account from its decision to its End, reused
// through a pool: the plan, the in-flight entries its targets count
// against, and what it learns as the proxy's observer (the only one). It
// keeps the in-flight accounting (this router's, which ReportInflight
// tells the cluster), teaches the policy (Recorder, Learner), counts the
// request's metrics and writes its debug line; End, called once, closes
// the open attempt and releases it.
type ledger struct {
	g     *Gateway
	s     *Settings
	model string
	path  string

	plan plan.Plan
	// loads are the in-flight entries of the snapshot's replicas (loadsOf);
	// planLoads their figures as the planner reads them.
	loads     []*replicaLoad
	planLoads []plan.Load
	targets   []*proxy.Upstream // parallel to plan.Targets
	// prefills are the upstreams of a split plan's prefill targets
	// (parallel to plan.Prefill); prefilled is the one whose transfer
	// parameters the decode got (-1: none), prefillCached the prompt
	// tokens its engine found cached.
	prefills      []*proxy.Upstream
	prefilled     int
	prefillCached int
	// decideTime is only logged (debug): clock reads cost on every request
	// otherwise.
	decideTime time.Duration

	// measuresTTFT is set for a streamed chat or completion: its first
	// byte is its first token, what the policy may learn from.
	measuresTTFT bool
	attempts     int
	// open is the attempt begun and not yet ended (-1: none).
	open      int
	firstByte bool
	ttft      time.Duration
	hdrBuf    [20]byte // formats header numbers
	requestID []byte   // X-Request-Id, the client's or the router's
	// abort ends the request when its client leaves (watched by g.watch
	// until End); nil for short non-streamed answers.
	abort *proxy.Abort

	// Flow control: the request's tenant and priority, its parsed body
	// (planned again when a held request is let go), how long it was held,
	// whether its first target's in-flight entry counts it already (the
	// dispatcher reserved it), and the tokens its quota was charged.
	tenant   *tenant.Tenant
	priority flowcontrol.Priority
	req      *request.Request
	queued   time.Duration
	reserved bool
	// charged is what admission charged the tenant's quota (quotaHeld).
	charged   int64
	quotaHeld bool
	// pin, when set, is the only replica that can serve the request (it
	// stores the response the request continues, named by pinWhat).
	pin, pinWhat string
	// session is the session the client named ("" for none).
	session string
	// continued is the prompt of a follow-up as the router rebuilt it
	// (nil when it could not); chain is the state its answer's ids carry
	// (storedchain.State), nil for none; previous and previousClient name
	// the response it continues, as the engine and as the client know it.
	continued                *storedchain.Continued
	chain                    []byte
	previous, previousClient string
}

// newLedger opens a ledger for a request decided under s.
func (g *Gateway) newLedger(s *Settings) *ledger {
	l := g.ledgers.Get().(*ledger)
	l.g, l.s = g, s
	l.attempts, l.open, l.firstByte, l.ttft, l.measuresTTFT, l.decideTime = 0, -1, false, 0, false, 0
	l.targets = l.targets[:0]
	l.prefills, l.prefilled, l.prefillCached = l.prefills[:0], -1, -1
	l.pin, l.pinWhat, l.session = "", "", ""
	l.continued, l.chain, l.previous, l.previousClient = nil, nil, "", ""
	l.tenant, l.priority, l.req, l.queued, l.reserved, l.charged, l.quotaHeld = s.Tenants.Default(), flowcontrol.Standard, nil, 0, false, 0, false
	return l
}

// release returns l to the pool; nothing may hold it after.
func (g *Gateway) release(l *ledger) {
	if l.abort != nil {
		g.watch.remove(l.abort)
		l.abort = nil
	}
	l.unreserve()
	l.s, l.loads, l.req, l.tenant = nil, nil, nil, nil
	l.plan.Release()
	clear(l.targets[:cap(l.targets)])
	clear(l.prefills[:cap(l.prefills)])
	g.ledgers.Put(l)
}

// Attempt implements proxy.Observer: the request is dispatched to target i.
func (l *ledger) Attempt(i int) {
	l.attempts++
	l.open = i
	l.firstByte = false
	if i > 0 {
		l.g.metrics.retries.Inc()
	}
	l.record(i)
	if rl := l.load(i); rl != nil {
		if i == 0 && l.reserved {
			l.reserved = false // the dispatcher counted it
			return
		}
		rl.requests.Add(1)
		rl.prefill.Add(int64(l.plan.Targets[i].Uncached))
	}
}

// unreserve returns a reservation no attempt took over.
func (l *ledger) unreserve() {
	if !l.reserved {
		return
	}
	l.reserved = false
	if rl := l.load(0); rl != nil {
		rl.requests.Add(-1)
		rl.prefill.Add(-int64(l.plan.Targets[0].Uncached))
	}
}

// record tells a policy that remembers where prompts went
// (routing.Recorder) that this one is sent to target i now. Requests routed
// in least-load mode are not recorded: prefixes did not steer them.
func (l *ledger) record(i int) {
	if t := &l.plan.Targets[i]; t.PrefixAware && !l.plan.Decision.Degraded {
		if rec, ok := l.s.Policy.(routing.Recorder); ok {
			rec.Record(&l.plan.Request, t.Name, t.FilterMatched, l.g.now())
		}
	}
}

// load is the in-flight entry target i counts against (nil: a fallback).
func (l *ledger) load(i int) *replicaLoad {
	if r := l.plan.Targets[i].Replica; r >= 0 {
		return l.loads[r]
	}
	return nil
}

// FirstByte implements proxy.Observer: target i has started answering, so
// its prefill is done.
func (l *ledger) FirstByte(i int, ttft time.Duration) {
	l.firstByte, l.ttft = true, ttft
	t, rl := &l.plan.Targets[i], l.load(i)
	if rl != nil {
		rl.prefill.Add(-int64(t.Uncached))
		rl.eject.reached()
		if l.s.Flow.Enabled {
			l.g.flow.freed() // its prefill is done: room for the next
		}
	}
	l.g.metrics.ttftOf(rl, t.Name).Observe(ttft.Seconds())
}

// Header implements proxy.Observer: the X-Kvmesh-* headers of the answer.
func (l *ledger) Header(i int, h *fasthttp.ResponseHeader) {
	t := &l.plan.Targets[i]
	// The names are canonical already: SetCanonical skips normalizing them.
	h.SetCanonical(hdrReplica, []byte(t.Name))
	h.SetCanonical(hdrMode, []byte(t.Mode))
	h.SetCanonical(hdrPromptTokens, strconv.AppendInt(l.hdrBuf[:0], int64(l.plan.Prompt.Tokens), 10))
	h.SetCanonical(hdrCachedTokens, strconv.AppendInt(l.hdrBuf[:0], int64(t.PredictedCached), 10))
	h.SetCanonical(hdrOffloadedTokens, strconv.AppendInt(l.hdrBuf[:0], int64(t.PredictedOffloaded), 10))
	if t.Picked && l.plan.Decision.PredictedTTFT > 0 {
		h.SetCanonical(hdrPredictedTTFT, strconv.AppendInt(l.hdrBuf[:0], l.plan.Decision.PredictedTTFT.Milliseconds(), 10))
	}
	if t.Split && l.prefilled >= 0 {
		h.SetCanonical(hdrPrefillReplica, []byte(l.plan.Prefill[l.prefilled].Name))
		h.SetCanonical(hdrPrefillCached, strconv.AppendInt(l.hdrBuf[:0], int64(l.prefillCached), 10))
	}
	if l.s.Flow.Enabled {
		h.SetCanonical(hdrQueueMs, strconv.AppendInt(l.hdrBuf[:0], l.queued.Milliseconds(), 10))
	}
	// X-Request-Id is already there: serveCompletion set it for every answer.
}

var (
	hdrReplica      = []byte("X-Kvmesh-Replica")
	hdrMode         = []byte("X-Kvmesh-Mode")
	hdrPromptTokens = []byte("X-Kvmesh-Prompt-Tokens")
	hdrCachedTokens = []byte("X-Kvmesh-Cached-Tokens")
	// hdrOffloadedTokens is the part of the predicted cached tokens held
	// only on an offload tier (loaded back, not found on the GPU).
	hdrOffloadedTokens = []byte("X-Kvmesh-Offloaded-Tokens")
	// hdrPrefillReplica names a split request's prefill replica, and
	// hdrPrefillCached the prompt tokens its engine found cached (the
	// decode's usage counts the transferred prompt as cached).
	hdrPrefillReplica = []byte("X-Kvmesh-Prefill-Replica")
	hdrPrefillCached  = []byte("X-Kvmesh-Prefill-Cached-Tokens")
)

// Retry implements proxy.Observer: attempt i failed, and a later target
// takes the request over.
func (l *ledger) Retry(i int, r proxy.Result) {
	l.finish(i, r)
}

// End implements proxy.Observer: the request is over, and r is how its open
// attempt ended. It teaches the policy, counts the request as served, logs
// its debug line and releases l.
func (l *ledger) End(r proxy.Result) {
	i := l.open
	if l.s.Flow.Enabled {
		// After release and finish below have returned this request's
		// in-flight work: the dispatcher must see the room it leaves.
		defer l.g.flow.freed()
	}
	if i < 0 { // no target was tried
		l.g.release(l)
		return
	}
	l.finish(i, r)
	g, t, m := l.g, &l.plan.Targets[i], l.g.metrics
	tokens := int64(l.plan.Prompt.Tokens)
	if r.PromptTokens >= 0 {
		tokens = int64(r.PromptTokens)
	}
	// What the engine generated, or, when it did not say (an error, a
	// dialect without output counts), what the request could have.
	if r.CompletionTokens > 0 {
		tokens += int64(r.CompletionTokens)
	} else {
		tokens += int64(l.req.MaxTokensAsked())
	}
	g.flow.correctQuota(l, tokens)
	l.learn(t, r)
	served := r.Err == nil && r.Status > 0 && r.Status < 500 && r.Status != 429 || r.ClientGone
	if served {
		m.tenantTokens.WithLabelValues(l.tenant.Name).Add(float64(tokens))
		m.routed(t.Mode).Inc()
		if l.req != nil && int(l.req.Kind) < len(m.byEndpoint) {
			m.byEndpoint[l.req.Kind].Inc()
		}
		if t.PredictedCached > 0 {
			m.prefixHits.Inc()
		}
		m.prompt.Add(float64(l.plan.Prompt.Tokens))
		m.predicted.Add(float64(t.PredictedCached))
		m.predictedOffloaded.Add(float64(t.PredictedOffloaded))
		actual := r.CachedTokens
		if t.Split {
			actual = l.prefillCached
		}
		if actual > 0 {
			m.actual.Add(float64(actual))
		}
		if l.session != "" {
			placement := "elsewhere"
			if t.Picked && l.plan.Decision.SessionHome {
				placement = "home"
			}
			m.sessions.WithLabelValues(placement).Inc()
		}
	}
	if g.log.GetLevel() <= zerolog.DebugLevel {
		l.logDecision(t, r)
	}
	g.release(l)
}

// finish closes attempt i: its in-flight work returns, a replica that did
// not answer is ejected, and the attempt's latency and error are counted.
func (l *ledger) finish(i int, r proxy.Result) {
	l.open = -1
	g, t, tl := l.g, &l.plan.Targets[i], l.load(i)
	if tl != nil {
		if !l.firstByte {
			tl.prefill.Add(-int64(t.Uncached))
		}
		tl.requests.Add(-1)
		if unreachable(r) {
			if d := tl.eject.failed(g.now()); d > 0 {
				g.metrics.ejections.WithLabelValues(t.Name).Inc()
				g.log.Warn().Bytes("request_id", l.requestID).Str("replica", t.Name).AnErr("error", r.Err).
					Dur("for", d).Msg("replica unreachable: out of routing")
			}
		}
	}
	m := g.metrics
	m.latency(tl, t.Name).Observe(r.Elapsed.Seconds())
	switch {
	case r.Internal: // counted as a panic where it was recovered
	case r.ClientGone:
		m.errors.WithLabelValues("client_gone").Inc()
	case r.Resumed:
		m.errors.WithLabelValues("stream_resumed").Inc()
	case r.Overran:
		m.errors.WithLabelValues("upstream_overran").Inc()
	case r.Err != nil && r.Retried:
		m.errors.WithLabelValues("upstream_retried").Inc()
	case r.Err != nil && r.Status == 0:
		m.errors.WithLabelValues("upstream").Inc()
	case r.Err != nil:
		m.errors.WithLabelValues("stream").Inc()
	case r.Status >= 500 || r.Status == 429:
		m.errors.WithLabelValues("upstream_status").Inc()
	case (r.Status == 401 || r.Status == 403) && tl != nil && (l.s.EngineAPIKey != "" || l.s.Tenants.RequiresKey()):
		// The router, not the client, authenticates to replicas here, so a
		// refusal is a configuration fault: say which flag to look at, once
		// in a while. (Without either setting the client's own
		// Authorization reached the engine: its 401 is the client's.)
		m.errors.WithLabelValues("upstream_unauthorized").Inc()
		g.authLog.Warn().Str("replica", t.Name).Int("status", r.Status).Bool("engine_api_key_set", l.s.EngineAPIKey != "").
			Msg("replica refused the request: engines started with --api-key need the router's --engine-api-key (KVMESH_ENGINE_API_KEY)")
	}
}

// logDecision writes the request's debug line: how it was decided, where
// it went and how that went.
func (l *ledger) logDecision(t *plan.Target, r proxy.Result) {
	g := l.g
	ev := g.log.Debug().Bytes("request_id", l.requestID).
		Str("policy", l.s.Policy.Name()).Str("model", l.model).Str("path", l.path).
		Str("replica", t.Name).Str("mode", string(t.Mode)).
		Int("prompt_tokens", l.plan.Prompt.Tokens).Int("predicted_cached", t.PredictedCached).
		Int("actual_cached", r.CachedTokens).Int("attempts", l.attempts).Int("status", r.Status).
		Dur("decide", l.decideTime).Dur("ttft", l.ttft).Dur("elapsed", r.Elapsed).
		Bool("degraded", l.plan.Decision.Degraded).Str("reason", l.plan.Decision.Reason)
	if t.Picked {
		// kvaware's estimates are for its pick: beside the TTFT
		// measured there, not at a replica a retry moved to.
		ev = ev.Dur("predicted_ttft", l.plan.Decision.PredictedTTFT).Dur("predicted_queue", l.plan.Decision.Queue)
	}
	if t.Split && l.prefilled >= 0 {
		ev = ev.Str("prefill_replica", l.plan.Prefill[l.prefilled].Name).Int("prefill_cached", l.prefillCached)
	}
	if l.plan.Prompt.Err != nil {
		ev = ev.Str("tokenize_error", l.plan.Prompt.Err.Error())
	}
	if l.plan.Prompt.MediaPrefix {
		ev = ev.Bool("media_text_prefix", true)
	}
	if r.Err != nil {
		ev = ev.AnErr("upstream_error", r.Err)
	}
	ev.Msg("request")
}

// learn tells a policy that calibrates its cost model (routing.Learner) the
// time to first token measured at t, when that is what the decision
// predicted (plan.Target.Teaches) and the answer measured one: a stream's
// first event, on the first try. The cached tokens are the engine's count
// when it gave one.
func (l *ledger) learn(t *plan.Target, r proxy.Result) {
	// r.Events: a 200 to a stream that is not SSE (an engine ignoring
	// "stream") came whole, so its first byte is its last.
	measured := l.measuresTTFT && l.firstByte && l.attempts == 1 && r.Status == 200 && r.Events > 0
	if !t.Teaches || !measured {
		return
	}
	learner, ok := l.s.Policy.(routing.Learner)
	if !ok {
		return
	}
	cached := t.PredictedCached
	if r.CachedTokens >= 0 {
		cached = r.CachedTokens
	}
	learner.Learn(&l.plan.Request, l.plan.PickCandidate(), cached, l.ttft)
}

// unreachable reports whether an attempt failed for want of a replica that
// answers: no response at all, not because the client left or the router
// had no free connection to it.
func unreachable(r proxy.Result) bool {
	return r.Err != nil && r.Status == 0 && !r.ClientGone && !r.Internal && !r.Overran && !errors.Is(r.Err, fasthttp.ErrNoFreeConns) &&
		!outOfDescriptors(r.Err)
}

// outOfDescriptors reports a dial that failed for want of a file descriptor
// here: at the open-file limit every replica would be ejected by a router
// that cannot open a socket, and stay out after descriptors are free again.
func outOfDescriptors(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

var _ proxy.Observer = (*ledger)(nil)

// replicaLoad is this router's in-flight work at one replica: requests
// dispatched and not finished, and their uncached prompt tokens until the
// first byte comes back (the prefill the engine still has to do).
type replicaLoad struct {
	requests  atomic.Int64
	prefill   atomic.Int64
	observers [2]atomic.Value // prometheus.Observer: upstream latency, ttft (see metrics.latency)
	eject     ejection        // out of routing after failing to answer
}

// clusterView adds this router's exact counts to the other routers'
// in-flight work the replica's sidecar last gossiped, as the planner does.
func (l *replicaLoad) clusterView(gossiped fleet.Load) (requests, prefillTokens int) {
	return gossiped.OthersInflightRequests + int(l.requests.Load()), gossiped.OthersInflightPrefillTokens + int(l.prefill.Load())
}

type inflightTable struct {
	mu sync.RWMutex
	m  map[string]*replicaLoad
}

func (t *inflightTable) init() { t.m = map[string]*replicaLoad{} }

func (t *inflightTable) get(name string) *replicaLoad {
	t.mu.RLock()
	l := t.m[name]
	t.mu.RUnlock()
	if l != nil {
		return l
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if l = t.m[name]; l == nil {
		l = &replicaLoad{}
		t.m[name] = l
	}
	return l
}

func (t *inflightTable) remove(name string) {
	t.mu.Lock()
	delete(t.m, name)
	t.mu.Unlock()
}

// loadIndex holds the in-flight entries of one snapshot's replicas, in the
// snapshot's order, so a decision reads each candidate's entry by index
// instead of looking fifty names up under a lock.
type loadIndex struct {
	snap  *fleet.Snapshot
	loads []*replicaLoad
	// unusable[i]: replica i's URL cannot be dialled (proxy.CheckURL).
	unusable []bool
}

// loadsOf returns the in-flight entries of snap's replicas (index i is
// snap.Replicas[i]). Snapshots are immutable, so the index is built once per
// snapshot; entries are removed only for replicas no snapshot has held for
// minutes (ForgetDeparted), so it stays valid.
func (g *Gateway) loadsOf(snap *fleet.Snapshot) *loadIndex {
	if li := g.loadIdx.Load(); li != nil && li.snap == snap {
		return li
	}
	li := &loadIndex{snap: snap, loads: make([]*replicaLoad, len(snap.Replicas)), unusable: make([]bool, len(snap.Replicas))}
	for i := range snap.Replicas {
		li.loads[i] = g.inflight.get(snap.Replicas[i].Name)
		li.unusable[i] = proxy.CheckURL(snap.Replicas[i].URL) != nil
	}
	g.loadIdx.Store(li)
	return li
}

// figures returns in dst (reused) what the planner reads of each replica at
// now (unix nanoseconds).
func (li *loadIndex) figures(dst []plan.Load, now int64) []plan.Load {
	dst = dst[:0]
	for i, l := range li.loads {
		dst = append(dst, plan.Load{
			Requests: int(l.requests.Load()), PrefillTokens: int(l.prefill.Load()),
			Ejected: l.eject.out(now), Unusable: li.unusable[i],
		})
	}
	return dst
}

// each calls f for every replica in name order.
func (t *inflightTable) each(f func(name string, l *replicaLoad)) {
	t.mu.RLock()
	names := make([]string, 0, len(t.m))
	for n := range t.m {
		names = append(names, n)
	}
	t.mu.RUnlock()
	sort.Strings(names)
	for _, n := range names {
		f(n, t.get(n))
	}
}

// ReportInflight tells the cluster this router's in-flight work every
// interval until stop closes. Without a cluster it returns at once.
func (g *Gateway) ReportInflight(every time.Duration, stop <-chan struct{}) {
	if g.cluster == nil {
		return
	}
	repeat(every, stop, func() {
		// The cluster node decides what goes on the wire (nothing for
		// a replica where this router has had no work for a while).
		g.inflight.each(func(name string, l *replicaLoad) {
			g.cluster.ReportInflight(name, int(l.requests.Load()), int(l.prefill.Load()))
		})
	})
}

// Inflight returns this router's in-flight requests summed over replicas.
func (g *Gateway) Inflight() int {
	n := 0
	g.inflight.each(func(_ string, l *replicaLoad) { n += int(l.requests.Load()) })
	return n
}
