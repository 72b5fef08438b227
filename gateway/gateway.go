// Package gateway is the router's HTTP face: the OpenAI-compatible API, the
// admin API and metrics, on fasthttp. For each chat or completion it parses
// the body (package request), has package plan turn it, the fleet snapshot
// and this router's own in-flight work into the targets to try (route.go),
// maps them to connection pools and hands them to the proxy with a ledger
// (ledger.go), the proxy's observer, which keeps the in-flight accounting,
// teaches the policy, counts the metrics and logs the request. Responses
// and Messages requests take the chat's path, converted to the chat vLLM
// renders (dialect.go reads their answers, and sends follow-ups of a stored
// response where it lives). A follow-up's prompt starts with a history only
// its replica holds: chain.go rebuilds it from the state the id carries
// (package storedchain) and the stored output read back from the replica,
// so its cached tokens are predicted as a chat's are; one whose
// instructions, tools or template arguments changed, or whose state or
// output cannot be read, is served unpredicted. The other engine endpoints it knows
// (embeddings, audio...: enginePaths) take the same path by model and load
// only; any other path is its own 404.
//
// Settings that a config reload may change live behind one atomic pointer,
// so a reload swaps them between requests and never drops one.
package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/console"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tenant"
	"github.com/kvmesh/kvmesh/tokenize"
)

// DefaultGCPercent is the router's garbage-collection target (GOGC) unless
// the operator sets one. Its live heap is small and mostly pointer-free
// (tokenizer tables, filters; segment caches live off-heap), so collecting
// at 5× the live heap instead of 2× costs little memory and takes a GC
// cycle's write barriers and assists off four in five decisions:
// BenchmarkDecision llama3/system-cached, after the uncached run, p99 at
// GOGC=100 113-133 µs, at 400 77-81 µs. GOMEMLIMIT still caps the heap.
const DefaultGCPercent = 400

// Settings are what a config reload may change. Build a new value and pass
// it to Gateway.Apply; never modify one after that.
type Settings struct {
	Policy routing.Policy
	// Models maps a served model name (or LoRA adapter) to how the router
	// treats it. A model absent here still routes if replicas serve it.
	Models map[string]Model
	// DefaultTokenizer tokenizes models without their own (nil: such
	// models route by load only).
	DefaultTokenizer tokenize.Model
	// MaxPrefixTokens caps the tokens used for matching (default 16384).
	MaxPrefixTokens int
	// MaxPrefixBytes bounds the prompt bytes rendered and tokenized to
	// find them (default tokenize.DefaultMaxPrefixBytes): a decision costs
	// the same for any body the size limit lets through.
	MaxPrefixBytes int
	// MaxAttempts bounds the replicas tried for one request (default 3),
	// not counting the fallback.
	MaxAttempts int
	// APIKeys, when not empty, are the bearer tokens clients must present;
	// the client's Authorization is then not forwarded.
	APIKeys map[string]bool
	// AdminToken guards /admin/routes/clear when set. Without one the
	// endpoint is refused unless AdminOpen: anyone reaching the port could
	// otherwise cut every router's prefix hits (five clears a second took
	// them from 40/40 to 4/40).
	AdminToken string
	// AdminOpen serves /admin/routes/clear to anyone when no AdminToken is
	// set (--admin-open: a port only trusted clients reach).
	AdminOpen bool
	// EngineAPIKey, when set, is sent as a bearer token to every replica,
	// discovered or static, in place of the client's Authorization: the
	// key engines were started with (vllm serve --api-key). Fallback
	// endpoints keep their own.
	EngineAPIKey string
	// Upstream tunes connections to replicas.
	Upstream proxy.Options
	// NoDataParallelHeader withholds X-data-parallel-rank from requests
	// to a data-parallel rank's replica (--no-data-parallel-header): the
	// engine's own balancer then picks the rank, whatever the router
	// predicted. For measuring what naming the rank is worth, and for
	// engines that refuse the header.
	NoDataParallelHeader bool
	// IgnoreTiers matches only the blocks replicas hold on a GPU, blind to
	// their offload tiers (--ignore-tiers, plan.Settings.IgnoreTiers).
	IgnoreTiers bool
	// Split and SplitMinUncached: when a request to a model served by
	// prefill and decode pools is split (plan.Settings).
	Split            plan.Split
	SplitMinUncached int
	// CarryStoredState has the ids of stored responses carry what the
	// router needs to predict their follow-ups (--carry-stored-state,
	// package storedchain). Off, ids name their replica alone: routers of
	// the release before read no other form, so it waits until all run
	// this one. Ids that carry it are read either way.
	CarryStoredState bool
	// ResumeStreams continues a stream that breaks after reaching the
	// client at the next replica tried, from the text already sent
	// (proxy.Request.Resume), instead of ending it with an error event.
	ResumeStreams bool
	// Tenants names each request's tenant from its API key; nil: one
	// default tenant, authenticated by APIKeys when set.
	Tenants *tenant.Directory
	// Flow holds requests in the router while the fleet is saturated.
	Flow FlowControl
	// SessionHeaders are the request headers naming a client's session, the
	// first one present wins (nil: DefaultSessionHeaders; empty: none).
	SessionHeaders []string
	// PassthroughPaths are POST paths passed through by model and load as
	// enginePaths are (--passthrough-paths): an engine route this build
	// does not list stays reachable without a new release. Each must pass
	// CheckPassthroughPath.
	PassthroughPaths []string

	// passthrough is PassthroughPaths as a set (withDefaults).
	passthrough map[string]bool
	// plan and planModels are the above as the planner reads them
	// (withDefaults).
	plan       plan.Settings
	planModels map[string]plan.Model
}

