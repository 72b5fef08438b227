// Package proxy forwards one OpenAI-style request to engine replicas over
// fasthttp and relays the answer to the client, streaming server-sent events
// as they arrive.
//
// It owns what happens on the wire: per-replica connection pools, timeouts
// that bound connecting and waiting for the first byte and the silence
// between chunks but never a long stream as a whole, retries on the next
// replica while nothing has reached the client yet, a clean SSE error when a
// stream breaks later (or, when the caller allows it, the stream continued
// at the next replica: resume.go), cancelling the upstream when the client
// goes away, and
// reading the engine's usage (cached prompt tokens) on the way through. Which
// replicas to try, in what order, is decided by the caller.
package proxy

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/valyala/fasthttp"
)

// Options tune the connections to one upstream. Zero fields take defaults.
type Options struct {
	// DialTimeout bounds establishing a TCP connection.
	DialTimeout time.Duration
	// FirstByteTimeout bounds the wait for the response to start once the
	// request is written; it must cover queueing plus prefill, and for a
	// non-streamed request, whose headers come with its last token, the
	// whole generation.
	FirstByteTimeout time.Duration
	// IdleTimeout bounds the silence between two reads once the response has
	// started, so a wedged stream ends while a long healthy one never does.
	IdleTimeout time.Duration
	// MaxConns caps connections per upstream; each stream holds one for its
	// whole life, so size it above the engine's concurrent sequences.
	MaxConns int
	// MaxConnWait is how long a request waits for a free connection.
	MaxConnWait time.Duration
	// MaxIdleConn closes pooled connections idle this long; keep it below the
	// engine's keep-alive (uvicorn's default is 5 s) so a request never picks
	// a connection the server is closing.
	MaxIdleConn time.Duration
}

func (o Options) withDefaults() Options {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.DialTimeout, 3*time.Second)
	def(&o.FirstByteTimeout, 10*time.Minute)
	def(&o.IdleTimeout, 2*time.Minute)
	def(&o.MaxConnWait, 2*time.Second)
	def(&o.MaxIdleConn, 4*time.Second)
	if o.MaxConns <= 0 {
		o.MaxConns = 4096
	}
	return o
}

// Upstream is one replica (or fallback endpoint) with its connection pool.
// It is safe for concurrent use.
type Upstream struct {
	Name string
	URL  string

	host   string // host:port for the Host header and dialing
	prefix string // path prefix of URL, without trailing slash
	// authorization, when set, replaces the client's Authorization header
	// (the engines' API key, or a fallback endpoint's own).
	authorization string
	// rank, when set, is the data-parallel rank every request names
	// (RankHeader); "" for an upstream that is not one rank of a server.
	rank string
	opt  Options // as given, for Same
	hc   *fasthttp.HostClient
	// firstByte and idle bound a stream's wait for its first event and the
	// silence between events (enforced by the relay).
	firstByte, idle time.Duration
	// watched holds the attempts an Abort may end.
	watched watched
}

// CheckURL reports why rawURL cannot be an upstream's (NewUpstream), nil
// when it can.
func CheckURL(rawURL string) error {
	_, err := parseURL(rawURL)
	return err
}

func parseURL(rawURL string) (*url.URL, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, err
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("URL %q must be http(s)://host[:port][/prefix]", rawURL)
	}
	return u, nil
}

