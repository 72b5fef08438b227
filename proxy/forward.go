package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"
)

// Request is what to send upstream. Body is sent as is; the caller has
// already made any change (such as asking for stream usage).
type Request struct {
	// ID names the request in log lines (its X-Request-Id).
	ID []byte
	// Path is the API path, e.g. /v1/chat/completions.
	Path string
	// Header holds the client's request headers; hop-by-hop headers and
	// Accept-Encoding are not forwarded (the router reads the body).
	Header *fasthttp.RequestHeader
	Body   []byte
	// StripUsage drops the usage-only chunk from a stream: the router asked
	// for it on the client's behalf and the client must not see it.
	StripUsage bool
	// DropAuthorization keeps the client's Authorization from the upstream
	// (the router checked it against its own keys).
	DropAuthorization bool
	// Stream is true when the client asked for a stream: the answer is then
	// relayed as it arrives. Otherwise it is read whole before relaying,
	// which is cheaper, and a failure while reading it can still be retried.
	Stream bool
	// Resume, when set, lets a stream that breaks after its first event go
	// on at the next target. It is given the text the client has received
	// and how many events carried it, and returns the body that asks a
	// target to continue from there, or false when it cannot be asked.
	Resume func(text []byte, chunks int) ([]byte, bool)
	// Abort, when set, lets the caller end the request while an engine
	// works on it (the client left): the upstream connection closes, so
	// the engine stops, and no other target is tried.
	Abort *Abort
	// Dialect, when set, reads and rewrites answers of an API other than
	// chat completions.
	Dialect Dialect
	// Method is the method sent upstream (POST when empty).
	Method string
	// Bodies, when set, holds the body of target i at Bodies[i] where that
	// is not nil (Body elsewhere): a split request's decode replicas are
	// sent the prefill's transfer parameters, the replica after them the
	// request whole. A continuation (Resume) goes to any target as built.
	Bodies [][]byte
}

// bodyFor is the body target i is sent.
func (r *Request) bodyFor(i int) []byte {
	if i < len(r.Bodies) && r.Bodies[i] != nil {
		return r.Bodies[i]
	}
	return r.Body
}

// Observer follows one request's attempts. Calls for a request come from one
// goroutine at a time, but the serving attempt's FirstByte and End may run
// after the fasthttp handler has returned. An attempt is open from its
// Attempt to the Retry or End that follows; the observer keeps track of
// which one that is.
type Observer interface {
	// Attempt is called before target i is tried.
	Attempt(i int)
	// FirstByte is called when target i's response headers arrive.
	FirstByte(i int, ttft time.Duration)
	// Header is called once, for the target whose response goes to the
	// client, before its headers are sent: add headers to h there.
	Header(i int, h *fasthttp.ResponseHeader)
	// Retry is called when attempt i failed and a later target takes the
	// request over (r.Retried or r.Resumed is set).
	Retry(i int, r Result)
	// End is called once per request, last: r is how the open attempt
	// ended (there is none when no target was tried). The observer may
	// release its state then.
	End(r Result)
}

// Result is how one attempt ended.
type Result struct {
	// Status is the upstream's HTTP status (0 when none arrived).
	Status int
	// Err is a transport, timeout or stream error, nil on a clean end.
	Err error
	// Retried is true when the attempt failed before anything reached the
	// client and a later target was tried.
	Retried bool
	// Resumed is true when the attempt's stream broke after reaching the
	// client and a later target was asked to continue it (Request.Resume).
	Resumed bool
	// ClientGone is true when the client disconnected mid-stream.
	ClientGone bool
	// Internal is true when the router itself failed the attempt (a panic
	// while relaying it): not the replica's fault.
	Internal bool
	// Overran is true when a replica took a non-streamed request but its
	// answer outlasted the first-byte timeout (which bounds the whole
	// generation there) or the buffered size: it was working, not
	// unreachable, and the attempt was not retried.
	Overran bool
	// PromptTokens and CachedTokens come from the engine's usage report;
	// -1 when the response carried none. CompletionTokens too, 0 when it
	// carried none.
	PromptTokens     int
	CachedTokens     int
	CompletionTokens int
	// Elapsed runs from dispatch to the end of the response body.
	Elapsed time.Duration
	// Events counts SSE events relayed to the client.
	Events int
}

