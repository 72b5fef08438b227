// Package enginesim serves the simulated engine of package engine over
// vLLM's HTTP dialect: OpenAI completions and chat completions (streamed or
// not, with usage.prompt_tokens_details.cached_tokens), /v1/models,
// /tokenize, /health, /metrics with vLLM's metric names and
// /reset_prefix_cache, with vLLM-shaped errors. One goroutine drives each
// engine and sleeps each step's simulated duration times the time scale;
// handlers reach it through channels.
//
// With a data-parallel size N above 1 the server fronts N independent
// engines as vLLM's API server fronts its DP ranks: each rank has its own
// prefix cache, scheduler and event stream (batches stamped with
// data_parallel_rank), a request carrying X-data-parallel-rank goes to that
// rank, and any other is placed by vLLM's internal load balancer.
//
// With a KV role the server plays a side of vLLM's disaggregated prefill
// and decode (its kv_transfer_params protocol, NixlConnector's): a prefill
// holds its blocks for a remote decode and names them in its answer, a
// decode given those parameters reads them from the prefill engine, over
// HTTP here, and is charged a transfer instead of the prefill.
package enginesim

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/tokenize"
)

// DefaultMaxTokens is the output length of a request that names none.
// (vLLM's default is "up to the model length"; a simulator wants short.)
const DefaultMaxTokens = 16

// Config configures a Server.
type Config struct {
	Model     string // served model name
	Tokenizer tokenize.Model
	Engine    engine.Config
	// TimeScale multiplies simulated step times into real sleeps: 1 is
	// real time, 0.1 ten times faster, 0 no sleeping at all.
	TimeScale float64
	// DataParallelSize is how many independent engines (vLLM DP ranks)
	// the server fronts; 0 means 1.
	DataParallelSize int
	// BalanceInterval is how often the internal balancer takes a fresh
	// snapshot of every rank's queues; 0 means vLLM's 100 ms (the DP
	// coordinator's stats publishing interval).
	BalanceInterval time.Duration
	// Events receives each step's KV-event batch, from every rank, each
	// batch stamped with its rank's data_parallel_rank; nil disables events.
	// Ranks call it concurrently, each from its own goroutine.
	Events engine.EventSink
	// APIKey, when set, is the bearer token every /v1 call must carry, as
	// with vllm serve --api-key (other paths and OPTIONS stay open).
	APIKey string
	// KVRole is the side of prefill/decode disaggregation the server
	// plays; empty means KVRoleBoth.
	KVRole KVRole
	// KVTransferTimeout is how long a prefill's blocks stay held for a
	// decode engine that does not read them, in simulated time
	// (VLLM_NIXL_ABORT_REQUEST_TIMEOUT); 0 means DefaultKVTransferTimeout.
	KVTransferTimeout time.Duration
	// KVLoadFailurePolicy is what a decode does when it cannot read a
	// remote prefill's KV; empty means KVLoadFail, vLLM's default.
	KVLoadFailurePolicy KVLoadFailurePolicy
	// EngineID is the server's remote_engine_id (vLLM's
	// kv_transfer_config.engine_id); empty means a random one.
	EngineID string
	// SideChannel is the host:port decode engines read this server's held
	// blocks at (remote_host, remote_port): its HTTP address; empty means
	// the local address each prefill request arrived at.
	SideChannel string
	Logger      zerolog.Logger
}

// Server is the HTTP face of one simulated engine per data-parallel rank.
type Server struct {
	cfg       Config
	ranks     []*rank
	balancer  *rankBalancer // nil with one rank
	vocabText map[uint32]string
	created   int64
	idPrefix  string
	nextID    atomic.Uint64
	running   atomic.Bool
	stopped   chan struct{}
	// sideClient reads held blocks from prefill engines.
	sideClient *fasthttp.Client
	responses  responseStore // stored Responses answers
}

