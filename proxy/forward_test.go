package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"
)

// serve runs h on a loopback port until the test ends.
func serve(t testing.TB, h fasthttp.RequestHandler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: h, CloseOnShutdown: true}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.ShutdownWithContext(shutdownCtx(t)) })
	return "http://" + ln.Addr().String()
}

// refusedURL is a loopback URL nothing listens on.
func refusedURL(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

type recorder struct {
	mu       sync.Mutex
	attempts []int
	first    []int
	header   []int
	ttft     time.Duration
	finish   map[int]Result // by attempt, from Retry and End
	retried  int
	ended    int
	done     chan struct{}
}

func newRecorder() *recorder {
	return &recorder{finish: map[int]Result{}, done: make(chan struct{}, 16)}
}

func (r *recorder) Attempt(i int) { r.mu.Lock(); r.attempts = append(r.attempts, i); r.mu.Unlock() }

// open is the attempt begun last (-1: none), which End ends.
func (r *recorder) open() int {
	if len(r.attempts) == 0 {
		return -1
	}
	return r.attempts[len(r.attempts)-1]
}
func (r *recorder) FirstByte(i int, ttft time.Duration) {
	r.mu.Lock()
	r.ttft = ttft
	r.first = append(r.first, i)
	r.mu.Unlock()
}
func (r *recorder) Header(i int, h *fasthttp.ResponseHeader) {
	r.mu.Lock()
	r.header = append(r.header, i)
	r.mu.Unlock()
	h.Set("X-Served-By", fmt.Sprint(i))
}
func (r *recorder) Retry(i int, res Result) {
	r.mu.Lock()
	r.finish[i] = res
	r.retried++
	r.mu.Unlock()
	r.done <- struct{}{}
}
func (r *recorder) End(res Result) {
	r.mu.Lock()
	r.finish[r.open()] = res
	r.ended++
	r.mu.Unlock()
	r.done <- struct{}{}
}

// router runs a fasthttp server that forwards every request to targets.
func router(t testing.TB, targets []*Upstream, strip bool, rec *recorder) string {
	f := &Forwarder{Log: zerolog.Nop()}
	return serve(t, func(ctx *fasthttp.RequestCtx) {
		req := &Request{Path: string(ctx.Path()), Header: &ctx.Request.Header, Body: append([]byte(nil), ctx.PostBody()...), StripUsage: strip,
			Stream: string(ctx.Path()) == "/v1/chat/completions"}
		f.Forward(ctx, req, targets, rec)
	})
}

func upstreams(t testing.TB, urls ...string) []*Upstream {
	return upstreamsWith(t, Options{FirstByteTimeout: 5 * time.Second, IdleTimeout: 2 * time.Second}, urls...)
}

// upstreamsWith is upstreams with options of the test's own.
func upstreamsWith(t testing.TB, opt Options, urls ...string) []*Upstream {
	var out []*Upstream
	for i, u := range urls {
		up, err := NewUpstream(fmt.Sprintf("r%d", i), u, "", opt)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(up.Close)
		out = append(out, up)
	}
	return out
}

const completionJSON = `{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":40,"total_tokens":41,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":32}}}`

func jsonEngine(ctx *fasthttp.RequestCtx) {
	ctx.SetContentType("application/json")
	ctx.Response.Header.Set("X-Engine", "yes")
	ctx.Response.Header.Set("X-Seen-Path", string(ctx.Path()))
	ctx.Response.Header.Set("X-Seen-Auth", string(ctx.Request.Header.Peek("Authorization")))
	ctx.Response.Header.Set("X-Seen-Body", string(ctx.PostBody()))
	ctx.SetBodyString(completionJSON)
}

func TestForwardNonStreamedRelaysBodyHeadersAndUsage(t *testing.T) {
	rec := newRecorder()
	base := serve(t, jsonEngine)
	url := router(t, upstreams(t, base+"/prefix"), false, rec)
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	req.SetRequestURI(url + "/v1/completions")
	req.Header.SetMethod("POST")
	req.Header.Set("Authorization", "Bearer client")
	req.SetBodyString(`{"model":"m","prompt":"hello","extra_field":[1,2]}`)
	if err := fasthttp.DoTimeout(req, resp, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := string(resp.Body()); got != completionJSON {
		t.Fatalf("body %q", got)
	}
	checks := map[string]string{
		"X-Engine": "yes", "X-Served-By": "0", "X-Seen-Path": "/prefix/v1/completions",
		"X-Seen-Auth": "Bearer client", "X-Seen-Body": `{"model":"m","prompt":"hello","extra_field":[1,2]}`,
	}
	for k, want := range checks {
		if got := string(resp.Header.Peek(k)); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	<-rec.done
	res := rec.finish[0]
	if res.PromptTokens != 40 || res.CachedTokens != 32 || res.Err != nil || res.Status != 200 {
		t.Fatalf("result %+v", res)
	}
}

func TestForwardRetriesBeforeFirstByte(t *testing.T) {
	fail500 := serve(t, func(ctx *fasthttp.RequestCtx) { ctx.Error("boom", 500) })
	fail429 := serve(t, func(ctx *fasthttp.RequestCtx) { ctx.Error("slow down", 429) })
	ok := serve(t, jsonEngine)
	rec := newRecorder()
	url := router(t, upstreams(t, refusedURL(t), fail500, fail429, ok), false, rec)
	status, body, err := fasthttp.Post(nil, url+"/v1/completions", nil)
	if err != nil || status != 200 || string(body) != completionJSON {
		t.Fatalf("status %d err %v body %q", status, err, body)
	}
	for range 4 {
		<-rec.done
	}
	if fmt.Sprint(rec.attempts) != "[0 1 2 3]" || fmt.Sprint(rec.header) != "[3]" {
		t.Fatalf("attempts %v header %v", rec.attempts, rec.header)
	}
	if rec.finish[0].Err == nil || rec.finish[1].Status != 500 || rec.finish[2].Status != 429 || !rec.finish[2].Retried {
		t.Fatalf("finishes %+v", rec.finish)
	}
	if rec.retried != 3 || rec.ended != 1 || rec.finish[3].Status != 200 {
		t.Fatalf("%d retries, %d ends (last %+v); want 3 and 1", rec.retried, rec.ended, rec.finish[3])
	}
}

// TestNoTargetStillEnds: with nothing to try the request is answered 503
// and still ended once, so the observer is released.
func TestNoTargetStillEnds(t *testing.T) {
	rec := newRecorder()
	url := router(t, nil, false, rec)
	status, _, err := fasthttp.Post(nil, url+"/v1/completions", nil)
	if err != nil || status != 503 {
		t.Fatalf("status %d, %v", status, err)
	}
	<-rec.done
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.ended != 1 || len(rec.attempts) != 0 || rec.retried != 0 {
		t.Fatalf("%d ends, attempts %v, %d retries", rec.ended, rec.attempts, rec.retried)
	}
}

func TestForwardDoesNotRetryClientErrorsAndRelaysLastFailure(t *testing.T) {
	bad := serve(t, func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("application/json")
		ctx.SetStatusCode(400)
		ctx.SetBodyString(`{"error":"bad"}`)
	})
	rec := newRecorder()
	url := router(t, upstreams(t, bad, serve(t, jsonEngine)), false, rec)
	status, body, _ := fasthttp.Post(nil, url+"/v1/completions", nil)
	if status != 400 || string(body) != `{"error":"bad"}` || len(rec.attempts) != 1 {
		t.Fatalf("status %d body %q attempts %v", status, body, rec.attempts)
	}

	fail503 := serve(t, func(ctx *fasthttp.RequestCtx) { ctx.Error("overloaded", 503) })
	rec = newRecorder()
	url = router(t, upstreams(t, refusedURL(t), fail503), false, rec)
	status, body, _ = fasthttp.Post(nil, url+"/v1/completions", nil)
	if status != 503 || string(body) != "overloaded" {
		t.Fatalf("want the last failure relayed, got %d %q", status, body)
	}

	rec = newRecorder()
	url = router(t, upstreams(t, refusedURL(t), refusedURL(t)), false, rec)
	// None answered: as when the router knows of no replica, a 503 the
	// client may retry after a moment.
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url + "/v1/completions")
	req.Header.SetMethod("POST")
	if err := fasthttp.Do(req, resp); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode() != 503 || string(resp.Header.Peek("Retry-After")) != "1" ||
		!bytes.Contains(resp.Body(), []byte(`"type":"service_unavailable","code":503}}`)) {
		t.Fatalf("all refused: %d, Retry-After %q, %s", resp.StatusCode(), resp.Header.Peek("Retry-After"), resp.Body())
	}
}

func TestNonStreamedAnswerOverrunningItsLimitIsNotRetried(t *testing.T) {
	// A non-streamed answer's headers come with its last token: a replica
	// still generating at the first-byte timeout is slow, not dead, and
	// another would start the generation over.
	var calls atomic.Int32
	slow := func(ctx *fasthttp.RequestCtx) {
		calls.Add(1)
		time.Sleep(time.Second)
		ctx.SetBodyString(completionJSON)
	}
	targets := upstreamsWith(t, Options{FirstByteTimeout: 300 * time.Millisecond}, serve(t, slow), serve(t, slow))
	rec := newRecorder()
	status, body, err := fasthttp.Post(nil, router(t, targets, false, rec)+"/v1/completions", nil)
	if err != nil || status != 504 || !bytes.Contains(body, []byte(`"type":"upstream_timeout","code":504}}`)) {
		t.Fatalf("slow answer: %d %v %s", status, err, body)
	}
	<-rec.done
	if n := calls.Load(); n != 1 || len(rec.attempts) != 1 || !rec.finish[0].Overran || rec.finish[0].Retried {
		t.Fatalf("generations %d, attempts %v, finish %+v: want one, not retried, overran", n, rec.attempts, rec.finish[0])
	}

	// An answer larger than the router buffers would be as large elsewhere.
	calls.Store(0)
	huge := func(ctx *fasthttp.RequestCtx) {
		calls.Add(1)
		ctx.SetBody(make([]byte, 65<<20))
	}
	rec = newRecorder()
	status, body, err = fasthttp.Post(nil, router(t, upstreams(t, serve(t, huge), serve(t, huge)), false, rec)+"/v1/completions", nil)
	if err != nil || status != 502 || !bytes.Contains(body, []byte("larger than the router buffers")) {
		t.Fatalf("huge answer: %d %v %.200s", status, err, body)
	}
	<-rec.done
	if n := calls.Load(); n != 1 || len(rec.attempts) != 1 || !rec.finish[0].Overran {
		t.Fatalf("generations %d, attempts %v, finish %+v: want one, not retried, overran", n, rec.attempts, rec.finish[0])
	}
}

// sseEngine streams n content events interval apart, then, when usage is
// set, a usage-only chunk, then [DONE]. It reports on gone when a write fails.
func sseEngine(n int, interval time.Duration, usage bool, gone chan<- time.Time) fasthttp.RequestHandler {
	return func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			for i := range n {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
				if err := w.Flush(); err != nil {
					if gone != nil {
						gone <- time.Now()
					}
					return
				}
				time.Sleep(interval)
			}
			if usage {
				fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n")
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
			_ = w.Flush()
		})
	}
}

