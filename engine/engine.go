// Package engine is the pure core of enginesim: a vLLM-like paged prefix
// cache and step scheduler with no sockets and no clock of its own.
//
// The caller feeds requests in and calls Step; each step schedules work the
// way vLLM's V1 scheduler does (running sequences first, then the waiting
// queue, under a token budget with chunked prefill and a cap on running
// sequences; a sequence that cannot get a block preempts the newest running
// one, or under priority scheduling the lowest-priority one), prices it with a CostProfile, advances every scheduled sequence, and
// returns the step's simulated duration, the tokens produced and the KV-cache
// events vLLM would publish for it. Time is whatever the caller makes of
// those durations, which keeps every behaviour here deterministic and
// testable without sleeping.
//
// With a host tier (Config.CPUBlocks) the engine also plays vLLM's
// OffloadingConnector with its CPU backend: blocks are written through to
// a larger host pool, and a prompt whose prefix the GPU pool evicted but
// the host pool still holds loads those blocks back instead of computing
// them, with the connector's CPU events. Loads are asynchronous, as the
// connector's are: the request waits (vLLM's WAITING_FOR_REMOTE_KVS) while
// its blocks cross one host link at a cost per token and others are
// scheduled; the engine keeps its own clock, the sum of the durations it
// returned, to know when a load is done.
//
// For prefill/decode disaggregation the engine plays either side of vLLM's
// NixlConnector: a request marked RemoteDecode (a prefill for another
// engine) keeps its blocks when it finishes, until Release, for the decode
// engine to read; a request marked RemotePrefill (the decode side) receives
// the KV of the prompt tokens its own cache lacks over a network link, at a
// cost per token, instead of computing them, waiting meanwhile as a host
// tier load does.
package engine

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Config sizes the engine.
type Config struct {
	BlockSize           int // tokens per KV block (vLLM --block-size)
	KVBlocks            int // KV capacity in blocks (vLLM num_gpu_blocks)
	MaxNumSeqs          int // cap on running sequences (vLLM --max-num-seqs)
	MaxNumBatchedTokens int // token budget per step (vLLM --max-num-batched-tokens)
	MaxModelLen         int // prompt plus output tokens (vLLM --max-model-len)
	// PriorityScheduling orders the waiting queue by each request's
	// Priority, then arrival, and preempts the lowest-priority running
	// request first (vLLM --scheduling-policy priority); off, requests are
	// served first come, first served and a non-zero Priority is refused.
	PriorityScheduling bool
	Cost               CostProfile
	// HashSeed starts every block hash chain. The default deliberately
	// differs from kvmesh's key seed: consumers must treat engine hashes as
	// opaque, as they must with vLLM.
	HashSeed uint64
	// Vocab are the token ids output tokens are drawn from; nil means
	// 256…511.
	Vocab []uint32
	// CPUBlocks is the host tier's capacity in blocks (vLLM's
	// OffloadingConnector, CPU backend, num_cpu_blocks); 0 disables it.
	CPUBlocks int
	// CPULoadUsPerToken is how long loading a block back from the host
	// tier takes per token, in µs, loads queueing on one link; 0 means
	// DefaultCPULoadUsPerToken.
	CPULoadUsPerToken float64
	// CPUPlaceholderEvents makes the host tier's BlockStored events the
	// placeholders vLLM's connector sends without
	// self_describing_kv_events (its default): hash only, no tokens.
	CPUPlaceholderEvents bool
	// TransferUsPerToken prices receiving a remote prefill's KV
	// (RemotePrefill requests), in µs per token, transfers queueing on
	// one network link; 0 means DefaultTransferUsPerToken.
	TransferUsPerToken float64
}

// DefaultTransferUsPerToken prices a remote prefill's KV crossing the
// network to the decode engine: a Llama-3-8B-shaped model holds 131,072
// bytes of KV per token (../shared/calibration), and an H200 node gives each
// GPU one 400 Gb/s NIC (50 GB/s) of which RDMA reads reach about 80 %,
// ≈ 40 GB/s: 131,072 B / 40 GB/s ≈ 3.3 µs per token, about an eighth of
// the 28.2 µs per token prefill costs (DefaultCost). Not measured here; a
// profile parameter like the floor.
const DefaultTransferUsPerToken = 3.3

// DefaultHashSeed is the HashSeed a zero Config gets.
var DefaultHashSeed = blockkey.Seed("", "enginesim")