// Forwarder tries targets in order and relays the first usable answer.
type Forwarder struct {
	Log zerolog.Logger
	// MaxBody bounds how much of a non-streamed answer is buffered
	// (default 64 MiB).
	MaxBody int
	// OnPanic, when set, is told of a panic recovered while relaying a
	// stream (its value and stack): that goroutine is fasthttp's, with no
	// handler above it to catch one, so the panic would end the process.
	OnPanic func(recovered any, stack []byte)
}

// Forward sends req to targets in order until one answers with something
// other than a connection error, 5xx or 429, writes that answer into ctx and
// returns the index of the target that served (-1 when all failed and ctx
// holds the last failure, or a 503 with Retry-After when none answered at
// all: no replica could serve, as when the router knows of none). Streams
// are relayed after Forward returns, from fasthttp's body-writer goroutine.
func (f *Forwarder) Forward(ctx *fasthttp.RequestCtx, req *Request, targets []*Upstream, obs Observer) int {
	var last *fasthttp.Response // last retryable failure, relayed if all fail
	lastIdx := -1
	var lastErr error
	// ended: End was called, or the stream's goroutine will call it.
	ended, start := false, time.Time{}
	defer func() {
		if last != nil {
			fasthttp.ReleaseResponse(last)
		}
		if !ended {
			// A panic left the request unended: end its open attempt as
			// the router's failure (its in-flight accounting would stay
			// raised for good), then let the panic go on to the handler's
			// recover.
			if v := recover(); v != nil {
				p := &Panic{Value: v, Stack: debug.Stack()}
				ended = true
				obs.End(Result{Err: p, Internal: true, PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)})
				panic(p)
			}
		}
	}()
	end := func(r Result) {
		ended = true
		obs.End(r)
	}
	for i, up := range targets {
		obs.Attempt(i)
		start = time.Now()
		resp, err := f.dispatch(up, req, req.bodyFor(i))
		if err == nil && !retryable(resp.StatusCode()) {
			// For a stream the first token is the first event, not the
			// headers (engines send those before prefill); relay reports it.
			if !isEventStream(resp) {
				obs.FirstByte(i, time.Since(start))
			}
			res, streaming := f.relay(ctx, req, targets, i, resp, start, obs)
			if streaming {
				ended = true // the stream's goroutine ends it
			} else {
				end(res)
			}
			return i
		}
		if req.Abort != nil && req.Abort.Aborted() {
			// The client left: nobody is waiting for another target.
			if resp != nil {
				fasthttp.ReleaseResponse(resp)
			}
			end(Result{Err: errAborted, ClientGone: true, PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)})
			WriteError(ctx, fasthttp.StatusBadGateway, "upstream_error", "client gone")
			return -1
		}
		if err != nil && !req.Stream && overran(err) {
			// Another replica would start the generation over, doubling a
			// wait the timeout meant to bound (or buffer the same
			// oversized answer): end here.
			end(Result{Err: err, Overran: true, PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)})
			f.Log.Warn().Bytes("request_id", req.ID).Str("replica", up.Name).Int("attempt", i+1).Int("of", len(targets)).Err(err).
				Msg("upstream answer overran its limit: not retried")
			if errors.Is(err, fasthttp.ErrBodyTooLarge) {
				WriteError(ctx, fasthttp.StatusBadGateway, "upstream_error", "the replica's answer is larger than the router buffers (64 MiB): ask for a stream")
			} else {
				WriteError(ctx, fasthttp.StatusGatewayTimeout, "upstream_timeout", fmt.Sprintf("no answer within the first-byte timeout (%v), which bounds a whole non-streamed generation: ask for a stream or raise upstream.first_byte_timeout", up.firstByte))
			}
			return -1
		}
		res := Result{Err: err, Retried: i < len(targets)-1, PromptTokens: -1, CachedTokens: -1}
		ev := f.Log.Warn().Bytes("request_id", req.ID).Str("replica", up.Name).Int("attempt", i+1).Int("of", len(targets))
		if err != nil {
			ev = ev.Err(err)
			lastErr = err
		} else {
			res.Status = resp.StatusCode()
			obs.FirstByte(i, time.Since(start))
			ev = ev.Int("status", res.Status)
			// Buffer the failure so it can be relayed if nothing better comes.
			body, rerr := readAll(resp, 1<<20)
			_ = resp.CloseBodyStream()
			resp.SetBodyRaw(body)
			if rerr != nil {
				res.Err = rerr
			}
			if last != nil {
				fasthttp.ReleaseResponse(last)
			}
			last, lastIdx = resp, i
		}
		res.Elapsed = time.Since(start)
		ev.Bool("retrying", res.Retried).Msg("upstream attempt failed")
		if res.Retried {
			obs.Retry(i, res)
			continue
		}
		// The last attempt failed too: answer, then end the request (the
		// observer may release its state).
		ended = true
		defer obs.End(res)
	}
	if last != nil {
		obs.Header(lastIdx, &ctx.Response.Header)
		copyResponseHeader(&ctx.Response.Header, &last.Header)
		ctx.SetStatusCode(last.StatusCode())
		ctx.SetBody(last.Body())
		return -1
	}
	msg := "no replica answered"
	if lastErr != nil {
		msg += ": " + lastErr.Error()
	}
	ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
	WriteError(ctx, fasthttp.StatusServiceUnavailable, "service_unavailable", msg)
	if len(targets) == 0 {
		end(Result{PromptTokens: -1, CachedTokens: -1})
	}
	return -1
}