func wantEvents(n int, usage bool) string {
	var sb strings.Builder
	for i := range n {
		fmt.Fprintf(&sb, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
	}
	if usage {
		sb.WriteString("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n")
	}
	return sb.String() + "data: [DONE]\n\n"
}

func TestForwardStreamsEventsAndStripsUsageWhenAsked(t *testing.T) {
	for _, strip := range []bool{false, true} {
		rec := newRecorder()
		url := router(t, upstreams(t, serve(t, sseEngine(5, time.Millisecond, true, nil))), strip, rec)
		status, body, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil)
		if err != nil || status != 200 {
			t.Fatal(status, err)
		}
		if want := wantEvents(5, !strip); string(body) != want {
			t.Fatalf("strip=%v body\n%s\nwant\n%s", strip, body, want)
		}
		<-rec.done
		if r := rec.finish[0]; r.CachedTokens != 48 || r.PromptTokens != 64 || r.Err != nil {
			t.Fatalf("strip=%v result %+v", strip, r)
		}
	}
}

func TestForwardBrokenStreamEndsWithErrorEvent(t *testing.T) {
	// An upstream that announces chunked SSE, sends one event and hangs up.
	broken := brokenSSE(t, `{"choices":[{"delta":{"content":"a"}}]}`)
	rec := newRecorder()
	url := router(t, upstreams(t, broken), false, rec)
	status, body, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil)
	if err != nil || status != 200 {
		t.Fatal(status, err)
	}
	want := "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"message\":"
	if !strings.HasPrefix(string(body), want) || !strings.HasSuffix(string(body), "\"type\":\"upstream_error\",\"code\":502}}\n\ndata: [DONE]\n\n") {
		t.Fatalf("body %q", body)
	}
	<-rec.done
	if rec.finish[0].Err == nil || rec.finish[0].Events != 1 {
		t.Fatalf("result %+v", rec.finish[0])
	}
}