// Request is one generation request.
type Request struct {
	ID        uint64
	Prompt    []uint32
	MaxTokens int
	// OutputSeed picks the deterministic output tokens.
	OutputSeed uint64
	// Priority: lower is served earlier (vLLM's request priority, 0 by
	// default); only with Config.PriorityScheduling.
	Priority int
	// RemoteDecode marks a prefill for a remote decode (vLLM's
	// kv_transfer_params do_remote_decode): when it finishes at its
	// length, its blocks stay referenced, listed in its last Output's
	// HeldBlocks, until Release.
	RemoteDecode bool
	// RemotePrefill marks a request whose prompt KV another engine
	// computed (do_remote_prefill): the tokens after its own cache's hit
	// cross the network link at Config.TransferUsPerToken each instead of
	// being computed, the request waiting meanwhile, and all but the last
	// prompt token count as computed once they are in, as vLLM's
	// scheduler counts a finished receive. Only the first scheduling
	// receives: a request preempted later recomputes.
	RemotePrefill bool
}

// FinishReason tells why a sequence stopped.
type FinishReason uint8

const (
	NotFinished FinishReason = iota
	FinishLength
	FinishAborted
)

// Output is what one step did for one request: at most one new token.
type Output struct {
	ID       uint64
	Token    uint32
	HasToken bool
	// First marks the request's first token (its time to first token).
	First bool
	// Finished is set on the request's last output.
	Finished FinishReason
	// CachedTokens is how many prompt tokens came from the prefix cache
	// when the request was first scheduled.
	CachedTokens int
	// Output tokens so far, including Token.
	Generated int
	// HeldBlocks, on the last output of a RemoteDecode request, are the
	// block ids kept for the remote decode until Release (vLLM's
	// remote_block_ids).
	HeldBlocks []int32
}

// StepResult is one engine step.
type StepResult struct {
	Duration time.Duration
	Outputs  []Output
	// Events are the KV-cache events of this step, nil when there were
	// none. vLLM publishes them after the step's forward pass.
	Events *kvevents.Batch
	// Scheduled is how many sequences took part; 0 means the engine had
	// nothing to do.
	Scheduled int
}

// EventSink takes each step's event batch, e.g. a ZMQ publisher.
type EventSink interface {
	Publish(*kvevents.Batch) error
}

// Stats are the engine gauges and counters vLLM exports.
type Stats struct {
	Waiting, Running int
	KVUsage          float64 // used blocks / capacity
	UsedBlocks       int
	CachedBlocks     int    // blocks holding a hash, used or not
	PrefixQueries    uint64 // prompt tokens looked up in the prefix cache
	PrefixHits       uint64 // of those, tokens found cached
	Preemptions      uint64
	PromptTokens     uint64 // prompt tokens of requests first scheduled
	GenerationTokens uint64
	Steps            uint64
	FinishedRequests uint64
	// AbortedRequests were dropped by Abort before their end (a client
	// gone), as vLLM counts finished_reason="abort".
	AbortedRequests uint64
	// OffloadedBlocks are the blocks the host tier holds.
	OffloadedBlocks int
	// ExternalQueries and ExternalHits are vLLM's connector prefix-cache
	// counters: with a host tier, the prompt tokens of requests first
	// scheduled that the GPU pool did not hold, and of those, the tokens
	// loaded from the host tier.
	ExternalQueries, ExternalHits uint64
	// HeldRequests and HeldBlocks are the finished RemoteDecode requests
	// whose blocks await Release, and those blocks.
	HeldRequests, HeldBlocks int
}

// Errors returned by Add.
var (
	ErrEmptyPrompt = errors.New("engine: empty prompt")
	ErrTooLong     = errors.New("engine: prompt plus max_tokens exceeds max model length")
	ErrBadMaxToken = errors.New("engine: max_tokens must be at least 1")
	ErrDuplicateID = errors.New("engine: request id already in use")
	// ErrPriority: a non-zero priority without priority scheduling, which
	// vLLM refuses too.
	ErrPriority = errors.New("engine: priority scheduling is not enabled")
)

type seqState uint8

// loadState is where a waiting sequence is with a load from the host
// tier.
type loadState uint8

const (
	loadNone     loadState = iota
	loadInFlight           // blocks allocated, KV crossing the link until loadReady
	loadDone               // KV on the GPU, the sequence ready to be admitted
)

const (
	stateWaiting seqState = iota
	stateRunning
)