func retryable(status int) bool { return status >= 500 || status == fasthttp.StatusTooManyRequests }

// overran reports whether a non-streamed attempt's error means the answer
// was too slow or too large rather than that the replica is unreachable:
// its headers come only with the whole completion.
func overran(err error) bool {
	return errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, fasthttp.ErrBodyTooLarge)
}

// dispatch sends req to up and returns once the response headers arrived;
// the body stays on the wire.
func (f *Forwarder) dispatch(up *Upstream, req *Request, body []byte) (*fasthttp.Response, error) {
	ureq := fasthttp.AcquireRequest()
	defer fasthttp.ReleaseRequest(ureq)
	if req.Header != nil {
		req.Header.CopyTo(&ureq.Header)
		dropUnforwarded(&ureq.Header, req.DropAuthorization)
	}
	if up.authorization != "" {
		ureq.Header.Set(fasthttp.HeaderAuthorization, up.authorization)
	}
	if up.rank != "" {
		ureq.Header.Set(RankHeader, up.rank)
	}
	method := req.Method
	if method == "" {
		method = fasthttp.MethodPost
	}
	ureq.Header.SetMethod(method)
	up.prepare(ureq, req.Path)
	ureq.SetBodyRaw(body)
	resp := fasthttp.AcquireResponse()
	resp.StreamBody = req.Stream
	if a := req.Abort; a != nil && !req.Stream {
		if a.Aborted() {
			fasthttp.ReleaseResponse(resp)
			return nil, errAborted
		}
		id := requestTags.Add(1)
		ureq.Header.Set(headerRequestTag, strconv.FormatUint(id, 10))
		a.begin(id)
		up.watched.add(id, a)
		defer func() { up.watched.remove(id); a.end() }()
	}
	if err := up.hc.Do(ureq, resp); err != nil {
		fasthttp.ReleaseResponse(resp)
		return nil, err
	}
	return resp, nil
}

// unforwarded are the request headers the engine never sees: hop-by-hop
// ones (they describe one connection), Accept-Encoding (the router reads the
// body), Expect (the router already read it) and the router's own request
// tag (a client's would claim another request's abort). Authorization is
// dropped too when the router checked it against its own keys.
var unforwarded = []string{
	"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade", fasthttp.HeaderAcceptEncoding, fasthttp.HeaderExpect,
	headerRequestTag,
	fasthttp.HeaderAuthorization, // must stay last: see dropUnforwarded
}

// dropUnforwarded deletes the unforwarded headers h holds. It finds them in
// one pass: a Del normalizes its name and scans every header, and most
// requests carry one or two of the twelve (eleven Dels took 350 ns).
func dropUnforwarded(h *fasthttp.RequestHeader, authorization bool) {
	n := len(unforwarded)
	if !authorization {
		n-- // Authorization is last
	}
	var present uint32
	var named [][]byte
	for k, v := range h.All() {
		for i, name := range unforwardedBytes[:n] {
			if bytes.EqualFold(k, name) {
				present |= 1 << i
			}
		}
		if bytes.EqualFold(k, unforwardedBytes[0]) {
			named = connectionNamed(named, v)
		}
	}
	if h.ConnectionClose() {
		present |= 1 // fasthttp keeps "Connection: close" as a flag
	}
	for _, name := range named {
		h.DelBytes(name)
	}
	for i, name := range unforwarded[:n] {
		if present&(1<<i) != 0 {
			h.Del(name)
		}
	}
}