// New builds a Server; call Run to start its engine.
func New(cfg Config) (*Server, error) {
	if cfg.Model == "" {
		return nil, errors.New("enginesim: model name is empty")
	}
	if cfg.Tokenizer == nil {
		return nil, errors.New("enginesim: no tokenizer")
	}
	if cfg.TimeScale < 0 || cfg.TimeScale != cfg.TimeScale {
		return nil, fmt.Errorf("enginesim: time scale %v: want ≥ 0", cfg.TimeScale)
	}
	if cfg.DataParallelSize < 0 {
		return nil, fmt.Errorf("enginesim: data-parallel size %d: want ≥ 1", cfg.DataParallelSize)
	}
	cfg.DataParallelSize = max(cfg.DataParallelSize, 1)
	if cfg.BalanceInterval <= 0 {
		cfg.BalanceInterval = defaultBalanceInterval
	}
	switch cfg.KVRole {
	case "":
		cfg.KVRole = KVRoleBoth
	case KVRoleBoth, KVRolePrefill, KVRoleDecode:
	default:
		return nil, fmt.Errorf("enginesim: KV role %q: want both, prefill or decode", cfg.KVRole)
	}
	switch cfg.KVLoadFailurePolicy {
	case "":
		cfg.KVLoadFailurePolicy = KVLoadFail
	case KVLoadFail, KVLoadRecompute:
	default:
		return nil, fmt.Errorf("enginesim: KV load failure policy %q: want fail or recompute", cfg.KVLoadFailurePolicy)
	}
	if cfg.KVTransferTimeout < 0 {
		return nil, fmt.Errorf("enginesim: KV transfer timeout %v: want ≥ 0", cfg.KVTransferTimeout)
	}
	if cfg.KVTransferTimeout == 0 {
		cfg.KVTransferTimeout = DefaultKVTransferTimeout
	}
	if cfg.EngineID == "" {
		cfg.EngineID = fmt.Sprintf("%016x%016x", rand.Uint64(), rand.Uint64())
	}
	if cfg.SideChannel != "" {
		if _, port, err := net.SplitHostPort(cfg.SideChannel); err != nil || port == "" {
			return nil, fmt.Errorf("enginesim: side channel %q: want host:port", cfg.SideChannel)
		}
	}
	vocab, text := outputVocab(cfg.Tokenizer)
	cfg.Engine.Vocab = vocab
	s := &Server{
		vocabText: text,
		created:   time.Now().Unix(),
		idPrefix:  strconv.FormatUint(rand.Uint64()>>16, 16),
		stopped:   make(chan struct{}),
		sideClient: &fasthttp.Client{Name: "enginesim", ReadTimeout: sideChannelTimeout, WriteTimeout: sideChannelTimeout,
			MaxIdleConnDuration: 5 * time.Second},
	}
	for i := range cfg.DataParallelSize {
		eng, err := engine.New(cfg.Engine)
		if err != nil {
			return nil, err
		}
		cfg.Engine = eng.Config()
		s.ranks = append(s.ranks, newRank(i, eng, cfg))
	}
	s.cfg = cfg
	if len(s.ranks) > 1 {
		s.balancer = newRankBalancer(len(s.ranks), cfg.BalanceInterval, s.rankLoad)
	}
	return s, nil
}

// rank is one data-parallel engine: its core, the loop driving it and the
// metrics it exports.
type rank struct {
	eng     *engine.Engine
	loop    *loop
	metrics *metrics
}

func newRank(i int, eng *engine.Engine, cfg Config) *rank {
	r := &rank{eng: eng, metrics: newMetrics(cfg.Model, cfg.Engine, i, cfg.DataParallelSize > 1, cfg.KVRole != KVRoleBoth)}
	var publishErrors uint64 // owned by the loop goroutine
	log := cfg.Logger.With().Int("data_parallel_rank", i).Logger()
	r.loop = newLoop(eng, i, cfg.TimeScale, cfg.Events, r.metrics, func(err error) {
		// A stuck publisher fails every step: log the first of each 1,000.
		if publishErrors%1000 == 0 {
			log.Warn().Err(err).Uint64("failures", publishErrors+1).Msg("publishing KV events")
		}
		publishErrors++
	})
	r.loop.holdFor = cfg.KVTransferTimeout
	return r
}

// rankLoad is what the DP coordinator reports of rank i: its waiting and
// running requests as of its last step.
func (s *Server) rankLoad(i int) (waiting, running int) {
	st := s.ranks[i].metrics.stats()
	return st.Waiting, st.Running
}

// Run drives the engine until ctx ends; requests still in flight then fail.
// Call it once.
func (s *Server) Run(ctx context.Context) {
	if s.running.Swap(true) {
		return
	}
	defer close(s.stopped)
	var wg sync.WaitGroup
	for _, r := range s.ranks {
		wg.Go(func() { r.loop.run(ctx) })
	}
	wg.Wait()
}