type seq struct {
	id          uint64
	tokens      []uint32 // prompt then generated
	promptLen   int
	maxTokens   int
	outputSeed  uint64
	priority    int
	arrival     uint64 // order of Add, vLLM's arrival_time
	state       seqState
	computed    int     // tokens whose KV is in blocks
	blocks      []int32 // block table
	hashes      []uint64
	cachedBlks  int // leading blocks already in the cache map
	cachedToks  int // prefix hit at first schedule, -1 before
	generated   int
	scheduledAt int // tokens scheduled this step

	load       loadState
	loadReady  time.Duration // engine clock when the load is done
	loadedTo   int           // tokens on the GPU once it is
	loadHashes []uint64      // the loaded blocks, pinned in the host tier

	remoteDecode  bool // hold the blocks at the end (RemoteDecode)
	remotePrefill bool // receive the prompt's KV when first scheduled
	received      bool // the load in flight is a remote prefill's
}

// Engine is the simulated engine. It is not safe for concurrent use: one
// goroutine drives it.
type Engine struct {
	cfg     Config
	pool    *pool
	host    *hostPool // nil without a host tier
	seqs    map[uint64]*seq
	waiting []*seq
	running []*seq
	events  []kvevents.Event
	outputs []Output
	stats   Stats
	arrived uint64 // requests added
	// clock is the sum of the durations Step returned; linkFree is when
	// the host link is done with the loads queued on it.
	clock, linkFree time.Duration
	// loading counts the waiting sequences with a load started, in flight
	// or done.
	loading int
	// netFree is when the network link is done with the remote prefills'
	// transfers queued on it.
	netFree time.Duration
	// held are the blocks of finished RemoteDecode requests, by id.
	held       map[uint64][]int32
	heldBlocks int
}

// New checks cfg and returns an idle engine.
func New(cfg Config) (*Engine, error) {
	if cfg.BlockSize <= 0 || cfg.KVBlocks <= 0 || cfg.MaxNumSeqs <= 0 || cfg.MaxNumBatchedTokens <= 0 || cfg.MaxModelLen <= 0 {
		return nil, fmt.Errorf("engine: block size, KV blocks, max seqs, max batched tokens and max model length must all be positive (got %d, %d, %d, %d, %d)",
			cfg.BlockSize, cfg.KVBlocks, cfg.MaxNumSeqs, cfg.MaxNumBatchedTokens, cfg.MaxModelLen)
	}
	// vLLM refuses to start when one sequence of max length cannot fit;
	// the same guarantee here means a lone sequence can always run.
	if need := (cfg.MaxModelLen + cfg.BlockSize - 1) / cfg.BlockSize; need > cfg.KVBlocks {
		return nil, fmt.Errorf("engine: max model length %d needs %d blocks of %d, more than the %d KV blocks", cfg.MaxModelLen, need, cfg.BlockSize, cfg.KVBlocks)
	}
	if cfg.CPUBlocks < 0 || cfg.CPULoadUsPerToken < 0 || cfg.CPULoadUsPerToken != cfg.CPULoadUsPerToken {
		return nil, fmt.Errorf("engine: CPU blocks and CPU load cost must be ≥ 0 (got %d, %v)", cfg.CPUBlocks, cfg.CPULoadUsPerToken)
	}
	if cfg.CPULoadUsPerToken == 0 {
		cfg.CPULoadUsPerToken = DefaultCPULoadUsPerToken
	}
	if cfg.TransferUsPerToken < 0 || cfg.TransferUsPerToken != cfg.TransferUsPerToken {
		return nil, fmt.Errorf("engine: transfer cost must be ≥ 0 (got %v)", cfg.TransferUsPerToken)
	}
	if cfg.TransferUsPerToken == 0 {
		cfg.TransferUsPerToken = DefaultTransferUsPerToken
	}
	if cfg.HashSeed == 0 {
		cfg.HashSeed = DefaultHashSeed
	}
	if len(cfg.Vocab) == 0 {
		cfg.Vocab = make([]uint32, 256)
		for i := range cfg.Vocab {
			cfg.Vocab[i] = uint32(256 + i)
		}
	}
	e := &Engine{cfg: cfg, seqs: make(map[uint64]*seq), held: make(map[uint64][]int32)}
	e.pool = newPool(cfg.KVBlocks, &e.events)
	if cfg.CPUBlocks > 0 {
		e.host = newHostPool(cfg.CPUBlocks, cfg.BlockSize, cfg.CPUPlaceholderEvents)
	}
	return e, nil
}

// Config returns the engine's configuration after defaults.
func (e *Engine) Config() Config { return e.cfg }