func TestClientDisconnectCancelsUpstreamWithin100ms(t *testing.T) {
	gone := make(chan time.Time, 1)
	rec := newRecorder()
	url := router(t, upstreams(t, serve(t, sseEngine(1000, 5*time.Millisecond, false, gone))), false, rec)
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprint(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	br := bufio.NewReader(c)
	// Read until a few events have arrived, then hang up.
	seen := 0
	for seen < 3 {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(line, "data:") {
			seen++
		}
	}
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0) // RST, as a killed client does
	}
	closed := time.Now()
	_ = c.Close()
	select {
	case at := <-gone:
		if d := at.Sub(closed); d > 100*time.Millisecond {
			t.Fatalf("upstream saw the cancel after %v", d)
		} else {
			t.Logf("upstream saw the cancel after %v", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("upstream never saw the cancel")
	}
	<-rec.done
	if r := rec.finish[0]; !r.ClientGone {
		t.Fatalf("result %+v", r)
	}
}

func TestUsageFromBody(t *testing.T) {
	cases := map[string][2]int{
		completionJSON:                  {40, 32},
		`{"usage":{"prompt_tokens":7}}`: {7, -1},
		`{"choices":[{"text":"\"usage\": no"}],"usage":null}`:            {-1, -1},
		`{"usage": {"prompt_tokens": 3, "prompt_tokens_details": null}}`: {3, -1},
		`not json`: {-1, -1},
	}
	for body, want := range cases {
		u := usageFromBody([]byte(body))
		if u.Prompt != want[0] || u.Cached != want[1] {
			t.Errorf("%s: got %+v want %v", body, u, want)
		}
	}
}

func TestErrorBodyIsValidJSON(t *testing.T) {
	got := string(ErrorBody(400, "invalid_request_error", "bad \"x\"\x00\n"))
	want := `{"error":{"message":"bad \"x\"\u0000\n","type":"invalid_request_error","code":400}}`
	if got != want {
		t.Fatalf("got %s", got)
	}
}

// TestStreamTTFTIsTheFirstEvent: engines send stream headers before
// prefill; the first token is the first event.
func TestStreamTTFTIsTheFirstEvent(t *testing.T) {
	slow := serve(t, func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		ctx.Response.ImmediateHeaderFlush = true
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			time.Sleep(150 * time.Millisecond) // prefill
			fmt.Fprint(w, "data: {\"choices\":[]}\n\ndata: [DONE]\n\n")
			_ = w.Flush()
		})
	})
	rec := newRecorder()
	url := router(t, upstreams(t, slow), false, rec)
	if status, _, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil); err != nil || status != 200 {
		t.Fatal(status, err)
	}
	<-rec.done
	if rec.ttft < 140*time.Millisecond || len(rec.first) != 1 {
		t.Fatalf("ttft %v, first-byte calls %v", rec.ttft, rec.first)
	}
}

