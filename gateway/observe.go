package gateway

import (
	"errors"
	"strconv"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/routing"
)

// Attempt implements proxy.Observer: the request is dispatched to target i.
func (ex *exchange) Attempt(i int) {
	ex.attempts++
	ex.firstByte = false
	if i > 0 {
		ex.g.metrics.retries.Inc()
	}
	ex.record(i)
	if l := ex.load(i); l != nil {
		l.requests.Add(1)
		l.prefill.Add(int64(ex.plan.Targets[i].Uncached))
	}
}

// record tells a policy that remembers where prompts went
// (routing.Recorder) that this one is sent to target i now. Requests routed
// in least-load mode are not recorded: prefixes did not steer them.
func (ex *exchange) record(i int) {
	if t := &ex.plan.Targets[i]; t.PrefixAware && !ex.plan.Decision.Degraded {
		if rec, ok := ex.s.Policy.(routing.Recorder); ok {
			rec.Record(&ex.plan.Request, t.Name, t.FilterMatched, ex.g.now())
		}
	}
}

// load is the in-flight entry target i counts against (nil: a fallback).
func (ex *exchange) load(i int) *replicaLoad {
	if r := ex.plan.Targets[i].Replica; r >= 0 {
		return ex.loads[r]
	}
	return nil
}

// FirstByte implements proxy.Observer: target i has started answering, so
// its prefill is done.
func (ex *exchange) FirstByte(i int, ttft time.Duration) {
	ex.firstByte, ex.ttft = true, ttft
	t, l := &ex.plan.Targets[i], ex.load(i)
	if l != nil {
		l.prefill.Add(-int64(t.Uncached))
		l.eject.reached()
	}
	ex.g.metrics.ttftOf(l, t.Name).Observe(ttft.Seconds())
}

// Header implements proxy.Observer: the X-Kvmesh-* headers of the answer.
func (ex *exchange) Header(i int, h *fasthttp.ResponseHeader) {
	t := &ex.plan.Targets[i]
	// The names are canonical already: SetCanonical skips normalizing them.
	h.SetCanonical(hdrReplica, []byte(t.Name))
	h.SetCanonical(hdrMode, []byte(t.Mode))
	h.SetCanonical(hdrPromptTokens, strconv.AppendInt(ex.hdrBuf[:0], int64(ex.plan.Prompt.Tokens), 10))
	h.SetCanonical(hdrCachedTokens, strconv.AppendInt(ex.hdrBuf[:0], int64(t.PredictedCached), 10))
	// X-Request-Id is already there: serveCompletion set it for every answer.
}

var (
	hdrReplica      = []byte("X-Kvmesh-Replica")
	hdrMode         = []byte("X-Kvmesh-Mode")
	hdrPromptTokens = []byte("X-Kvmesh-Prompt-Tokens")
	hdrCachedTokens = []byte("X-Kvmesh-Cached-Tokens")
)

// Finish implements proxy.Observer. The last call releases ex.
func (ex *exchange) Finish(i int, r proxy.Result) {
	g, t, tl := ex.g, &ex.plan.Targets[i], ex.load(i)
	if l := tl; l != nil {
		if !ex.firstByte {
			l.prefill.Add(-int64(t.Uncached))
		}
		l.requests.Add(-1)
		if unreachable(r) {
			if d := l.eject.failed(g.now()); d > 0 {
				g.metrics.ejections.WithLabelValues(t.Name).Inc()
				g.log.Warn().Bytes("request_id", ex.requestID).Str("replica", t.Name).AnErr("error", r.Err).
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
	case (r.Status == 401 || r.Status == 403) && tl != nil && (ex.s.EngineAPIKey != "" || len(ex.s.APIKeys) > 0):
		// The router, not the client, authenticates to replicas here, so a
		// refusal is a configuration fault: say which flag to look at, once
		// in a while. (Without either setting the client's own
		// Authorization reached the engine: its 401 is the client's.)
		m.errors.WithLabelValues("upstream_unauthorized").Inc()
		g.authLog.Warn().Str("replica", t.Name).Int("status", r.Status).Bool("engine_api_key_set", ex.s.EngineAPIKey != "").
			Msg("replica refused the request: engines started with --api-key need the router's --engine-api-key (KVMESH_ENGINE_API_KEY)")
	}
	if r.Retried || r.Resumed {
		return
	}
	ex.learn(t, r)
	served := r.Err == nil && r.Status > 0 && r.Status < 500 && r.Status != 429 || r.ClientGone
	if served {
		m.routed(t.Mode).Inc()
		if t.PredictedCached > 0 {
			m.prefixHits.Inc()
		}
		m.prompt.Add(float64(ex.plan.Prompt.Tokens))
		m.predicted.Add(float64(t.PredictedCached))
		if r.CachedTokens > 0 {
			m.actual.Add(float64(r.CachedTokens))
		}
	}
	if g.log.GetLevel() <= zerolog.DebugLevel {
		ev := g.log.Debug().Bytes("request_id", ex.requestID).
			Str("policy", ex.s.Policy.Name()).Str("model", ex.model).Str("path", ex.path).
			Str("replica", t.Name).Str("mode", string(t.Mode)).
			Int("prompt_tokens", ex.plan.Prompt.Tokens).Int("predicted_cached", t.PredictedCached).
			Int("actual_cached", r.CachedTokens).Int("attempts", ex.attempts).Int("status", r.Status).
			Dur("decide", ex.decideTime).Dur("ttft", ex.ttft).Dur("elapsed", r.Elapsed).
			Bool("degraded", ex.plan.Decision.Degraded).Str("reason", ex.plan.Decision.Reason)
		if t.Picked {
			// kvaware's estimates are for its pick: beside the TTFT
			// measured there, not at a replica a retry moved to.
			ev = ev.Dur("predicted_ttft", ex.plan.Decision.PredictedTTFT).Dur("predicted_queue", ex.plan.Decision.Queue)
		}
		if ex.plan.Prompt.Err != nil {
			ev = ev.Str("tokenize_error", ex.plan.Prompt.Err.Error())
		}
		if ex.plan.Prompt.MediaPrefix {
			ev = ev.Bool("media_text_prefix", true)
		}
		if r.Err != nil {
			ev = ev.AnErr("upstream_error", r.Err)
		}
		ev.Msg("request")
	}
	g.putExchange(ex)
}

// learn tells a policy that calibrates its cost model (routing.Learner) the
// time to first token measured at t, when that is what the decision
// predicted (plan.Target.Teaches) and the answer measured one: a stream's
// first event, on the first try. The cached tokens are the engine's count
// when it gave one.
func (ex *exchange) learn(t *plan.Target, r proxy.Result) {
	// r.Events: a 200 to a stream that is not SSE (an engine ignoring
	// "stream") came whole, so its first byte is its last.
	measured := ex.measuresTTFT && ex.firstByte && ex.attempts == 1 && r.Status == 200 && r.Events > 0
	if !t.Teaches || !measured {
		return
	}
	l, ok := ex.s.Policy.(routing.Learner)
	if !ok {
		return
	}
	cached := t.PredictedCached
	if r.CachedTokens >= 0 {
		cached = r.CachedTokens
	}
	l.Learn(&ex.plan.Request, ex.plan.PickCandidate(), cached, ex.ttft)
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

var _ proxy.Observer = (*exchange)(nil)