// Add queues a request. It fails, leaving the engine untouched, on an empty
// prompt, max tokens below 1, a prompt plus output longer than the model
// length, or an id already queued or running.
func (e *Engine) Add(r Request) error {
	switch {
	case len(r.Prompt) == 0:
		return ErrEmptyPrompt
	case r.MaxTokens < 1:
		return ErrBadMaxToken
	case len(r.Prompt)+r.MaxTokens > e.cfg.MaxModelLen:
		return ErrTooLong
	case r.Priority != 0 && !e.cfg.PriorityScheduling:
		return ErrPriority
	}
	if _, dup := e.seqs[r.ID]; dup {
		return ErrDuplicateID
	}
	if _, dup := e.held[r.ID]; dup {
		return ErrDuplicateID
	}
	s := &seq{
		id:         r.ID,
		tokens:     append(make([]uint32, 0, len(r.Prompt)+r.MaxTokens), r.Prompt...),
		promptLen:  len(r.Prompt),
		maxTokens:  r.MaxTokens,
		outputSeed: r.OutputSeed,
		priority:   r.Priority,
		arrival:    e.arrived,
		cachedToks: -1,

		remoteDecode:  r.RemoteDecode,
		remotePrefill: r.RemotePrefill,
	}
	e.arrived++
	s.hashes = blockkey.Append(make([]uint64, 0, cap(s.tokens)/e.cfg.BlockSize), e.cfg.HashSeed, s.tokens, e.cfg.BlockSize)
	e.seqs[r.ID] = s
	e.enqueue(s)
	return nil
}

// before reports whether a is served before b under priority scheduling:
// vLLM's (priority, arrival_time) order.
func before(a, b *seq) bool {
	if a.priority != b.priority {
		return a.priority < b.priority
	}
	return a.arrival < b.arrival
}

// enqueue adds a new request to the waiting queue: at the back, or under
// priority scheduling in (priority, arrival) order.
func (e *Engine) enqueue(s *seq) {
	i := len(e.waiting)
	if e.cfg.PriorityScheduling {
		i = sort.Search(len(e.waiting), func(j int) bool { return before(s, e.waiting[j]) })
	}
	e.waiting = slices.Insert(e.waiting, i, s)
}

// Abort drops a request wherever it is and frees its blocks. The blocks it
// filled stay cached until evicted, as in vLLM. It reports whether the
// request was known.
func (e *Engine) Abort(id uint64) bool {
	s, ok := e.seqs[id]
	if !ok {
		return false
	}
	if s.state == stateRunning {
		e.running = removeSeq(e.running, s)
	} else {
		e.waiting = removeSeq(e.waiting, s)
	}
	e.release(s)
	delete(e.seqs, id)
	e.stats.AbortedRequests++
	return true
}

func removeSeq(list []*seq, s *seq) []*seq {
	for i, x := range list {
		if x == s {
			copy(list[i:], list[i+1:])
			list[len(list)-1] = nil
			return list[:len(list)-1]
		}
	}
	return list
}

func (e *Engine) release(s *seq) {
	if s.load == loadInFlight && s.loadHashes != nil {
		e.host.unpin(s.loadHashes)
	}
	if s.load != loadNone {
		e.loading--
	}
	s.load, s.loadHashes = loadNone, nil
	e.pool.free(s.blocks)
	s.blocks = s.blocks[:0]
	s.cachedBlks = 0
	s.computed = 0
}

// Release frees the blocks a finished RemoteDecode request holds, once the
// remote decode has read them or given up on them, and reports whether it
// held any. The blocks stay cached until evicted, as any finished
// request's.
func (e *Engine) Release(id uint64) bool {
	blocks, ok := e.held[id]
	if !ok {
		return false
	}
	delete(e.held, id)
	e.heldBlocks -= len(blocks)
	e.pool.free(blocks)
	return true
}

// HasWork reports whether any request is queued or running.
func (e *Engine) HasWork() bool { return len(e.waiting)+len(e.running) > 0 }

// ResetPrefixCache forgets every cached block, the host tier's too, and
// returns the AllBlocksCleared batch to publish at ts: the event says no
// block of any medium is left. Like vLLM it refuses while any block is in
// use by a request.
func (e *Engine) ResetPrefixCache(ts float64) (*kvevents.Batch, bool) {
	if !e.pool.reset() {
		return nil, false
	}
	if e.host != nil {
		e.host.reset()
	}
	return e.takeEvents(ts), true
}

// Stats returns the current gauges and counters.
func (e *Engine) Stats() Stats {
	st := e.stats
	st.Waiting, st.Running = len(e.waiting), len(e.running)
	st.UsedBlocks = e.pool.used()
	st.KVUsage = float64(st.UsedBlocks) / float64(e.cfg.KVBlocks)
	st.CachedBlocks = e.pool.numCached
	st.HeldRequests, st.HeldBlocks = len(e.held), e.heldBlocks
	if e.host != nil {
		st.OffloadedBlocks = e.host.lru.Len()
	}
	return st
}