// NewUpstream returns an upstream for base URL rawURL (http or https; a path
// is kept as a prefix, so "https://api.example.com/v1" is not supported: give
// the URL without the /v1). apiKey, when not empty, is sent as a bearer token
// instead of the client's Authorization.
func NewUpstream(name, rawURL, apiKey string, opt Options) (*Upstream, error) {
	u, err := parseURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("proxy: upstream %q: %w", name, err)
	}
	given := opt
	opt = opt.withDefaults()
	useTLS := u.Scheme == "https"
	addr := u.Host
	if u.Port() == "" {
		if useTLS {
			addr = net.JoinHostPort(u.Hostname(), "443")
		} else {
			addr = net.JoinHostPort(u.Hostname(), "80")
		}
	}
	up := &Upstream{
		Name:      name,
		URL:       rawURL,
		host:      u.Host,
		prefix:    strings.TrimSuffix(u.EscapedPath(), "/"),
		firstByte: opt.FirstByteTimeout,
		idle:      opt.IdleTimeout,
		opt:       given,
	}
	up.authorization = bearer(apiKey)
	dialer := &net.Dialer{Timeout: opt.DialTimeout, KeepAlive: 30 * time.Second}
	var tlsConfig *tls.Config
	if useTLS {
		tlsConfig = &tls.Config{ServerName: u.Hostname(), ClientSessionCache: tls.NewLRUClientSessionCache(0), MinVersion: tls.VersionTLS12}
	}
	up.hc = &fasthttp.HostClient{
		Addr:  addr,
		IsTLS: useTLS,
		Dial: func(a string) (net.Conn, error) {
			c, err := dialer.Dial("tcp", a)
			if err != nil {
				return nil, err
			}
			if tlsConfig != nil {
				// TLS goes under deadlineConn, not over it (fasthttp would
				// wrap it otherwise): a tagged request must be read in the
				// clear to be found (abort.go).
				if c, err = handshake(c, tlsConfig, opt.DialTimeout); err != nil {
					return nil, err
				}
			}
			// After the first bytes (a stream's headers may come before
			// prefill) the connection only has a backstop; the relay times
			// the first event and the gaps between events itself.
			return &deadlineConn{Conn: c, firstByte: opt.FirstByteTimeout, idle: max(opt.IdleTimeout, opt.FirstByteTimeout), watched: &up.watched}, nil
		},
		MaxConns:                      opt.MaxConns,
		MaxConnWaitTimeout:            opt.MaxConnWait,
		MaxIdleConnDuration:           opt.MaxIdleConn,
		MaxIdemponentCallAttempts:     2,
		MaxResponseBodySize:           64 << 20, // buffered (non-streamed) answers
		RetryIfErr:                    retryStaleConn,
		DisableHeaderNamesNormalizing: true,
		DisablePathNormalizing:        true,
		NoDefaultUserAgentHeader:      true,
		ReadBufferSize:                16 << 10,
		WriteBufferSize:               16 << 10,
		// ReadTimeout and WriteTimeout stay 0: fasthttp would apply them to
		// the whole streamed body. deadlineConn bounds silence instead.
	}
	return up, nil
}

// RankHeader names the data-parallel rank of a server a request is to be
// served on. vLLM (OpenAIServing._get_data_parallel_rank, v0.26) and SGLang
// (OpenAIServingBase.extract_routed_dp_rank_from_header) read it, in any
// case; without it their internal balancer picks a rank.
const RankHeader = "X-data-parallel-rank"

// NewRankUpstream is NewUpstream for data-parallel rank rank of the server
// at rawURL: every request sent through it names the rank in RankHeader,
// in place of any the client sent, so that it is served by the rank whose
// cache was predicted. A negative rank is NewUpstream's upstream.
func NewRankUpstream(name, rawURL, apiKey string, rank int, opt Options) (*Upstream, error) {
	u, err := NewUpstream(name, rawURL, apiKey, opt)
	if err == nil && rank >= 0 {
		u.rank = strconv.Itoa(rank)
	}
	return u, err
}

// Rank is the data-parallel rank u's requests name, -1 for none.
func (u *Upstream) Rank() int {
	if u.rank == "" {
		return -1
	}
	r, _ := strconv.Atoi(u.rank)
	return r
}

func bearer(apiKey string) string {
	if apiKey == "" {
		return ""
	}
	return "Bearer " + apiKey
}

// Same reports whether NewUpstream(u.Name, rawURL, apiKey, opt) would build
// an upstream like u, so a pool can be kept across configuration reloads.
func (u *Upstream) Same(rawURL, apiKey string, opt Options) bool {
	return u.URL == rawURL && u.authorization == bearer(apiKey) && u.opt == opt
}

// retryStaleConn retries once when a pooled connection turned out closed
// before any response byte: the server closed it while idle (seen as a
// closed connection, a broken pipe on write, or a reset), so it cannot have
// started the request. Without this, an engine that restarted or timed out
// idle connections fails the next request on each of them.
func retryStaleConn(_ *fasthttp.Request, attempts int, err error) (bool, bool) {
	stale := err == fasthttp.ErrConnectionClosed || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
	return false, attempts < 2 && stale
}

