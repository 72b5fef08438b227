package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/tokenize"
)

func (g *Gateway) serveCompletion(ctx *fasthttp.RequestCtx, k request.Kind) {
	var idBuf [maxRequestIDLen]byte
	id := requestID(&ctx.Request.Header, idBuf[:0])
	ctx.Response.Header.SetCanonical(hdrRequestID, id) // errors carry it too
	s := g.Settings()
	tn, prio, slo, err := s.admission(ctx)
	if err != nil {
		g.fail(ctx, err)
		return
	}
	var p *request.Request
	path := string(ctx.Path())
	if k == request.Passthrough {
		p, err = request.ParsePassthrough(ctx.PostBody(), string(ctx.Request.Header.MultipartFormBoundary()))
		path = string(ctx.RequestURI()) // with its query, if any
	} else {
		if k.Converted() {
			path = string(ctx.RequestURI())
		}
		p, err = request.Parse(ctx.PostBody(), k)
	}
	if err != nil {
		g.fail(ctx, err)
		return
	}
	snap := g.table.Snapshot()
	if p.Model == "" {
		if p.Model = soleModel(snap); p.Model == "" {
			g.fail(ctx, request.Invalid("model is required"))
			return
		}
	}
	body := ctx.PostBody()
	l := g.newLedger(s)
	l.model, l.path = p.Model, path
	l.requestID = append(l.requestID[:0], id...)
	l.tenant, l.priority, l.req = tn, prio, p
	l.session = s.sessionOf(&ctx.Request.Header)
	if st, stored := storedResponse(body, p); stored {
		// A follow-up goes where its stored response lives, and nowhere else.
		l.pin, l.pinWhat, body = st.replica, fmt.Sprintf("Response with id '%s'", p.PreviousResponseID), st.engineBody
		l.previous, l.previousClient = st.engineID, p.PreviousResponseID
		l.continued, l.chain = g.continuation(s, snap, p, st.replica, st.engineID, st.state)
	}
	if !s.CarryStoredState {
		l.chain = nil
	}
	if err := l.decide(snap, p); err != nil {
		g.release(l)
		g.fail(ctx, err)
		return
	}
	if l.pin == "" && s.CarryStoredState {
		l.chain = l.beginChain()
	}
	if err := g.admit(ctx, l, slo); err != nil {
		g.release(l)
		var r *rejection
		switch {
		case errors.As(err, &r):
			g.reject(ctx, r)
		case errors.Is(err, errClientLeft):
			ctx.SetConnectionClose()
		default:
			g.fail(ctx, err)
		}
		return
	}
	l.measuresTTFT = p.Stream && k != request.Passthrough
	strip := false
	// Responses and Messages streams report usage unasked.
	if p.Stream && !p.WantsUsage && (k == request.Chat || k == request.Completion) {
		if b, err := request.WithIncludeUsage(body, p.StreamOptions); err == nil {
			body, strip = b, true
		}
	}
	// vLLM's Anthropic handler builds its chat request without a priority
	// (_build_base_request, 0001948b): a Messages body gets none.
	if s.Models[p.Model].EnginePriority && k != request.Passthrough && k != request.Messages {
		if b, err := request.WithPriority(body, enginePriority(l.priority)); err == nil {
			body = b
		}
	}
	req := proxy.Request{
		ID:                l.requestID,
		Path:              l.path,
		Header:            &ctx.Request.Header,
		Body:              body,
		StripUsage:        strip,
		DropAuthorization: s.Tenants.RequiresKey(),
		Stream:            p.Stream,
		Dialect:           l.dialectOf(k),
	}
	if p.Stream && s.ResumeStreams && (k == request.Chat || k == request.Completion) {
		// The stream may outlive ctx's buffers (a client gone mid-way).
		orig, k := bytes.Clone(body), p.Kind
		tk := s.tokenizer(s.Models[p.Model])
		req.Resume = func(text []byte, chunks int) ([]byte, bool) {
			// An engine may send several tokens per event: count the text's
			// tokens too, so the continuation never overshoots max_tokens
			// by more than re-tokenizing differs.
			if tk != nil {
				if ids, err := tk.Encode(string(text), false); err == nil {
					chunks = max(chunks, len(ids))
				}
			}
			return request.Continuation(orig, k, text, chunks)
		}
	}
	if p.Stream || !p.ShortAnswer() {
		// A client that leaves while the engine works must stop the
		// engine too; the proxy only hears of it through an Abort (a
		// stream writes nothing before its first event). Watched until
		// the request's End.
		l.abort = &proxy.Abort{}
		req.Abort = l.abort
		g.watch.add(l.abort, ctx.Conn())
	}
	if len(l.plan.Prefill) > 0 {
		g.prefill(l, &req, k)
	}
	// l belongs to the proxy from here: it is released on End, which may
	// run after this handler returns.
	g.fwd.Forward(ctx, &req, l.targets, l)
}