// Resident returns the multiset of block hashes the prefix cache holds
// (hash → copies): what a consumer of the events must reconstruct.
func (e *Engine) Resident() map[uint64]int {
	m := make(map[uint64]int, len(e.pool.cached))
	for h := range e.pool.cached {
		m[h] = e.pool.copies(h)
	}
	return m
}

// Holds reports whether the prefix cache holds the block with engine hash
// h: a simulator's oracle reads the exact cache through it.
func (e *Engine) Holds(h uint64) bool {
	_, ok := e.pool.lookup(h)
	return ok
}

// Backlog is the work ahead of a new request at an engine, exactly as it
// stands between steps: what a simulator's oracle weighs.
type Backlog struct {
	// PrefillTokens are the prompt tokens still to compute: a waiting
	// sequence's uncached ones as the cache stands now, a running one's
	// not yet prefilled.
	PrefillTokens int
	// Running counts the running sequences, DecodeContext their tokens
	// with KV: every step decodes them.
	Running, DecodeContext int
}

// Backlog returns the engine's backlog.
func (e *Engine) Backlog() Backlog {
	var b Backlog
	for _, s := range e.waiting {
		done := s.computed
		if s.load == loadNone && s.computed == 0 {
			done = e.longestHit(s) * e.cfg.BlockSize
		}
		b.PrefillTokens += max(len(s.tokens)-done, 0)
	}
	for _, s := range e.running {
		b.PrefillTokens += max(s.promptLen-s.computed, 0)
		b.DecodeContext += s.computed
	}
	b.Running = len(e.running)
	return b
}

// Offloaded returns the block hashes the host tier holds, least recently
// used first: what a consumer of the CPU events must reconstruct.
func (e *Engine) Offloaded() []uint64 {
	if e.host == nil {
		return nil
	}
	hs := make([]uint64, 0, e.host.lru.Len())
	for el := e.host.lru.Front(); el != nil; el = el.Next() {
		hs = append(hs, el.Value.(uint64))
	}
	return hs
}

// takeEvents makes the step's batch: the GPU pool's events, then the host
// tier's, as vLLM's scheduler appends the connector's events to the KV
// cache manager's.
func (e *Engine) takeEvents(ts float64) *kvevents.Batch {
	if e.host != nil {
		e.events = append(e.events, e.host.takeEvents()...)
	}
	if len(e.events) == 0 {
		return nil
	}
	b := &kvevents.Batch{TS: ts, Events: e.events, DPRank: 0}
	e.events = nil
	return b
}

// Step runs one scheduling step; ts stamps its event batch. The returned
// Outputs slice is reused by the next Step.
func (e *Engine) Step(ts float64) StepResult {
	e.outputs = e.outputs[:0]
	var work stepWork
	scheduled := e.schedule(&work)
	if len(scheduled) == 0 {
		// Nothing to compute: wait for the next load, if any, a slice at
		// a time so that requests arriving meanwhile are not held up.
		wait := min(max(e.nextLoad()-e.clock, 0), loadWaitSlice)
		e.clock += wait
		return StepResult{Duration: wait, Events: e.takeEvents(ts)}
	}
	e.stats.Steps++
	for _, s := range scheduled {
		e.advance(s)
	}
	d := e.cfg.Cost.duration(work)
	e.clock += d
	return StepResult{
		Duration:  d,
		Outputs:   e.outputs,
		Events:    e.takeEvents(ts),
		Scheduled: len(scheduled),
	}
}

// loadWaitSlice bounds the step that only waits for a load: vLLM's engine
// core polls for new requests while its transfers run.
const loadWaitSlice = time.Millisecond

// nextLoad is when the first load in flight is done, or the clock when
// none is.
func (e *Engine) nextLoad() time.Duration {
	next := e.clock
	if e.loading == 0 {
		return next
	}
	for _, s := range e.waiting {
		if s.load == loadInFlight && (next == e.clock || s.loadReady < next) {
			next = s.loadReady
		}
	}
	return next
}