// Handler serves every endpoint.
func (s *Server) Handler(ctx *fasthttp.RequestCtx) {
	path := string(ctx.Path())
	method := string(ctx.Method())
	if !s.authorized(ctx, path, method) {
		ctx.SetStatusCode(fasthttp.StatusUnauthorized)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"error":"Unauthorized"}`)
		return
	}
	if rest, ok := strings.CutPrefix(path, "/v1/responses/"); ok {
		s.serveStored(ctx, rest)
		return
	}
	want := "POST"
	switch path {
	case "/v1/models", "/health", "/metrics", "/version", "/ping":
		want = "GET"
	case "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize", "/reset_prefix_cache", readPath, notifyPath:
	default:
		ctx.SetStatusCode(fasthttp.StatusNotFound)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"detail":"Not Found"}`)
		return
	}
	if method != want && !(want == "GET" && method == "HEAD") {
		ctx.SetStatusCode(fasthttp.StatusMethodNotAllowed)
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"detail":"Method Not Allowed"}`)
		return
	}
	switch path {
	case "/v1/completions":
		s.generate(ctx, false)
	case "/v1/chat/completions":
		s.generate(ctx, true)
	case "/v1/responses":
		s.agentGenerate(ctx, responsesAPI)
	case "/v1/messages":
		s.agentGenerate(ctx, messagesAPI)
	case "/tokenize":
		s.tokenizeEndpoint(ctx)
	case "/v1/models":
		s.models(ctx)
	case "/health", "/ping":
		select {
		case <-s.stopped:
			ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
		default:
		}
	case "/version":
		ctx.SetContentType("application/json")
		ctx.SetBodyString(`{"version":"enginesim"}`)
	case "/metrics":
		ctx.SetContentType("text/plain; version=0.0.4; charset=utf-8")
		ms := make([]*metrics, len(s.ranks))
		for i, r := range s.ranks {
			ms[i] = r.metrics
		}
		ctx.SetBody(appendMetricsText(make([]byte, 0, 8<<10*len(ms)), ms))
	case "/reset_prefix_cache":
		s.resetPrefixCache(ctx)
	case readPath:
		s.sideChannel(ctx, false)
	case notifyPath:
		s.sideChannel(ctx, true)
	}
}

// authorized applies vLLM's API-key rule: /v1 paths need the key, except
// for OPTIONS.
func (s *Server) authorized(ctx *fasthttp.RequestCtx, path, method string) bool {
	if s.cfg.APIKey == "" || method == fasthttp.MethodOptions || !strings.HasPrefix(path, "/v1") {
		return true
	}
	got := ctx.Request.Header.Peek(fasthttp.HeaderAuthorization)
	return subtle.ConstantTimeCompare(got, []byte("Bearer "+s.cfg.APIKey)) == 1
}

// resetPrefixCache resets every rank's cache and answers with rank 0's
// result, as vLLM's DP client does (call_utility_async on every engine,
// the first engine's result returned).
func (s *Server) resetPrefixCache(ctx *fasthttp.RequestCtx) {
	results := make([]chan bool, len(s.ranks))
	for i, r := range s.ranks {
		result := make(chan bool, 1)
		results[i] = result
		f := func() {
			b, ok := r.eng.ResetPrefixCache(0)
			if ok {
				r.loop.publish(b)
				r.loop.publishStats()
			}
			result <- ok
		}
		select {
		case r.loop.control <- f:
		case <-s.stopped:
			writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
			return
		}
	}
	first := true
	for i, result := range results {
		select {
		case ok := <-result:
			if i == 0 {
				first = ok
			}
		case <-s.stopped:
			writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
			return
		}
	}
	if !first {
		writeError(ctx, fasthttp.StatusConflict, "ConflictError", "cannot reset the prefix cache while requests hold KV blocks")
	}
}

func (s *Server) models(ctx *fasthttp.RequestCtx) {
	b := make([]byte, 0, 512)
	b = append(b, `{"object":"list","data":[{"id":`...)
	b = appendJSONString(b, s.cfg.Model)
	b = append(b, `,"object":"model","created":`...)
	b = strconv.AppendInt(b, s.created, 10)
	b = append(b, `,"owned_by":"vllm","root":`...)
	b = appendJSONString(b, s.cfg.Model)
	b = append(b, `,"parent":null,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(s.cfg.Engine.MaxModelLen), 10)
	b = append(b, `,"permission":[{"id":"modelperm-`...)
	b = append(b, s.idPrefix...)
	b = append(b, `","object":"model_permission","created":`...)
	b = strconv.AppendInt(b, s.created, 10)
	b = append(b, `,"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}]}`...)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

// writeError writes vLLM's error body: ErrorResponse{error: ErrorInfo} since
// v0.10.1 (vllm-project/vllm#22099; before, the ErrorInfo alone, with an
// "object":"error").
func writeError(ctx *fasthttp.RequestCtx, code int, typ, msg string) {
	b := make([]byte, 0, 128+len(msg))
	b = append(b, `{"error":{"message":`...)
	b = appendJSONString(b, msg)
	b = append(b, `,"type":`...)
	b = appendJSONString(b, typ)
	b = append(b, `,"param":null,"code":`...)
	b = strconv.AppendInt(b, int64(code), 10)
	b = append(b, "}}"...)
	ctx.SetStatusCode(code)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

func badRequest(ctx *fasthttp.RequestCtx, msg string) {
	writeError(ctx, fasthttp.StatusBadRequest, "BadRequestError", msg)
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string. Invalid UTF-8 never gets
// here: request bodies are checked first and output text is ours.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	b = appendJSONStringBody(b, s)
	return append(b, '"')
}

// appendJSONStringBody appends s escaped for a JSON string, without quotes.
func appendJSONStringBody(b []byte, s string) []byte {
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"', '\\':
			b = append(b, '\\', c)
		case '\n':
			b = append(b, '\\', 'n')
		case '\r':
			b = append(b, '\\', 'r')
		case '\t':
			b = append(b, '\\', 't')
		default:
			b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		}
		start = i + 1
	}
	return append(b, s[start:]...)
}