// admit applies flow control to l's planned request: sheddable work no
// replica is predicted to serve within its TTFT SLO is turned away, then
// its tenant's quota is charged, then, while the fleet is saturated, it is
// held (hold) until a replica has room. On error nothing was charged.
func (g *Gateway) admit(ctx *fasthttp.RequestCtx, l *ledger, slo time.Duration) error {
	d := &l.plan.Decision
	if slo > 0 && l.priority == flowcontrol.Sheddable && d.PredictedTTFT > slo {
		return saturated("slo", fmt.Sprintf("no replica of %s is predicted to answer within %s (best: %s) and the request is sheddable", l.model, slo, d.PredictedTTFT.Round(time.Millisecond)), time.Second)
	}
	maxTokens := int64(l.req.MaxTokensAsked())
	if err := g.flow.admitQuota(l, int64(l.plan.Prompt.Tokens)+maxTokens); err != nil {
		return err
	}
	if !l.s.Flow.Enabled || !g.flow.mustWait(l) {
		return nil
	}
	cost := maxTokens
	if len(l.plan.Targets) > 0 {
		cost += int64(l.plan.Targets[0].Uncached)
	}
	if err := g.flow.hold(ctx, l, cost); err != nil {
		g.flow.refundQuota(l)
		return err
	}
	return nil
}

// enginePriority is vLLM's request priority for band p (lower is served
// first): standard is vLLM's default 0, so requests reaching an engine
// without the router keep their place.
func enginePriority(p flowcontrol.Priority) int { return int(p) - int(flowcontrol.Standard) }

// soleModel returns the only model the fleet serves, or "".
func soleModel(snap *fleet.Snapshot) string {
	model := ""
	for i := range snap.Replicas {
		for _, m := range snap.Replicas[i].Models {
			if model != "" && m != model {
				return ""
			}
			model = m
		}
	}
	return model
}

// servedBy reports whether any replica in snap, live or not, serves model.
func servedBy(snap *fleet.Snapshot, model string) bool {
	for i := range snap.Replicas {
		if plan.Serves(&snap.Replicas[i], model) {
			return true
		}
	}
	return false
}

// decide plans the request (package plan) and maps its targets to
// connection pools; what the plan tells of its prompt is counted and,
// for a tokenizer that panicked, logged.
func (l *ledger) decide(snap *fleet.Snapshot, p *request.Request) error {
	g, s := l.g, l.s
	var t0 time.Time
	timed := g.log.GetLevel() <= zerolog.DebugLevel
	if timed {
		t0 = time.Now()
	}
	now := g.now()
	li := g.loadsOf(snap)
	l.loads = li.loads
	l.planLoads = li.figures(l.planLoads, now.UnixNano())
	ms := s.Models[l.model]
	in := plan.Input{
		Snapshot: snap, Loads: l.planLoads, Request: p, Model: l.model,
		Settings: s.plan, ModelSettings: s.planModel(l.model, ms), Now: now,
		Replica: l.pin, StoredBy: l.pinWhat, Session: l.session, Continued: l.continued,
	}
	if p.Kind != request.Chat && p.Kind != request.Completion {
		// vLLM's disaggregated protocol is spoken on chat and completions
		// only: other APIs are served whole, on the decode pool.
		in.Settings.Split = plan.SplitNever
	}
	err := l.plan.Decide(&in)
	if timed {
		l.decideTime = time.Since(t0)
	}
	pl := &l.plan
	g.countPrompt(&pl.Prompt, l.model)
	if err != nil {
		return err
	}
	if pl.Spilled {
		g.metrics.spills.Inc()
	}
	for _, i := range pl.Unusable {
		if _, err := g.upstream(&snap.Replicas[i]); err != nil {
			g.log.Warn().Err(err).Str("replica", snap.Replicas[i].Name).Msg("replica has an unusable URL")
		}
	}
	for i := range pl.Targets {
		t := &pl.Targets[i]
		if t.Replica < 0 {
			l.targets = append(l.targets, ms.Fallback[t.Fallback])
			continue
		}
		up, err := g.upstream(&snap.Replicas[t.Replica])
		if err != nil { // not met: loadsOf checked every URL, and unusable ones are no target
			return err
		}
		l.targets = append(l.targets, up)
	}
	for i := range pl.Prefill {
		up, err := g.upstream(&snap.Replicas[pl.Prefill[i].Replica])
		if err != nil {
			return err
		}
		l.prefills = append(l.prefills, up)
	}
	return nil
}

// countPrompt counts prompts over the bounds, cut to them, or whose
// tokenizer panicked (logged with its stack).
func (g *Gateway) countPrompt(pr *plan.Prompt, model string) {
	if pr.Estimated {
		g.metrics.promptsCut.Inc()
	}
	if pr.Err == nil {
		return
	}
	var tp *plan.TokenizerPanic // on the heap (errors.As): only for a failure
	switch {
	case errors.Is(pr.Err, tokenize.ErrPromptTooLong):
		g.metrics.promptsTooLong.Inc()
	case errors.As(pr.Err, &tp):
		g.panicked("tokenizer_panic", tp.Value, tp.Stack).Str("model", model).
			Msg("tokenizer panicked; the request is routed by load")
	}
}

// sessionOf is the session a request names in the first of the session
// headers it carries, "" for none.
func (s *Settings) sessionOf(h *fasthttp.RequestHeader) string {
	for _, name := range s.SessionHeaders {
		if v := h.Peek(name); len(v) > 0 {
			return string(v)
		}
	}
	return ""
}