// schedule picks this step's work (vLLM V1 order) and allocates its blocks.
func (e *Engine) schedule(work *stepWork) []*seq {
	budget := e.cfg.MaxNumBatchedTokens
	var scheduled []*seq
	preempted := false
	for i := 0; i < len(e.running) && budget > 0; i++ {
		s := e.running[i]
		n := min(len(s.tokens)-s.computed, budget)
		for !e.allocate(s, n) {
			// Recompute preemption: the newest running sequence, or under
			// priority scheduling the lowest-priority one, goes back to
			// the waiting queue; if it was scheduled this step already,
			// its tokens return to the budget.
			v := len(e.running) - 1
			if e.cfg.PriorityScheduling {
				for j := range e.running {
					if before(e.running[v], e.running[j]) {
						v = j
					}
				}
			}
			victim := e.running[v]
			e.running = slices.Delete(e.running, v, v+1)
			if v < i {
				i--
				k := slices.Index(scheduled, victim)
				budget += victim.scheduledAt
				scheduled = slices.Delete(scheduled, k, k+1)
			}
			e.preempt(victim)
			preempted = true
			if victim == s {
				n = 0
				break
			}
		}
		if n == 0 {
			break
		}
		budget -= n
		scheduled = append(scheduled, s)
	}
	for _, s := range scheduled {
		e.account(s, s.scheduledAt, work)
	}
	if preempted {
		return scheduled
	}
	bs := e.cfg.BlockSize
	// blocked: a request that needs blocks did not get them; none behind
	// it may take blocks (FCFS), but loaded requests, which hold theirs,
	// are still admitted.
	blocked := false
admission:
	for i := 0; i < len(e.waiting) && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs; {
		s := e.waiting[i]
		var n int
		switch s.load {
		case loadInFlight:
			if e.clock < s.loadReady {
				i++ // vLLM passes over a request waiting for its KV
				continue
			}
			if s.loadHashes != nil {
				e.host.unpin(s.loadHashes)
			}
			s.load, s.loadHashes, s.computed = loadDone, nil, s.loadedTo
			if s.received {
				// vLLM caches a received prompt's blocks when its receive
				// is done, then schedules its last token.
				e.allocate(s, 0)
				s.received = false
			}
			fallthrough
		case loadDone:
			// Its blocks cover the prompt: allocate only caches them.
			n = min(len(s.tokens)-s.computed, budget)
			if !e.allocate(s, n) {
				break admission
			}
		case loadNone:
			if blocked {
				if e.loading == 0 {
					break admission // nobody behind can be admitted
				}
				i++
				continue
			}
			hit := e.longestHit(s)
			if s.remotePrefill {
				if e.startTransfer(s, hit) {
					e.countFirstSchedule(s, hit, s.loadedTo, len(s.tokens)-hit*bs)
				} else {
					blocked = true
				}
				i++
				continue
			}
			if loaded := e.hostHit(s, hit); loaded > 0 {
				if e.startLoad(s, hit, loaded) {
					e.countFirstSchedule(s, hit, (hit+loaded)*bs, loaded*bs)
				} else {
					blocked = true
				}
				i++
				continue
			}
			n = min(len(s.tokens)-hit*bs, budget)
			if !e.allocateWithHit(s, hit, n) {
				blocked = true
				i++
				continue
			}
			e.countFirstSchedule(s, hit, hit*bs, 0)
		}
		if i == 0 {
			e.waiting[0] = nil
			e.waiting = e.waiting[1:]
		} else {
			e.waiting = slices.Delete(e.waiting, i, i+1)
		}
		if s.load != loadNone {
			e.loading--
			s.load = loadNone
		}
		s.state = stateRunning
		e.running = append(e.running, s)
		e.account(s, n, work)
		budget -= n
		scheduled = append(scheduled, s)
	}
	return scheduled
}

// countFirstSchedule counts a request's prefix-cache lookup the first time
// it is scheduled: hit blocks from the GPU pool, cached tokens in all (the
// request's num_cached_tokens), external of them from a connector (loaded
// from the host tier or received from a remote prefill).
func (e *Engine) countFirstSchedule(s *seq, hit, cached, external int) {
	if s.cachedToks >= 0 {
		return
	}
	bs := e.cfg.BlockSize
	// vLLM's num_cached_tokens counts the connector's tokens too; its
	// prefix-cache counters only the GPU pool's.
	s.cachedToks = cached
	e.stats.PrefixQueries += uint64(len(s.tokens))
	e.stats.PrefixHits += uint64(hit * bs)
	e.stats.PromptTokens += uint64(s.promptLen)
	if e.host != nil || s.received {
		// What the GPU pool missed is asked of the connector.
		e.stats.ExternalQueries += uint64(len(s.tokens) - hit*bs)
		e.stats.ExternalHits += uint64(external)
	}
}