// TestStalledStreamsEnd: a stream whose first event, or next event, is
// overdue ends with an error event; a slow but flowing one does not.
func TestStalledStreamsEnd(t *testing.T) {
	engine := func(firstDelay, gap time.Duration, n int) string {
		return serve(t, func(ctx *fasthttp.RequestCtx) {
			ctx.SetContentType("text/event-stream")
			ctx.Response.ImmediateHeaderFlush = true
			ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
				time.Sleep(firstDelay)
				for range n {
					fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n")
					if w.Flush() != nil {
						return
					}
					time.Sleep(gap)
				}
				fmt.Fprint(w, "data: [DONE]\n\n")
				_ = w.Flush()
			})
		})
	}
	opts := Options{FirstByteTimeout: 300 * time.Millisecond, IdleTimeout: 150 * time.Millisecond}
	cases := []struct {
		name       string
		url        string
		wantBroken bool
	}{
		{"first event late", engine(600*time.Millisecond, 0, 1), true},
		{"gap too long", engine(0, 400*time.Millisecond, 2), true},
		{"slow but flowing", engine(200*time.Millisecond, 100*time.Millisecond, 8), false},
	}
	for _, c := range cases {
		up, err := NewUpstream("u", c.url, "", opts)
		if err != nil {
			t.Fatal(err)
		}
		rec := newRecorder()
		url := router(t, []*Upstream{up}, false, rec)
		start := time.Now()
		_, body, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil)
		if err != nil {
			t.Fatal(err)
		}
		<-rec.done
		broken := strings.Contains(string(body), `"type":"upstream_error"`)
		if broken != c.wantBroken || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
			t.Errorf("%s: broken=%v after %v: %q", c.name, broken, time.Since(start), body)
		}
		if c.wantBroken && time.Since(start) > 550*time.Millisecond {
			t.Errorf("%s: took %v to give up", c.name, time.Since(start))
		}
		up.Close()
	}
}

func TestStaleConnectionErrorsAreRetriedOnce(t *testing.T) {
	for _, err := range []error{fasthttp.ErrConnectionClosed, &net.OpError{Op: "write", Err: os.NewSyscallError("write", syscall.EPIPE)}, syscall.ECONNRESET} {
		if _, retry := retryStaleConn(nil, 1, err); !retry {
			t.Errorf("%v not retried", err)
		}
		if _, retry := retryStaleConn(nil, 2, err); retry {
			t.Errorf("%v retried twice", err)
		}
	}
	if _, retry := retryStaleConn(nil, 1, errors.New("timeout")); retry {
		t.Error("a timeout was retried on the same connection pool")
	}
}