// DefaultSessionHeaders are the session headers of common agent clients:
// X-Session-Id (a common convention, the one to set from a client of one's
// own), Claude Code's x-claude-code-session-id, and session_id, which
// OpenAI's Codex CLI sends with each Responses request
// (codex-rs/codex-api, build_conversation_headers).
var DefaultSessionHeaders = []string{"X-Session-Id", "X-Claude-Code-Session-Id", "Session_id"}

// Model is per-model routing knowledge.
type Model struct {
	// Tokenizer for this model (nil: DefaultTokenizer).
	Tokenizer tokenize.Model
	// Adapter is set when the model name is a LoRA adapter: its block keys
	// are seeded with this name. Base names the model it adapts.
	Adapter, Base string
	// Fallback takes requests no replica can serve (mode fallback).
	Fallback []*proxy.Upstream
	// SpillAfter, with a Fallback, sends a request to the fallback first
	// when even its best replica is predicted to keep it waiting longer
	// than this for a first token (kvaware's estimate, which counts the
	// prefill its cached prefix saves: cold prompts spill before warm
	// ones). 0: the fallback only takes what no replica can serve.
	SpillAfter time.Duration
	// EnginePriority: its replicas run vLLM's --scheduling-policy
	// priority, and each request's band is sent as its priority field
	// (enginePriority), so the engine serves critical work first too.
	EnginePriority bool
}

// tokenizer is ms's tokenizer, else the default one (nil: none).
func (s *Settings) tokenizer(ms Model) tokenize.Model {
	if ms.Tokenizer != nil {
		return ms.Tokenizer
	}
	return s.DefaultTokenizer
}