// connectionNamed appends to named copies of the header names a Connection
// value lists: they are hop-by-hop too and must not be forwarded (RFC 9110
// §7.6.1). Kept are the headers the engine needs to read the request at all
// (Content-Length, Host, Content-Type), which no hop may take away, and the
// options fasthttp handles itself (close, keep-alive).
func connectionNamed(named [][]byte, value []byte) [][]byte {
	for tok := range bytes.SplitSeq(value, []byte(",")) {
		tok = bytes.TrimSpace(tok)
		if len(tok) == 0 || slices.ContainsFunc(connectionKept, func(k []byte) bool { return bytes.EqualFold(tok, k) }) {
			continue
		}
		named = append(named, bytes.Clone(tok))
	}
	return named
}

var connectionKept = [][]byte{[]byte("close"), []byte("keep-alive"), []byte("Content-Length"), []byte("Host"), []byte("Content-Type")}

var unforwardedBytes = func() [][]byte {
	out := make([][]byte, len(unforwarded))
	for i, n := range unforwarded {
		out[i] = []byte(n)
	}
	return out
}()

func copyResponseHeader(dst, src *fasthttp.ResponseHeader) {
	for k, v := range src.All() {
		if skipResponseHeader(k) {
			continue
		}
		dst.SetBytesKV(k, v)
	}
}

// skipResponseHeader is true for headers the router's server sets itself
// (framing, connection, date) and hop-by-hop ones.
func skipResponseHeader(k []byte) bool {
	for _, h := range skippedResponseHeaders {
		if bytes.EqualFold(k, h) {
			return true
		}
	}
	return false
}

var skippedResponseHeaders = [][]byte{
	[]byte("Content-Length"), []byte("Transfer-Encoding"), []byte("Connection"), []byte("Keep-Alive"),
	[]byte("Trailer"), []byte("Upgrade"), []byte("Proxy-Connection"), []byte("Te"), []byte("Date"),
}

// relay writes resp into ctx: SSE streams event by event, anything else
// buffered. It returns how a buffered answer's attempt ended, or streaming
// when the stream's goroutine took the request over (and ends it).
func (f *Forwarder) relay(ctx *fasthttp.RequestCtx, req *Request, targets []*Upstream, i int, resp *fasthttp.Response, start time.Time, obs Observer) (res Result, streaming bool) {
	obs.Header(i, &ctx.Response.Header)
	copyResponseHeader(&ctx.Response.Header, &resp.Header)
	ctx.SetStatusCode(resp.StatusCode())
	if isEventStream(resp) && resp.BodyStream() == nil {
		// An event stream read whole (the request did not ask to stream):
		// relay it at once, still reading and stripping usage.
		res := Result{Status: resp.StatusCode(), PromptTokens: -1, CachedTokens: -1}
		bw := bufio.NewWriter(ctx.Response.BodyWriter())
		done := false
		rest, _ := writeEvents(bw, resp.Body(), req.StripUsage, &res, &done, nil, req.dialected(i, nil))
		_, _ = bw.Write(rest)
		_ = bw.Flush()
		fasthttp.ReleaseResponse(resp)
		res.Elapsed = time.Since(start)
		return res, false
	}
	if !isEventStream(resp) {
		res := Result{Status: resp.StatusCode(), PromptTokens: -1, CachedTokens: -1}
		if resp.BodyStream() == nil { // read whole by the client already
			ctx.Response.SetBody(resp.Body())
			req.bodyUsage(i, &ctx.Response, &res)
			fasthttp.ReleaseResponse(resp)
			res.Elapsed = time.Since(start)
			return res, false
		}
		// Read straight into the client response's pooled body buffer.
		ctx.Response.ResetBody()
		buf := copyBufs.Get().(*[]byte)
		n, err := io.CopyBuffer(ctx.Response.BodyWriter(), io.LimitReader(resp.BodyStream(), int64(f.maxBody())+1), *buf)
		copyBufs.Put(buf)
		if err == io.EOF {
			err = nil
		}
		if err == nil && n > int64(f.maxBody()) {
			err = errBodyTooLarge
		}
		if err != nil {
			_ = resp.BodyStream().(fasthttp.ReadCloserWithError).CloseWithError(err)
			res.Err = err
			ctx.Response.Header.Reset()
			WriteError(ctx, fasthttp.StatusBadGateway, "upstream_error", "reading upstream response: "+err.Error())
		} else {
			_ = resp.CloseBodyStream()
			req.bodyUsage(i, &ctx.Response, &res)
		}
		fasthttp.ReleaseResponse(resp)
		res.Elapsed = time.Since(start)
		return res, false
	}
	ctx.Response.ImmediateHeaderFlush = true
	stream := *req
	if i+1 < len(targets) && stream.Header != nil {
		// A stream may be sent again (retried before its first event, or
		// continued) after the handler returned, when ctx's buffers may be
		// gone (a client that left): keep copies.
		stream.Header = new(fasthttp.RequestHeader)
		req.Header.CopyTo(stream.Header)
		stream.Body = bytes.Clone(req.Body)
	}
	ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
		// The handler has returned: ctx must not be touched from here on.
		f.relayStream(w, &stream, targets, i, resp, start, obs)
	})
	return Result{}, true
}

