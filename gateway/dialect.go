package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/chatconv"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/storedid"
)

// dialect is how the proxy reads and rewrites the answers of a Responses or
// Messages request (proxy.Dialect): usage from chatconv's readers, and, for
// Responses, the response ids rewritten to name the replica that stored
// them (package storedid). replica names target i's replica, "" for a
// fallback endpoint, whose ids are left as they are.
type dialect struct {
	kind    request.Kind
	replica func(i int) string
	// naming is how ids are named beside their replica: the state they
	// carry, the predecessor as the client knows it.
	naming storedid.Naming
}

// BodyUsage implements proxy.Dialect.
func (d *dialect) BodyUsage(body []byte) proxy.Usage {
	if d.kind == request.Messages {
		return proxyUsage(chatconv.MessagesUsage(body))
	}
	return proxyUsage(chatconv.ResponsesUsage(body))
}

// EventUsage implements proxy.Dialect.
func (d *dialect) EventUsage(payload []byte) (proxy.Usage, bool) {
	read := chatconv.ResponsesEventUsage
	if d.kind == request.Messages {
		read = chatconv.MessagesEventUsage
	}
	u, ok := read(payload)
	return proxyUsage(u), ok
}

// proxyUsage is u as the proxy counts it: both APIs count what they
// generated in usage.output_tokens.
func proxyUsage(u chatconv.Usage) proxy.Usage {
	return proxy.Usage{Prompt: u.Prompt, Cached: u.Cached, Completion: max(u.Output, 0)}
}

// Output implements proxy.Dialect: vLLM opens a Responses stream with response.created and
// response.in_progress before prefill; the events after them come with
// output. A Messages stream starts (message_start) with the first chunk
// of output.
func (d *dialect) Output(payload []byte) bool {
	if d.kind == request.Messages {
		return true
	}
	return !bytes.Contains(payload, []byte(`"type":"response.created"`)) &&
		!bytes.Contains(payload, []byte(`"type":"response.in_progress"`)) &&
		!bytes.Contains(payload, []byte(`"type":"response.queued"`))
}

// Rewrite implements proxy.Dialect.
func (d *dialect) Rewrite(i int, b []byte) []byte {
	if d.kind != request.Responses {
		return nil
	}
	n := d.naming
	if n.Replica = d.replica(i); n.Replica == "" {
		return nil
	}
	return storedid.RewriteAs(b, n)
}

// StreamError is the error event each API ends a broken stream with:
// OpenAI's "error" event for Responses, Anthropic's for Messages.
func (d *dialect) StreamError(msg string) []byte {
	m, _ := json.Marshal(msg) // a string always marshals
	if d.kind == request.Messages {
		return []byte(`event: error` + "\n" + `data: {"type":"error","error":{"type":"api_error","message":` + string(m) + `}}` + "\n\n")
	}
	return []byte(`event: error` + "\n" + `data: {"type":"error","code":"upstream_error","message":` + string(m) + `,"param":null}` + "\n\n")
}

// dialectOf returns the dialect of l's answers, nil for chat completions'.
func (l *ledger) dialectOf(k request.Kind) proxy.Dialect {
	if !k.Converted() {
		return nil
	}
	return &dialect{kind: k, replica: func(i int) string {
		if t := &l.plan.Targets[i]; t.Replica >= 0 {
			return t.Name
		}
		return ""
	}, naming: storedid.Naming{State: l.chain, Previous: l.previous, PreviousClient: l.previousClient}}
}

// continues is the stored response a Responses body continues.
type continues struct {
	// replica stores it as engineID; state is what its id carried (nil
	// for none).
	replica, engineID string
	state             []byte
	// engineBody is the body with the engine's own id put back.
	engineBody []byte
}