// TestForwardDropsHopByHopHeaders: connection-scoped headers, Expect,
// Accept-Encoding and a client's X-Kvmesh-Request (the router's own request
// tag) stay at the router; every other header reaches the engine as the
// client sent it.
func TestForwardDropsHopByHopHeaders(t *testing.T) {
	seen := make(chan string, 1)
	base := serve(t, func(ctx *fasthttp.RequestCtx) {
		var sb strings.Builder
		for k, v := range ctx.Request.Header.All() {
			fmt.Fprintf(&sb, "%s: %s\n", k, v)
		}
		seen <- sb.String()
		jsonEngine(ctx)
	})
	url := router(t, upstreams(t, base), false, newRecorder())
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"m","prompt":"hi"}`
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"+
		"Keep-Alive: timeout=5\r\nProxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n"+
		"Trailer: X-T\r\nUpgrade: h2c\r\nAccept-Encoding: gzip\r\nX-Tenant: acme\r\nOpenAI-Organization: org-1\r\nX-Kvmesh-Request: 7\r\n"+
		"X-Hop: 1\r\nX-Other-Hop: 2\r\nConnection: close, X-Hop\r\nConnection: x-other-hop, Content-Length\r\n\r\n%s", len(body), body)
	resp := fasthttp.AcquireResponse()
	if err := resp.Read(bufio.NewReader(conn)); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode() != 200 {
		t.Fatalf("status %d", resp.StatusCode())
	}
	got := strings.ToLower(<-seen)
	// Headers the client's Connection names are hop-by-hop too (RFC 9110
	// §7.6.1), except the framing ones the router sets for its own request.
	for _, h := range []string{"keep-alive:", "proxy-authorization:", "proxy-connection:", "te:", "trailer:", "upgrade:", "accept-encoding:", "connection:", "x-kvmesh-request:", "x-hop:", "x-other-hop:"} {
		if strings.Contains(got, "\n"+h) || strings.HasPrefix(got, h) {
			t.Errorf("engine received %q:\n%s", h, got)
		}
	}
	for _, h := range []string{"x-tenant: acme", "openai-organization: org-1", "content-type: application/json", fmt.Sprintf("content-length: %d", len(body))} {
		if !strings.Contains(got, h) {
			t.Errorf("engine did not receive %q:\n%s", h, got)
		}
	}
}

// TestForwardDropsCheckedAuthorization: a client key the router checked
// stays at the router; an upstream's own key replaces it.
func TestForwardDropsCheckedAuthorization(t *testing.T) {
	base := serve(t, jsonEngine)
	plain := upstreams(t, base)[0]
	keyed, err := NewUpstream("keyed", base, "upstream-key", Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(keyed.Close)
	f := &Forwarder{Log: zerolog.Nop()}
	for _, c := range []struct {
		up   *Upstream
		want string
	}{{plain, ""}, {keyed, "Bearer upstream-key"}} {
		url := serve(t, func(ctx *fasthttp.RequestCtx) {
			f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: ctx.PostBody(), DropAuthorization: true},
				[]*Upstream{c.up}, newRecorder())
		})
		status, _, hdr := post(t, url+"/v1/completions", "Bearer client-key")
		if status != 200 || hdr != c.want {
			t.Errorf("%s: status %d, engine saw Authorization %q, want %q", c.up.Name, status, hdr, c.want)
		}
	}
}

func post(t *testing.T, url, auth string) (int, []byte, string) {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod("POST")
	req.Header.Set("Authorization", auth)
	req.SetBodyString(`{"model":"m","prompt":"x"}`)
	if err := fasthttp.DoTimeout(req, resp, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode(), append([]byte(nil), resp.Body()...), string(resp.Header.Peek("X-Seen-Auth"))
}

// brokenSSE serves, on raw TCP, a chunked event stream of events that hangs
// up before it ends, as an engine that died mid-answer.
func brokenSSE(t *testing.T, events ...string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				_, _ = c.Read(buf)
				fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
				for _, ev := range events {
					ev = "data: " + ev + "\n\n"
					fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev)
				}
				time.Sleep(20 * time.Millisecond)
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// TestStreamBrokenBeforeItsFirstEventIsRetried: engines send a stream's
// headers before queueing and prefill. One that dies or stalls then has
// sent the client nothing of the answer, so the next target serves the
// request itself, whether or not streams may be continued.
func TestStreamBrokenBeforeItsFirstEventIsRetried(t *testing.T) {
	stalled := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ln.Close() })
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			_, _ = c.Read(make([]byte, 4096))
			fmt.Fprint(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			time.Sleep(3 * time.Second)
		}()
		return "http://" + ln.Addr().String()
	}
	for _, c := range []struct{ name, first string }{{"dies", brokenSSE(t)}, {"stalls", stalled()}} {
		targets := upstreamsWith(t, Options{FirstByteTimeout: 300 * time.Millisecond}, c.first, serve(t, sseEngine(3, 0, false, nil)))
		rec := newRecorder()
		status, body, err := fasthttp.Post(nil, router(t, targets, false, rec)+"/v1/chat/completions", nil)
		if err != nil || status != 200 || string(body) != wantEvents(3, false) {
			t.Fatalf("%s: %d %v %q", c.name, status, err, body)
		}
		<-rec.done
		<-rec.done
		if fmt.Sprint(rec.attempts) != "[0 1]" || !rec.finish[0].Retried || rec.finish[0].Err == nil || rec.finish[1].Err != nil || rec.finish[1].Events != 4 {
			t.Fatalf("%s: attempts %v, finishes %+v", c.name, rec.attempts, rec.finish)
		}
	}
}

// TestBrokenStreamContinuesAtNextTarget: a stream that breaks after two
// tokens goes on at the next target, which is asked (through Resume) to
// continue from the text the client has; the client sees one stream, the
// continuation's role announcement dropped, and no error.
func TestBrokenStreamContinuesAtNextTarget(t *testing.T) {
	// Each engine names and dates its stream; the client must see a's.
	created := map[string]string{"a": "1700000001", "b": "1700000002"}
	role := func(id string) string {
		return `{"id":"` + id + `","created":` + created[id] + `,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`
	}
	tok := func(id, s string) string {
		return `{"id":"` + id + `","created":` + created[id] + `,"choices":[{"index":0,"delta":{"content":"` + s + `"},"finish_reason":null}]}`
	}
	stop := func(id, s string) string {
		return `{"id":"` + id + `","created":` + created[id] + `,"choices":[{"index":0,"delta":{"content":"` + s + `"},"finish_reason":"stop"}]}`
	}
	a := brokenSSE(t, role("a"), tok("a", "Hel"), tok("a", "lo"))
	finished := brokenSSE(t, role("a"), tok("a", "Hel"), stop("a", "lo"))
	var seen atomic.Value
	b := serve(t, func(ctx *fasthttp.RequestCtx) {
		seen.Store(string(ctx.PostBody()))
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyStreamWriter(func(w *bufio.Writer) {
			for _, ev := range []string{role("b"), tok("b", " world"), stop("b", ""), "[DONE]"} {
				fmt.Fprintf(w, "data: %s\n\n", ev)
				_ = w.Flush()
			}
		})
	})
	for _, c := range []struct {
		name    string
		targets []string
		resume  bool
		want    string
	}{
		{"continued", []string{a, b}, true, role("a") + tok("a", "Hel") + tok("a", "lo") + tok("a", " world") + stop("a", "") + "[DONE]"},
		{"no target left", []string{a}, true, ""},
		{"next target refuses", []string{a, refusedURL(t)}, true, ""},
		{"not asked", []string{a, b}, false, ""},
		{"answer complete", []string{finished, b}, true, role("a") + tok("a", "Hel") + stop("a", "lo") + "[DONE]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := newRecorder()
			var asked atomic.Value
			f := &Forwarder{Log: zerolog.Nop()}
			targets := upstreams(t, c.targets...)
			url := serve(t, func(ctx *fasthttp.RequestCtx) {
				req := &Request{Path: "/v1/chat/completions", Header: &ctx.Request.Header, Body: []byte(`{"stream":true}`), Stream: true}
				if c.resume {
					req.Resume = func(text []byte, chunks int) ([]byte, bool) {
						asked.Store(fmt.Sprintf("%s/%d", text, chunks))
						return []byte(`{"continue":"` + string(text) + `"}`), true
					}
				}
				f.Forward(ctx, req, targets, rec)
			})
			status, body, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil)
			if err != nil || status != 200 {
				t.Fatal(status, err)
			}
			if c.want == "" {
				if !strings.Contains(string(body), `"type":"upstream_error"`) || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
					t.Fatalf("want the error event, got %q", body)
				}
				if len(c.targets) > 1 && c.resume { // resumed, then the continuation failed: that is the End
					for range 2 {
						<-rec.done
					}
					rec.mu.Lock()
					defer rec.mu.Unlock()
					if r0, r1 := rec.finish[0], rec.finish[1]; !r0.Resumed || r1.Retried || r1.Err == nil {
						t.Fatalf("finish %+v / %+v", r0, r1)
					}
				}
				return
			}
			var got strings.Builder
			for _, ev := range strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n") {
				got.WriteString(strings.TrimPrefix(ev, "data: "))
			}
			if got.String() != c.want {
				t.Fatalf("client got\n%s\nwant\n%s", got.String(), c.want)
			}
			if c.name == "answer complete" { // nothing to continue: just the end marker
				<-rec.done
				rec.mu.Lock()
				defer rec.mu.Unlock()
				if asked.Load() != nil || rec.finish[0].Resumed || len(rec.attempts) != 1 {
					t.Fatalf("asked %v, attempts %v, finish %+v", asked.Load(), rec.attempts, rec.finish[0])
				}
				return
			}
			if asked.Load() != "Hello/2" || seen.Load() != `{"continue":"Hello"}` {
				t.Fatalf("Resume got %v; the next target got %v", asked.Load(), seen.Load())
			}
			for range 2 {
				<-rec.done
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if r0, r1 := rec.finish[0], rec.finish[1]; !r0.Resumed || r0.Err == nil || r1.Err != nil || r1.Resumed || len(rec.attempts) != 2 {
				t.Fatalf("attempts %v, finish %+v / %+v", rec.attempts, r0, r1)
			}
		})
	}
}

// TestTranscriptKnowsWhatCannotBeContinued: only one choice of plain text
// can be continued from its transcript.
func TestTranscriptKnowsWhatCannotBeContinued(t *testing.T) {
	for _, c := range []struct {
		chunk string
		lost  bool
	}{
		{`{"choices":[{"index":0,"delta":{"content":"a"}}]}`, false},
		{`{"choices":[{"index":0,"text":"a","finish_reason":null}]}`, false},
		{`{"choices":[],"usage":{"prompt_tokens":3}}`, false},
		{`{"choices":[{"index":0,"delta":{"content":"a","tool_calls":null}}]}`, false},
		{`{"choices":[{"index":1,"delta":{"content":"a"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}`, false},
		{`{"error":{"message":"boom"}}`, true},
		{`not json`, true},
	} {
		tr := &transcript{}
		tr.note([]byte(c.chunk))
		if tr.lost != c.lost || tr.resumable() != (!c.lost && !strings.Contains(c.chunk, `"finish_reason":"`)) {
			t.Errorf("%s: lost=%v resumable=%v, want lost=%v", c.chunk, tr.lost, tr.resumable(), c.lost)
		}
	}
}

// workingEngine accepts one connection on ln and reads it as an engine
// generating for minutes does, noticing only a close: request gets what the
// first read brought, closed when the connection closed.
func workingEngine(ln net.Listener) (request <-chan string, closed <-chan time.Time) {
	req, done := make(chan string, 1), make(chan time.Time, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		n, _ := c.Read(buf)
		req <- string(buf[:n])
		for {
			if _, err := c.Read(buf); err != nil {
				done <- time.Now()
				return
			}
		}
	}()
	return req, done
}

// TestAbortEndsANonStreamedRequestAtTheEngine: an Abort closes the
// connection of the attempt in flight (the engine sees it within 100 ms and
// stops) and no other target is tried.
func TestAbortEndsANonStreamedRequestAtTheEngine(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	request, closed := workingEngine(ln)
	var second atomic.Int32
	other := serve(t, func(ctx *fasthttp.RequestCtx) { second.Add(1); jsonEngine(ctx) })
	targets := upstreams(t, "http://"+ln.Addr().String(), other)
	aborts := make(chan *Abort, 1)
	rec := newRecorder()
	f := &Forwarder{Log: zerolog.Nop()}
	url := serve(t, func(ctx *fasthttp.RequestCtx) {
		a := &Abort{}
		aborts <- a
		f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: []byte(`{"prompt":"x","max_tokens":500}`), Abort: a}, targets, rec)
	})
	go func() { _, _, _ = fasthttp.Post(nil, url+"/v1/completions", nil) }()
	a := <-aborts
	time.Sleep(100 * time.Millisecond) // the engine is working
	aborted := time.Now()
	a.Now()
	select {
	case at := <-closed:
		if d := at.Sub(aborted); d > 100*time.Millisecond {
			t.Errorf("the engine saw the close %v after the abort", d)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the engine's connection stayed open after the abort")
	}
	<-rec.done
	rec.mu.Lock()
	defer rec.mu.Unlock()
	tagged := strings.Contains(<-request, "\r\nX-Kvmesh-Request: ")
	if r := rec.finish[0]; !r.ClientGone || len(rec.attempts) != 1 || second.Load() != 0 || !tagged {
		t.Fatalf("attempts %v, finish %+v, second target hit %d times, tagged %v", rec.attempts, r, second.Load(), tagged)
	}
}