// relayStream relays target i's event stream and, when it breaks and req
// allows it, continues it at the following targets.
func (f *Forwarder) relayStream(w *bufio.Writer, req *Request, targets []*Upstream, i int, resp *fasthttp.Response, start time.Time, obs Observer) {
	var tr *transcript
	if req.Resume != nil {
		tr = &transcript{}
	}
	ended := false
	defer func() {
		if v := recover(); v != nil {
			f.survive(w, req, v, obs, ended, start)
		}
	}()
	sent := 0 // events the client has had, over all attempts
	for {
		up := targets[i]
		first := func() { obs.FirstByte(i, time.Since(start)) }
		res, done := relayEvents(w, resp, req.StripUsage, up.firstByte, up.idle, first, req.Abort, tr, req.dialected(i, first))
		res.Status = resp.StatusCode()
		res.Elapsed = time.Since(start)
		fasthttp.ReleaseResponse(resp)
		sent += res.Events
		broken := res.Err != nil && !res.ClientGone && !done
		var body []byte
		switch {
		case !broken || i+1 == len(targets):
		case sent == 0:
			// Only headers reached the client (engines send them before
			// queueing and prefill): the next target gets the request
			// itself, as for a failure before the first byte.
			res.Retried = true
		case tr.resumable():
			body, res.Resumed = req.Resume(tr.text, tr.chunks)
		}
		if !res.Resumed && !res.Retried {
			if res.Err != nil {
				f.Log.Warn().Bytes("request_id", req.ID).Err(res.Err).Bool("client_gone", res.ClientGone).Int("events", res.Events).Msg("stream ended early")
			}
			if !broken {
				ended = true
				obs.End(res)
				return
			}
		}
		next, nextResp, nextStart, last := -1, (*fasthttp.Response)(nil), time.Time{}, res
		if res.Resumed || res.Retried {
			if res.Retried {
				f.Log.Warn().Bytes("request_id", req.ID).Err(res.Err).Str("replica", up.Name).Msg("stream broke before its first event: sending it to the next replica")
			} else {
				f.Log.Warn().Bytes("request_id", req.ID).Err(res.Err).Str("replica", up.Name).Int("events", res.Events).Int("chunks", tr.chunks).Msg("stream broke: continuing it at the next replica")
			}
			obs.Retry(i, res)
			cont := *req
			if res.Resumed {
				cont.Body, cont.Bodies = body, nil
			}
			next, nextResp, nextStart, last = f.continueAt(&cont, targets, i+1, obs)
		}
		if next < 0 {
			// The stream ends here, broken: the client gets its end
			// (below), then the request is ended with its last failure.
			ended = true
			defer obs.End(last)
			if tr != nil && tr.finished {
				// The answer was complete; only the end marker was lost.
				_, _ = w.WriteString("data: [DONE]\n\n")
			} else {
				req.writeStreamError(w, "upstream stream broken: "+res.Err.Error())
			}
			_ = w.Flush()
			return
		}
		if res.Resumed {
			tr.continuing()
		}
		i, resp, start = next, nextResp, nextStart
	}
}

// A Panic is one recovered while an attempt was in flight, passed on with
// the stack of where it happened once the attempt was finished.
type Panic struct {
	Value any
	Stack []byte
}

func (p *Panic) Error() string { return fmt.Sprintf("internal error: %v", p.Value) }

