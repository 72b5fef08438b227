// Package routing decides which replica serves a request. It is a pure core:
// a request and the candidates' state (as one router sees them at one moment)
// go in, a decision comes out. No sockets, no clocks (time is an input), so
// every policy can be tested and simulated exactly.
//
// The default policy, kvaware, predicts each replica's time to first token as
// the prefill work already queued there plus this request's uncached prefill,
// and picks the smallest: a warm replica wins until its queue costs more than
// the prefill it saves. The other policies are baselines for side-by-side
// comparison.
package routing

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/costfit"
)

// Mode says why a replica was picked; it is reported as X-Kvmesh-Mode.
type Mode string

const (
	ModePrefix   Mode = "prefix"   // picked for a cached prefix
	ModeBalance  Mode = "balance"  // picked by load (no useful prefix, or degraded to least-load)
	ModeCold     Mode = "cold"     // a prefix no replica holds, placed by consistent hashing
	ModeStatic   Mode = "static"   // a static upstream without KV events
	ModeFallback Mode = "fallback" // no replica could serve; the fallback took it (set by the proxy)
	ModeSplit    Mode = "split"    // prefilled on a prefill replica, decoded on this one (set by the planner)
)

// Candidate is one replica that serves the request's model, as the router
// sees it for this decision.
type Candidate struct {
	Name string
	// PrefixAware is true when the replica's resident blocks are known and
	// fresh enough to trust: it has KV events, takes part in prefix matching,
	// and its state is not stale. Otherwise it is routed by load only.
	PrefixAware bool
	// Static is true for an upstream without a sidecar.
	Static bool
	// MatchedTokens is how many leading prompt tokens its filter holds
	// (matched blocks × block size), at most Request.MaxCachedTokens (the
	// caller caps it: it knows the replica's block size); ignored unless
	// PrefixAware.
	MatchedTokens int
	// OffloadedTokens is the part of MatchedTokens held only on an offload
	// tier, OffloadMedium (e.g. "CPU"): the engine loads it back instead of
	// computing it, at Config.OffloadPerToken per token. The planner matches
	// GPU blocks first; where they stop, offloaded blocks continue the
	// prefix on one tier.
	OffloadedTokens int
	OffloadMedium   string

	Waiting int // requests queued at the engine
	Running int // requests running at the engine
	// PendingPrefillTokens are uncached prompt tokens that routers have
	// dispatched to the replica and that have not produced a first token yet:
	// the prefill work queued ahead of a new request.
	PendingPrefillTokens int
	// InflightRequests are requests dispatched by routers and not finished.
	InflightRequests int
}

// Request is what routing needs to know about a request.
type Request struct {
	// Model names the engine model that serves it (a LoRA adapter's base):
	// costs are learned per model.
	Model        string
	PromptTokens int
	// PromptContinues is set when the engine's prompt goes on past the
	// PromptTokens the router counted (a chat's text before its media):
	// every full block of them can then hit.
	PromptContinues bool
	// Keys are the prompt's chained block keys (for speculative records).
	Keys []uint64
	// BlockSize is the token count behind each key.
	BlockSize int
	// AffinityKey places prefixes no replica holds yet so that every router
	// agrees (consistent hashing); 0 when the prompt has no full block.
	AffinityKey uint64
	// Session is a hash of the client's session id (0: none). kvaware
	// places a session like a cold prefix, by consistent hashing on it, and
	// keeps it on that home while the home's predicted time to first token
	// is within ColdSlack of the best: every router agrees on the home
	// without sharing state, and the cost rule still wins past the slack.
	Session uint64
	// Now is the decision time (speculative records expire by it).
	Now time.Time
	// Rank, when positive, is how many leading entries of Decision.Order
	// the caller reads: a policy may leave the entries after them in any
	// order. The planner sets it to the replicas it may try, so that a
	// fleet of a thousand is not sorted for the three it tries.
	Rank int
}

// Decision is a policy's answer.
type Decision struct {
	// Pick is the index of the chosen candidate, -1 when none can serve.
	Pick int
	// Order lists every usable candidate, best first (Pick first); the proxy
	// retries down this list when a replica fails before its first byte.
	// With Request.Rank set, only its first Rank entries are in rank order.
	Order []int
	Mode  Mode
	// PredictedCachedTokens is the prefix the picked replica should hold.
	PredictedCachedTokens int
	// PredictedOffloadedTokens is the part of PredictedCachedTokens the
	// pick holds only on an offload tier.
	PredictedOffloadedTokens int
	// Degraded is true when kvaware ran in least-load mode for imbalance.
	Degraded bool
	// PredictedTTFT and Queue are kvaware's estimates for the pick (engine
	// time): the whole predicted time to first token and the part of it
	// spent waiting behind work already there.
	PredictedTTFT, Queue time.Duration
	// Reason is a short constant account of the choice, for debug logs.
	Reason string
	// SessionHome: the request named a session and the pick is its home.
	SessionHome bool
}

