// Package enginesim serves the simulated engine of package engine over
// vLLM's HTTP dialect: OpenAI completions and chat completions (streamed or
// not, with usage.prompt_tokens_details.cached_tokens), /v1/models,
// /tokenize, /health, /metrics with vLLM's metric names and
// /reset_prefix_cache, with vLLM-shaped errors. One goroutine drives the
// engine and sleeps each step's simulated duration times the time scale;
// handlers reach it through channels.
package enginesim

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
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
	// Events receives each step's KV-event batch; nil disables events.
	Events engine.EventSink
	// APIKey, when set, is the bearer token every /v1 call must carry, as
	// with vllm serve --api-key (other paths and OPTIONS stay open).
	APIKey string
	Logger zerolog.Logger
}

// Server is the HTTP face of one simulated engine.
type Server struct {
	cfg       Config
	eng       *engine.Engine
	loop      *loop
	metrics   *metrics
	vocabText map[uint32]string
	created   int64
	idPrefix  string
	nextID    atomic.Uint64
	running   atomic.Bool
	stopped   chan struct{}
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
	vocab, text := outputVocab(cfg.Tokenizer)
	cfg.Engine.Vocab = vocab
	eng, err := engine.New(cfg.Engine)
	if err != nil {
		return nil, err
	}
	cfg.Engine = eng.Config()
	s := &Server{
		cfg:       cfg,
		eng:       eng,
		metrics:   newMetrics(cfg.Model, cfg.Engine),
		vocabText: text,
		created:   time.Now().Unix(),
		idPrefix:  strconv.FormatUint(rand.Uint64()>>16, 16),
		stopped:   make(chan struct{}),
	}
	var publishErrors uint64 // owned by the loop goroutine
	s.loop = newLoop(eng, cfg.TimeScale, cfg.Events, s.metrics, func(err error) {
		// A stuck publisher fails every step: log the first of each 1,000.
		if publishErrors%1000 == 0 {
			cfg.Logger.Warn().Err(err).Uint64("failures", publishErrors+1).Msg("publishing KV events")
		}
		publishErrors++
	})
	return s, nil
}

// Run drives the engine until ctx ends; requests still in flight then fail.
// Call it once.
func (s *Server) Run(ctx context.Context) {
	if s.running.Swap(true) {
		return
	}
	defer close(s.stopped)
	s.loop.run(ctx)
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
	want := "POST"
	switch path {
	case "/v1/models", "/health", "/metrics", "/version", "/ping":
		want = "GET"
	case "/v1/completions", "/v1/chat/completions", "/tokenize", "/reset_prefix_cache":
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
		ctx.SetBody(s.metrics.appendText(make([]byte, 0, 8<<10)))
	case "/reset_prefix_cache":
		s.resetPrefixCache(ctx)
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

func (s *Server) resetPrefixCache(ctx *fasthttp.RequestCtx) {
	result := make(chan bool, 1)
	f := func() {
		b, ok := s.eng.ResetPrefixCache(0)
		if ok {
			s.loop.publish(b)
			s.loop.publishStats()
		}
		result <- ok
	}
	select {
	case s.loop.control <- f:
	case <-s.stopped:
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
		return
	}
	select {
	case ok := <-result:
		if !ok {
			writeError(ctx, fasthttp.StatusConflict, "ConflictError", "cannot reset the prefix cache while requests hold KV blocks")
		}
	case <-s.stopped:
		writeError(ctx, fasthttp.StatusServiceUnavailable, "ServiceUnavailableError", errShutdown.Error())
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