// headerPanics is an observer with a bug that fires while an answer is
// being relayed, between its attempt and its finish.
type headerPanics struct{ *recorder }

func (headerPanics) Header(int, *fasthttp.ResponseHeader) { panic("boom") }

// TestPanicMidAttemptFinishesIt: a panic between an attempt and its finish
// still finishes the attempt (as the router's failure, so in-flight counts
// return), then goes on up to the handler with the stack where it began.
func TestPanicMidAttemptFinishesIt(t *testing.T) {
	rec := newRecorder()
	targets := upstreams(t, serve(t, jsonEngine))
	f := &Forwarder{Log: zerolog.Nop()}
	caught := make(chan any, 1)
	url := serve(t, func(ctx *fasthttp.RequestCtx) {
		defer func() { caught <- recover() }()
		f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: []byte(`{"prompt":"x"}`)}, targets, headerPanics{rec})
	})
	go func() { _, _, _ = fasthttp.Post(nil, url+"/v1/completions", nil) }()
	p, ok := (<-caught).(*Panic)
	if !ok || p.Value != "boom" || !strings.Contains(string(p.Stack), "headerPanics.Header") {
		t.Fatalf("handler recovered %#v, want the *Panic with the stack of Header", p)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if r, finished := rec.finish[0]; !finished || !r.Internal || len(rec.attempts) != 1 {
		t.Fatalf("attempts %v, finish %+v: the attempt was left open", rec.attempts, rec.finish)
	}
}