// Close drops the upstream's idle connections. In-flight requests finish.
func (u *Upstream) Close() { u.hc.CloseIdleConnections() }

// InUse reports the connections currently open to the upstream.
func (u *Upstream) InUse() int { return u.hc.ConnsCount() }

// Get performs a small buffered GET of path (e.g. /v1/models) with an
// overall timeout, for discovery rather than proxying.
func (u *Upstream) Get(path string, timeout time.Duration) (status int, body []byte, err error) {
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	u.prepare(req, path)
	req.Header.SetMethod(fasthttp.MethodGet)
	if u.authorization != "" {
		req.Header.Set(fasthttp.HeaderAuthorization, u.authorization)
	}
	if err := u.hc.DoTimeout(req, resp, timeout); err != nil {
		return 0, nil, err
	}
	return resp.StatusCode(), append([]byte(nil), resp.Body()...), nil
}

func (u *Upstream) prepare(req *fasthttp.Request, path string) {
	req.SetRequestURI(u.prefix + path)
	if u.hc.IsTLS {
		req.URI().SetScheme("https")
	}
	req.SetHost(u.host)
}

// deadlineConn turns per-read deadlines into the two timeouts a streaming
// proxy needs: after a request is written, the first read may wait up to
// firstByte (queueing and prefill); every later read up to idle. A
// connection carries one request at a time, so the state is per request.
type deadlineConn struct {
	net.Conn
	firstByte, idle time.Duration
	waiting         atomic.Bool
	// deadline is the read deadline last set; it is only moved when it
	// would change by more than an eighth of the timeout, since a read per
	// chunk would otherwise reset a runtime timer each time.
	deadline time.Time
	forced   atomic.Bool
	// owner is the tag of the request being carried (0: untagged) and
	// aborted the tag an Abort ended (abort.go).
	watched        *watched
	owner, aborted atomic.Uint64
	ownerMu        sync.Mutex // an abort and a change of owner exclude each other
}

// handshake runs the TLS handshake on c within timeout.
func handshake(c net.Conn, cfg *tls.Config, timeout time.Duration) (net.Conn, error) {
	tc := tls.Client(c, cfg)
	_ = tc.SetDeadline(time.Now().Add(timeout))
	if err := tc.Handshake(); err != nil {
		_ = c.Close()
		return nil, err
	}
	_ = tc.SetDeadline(time.Time{})
	return tc, nil
}

// Handshake is what tells fasthttp that a connection speaks TLS already
// (Dial did the handshake), so that it does not wrap it in another.
func (c *deadlineConn) Handshake() error {
	if h, ok := c.Conn.(interface{ Handshake() error }); ok {
		return h.Handshake()
	}
	return nil
}

func (c *deadlineConn) Write(p []byte) (int, error) {
	if !c.waiting.Load() { // the start of a request
		c.watched.noteWrite(c, p)
	}
	c.waiting.Store(true)
	c.forced.Store(true)
	return c.Conn.Write(p)
}

func (c *deadlineConn) Read(p []byte) (int, error) {
	if id := c.aborted.Load(); id != 0 && id == c.owner.Load() {
		return 0, errAborted
	}
	d := c.idle
	if c.waiting.Load() {
		d = c.firstByte
	}
	want := time.Now().Add(d)
	if c.forced.Swap(false) || want.Sub(c.deadline) > d/8 {
		if err := c.Conn.SetReadDeadline(want); err != nil {
			return 0, err
		}
		c.deadline = want
		// An abort since the check above set its deadline first: this one
		// would undo it and the read would wait out the whole timeout.
		if id := c.aborted.Load(); id != 0 && id == c.owner.Load() {
			return 0, errAborted
		}
	}
	n, err := c.Conn.Read(p)
	if n > 0 && c.waiting.Load() {
		c.waiting.Store(false)
		c.forced.Store(true) // switch to the idle timeout at the next read
	}
	return n, err
}