// startTransfer gives a RemotePrefill sequence its hit blocks and fresh
// blocks for the rest of its prompt, and queues the receive of every token
// after the hit on the network link (NixlConnector's
// get_num_new_matched_tokens asks for them all, loaded asynchronously), or
// changes nothing and returns false. Once received, all but the last
// prompt token count as computed (vLLM's _update_waiting_for_remote_kv).
func (e *Engine) startTransfer(s *seq, hit int) bool {
	if !e.takeHitBlocks(s, hit, e.blocksFor(len(s.tokens))-hit) {
		return false
	}
	s.blocks = e.pool.alloc(s.blocks, e.blocksFor(len(s.tokens))-hit)
	n := len(s.tokens) - hit*e.cfg.BlockSize
	e.netFree = max(e.netFree, e.clock) + time.Duration(e.cfg.TransferUsPerToken*1e3*float64(n))
	s.load, s.loadReady, s.loadedTo = loadInFlight, e.netFree, len(s.tokens)-1
	s.remotePrefill, s.received = false, true
	e.loading++
	return true
}

// startLoad gives a waiting sequence its hit blocks and fresh blocks for
// the rest of its prompt, and queues the load of its next loaded blocks
// from the host tier on the link, or changes nothing and returns false.
// Holding blocks for the whole prompt, a loaded sequence can always be
// admitted once its load is done.
func (e *Engine) startLoad(s *seq, hit, loaded int) bool {
	if !e.takeHitBlocks(s, hit, e.blocksFor(len(s.tokens))-hit) {
		return false
	}
	s.blocks = e.pool.alloc(s.blocks, e.blocksFor(len(s.tokens))-hit)
	bs := e.cfg.BlockSize
	s.loadHashes = s.hashes[hit : hit+loaded : hit+loaded]
	e.host.pin(s.loadHashes)
	e.linkFree = max(e.linkFree, e.clock) + time.Duration(e.cfg.CPULoadUsPerToken*1e3*float64(loaded*bs))
	s.load, s.loadReady, s.loadedTo = loadInFlight, e.linkFree, (hit+loaded)*bs
	e.loading++
	return true
}

// longestHit counts the leading blocks of s found in the cache. Like vLLM
// it leaves at least the last token to compute, so a prompt that is a whole
// number of blocks long hits one block less.
func (e *Engine) longestHit(s *seq) int {
	limit := e.hitLimit(s)
	for i := range limit {
		if _, ok := e.pool.lookup(s.hashes[i]); !ok {
			return i
		}
	}
	return limit
}

func (e *Engine) hitLimit(s *seq) int {
	return min(len(s.hashes), (len(s.tokens)-1)/e.cfg.BlockSize)
}

// hostHit counts the blocks of s after its first gpuHit ones that the host
// tier holds in a row, under the same limit: the blocks the connector
// loads instead of their being computed.
func (e *Engine) hostHit(s *seq, gpuHit int) int {
	if e.host == nil {
		return 0
	}
	limit := e.hitLimit(s)
	for i := gpuHit; i < limit; i++ {
		if !e.host.has(s.hashes[i]) {
			return i - gpuHit
		}
	}
	return limit - gpuHit
}