// CacheableTokens is the most of a promptTokens-long prompt that an engine
// with blockSize-token blocks serves from its prefix cache, and so the most
// any prediction may claim. vLLM must compute at least the last prompt token
// to get its logits, and reuses the cache in whole blocks only: its KV cache
// manager looks for a hit within the first num_tokens-1 tokens
// (vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks:
// max_cache_hit_length = request.num_tokens - 1; read at vLLM main 003df29,
// the rule of the v0.14.0 the deployment pins). A prompt ending on a block
// boundary therefore never hits its last block: a 48-token repeat with
// 16-token blocks gets 32 cached, not 48.
func CacheableTokens(promptTokens, blockSize int) int {
	if promptTokens <= 0 || blockSize <= 0 {
		return 0
	}
	return (promptTokens - 1) / blockSize * blockSize
}

// MaxCachedTokens is the most of req an engine with blockSize-token blocks
// can serve from its cache: CacheableTokens, or all of PromptTokens' full
// blocks when the prompt continues past them.
func (req *Request) MaxCachedTokens(blockSize int) int {
	if req.PromptContinues && blockSize > 0 {
		return req.PromptTokens / blockSize * blockSize
	}
	return CacheableTokens(req.PromptTokens, blockSize)
}

// Policy chooses a replica. Implementations are safe for concurrent use.
type Policy interface {
	Name() string
	// Route fills d for req among cands. d.Order is reused (appended from
	// d.Order[:0]) to avoid allocating on every request.
	Route(req *Request, cands []Candidate, d *Decision)
}

// A Recorder remembers where requests were sent (kvaware's speculative
// records), so that siblings arriving before the engines' events follow
// them. Route only reads that memory; the caller records each dispatch: to
// the pick, to the replica a retry or a resumed stream moved the request
// to, never to a fallback. A prompt is remembered where it went, not where
// it was meant to go.
type Recorder interface {
	// Record: req was sent to replica at time at (a retry may come long
	// after the decision), and the replica's filter already showed
	// filterMatchedTokens of it.
	Record(req *Request, replica string, filterMatchedTokens int, at time.Time)
}

// A Learner fits its cost model to what requests measured (kvaware, which
// decides by the fit with Config.Calibrate). The caller reports only what
// measures an engine's time to first token: a streamed answer from the
// replica the decision picked, on the first try (a non-streamed answer's
// first byte waits for the whole completion).
type Learner interface {
	// Learn: req, routed to candidate c (as it stood at the decision), had
	// its first token after ttft, with cachedTokens of its prompt cached.
	Learn(req *Request, c *Candidate, cachedTokens int, ttft time.Duration)
}

// A Clearer forgets its route records (kvaware's speculative records) on
// request: an operator's clear, or another router's, after a model update or
// a canary switch made them wrong.
type Clearer interface {
	// ClearRecords forgets the records for the named replicas (all when
	// names is empty).
	ClearRecords(names []string)
}

// A Degrader can fall back to routing by load alone when a model's replicas
// are too unevenly loaded (kvaware); the router exports that state.
type Degrader interface {
	// Degradations counts switches into least-load mode, of every model.
	Degradations() uint64
	// Degraded reports whether any model is in least-load mode now.
	Degraded() bool
}

// A CostModeler exposes the cost models a Learner fitted, for export.
type CostModeler interface {
	// CostModels calls yield with each model's fitted coefficients and the
	// weight of the observations behind them.
	CostModels(yield func(model string, k costfit.Coefficients, observations float64))
}

// Names lists the policies New accepts.
var Names = []string{"kvaware", "random", "round-robin", "least-loaded", "chwbl", "prefix-pin"}

// Validate reports the error New would give for name and cfg, without
// building a policy.
func Validate(name string, cfg Config) error {
	if name != "" && !slices.Contains(Names, name) {
		return unknownPolicy(name)
	}
	return cfg.withDefaults().check()
}

func unknownPolicy(name string) error {
	return fmt.Errorf("routing: unknown policy %q (want one of %v)", name, Names)
}

// New returns the named policy.
func New(name string, cfg Config) (Policy, error) {
	cfg = cfg.withDefaults()
	if err := cfg.check(); err != nil {
		return nil, err
	}
	switch name {
	case "kvaware", "":
		return newKVAware(cfg), nil
	case "random":
		return newRandom(), nil
	case "round-robin":
		return &roundRobin{}, nil
	case "least-loaded":
		return &leastLoaded{cfg: cfg}, nil
	case "chwbl":
		return &chwbl{cfg: cfg}, nil
	case "prefix-pin":
		return &prefixPin{cfg: cfg}, nil
	}
	return nil, unknownPolicy(name)
}