// Unwrap returns the panic's value when it was an error.
func (p *Panic) Unwrap() error {
	err, _ := p.Value.(error)
	return err
}

// survive ends a stream whose relay panicked: unless it was ended, the
// request ends with the router's failure (so its in-flight accounting
// returns and the observer is released), the client gets the stream's
// error event, and OnPanic hears of it.
func (f *Forwarder) survive(w *bufio.Writer, req *Request, v any, obs Observer, ended bool, start time.Time) {
	p := &Panic{Value: v, Stack: debug.Stack()}
	if !ended {
		obs.End(Result{Err: p, Internal: true, PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)})
	}
	req.writeStreamError(w, "internal error")
	_ = w.Flush()
	if f.OnPanic != nil {
		f.OnPanic(p.Value, p.Stack)
	} else {
		f.Log.Error().Interface("panic", v).Bytes("stack", p.Stack).Msg("stream relay panicked")
	}
}

// continueAt dispatches a continuation to the targets from `from` on and
// returns the first that answers with an event stream, or -1 and the last
// failure, for the caller to end the request with (each earlier failure is
// a Retry).
func (f *Forwarder) continueAt(req *Request, targets []*Upstream, from int, obs Observer) (int, *fasthttp.Response, time.Time, Result) {
	var res Result
	for j := from; j < len(targets); j++ {
		obs.Attempt(j)
		start := time.Now()
		resp, err := f.dispatch(targets[j], req, req.bodyFor(j))
		if err == nil && resp.StatusCode() == fasthttp.StatusOK && isEventStream(resp) && resp.BodyStream() != nil {
			return j, resp, start, Result{}
		}
		res = Result{Err: err, Retried: j < len(targets)-1, PromptTokens: -1, CachedTokens: -1, Elapsed: time.Since(start)}
		if err == nil {
			res.Status = resp.StatusCode()
			res.Err = fmt.Errorf("continuation answered %d %s", res.Status, resp.Header.ContentType())
			_ = resp.CloseBodyStream()
			fasthttp.ReleaseResponse(resp)
		}
		f.Log.Warn().Bytes("request_id", req.ID).Err(res.Err).Str("replica", targets[j].Name).Msg("stream continuation failed")
		if res.Retried {
			obs.Retry(j, res)
		}
	}
	return -1, nil, time.Time{}, res
}

func (f *Forwarder) maxBody() int {
	if f.MaxBody > 0 {
		return f.MaxBody
	}
	return 64 << 20
}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 16<<10); return &b }}

// maxPendingEvent bounds how much of an unfinished SSE event is held back.
const maxPendingEvent = 1 << 20

// errFirstEventError ends a stream whose first event is an error: the
// engine failed the request before its first token (vLLM answers a
// generation error in a stream as one error event after a 200, such as a
// decode whose remote prefill's KV could not be read), so it is a failure
// before the first byte, which the next target may still serve.
var errFirstEventError = errors.New("proxy: the stream's first event is an error")

// errorEvent reports whether an event's data is an engine's error object:
// {"error": {...}} (vLLM's ErrorResponse, SGLang) or {"object": "error",
// ...} (vLLM before its ErrorInfo wrapper).
func errorEvent(payload []byte) bool {
	p := bytes.TrimLeft(payload, " \t")
	return bytes.HasPrefix(p, []byte(`{"error"`)) || bytes.HasPrefix(p, []byte(`{"object":"error"`)) || bytes.HasPrefix(p, []byte(`{"object": "error"`))
}

// errStalled ends a stream whose next event is overdue.
var errStalled = errors.New("proxy: upstream stream stalled (first-byte or idle timeout)")

// errBodyTooLarge reports an upstream answer over the buffering limit.
var errBodyTooLarge = errors.New("proxy: upstream response over the size limit")

func readAll(resp *fasthttp.Response, limit int) ([]byte, error) {
	r := resp.BodyStream()
	if r == nil {
		return resp.Body(), nil
	}
	var buf bytes.Buffer
	n, err := buf.ReadFrom(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return nil, err
	}
	if n > int64(limit) {
		return nil, errBodyTooLarge
	}
	return buf.Bytes(), nil
}

func isEventStream(resp *fasthttp.Response) bool {
	return bytes.HasPrefix(resp.Header.ContentType(), []byte("text/event-stream"))
}