func (s *Settings) withDefaults() *Settings {
	c := *s
	if c.MaxPrefixTokens <= 0 {
		c.MaxPrefixTokens = tokenize.DefaultMaxPrefixTokens
	}
	if c.MaxPrefixBytes <= 0 {
		c.MaxPrefixBytes = tokenize.DefaultMaxPrefixBytes
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = 3
	}
	if c.Policy == nil {
		c.Policy, _ = routing.New("kvaware", routing.Config{})
	}
	if c.Tenants == nil {
		keys := make([]string, 0, len(c.APIKeys))
		for k := range c.APIKeys {
			keys = append(keys, k)
		}
		// Keys from a map are distinct and, once in a map, not empty or
		// the tenant package would refuse them: New cannot fail here.
		c.Tenants, _ = tenant.New(tenant.Spec{Default: tenant.Tenant{MaxPriority: flowcontrol.Standard}, DefaultKeys: keys})
	}
	c.Flow = c.Flow.withDefaults()
	c.passthrough = make(map[string]bool, len(c.PassthroughPaths))
	for _, p := range c.PassthroughPaths {
		c.passthrough[p] = true
	}
	if c.SessionHeaders == nil {
		c.SessionHeaders = DefaultSessionHeaders
	}
	c.plan = plan.Settings{Policy: c.Policy, MaxPrefixTokens: c.MaxPrefixTokens, MaxPrefixBytes: c.MaxPrefixBytes, MaxAttempts: c.MaxAttempts, IgnoreTiers: c.IgnoreTiers,
		Split: c.Split, SplitMinUncached: c.SplitMinUncached}
	c.planModels = make(map[string]plan.Model, len(c.Models))
	for name, ms := range c.Models {
		pm := plan.Model{Tokenizer: c.tokenizer(ms), Adapter: ms.Adapter, Base: ms.Base, SpillAfter: ms.SpillAfter}
		for _, up := range ms.Fallback {
			pm.Fallback = append(pm.Fallback, up.Name)
		}
		c.planModels[name] = pm
	}
	return &c
}

// planModel is how the planner treats model, whose settings are ms.
func (s *Settings) planModel(model string, ms Model) plan.Model {
	if pm, ok := s.planModels[model]; ok {
		return pm
	}
	return plan.Model{Tokenizer: s.tokenizer(ms), Adapter: ms.Adapter, Base: ms.Base, SpillAfter: ms.SpillAfter}
}

// Clusterer spreads what one router learns to the others (gossip); nil
// when the router runs alone.
type Clusterer interface {
	ReportInflight(replica string, requests, prefillTokens int)
	ClearRoutes(names []string)
	// ShareTenantUsage tells the other routers what each tenant used here
	// (quotas across routers); their reports come back through
	// MergeTenantUsage.
	ShareTenantUsage(usage []filterstream.TenantUsage)
}

// Gateway serves the router's HTTP API.
type Gateway struct {
	table   *fleet.Table
	cluster Clusterer
	log     zerolog.Logger
	// maxBody is the body limit Server was given, named in the 413.
	maxBody int
	// stopping is set once shutdown began (Stopping).
	stopping atomic.Bool
	authLog  zerolog.Logger // log, at most one line a minute: replicas refusing the router
	// panicLog is log at most once a minute: a panic a request provokes
	// repeats with every such request.
	panicLog zerolog.Logger

	settings atomic.Pointer[Settings]
	fwd      proxy.Forwarder
	metrics  *metrics
	inflight inflightTable
	loadIdx  atomic.Pointer[loadIndex] // in-flight entries of the latest snapshot's replicas

	upMu      sync.Mutex
	upstreams atomic.Pointer[map[string]*proxy.Upstream] // by replica name, copy-on-write

	watch   clientWatch // clients of long non-streamed requests
	flow    *flowGate
	ledgers sync.Pool
	now     func() time.Time
	started time.Time
}

// New returns a gateway routing over table. cluster may be nil.
func New(table *fleet.Table, cluster Clusterer, s Settings, log zerolog.Logger) *Gateway {
	g := &Gateway{table: table, cluster: cluster, log: log, now: time.Now, started: time.Now(),
		authLog:  log.Sample(&zerolog.BurstSampler{Burst: 1, Period: time.Minute}),
		panicLog: log.Sample(&zerolog.BurstSampler{Burst: 1, Period: time.Minute})}
	g.fwd = proxy.Forwarder{Log: log, OnPanic: func(v any, stack []byte) {
		g.panicked("panic", v, stack).Msg("stream relay panicked")
	}}
	g.inflight.init()
	g.flow = newFlowGate(g)
	empty := map[string]*proxy.Upstream{}
	g.upstreams.Store(&empty)
	g.Apply(s)
	g.metrics = newMetrics(g)
	g.ledgers.New = func() any { return new(ledger) }
	return g
}