// storedResponse reads the stored response a Responses body continues
// from its previous_response_id. ok is false for a body continuing none,
// or an id no router issued (routed as any other request).
func storedResponse(body []byte, p *request.Request) (c continues, ok bool) {
	if p.Kind != request.Responses || p.PreviousResponseID == "" {
		return c, false
	}
	c.replica, c.engineID, c.state, ok = storedid.DecodeState(p.PreviousResponseID)
	if !ok {
		return c, false
	}
	// Decode takes only ids made of bytes JSON never escapes: the body
	// spells this one as it is.
	c.engineBody = bytes.ReplaceAll(body, []byte(`"`+p.PreviousResponseID+`"`), []byte(`"`+c.engineID+`"`))
	return c, true
}

// responsesPrefix starts the stored-response routes vLLM serves:
// GET /v1/responses/{id} (?stream=true&starting_after=N replays a
// background response's events) and POST /v1/responses/{id}/cancel. vLLM
// serves no DELETE.
var responsesPrefix = []byte("/v1/responses/")

// serveStored sends a retrieval or cancellation of a stored
// response to the replica its id names, the engine's id restored in the
// path, and the ids of the answer rewritten back. An id this router did
// not issue, or whose replica is gone, is a 404 that says why.
func (g *Gateway) serveStored(ctx *fasthttp.RequestCtx, path []byte) {
	s := g.Settings()
	if err := s.authorize(ctx); err != nil {
		g.fail(ctx, err)
		return
	}
	rest := string(path[len(responsesPrefix):])
	id, action, _ := strings.Cut(rest, "/")
	method := string(ctx.Method())
	switch {
	case action == "" && method == fasthttp.MethodGet:
	case action == "cancel" && method == fasthttp.MethodPost:
	default:
		noRoute(ctx)
		return
	}
	replica, engineID, state, ok := storedid.DecodeState(id)
	if !ok {
		g.fail(ctx, &request.Error{Status: 404, Type: "invalid_request_error", Message: fmt.Sprintf(
			"Response with id '%s' not found: this router did not issue it, so it cannot tell which replica stores it", id)})
		return
	}
	snap := g.table.Snapshot()
	i := snap.Find(replica)
	if i < 0 || !snap.Replicas[i].Online && !snap.Replicas[i].Stale {
		g.fail(ctx, &request.Error{Status: 404, Type: "invalid_request_error", Message: fmt.Sprintf(
			"Response with id '%s' not found: it was stored by replica %q, which is no longer in the fleet: a stored response lives in the engine that made it", id, replica)})
		return
	}
	up, err := g.upstream(&snap.Replicas[i])
	if err != nil {
		g.fail(ctx, err)
		return
	}
	upath := string(responsesPrefix) + engineID
	if action != "" {
		upath += "/" + action
	}
	if q := ctx.URI().QueryString(); len(q) > 0 {
		upath += "?" + string(q)
	}
	stream := bytes.Equal(ctx.QueryArgs().Peek("stream"), []byte("true"))
	var idBuf [maxRequestIDLen]byte
	rid := requestID(&ctx.Request.Header, idBuf[:0])
	ctx.Response.Header.SetCanonical(hdrRequestID, rid)
	req := proxy.Request{
		ID: bytes.Clone(rid), Path: upath, Header: &ctx.Request.Header, Body: ctx.PostBody(),
		DropAuthorization: s.Tenants.RequiresKey(), Stream: stream, Method: method,
		Dialect: &dialect{kind: request.Responses, replica: func(int) string { return replica }, naming: storedid.Naming{State: state}},
	}
	g.fwd.Forward(ctx, &req, []*proxy.Upstream{up}, storedObserver{name: replica})
}

// storedObserver observes a stored-response call: it only names the
// replica that answered. Such calls do no prefill, so they take no part in
// in-flight accounting or the cost model.
type storedObserver struct{ name string }

func (o storedObserver) Attempt(int)                  {}
func (o storedObserver) FirstByte(int, time.Duration) {}
func (o storedObserver) Retry(int, proxy.Result)      {}
func (o storedObserver) End(proxy.Result)             {}
func (o storedObserver) Header(_ int, h *fasthttp.ResponseHeader) {
	h.SetCanonical(hdrReplica, []byte(o.name))
}