// endPanics is an observer whose first End panics after it ran.
type endPanics struct {
	*recorder
	calls atomic.Int32
}

func (o *endPanics) End(r Result) {
	if o.calls.Add(1) == 1 {
		panic("end boom")
	}
}

// TestPanicInEndIsNotEndedTwice: the observer may release its state on
// End; a panic from inside it must not bring a second End.
func TestPanicInEndIsNotEndedTwice(t *testing.T) {
	obs := &endPanics{recorder: newRecorder()}
	targets := upstreams(t, serve(t, jsonEngine))
	f := &Forwarder{Log: zerolog.Nop()}
	caught := make(chan any, 1)
	url := serve(t, func(ctx *fasthttp.RequestCtx) {
		defer func() { caught <- recover() }()
		f.Forward(ctx, &Request{Path: "/v1/completions", Header: &ctx.Request.Header, Body: []byte(`{"prompt":"x"}`)}, targets, obs)
	})
	go func() { _, _, _ = fasthttp.Post(nil, url+"/v1/completions", nil) }()
	if v := <-caught; v == nil {
		t.Fatal("no panic reached the handler")
	}
	if n := obs.calls.Load(); n != 1 {
		t.Fatalf("End called %d times", n)
	}
}

// TestPanicInAContinuationFinishesIt: a panic while a broken stream is
// being continued at the next target finishes that target's attempt.
func TestPanicInAContinuationFinishesIt(t *testing.T) {
	broken := brokenSSE(t, `{"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}`,
		`{"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}`)
	targets := append(upstreams(t, broken), nil) // dispatching to nil panics
	rec := newRecorder()
	f := &Forwarder{Log: zerolog.Nop(), OnPanic: func(any, []byte) {}}
	url := serve(t, func(ctx *fasthttp.RequestCtx) {
		f.Forward(ctx, &Request{Path: "/v1/chat/completions", Header: &ctx.Request.Header, Body: []byte(`{"stream":true}`), Stream: true,
			Resume: func([]byte, int) ([]byte, bool) { return []byte(`{}`), true }}, targets, rec)
	})
	_, _, _ = fasthttp.Post(nil, url+"/v1/chat/completions", nil)
	deadline := time.Now().Add(2 * time.Second)
	for {
		rec.mu.Lock()
		r, finished := rec.finish[1]
		rec.mu.Unlock()
		if finished {
			if !r.Internal {
				t.Fatalf("continuation finished as %+v, want the router's failure", r)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the continuation's attempt was never finished")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStreamWhoseFirstEventIsAnErrorIsRetried: an engine that fails the
// request in its stream's first event (vLLM's generation error, as a
// decode whose remote KV could not be read answers) failed before the
// first token: the next target serves, and the client sees only its
// stream. With no target left the stream ends with an error event.
func TestStreamWhoseFirstEventIsAnErrorIsRetried(t *testing.T) {
	const errEvent = `data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}` + "\n\ndata: [DONE]\n\n"
	failing := serve(t, func(ctx *fasthttp.RequestCtx) {
		ctx.SetContentType("text/event-stream")
		ctx.SetBodyString(errEvent)
	})
	ok := serve(t, sseEngine(3, 0, false, nil))
	rec := newRecorder()
	url := router(t, upstreams(t, failing, ok), false, rec)
	status, body, err := fasthttp.Post(nil, url+"/v1/chat/completions", nil)
	if err != nil || status != 200 || strings.Contains(string(body), "error") || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("status %d err %v body %q", status, err, body)
	}
	for range 2 {
		<-rec.done
	}
	rec.mu.Lock()
	if fmt.Sprint(rec.attempts) != "[0 1]" || rec.retried != 1 || !errors.Is(rec.finish[0].Err, errFirstEventError) {
		t.Errorf("attempts %v, %d retries, first %+v", rec.attempts, rec.retried, rec.finish[0])
	}
	rec.mu.Unlock()

	rec = newRecorder()
	url = router(t, upstreams(t, failing), false, rec)
	if _, body, err = fasthttp.Post(nil, url+"/v1/chat/completions", nil); err != nil || !strings.Contains(string(body), "error") {
		t.Fatalf("last target: %v %q", err, body)
	}
}