// Apply swaps in new settings; requests already routed finish with the old.
func (g *Gateway) Apply(s Settings) {
	ns := s.withDefaults()
	old := g.settings.Swap(ns)
	g.flow.configure(ns)
	if old != nil && g.metrics != nil && old.Policy != s.Policy {
		g.metrics.retirePolicy(old.Policy)
	}
}

// Stopping makes /ready answer 503 from now on, while every other route
// serves as before: load balancers take the router out before it stops
// accepting connections.
func (g *Gateway) Stopping() { g.stopping.Store(true) }

// Settings returns the settings in force.
func (g *Gateway) Settings() *Settings { return g.settings.Load() }

// SetCluster attaches the gossip node once it has started.
func (g *Gateway) SetCluster(c Clusterer) { g.cluster = c }

// ClearRecords drops the policy's own route records for names (all when
// empty); gossip calls it when another router cleared routes.
func (g *Gateway) ClearRecords(names []string) {
	if c, ok := g.Settings().Policy.(routing.Clearer); ok {
		c.ClearRecords(names)
	}
}

// Handler is the fasthttp handler for every route: the API and the
// operator's on one port.
func (g *Gateway) Handler(ctx *fasthttp.RequestCtx) { g.serve(ctx, apiRoutes|operatorRoutes) }

// routeSet is which of the router's routes a listener serves; /health and
// /ready are served on every one.
type routeSet uint8

const (
	// apiRoutes: the OpenAI API, /tokenize and the engine endpoints passed
	// through.
	apiRoutes routeSet = 1 << iota
	// operatorRoutes: /admin/*, the console and /metrics (operatorRoute).
	operatorRoutes
)