func (e *Engine) blocksFor(tokens int) int {
	return (tokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize
}

// allocateWithHit gives a waiting sequence its hit blocks plus room for n
// new tokens, or changes nothing and returns false.
func (e *Engine) allocateWithHit(s *seq, hit, n int) bool {
	if !e.takeHitBlocks(s, hit, e.blocksFor(hit*e.cfg.BlockSize+n)-hit) {
		return false
	}
	return e.allocate(s, n)
}

// takeHitBlocks gives s its first hit blocks from the cache if need more
// blocks can be allocated after them, or changes nothing and returns false.
func (e *Engine) takeHitBlocks(s *seq, hit, need int) bool {
	// Hit blocks nobody references sit in the free queue; touching them
	// takes them out, so they count against what is free.
	evictableHits := 0
	for i := range hit {
		b, _ := e.pool.lookup(s.hashes[i])
		if e.pool.ref[b] == 0 {
			evictableHits++
		}
	}
	if need+evictableHits > e.pool.numFree {
		return false
	}
	for i := range hit {
		b, _ := e.pool.lookup(s.hashes[i])
		e.pool.touch(b)
		s.blocks = append(s.blocks, b)
	}
	if e.host != nil {
		// The connector's lookup marks the blocks it was asked about.
		e.host.touch(s.hashes[hit:e.hitLimit(s)])
	}
	s.computed = hit * e.cfg.BlockSize
	s.cachedBlks = hit
	return true
}

// allocate makes room for n more tokens of s and caches the blocks those
// tokens fill, or changes nothing and returns false.
func (e *Engine) allocate(s *seq, n int) bool {
	need := e.blocksFor(s.computed+n) - len(s.blocks)
	if need > e.pool.numFree {
		return false
	}
	if need > 0 {
		s.blocks = e.pool.alloc(s.blocks, need)
	}
	// vLLM caches blocks when the tokens that fill them are scheduled.
	full := min((s.computed+n)/e.cfg.BlockSize, len(s.hashes))
	if full > s.cachedBlks {
		start := s.cachedBlks
		for i := start; i < full; i++ {
			e.pool.cache(s.blocks[i], s.hashes[i])
		}
		// Field for field what vLLM v0.26 sends for a text-only request on
		// a full-attention model (kv-events.md §1.7a).
		ev := kvevents.Event{
			Kind:        kvevents.KindBlockStored,
			BlockHashes: s.hashes[start:full:full],
			TokenIDs:    s.tokens[start*e.cfg.BlockSize : full*e.cfg.BlockSize : full*e.cfg.BlockSize],
			BlockSize:   e.cfg.BlockSize,
			Medium:      "GPU",
			HasGroupIdx: true,
			SpecKind:    "full_attention",
			ExtraKeys:   nilExtraKeys(full - start),
		}
		if start > 0 {
			ev.ParentHash, ev.HasParent = s.hashes[start-1], true
		}
		e.events = append(e.events, ev)
		if e.host != nil {
			e.host.store(s.hashes[:full], start, s.tokens)
		}
		s.cachedBlks = full
	}
	s.scheduledAt = n
	return true
}

// preempt sends a running sequence back to wait: to the front of the queue,
// or under priority scheduling to its (priority, arrival) place.
func (e *Engine) preempt(s *seq) {
	e.release(s)
	s.state = stateWaiting
	e.stats.Preemptions++
	if e.cfg.PriorityScheduling {
		e.enqueue(s)
		return
	}
	e.waiting = slices.Insert(e.waiting, 0, s)
}

// account adds s's scheduled tokens to the step's work.
func (e *Engine) account(s *seq, n int, w *stepWork) {
	if n == 1 && s.computed >= s.promptLen {
		w.decodeSeqs++
		w.decodeContext += int64(s.computed)
		return
	}
	w.prefillTokens += int64(n)
	w.attentionPairs += float64(n)*float64(s.computed) + float64(n)*float64(n)/2
}

// advance applies a step's computation to s: its scheduled tokens now have
// KV, and when none are left to compute it samples the next token.
func (e *Engine) advance(s *seq) {
	s.computed += s.scheduledAt
	s.scheduledAt = 0
	if s.computed < len(s.tokens) {
		return // a prefill chunk; more to come
	}
	tok := e.cfg.Vocab[mix(s.outputSeed, uint64(s.generated))%uint64(len(e.cfg.Vocab))]
	s.tokens = append(s.tokens, tok)
	if len(s.tokens)%e.cfg.BlockSize == 0 {
		s.hashes = append(s.hashes, blockkey.Next(e.parentHash(s), s.tokens[len(s.tokens)-e.cfg.BlockSize:]))
	}
	s.generated++
	e.stats.GenerationTokens++
	out := Output{ID: s.id, Token: tok, HasToken: true, First: s.generated == 1, CachedTokens: s.cachedToks, Generated: s.generated}
	if s.generated >= s.maxTokens {
		out.Finished = FinishLength
		e.running = removeSeq(e.running, s)
		if s.remoteDecode && len(s.blocks) > 0 {
			// NixlConnector's request_finished delays freeing a length-
			// capped prefill's blocks for the decode engine to read.
			out.HeldBlocks = slices.Clone(s.blocks)
			e.held[s.id] = s.blocks
			e.heldBlocks += len(s.blocks)
			s.blocks = nil
		}
		e.release(s)
		delete(e.seqs, s.id)
		e.stats.FinishedRequests++
	}
	e.outputs = append(e.outputs, out)
}

func (e *Engine) parentHash(s *seq) uint64 {
	if len(s.hashes) == 0 {
		return e.cfg.HashSeed
	}
	return s.hashes[len(s.hashes)-1]
}

// nilExtraKeys is the msgpack of vLLM's extra_keys for n blocks without
// LoRA, multimodal inputs or cache salt: a list of n nils.
func nilExtraKeys(n int) []byte {
	var b []byte
	switch {
	case n < 16:
		b = append(make([]byte, 0, 1+n), 0x90|byte(n))
	case n < 1<<16:
		b = append(make([]byte, 0, 3+n), 0xdc, byte(n>>8), byte(n))
	default:
		b = append(make([]byte, 0, 5+n), 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	for range n {
		b = append(b, 0xc0)
	}
	return b
}

// mix is splitmix64 of seed+i: cheap, deterministic output tokens.
func mix(seed, i uint64) uint64 { return blockkey.Remix(seed + (i+1)*0x9e3779b97f4a7c15) }
