package gateway

import (
	"errors"

	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
)

// Prefill/decode disaggregation: a split plan (plan.Plan.Prefill) is
// served in two steps, as vLLM's disaggregated proxy serves it. First the
// prefill, which the client never sees, at the prefill targets in turn
// until one answers with kv_transfer_params; then the client's request
// with those parameters to the decode targets, which Forward tries in
// turn as any request (a decode engine that cannot read the KV fails
// before its first byte, and the next one reads the same parameters: the
// prefill engine holds its blocks until a decode has them or they
// expire), and last the request whole at a decode-capable replica, which
// computes the prompt again. When no prefill replica answers, the request
// is served whole at once.

// errNoTransfer: a prefill engine answered 200 without transfer
// parameters (it does not run a KV connector).
var errNoTransfer = errors.New("prefill answered without kv_transfer_params")

// prefill runs l's prefill step and fills req.Bodies for the decode
// targets; when no prefill replica could, the split targets are dropped
// and the request goes whole to what remains.
func (g *Gateway) prefill(l *ledger, req *proxy.Request, k request.Kind) {
	pre, err := request.PrefillBody(req.Body, k)
	if err == nil {
		step := proxy.Request{ID: req.ID, Path: req.Path, Header: req.Header, Body: pre,
			DropAuthorization: req.DropAuthorization, Abort: req.Abort}
		for j := range l.plan.Prefill {
			if req.Abort != nil && req.Abort.Aborted() {
				break
			}
			params, ok := l.prefillAt(j, &step)
			if !ok {
				continue
			}
			// Every decode target reads the same parameters.
			decode, _ := request.DecodeBody(req.Body, params) // req.Body is an object: PrefillBody took it
			req.Bodies = req.Bodies[:0]
			for i := range l.plan.Targets {
				var b []byte
				if l.plan.Targets[i].Split {
					b = decode
				}
				req.Bodies = append(req.Bodies, b)
			}
			return
		}
	}
	l.serveWhole()
}

// prefillAt sends the prefill to prefill target j and returns the
// transfer parameters it answered, false when it failed: its in-flight
// work is counted meanwhile, and a replica that did not answer ejected.
func (l *ledger) prefillAt(j int, step *proxy.Request) ([]byte, bool) {
	g, t := l.g, &l.plan.Prefill[j]
	rl := l.loads[t.Replica]
	if t.PrefixAware && !l.plan.Decision.Degraded {
		if rec, ok := l.s.Policy.(routing.Recorder); ok {
			rec.Record(&l.plan.Request, t.Name, t.FilterMatched, g.now())
		}
	}
	rl.requests.Add(1)
	rl.prefill.Add(int64(t.Uncached))
	a, err := g.fwd.Exchange(l.prefills[j], step)
	rl.requests.Add(-1)
	rl.prefill.Add(-int64(t.Uncached))
	if l.s.Flow.Enabled {
		g.flow.freed()
	}
	var params []byte
	ok := err == nil && a.Status == 200
	if ok {
		if params, ok = request.TransferParams(a.Body); !ok {
			err = errNoTransfer
		}
	}
	if err == nil || a.Status > 0 {
		rl.eject.reached()
	} else if unreachable(proxy.Result{Err: err}) {
		if d := rl.eject.failed(g.now()); d > 0 {
			g.metrics.ejections.WithLabelValues(t.Name).Inc()
		}
	}
	if !ok {
		g.metrics.prefills.WithLabelValues("failed").Inc()
		g.log.Warn().Bytes("request_id", l.requestID).Str("replica", t.Name).Int("status", a.Status).AnErr("error", err).
			Int("attempt", j+1).Int("of", len(l.plan.Prefill)).Msg("prefill failed")
		return nil, false
	}
	g.metrics.prefills.WithLabelValues("ok").Inc()
	g.metrics.ttftOf(rl, t.Name).Observe(a.Elapsed.Seconds())
	l.prefilled, l.prefillCached = j, a.CachedTokens
	return params, true
}

// serveWhole drops a split plan's decode targets: what remains (the
// request whole at a decode-capable replica, the fallback) serves it.
func (l *ledger) serveWhole() {
	l.unreserve() // a reservation flow control made counts the first decode target
	n := 0
	for i := range l.plan.Targets {
		if !l.plan.Targets[i].Split {
			l.plan.Targets[n], l.targets[n] = l.plan.Targets[i], l.targets[i]
			n++
		}
	}
	l.plan.Targets, l.targets = l.plan.Targets[:n], l.targets[:n]
	if n > 0 && l.plan.Targets[0].Replica >= 0 {
		l.plan.Targets[0].Picked = true
	}
}