func (g *Gateway) serve(ctx *fasthttp.RequestCtx, routes routeSet) {
	defer g.survive(ctx)
	path := ctx.Path()
	switch {
	case string(path) == "/health":
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"status":"ok"}`)
	case string(path) == "/ready":
		g.serveReady(ctx)
	case operatorRoute(path):
		if routes&operatorRoutes == 0 {
			noRoute(ctx)
			return
		}
		g.serveOperator(ctx, path)
	case routes&apiRoutes == 0:
		noRoute(ctx)
	default:
		g.serveAPI(ctx, path)
	}
}

func (g *Gateway) serveAPI(ctx *fasthttp.RequestCtx, path []byte) {
	post := ctx.IsPost()
	switch {
	case post && string(path) == "/v1/chat/completions":
		g.serveCompletion(ctx, request.Chat)
	case post && string(path) == "/v1/completions":
		g.serveCompletion(ctx, request.Completion)
	case post && string(path) == "/v1/responses":
		g.serveCompletion(ctx, request.Responses)
	case post && string(path) == "/v1/messages":
		g.serveCompletion(ctx, request.Messages)
	case bytes.HasPrefix(path, responsesPrefix):
		g.serveStored(ctx, path)
	case string(path) == "/v1/models":
		g.serveModels(ctx, "")
	case !post && bytes.HasPrefix(path, modelPrefix):
		g.serveModels(ctx, string(path[len(modelPrefix):]))
	case post && string(path) == "/tokenize":
		g.serveTokenize(ctx)
	case post && (passedThrough(path) || g.Settings().passthrough[string(path)]):
		g.serveCompletion(ctx, request.Passthrough)
	case !post && (postOnly(path) || g.Settings().passthrough[string(path)]):
		onlyPost(ctx, path)
	default:
		noRoute(ctx)
	}
}

func (g *Gateway) serveOperator(ctx *fasthttp.RequestCtx, path []byte) {
	switch {
	case string(path) == "/metrics":
		g.metrics.serve(ctx)
	case string(path) == "/admin/replicas":
		g.serveReplicas(ctx)
	case string(path) == "/admin/queues":
		g.serveQueues(ctx)
	case string(path) == "/admin/routes/clear":
		if !ctx.IsPost() {
			onlyPost(ctx, path)
			return
		}
		g.serveClear(ctx)
	case console.Owns(path):
		console.Handler(ctx)
	default:
		noRoute(ctx)
	}
}

// onlyPost answers another method on a POST route 405, not a 404 that
// reads as a wrong URL.
func onlyPost(ctx *fasthttp.RequestCtx, path []byte) {
	ctx.Response.Header.Set(fasthttp.HeaderAllow, fasthttp.MethodPost)
	proxy.WriteError(ctx, fasthttp.StatusMethodNotAllowed, "invalid_request_error", string(ctx.Method())+" "+string(path)+": only POST is served here")
}

// noRoute is the router's own 404, OpenAI-shaped, for a path the listener
// does not serve: a mistyped one never reaches an engine. It goes around
// fail, which would count it in errors_total as an unknown model.
func noRoute(ctx *fasthttp.RequestCtx) {
	proxy.WriteError(ctx, fasthttp.StatusNotFound, "not_found_error", "no route "+string(ctx.Method())+" "+string(ctx.Path()))
}

// survive turns a panic in a request's handling into a 500 for that request
// alone (fasthttp would let it end the process, and every stream with it),
// counted as errors_total{type="panic"} and logged with its stack.
func (g *Gateway) survive(ctx *fasthttp.RequestCtx) {
	r := recover()
	if r == nil {
		return
	}
	stack := debug.Stack()
	if p, ok := r.(*proxy.Panic); ok { // re-raised once its attempt was finished
		r, stack = p.Value, p.Stack
	}
	g.panicked("panic", r, stack).Str("path", string(ctx.Path())).Msg("request handler panicked")
	ctx.Response.Reset()
	proxy.WriteError(ctx, fasthttp.StatusInternalServerError, "internal_error", "internal error")
}

// panicked counts a recovered panic as errors_total{type=typ} and returns
// the (rate-limited) log event that tells it, with its stack.
func (g *Gateway) panicked(typ string, v any, stack []byte) *zerolog.Event {
	g.metrics.errors.WithLabelValues(typ).Inc()
	return g.panicLog.Error().Interface("panic", v).Bytes("stack", stack)
}

// ErrorHandler answers requests fasthttp could not read, in OpenAI's shape.
func (g *Gateway) ErrorHandler(ctx *fasthttp.RequestCtx, err error) {
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		g.metrics.errors.WithLabelValues("too_large").Inc()
		proxy.WriteError(ctx, fasthttp.StatusRequestEntityTooLarge, "invalid_request_error",
			fmt.Sprintf("request body over the router's limit of %d bytes (--max-body-bytes)", g.maxBody))
		ctx.SetConnectionClose()
		return
	}
	g.metrics.errors.WithLabelValues("bad_request").Inc()
	proxy.WriteError(ctx, fasthttp.StatusBadRequest, "invalid_request_error", "cannot read request: "+err.Error())
	ctx.SetConnectionClose()
}

func (g *Gateway) fail(ctx *fasthttp.RequestCtx, err error) {
	var re *request.Error
	if !errors.As(err, &re) {
		re = &request.Error{Status: 500, Type: "internal_error", Message: err.Error()}
	}
	label := "bad_request"
	switch re.Status {
	case 401:
		label = "unauthorized"
	case 403:
		label = "forbidden"
	case 404:
		label = "unknown_model"
		if re.Type == "invalid_request_error" { // the stored-response 404s (dialect.go, plan)
			label = "stored_response_not_found"
		}
	case 503:
		label = "no_replica"
		ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
	}
	g.metrics.errors.WithLabelValues(label).Inc()
	proxy.WriteError(ctx, re.Status, re.Type, re.Message)
}

// authorize checks the client's bearer token against the configured keys
// (the router's and its tenants').
func (s *Settings) authorize(ctx *fasthttp.RequestCtx) error {
	if !s.Tenants.RequiresKey() {
		return nil
	}
	tok, ok := bytes.CutPrefix(ctx.Request.Header.Peek(fasthttp.HeaderAuthorization), []byte("Bearer "))
	if _, known := s.Tenants.Identify(tok, nil); !ok || !known {
		return errUnauthorized
	}
	return nil
}

var errUnauthorized = &request.Error{Status: 401, Type: "invalid_request_error", Message: "missing or invalid API key"}

// invalidHeader is a 400 naming the request header at fault.
func invalidHeader(name, why string) error {
	return request.Invalid("header %s: %s", name, why)
}

// upstream returns the connection pool for replica r, creating it on first
// use and replacing it when the replica's URL, the engine API key or the
// upstream options changed.
func (g *Gateway) upstream(r *fleet.Replica) (*proxy.Upstream, error) {
	s := g.Settings()
	rank := s.rankOf(r)
	if u := (*g.upstreams.Load())[r.Name]; u != nil && u.Same(r.URL, s.EngineAPIKey, s.Upstream) && u.Rank() == rank {
		return u, nil
	}
	g.upMu.Lock()
	defer g.upMu.Unlock()
	cur := *g.upstreams.Load()
	if u := cur[r.Name]; u != nil && u.Same(r.URL, s.EngineAPIKey, s.Upstream) && u.Rank() == rank {
		return u, nil
	}
	u, err := proxy.NewRankUpstream(r.Name, r.URL, s.EngineAPIKey, rank, s.Upstream)
	if err != nil {
		return nil, err
	}
	next := make(map[string]*proxy.Upstream, len(cur)+1)
	for k, v := range cur {
		next[k] = v
	}
	if old := next[r.Name]; old != nil {
		old.Close()
	}
	next[r.Name] = u
	g.upstreams.Store(&next)
	return u, nil
}

// rankOf is the data-parallel rank requests to r name (-1: none): its own
// when it is one rank of a server, so that the engine serves them from the
// cache the router predicted rather than where its balancer would.
func (s *Settings) rankOf(r *fleet.Replica) int {
	if !r.DataParallel || s.NoDataParallelHeader {
		return -1
	}
	return r.DataParallelRank
}

// Server returns a fasthttp server for every route, configured for long
// streams: no write timeout (it would cap a whole stream), request bodies
// up to maxBody bytes, 16 KiB of headers.
func (g *Gateway) Server(maxBody int) *fasthttp.Server {
	return g.server(maxBody, g.Handler)
}

// Servers returns Server's two halves, for an admin listener: api serves
// the API and answers the operator's routes (/admin/*, the console,
// /metrics) with a 404; admin serves those alone. Both answer /health and
// /ready, where orchestrators probe.
func (g *Gateway) Servers(maxBody int) (api, admin *fasthttp.Server) {
	api = g.server(maxBody, func(ctx *fasthttp.RequestCtx) { g.serve(ctx, apiRoutes) })
	admin = g.server(maxBody, func(ctx *fasthttp.RequestCtx) { g.serve(ctx, operatorRoutes) })
	return api, admin
}

func (g *Gateway) server(maxBody int, h fasthttp.RequestHandler) *fasthttp.Server {
	g.maxBody = maxBody // for the 413's message; set before anything is served
	return &fasthttp.Server{
		Handler:                      h,
		ErrorHandler:                 g.ErrorHandler,
		Name:                         "kvmesh-router",
		MaxRequestBodySize:           maxBody,
		ReadBufferSize:               16 << 10,
		ReadTimeout:                  5 * time.Minute, // reading one request, not the response
		IdleTimeout:                  2 * time.Minute,
		WriteTimeout:                 0,
		CloseOnShutdown:              true,
		NoDefaultDate:                false,
		DisablePreParseMultipartForm: true,
	}
}