// relayEvents copies SSE events from resp to w, flushing after each read so
// every event leaves as soon as it arrived, and notes usage (and, with tr,
// the text) on the way. first is called when the first body bytes arrive
// (the first token); never if none came. done reports whether [DONE] was
// relayed; a stream that broke before it is left for the caller to end.
//
// With a dialect (dl) the first token is the first event carrying output,
// which dl reports, not the first bytes.
func relayEvents(w *bufio.Writer, resp *fasthttp.Response, strip bool, firstByte, idle time.Duration, first func(), abort *Abort, tr *transcript, dl *dialected) (res Result, done bool) {
	res = Result{PromptTokens: -1, CachedTokens: -1}
	body := resp.BodyStream()
	closer, _ := body.(fasthttp.ReadCloserWithError)
	// A watchdog ends a stream whose first event or next event is overdue:
	// closing the body unblocks the Read below.
	var stalled atomic.Bool
	watchdog := time.AfterFunc(firstByte, func() {
		stalled.Store(true)
		if closer != nil {
			_ = closer.CloseWithError(errStalled)
		}
	})
	defer watchdog.Stop()
	if abort != nil && closer != nil {
		// Before the first event, and in a long gap, no write would show
		// that the client left.
		defer abort.relaying(closer)()
	}
	buf := make([]byte, 32<<10)
	var pending []byte
	firstSeen := false
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			watchdog.Reset(idle)
			if !firstSeen {
				firstSeen = true
				if dl == nil {
					first()
				}
			}
			data := buf[:n]
			if len(pending) > 0 {
				pending = append(pending, data...)
				data = pending
			}
			rest, werr := writeEvents(w, data, strip, &res, &done, tr, dl)
			if werr == nil {
				werr = w.Flush()
			}
			if errors.Is(werr, errFirstEventError) {
				// Nothing of this attempt reached the client: the caller
				// tries the next target as for a failure before the first byte.
				res.Err = werr
				if closer != nil {
					_ = closer.CloseWithError(werr)
				}
				return res, done
			}
			if werr != nil {
				res.ClientGone, res.Err = true, werr
				if closer != nil {
					_ = closer.CloseWithError(werr) // closes the upstream connection: the engine aborts
				}
				return res, done
			}
			if len(rest) > maxPendingEvent {
				// An event this large without its blank line: pass it on
				// as is rather than buffer without bound.
				if _, werr := w.Write(rest); werr == nil {
					werr = w.Flush()
				}
				res.Events++
				rest = nil
			}
			pending = append(pending[:0], rest...)
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				_ = resp.CloseBodyStream()
				if len(pending) > 0 { // a last event without its blank line
					_, _ = w.Write(pending)
				}
				_ = w.Flush()
				return res, done
			}
			switch {
			case abort != nil && abort.Aborted():
				res.ClientGone, rerr = true, errAborted
			case stalled.Load():
				rerr = errStalled
			}
			res.Err = rerr
			if closer != nil {
				_ = closer.CloseWithError(rerr)
			}
			return res, done
		}
	}
}

// writeEvents writes the complete events in data to w and returns the
// incomplete tail. A usage-only chunk is dropped when strip is set. A
// non-nil tr follows the text relayed (and drops a continuation's lead). A
// non-nil dl reads the events of its API instead (writeDialectEvent).
func writeEvents(w *bufio.Writer, data []byte, strip bool, res *Result, done *bool, tr *transcript, dl *dialected) ([]byte, error) {
	for {
		end, sep := eventEnd(data)
		if end < 0 {
			return data, nil
		}
		ev := data[:end+sep]
		data = data[end+sep:]
		if dl != nil {
			if err := writeDialectEvent(w, ev, end, res, dl); err != nil {
				return nil, err
			}
			continue
		}
		payload, ok := eventData(ev[:end])
		if ok && res.Events == 0 && errorEvent(payload) {
			return nil, errFirstEventError
		}
		keep := true
		if ok {
			if bytes.Equal(payload, doneMarker) {
				*done = true
			} else {
				if bytes.Contains(payload, usageKey) {
					if u, usageOnly, ok := parseUsageChunk(payload); ok {
						res.setUsage(u)
						keep = !(strip && usageOnly)
					}
				}
				if tr != nil {
					keep = tr.note(payload) && keep
					ev = tr.sameID(ev)
				}
			}
		} else if tr != nil && len(bytes.TrimSpace(ev)) > 0 && !bytes.HasPrefix(ev, []byte(":")) {
			tr.lost = true // an event the transcript cannot read
		}
		if !keep {
			continue
		}
		res.Events++
		if _, err := w.Write(ev); err != nil {
			return nil, err
		}
	}
}

// writeDialectEvent writes one event of a dialect's stream (its blank line
// at end), as dl reads and rewrites its data.
func writeDialectEvent(w *bufio.Writer, ev []byte, end int, res *Result, dl *dialected) error {
	if s, e := dataLine(ev[:end]); s >= 0 {
		if out := dl.note(ev[s:e], res); out != nil {
			if _, err := w.Write(ev[:s]); err != nil {
				return err
			}
			if _, err := w.Write(out); err != nil {
				return err
			}
			ev = ev[e:]
		}
	}
	res.Events++
	_, err := w.Write(ev)
	return err
}

// dialected returns req's dialect for target i's stream, nil without one.
func (req *Request) dialected(i int, first func()) *dialected {
	if req.Dialect == nil {
		return nil
	}
	return &dialected{d: req.Dialect, target: i, first: first}
}

// bodyUsage reads the usage of target i's non-streamed answer in resp into
// res and, with a dialect, rewrites the answer as the client gets it.
func (req *Request) bodyUsage(i int, resp *fasthttp.Response, res *Result) {
	if req.Dialect == nil {
		res.setUsage(usageFromBody(resp.Body()))
		return
	}
	res.setUsage(req.Dialect.BodyUsage(resp.Body()))
	if out := req.Dialect.Rewrite(i, resp.Body()); out != nil {
		resp.SetBody(out)
	}
}

// setUsage takes the counts of an engine's usage report.
func (r *Result) setUsage(u Usage) {
	r.PromptTokens, r.CachedTokens, r.CompletionTokens = u.Prompt, u.Cached, u.Completion
}

var (
	doneMarker = []byte("[DONE]")
	usageKey   = []byte(`"usage"`)
)

// eventEnd finds the blank line ending the first event: its offset and the
// separator's length ("\n\n" or "\r\n\r\n"), or -1.
func eventEnd(b []byte) (int, int) {
	lf := bytes.Index(b, []byte("\n\n"))
	crlf := bytes.Index(b, []byte("\r\n\r\n"))
	switch {
	case crlf >= 0 && (lf < 0 || crlf < lf):
		return crlf, 4
	case lf >= 0:
		return lf, 2
	}
	return -1, 0
}

// eventData returns the data of a single-line "data:" event.
func eventData(ev []byte) ([]byte, bool) {
	rest, ok := bytes.CutPrefix(ev, []byte("data:"))
	if !ok || bytes.IndexByte(rest, '\n') >= 0 {
		return nil, false
	}
	return bytes.TrimSpace(rest), true
}

// WriteError writes an OpenAI-shaped error.
func WriteError(ctx *fasthttp.RequestCtx, status int, typ, msg string) {
	ctx.Response.Header.SetContentType("application/json")
	ctx.SetStatusCode(status)
	ctx.SetBody(ErrorBody(status, typ, msg))
}

// ErrorBody is the JSON of an OpenAI-shaped error:
// {"error":{"message":...,"type":...,"code":status}}.
func ErrorBody(status int, typ, msg string) []byte {
	b := make([]byte, 0, 64+len(msg))
	b = append(b, `{"error":{"message":`...)
	b = appendJSONString(b, msg)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, typ)
	b = append(b, `,"code":`...)
	b = strconv.AppendInt(b, int64(status), 10)
	return append(b, "}}"...)
}

func appendJSONString(b []byte, s string) []byte {
	q, _ := json.Marshal(s) // a string always marshals
	return append(b, q...)
}

// writeStreamError ends a broken stream as req's API does: its dialect's
// error event, or writeStreamError's.
func (req *Request) writeStreamError(w *bufio.Writer, msg string) {
	if req.Dialect != nil {
		_, _ = w.Write(req.Dialect.StreamError(msg))
		return
	}
	writeStreamError(w, msg)
}

// writeStreamError ends a broken stream the way clients can parse: an error
// event, then [DONE].
func writeStreamError(w *bufio.Writer, msg string) {
	_, _ = fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", ErrorBody(fasthttp.StatusBadGateway, "upstream_error", msg))
}
