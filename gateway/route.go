package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// defaultBlockSize keys prompts when no candidate announces one (static
// upstreams only): it still gives consistent hashing a stable affinity key.
const defaultBlockSize = 16

// affinityBlocks is how many leading blocks place a cold prefix.
const affinityBlocks = 4

// maxReusedIDs bounds the id buffer a pooled exchange keeps (1 MiB), so one
// huge prompt does not pin its buffer for good.
const maxReusedIDs = 1 << 18

// maxReusedPrompt bounds the prompt buffer an idle exchange keeps.
const maxReusedPrompt = 1 << 20

// exchange is one request's routing state, reused through a pool. It is the
// proxy's Observer, so it also does in-flight accounting and metrics.
type exchange struct {
	g     *Gateway
	s     *Settings
	model string
	path  string

	promptTokens int
	// promptEstimated: promptTokens counts only the window of a long
	// prompt that was tokenized exactly, the rest by estimate.
	promptEstimated bool
	tokenizeErr     error
	// mediaPrefix is set when the chat holds media: ids are then the
	// text before the first media part, and promptTokens counts only them.
	mediaPrefix bool
	// staleOnly is set when the candidates are replicas whose sidecars fell
	// silent: their load figures are not current, so their answers teach
	// the cost model nothing true.
	staleOnly  bool
	decideTime time.Duration

	req      routing.Request
	d        routing.Decision
	cands    []routing.Candidate
	matchAll []int
	snapIdx  []int          // snapshot index of each candidate, parallel to cands
	loads    []*replicaLoad // in-flight entries of the snapshot's replicas (loadsOf)
	keys     []uint64
	ids      []uint32 // the prompt's ids: p.promptIDs or idsBuf
	idsBuf   []uint32 // reused by the tokenizer across requests
	// promptBuf is reused to render chat prompts into: only their ids are
	// kept, and a new prompt per request was most of a decision's garbage.
	promptBuf []byte
	seed      uint64

	targets []*proxy.Upstream
	info    []targetInfo

	// measuresTTFT is set for a streamed chat or completion: its first
	// byte is its first token, what the policy may learn from.
	measuresTTFT bool
	attempts     int
	firstByte    bool
	ttft         time.Duration
	hdrBuf       [20]byte // formats header numbers
	requestID    []byte   // X-Request-Id, the client's or the router's
	// abort ends the request when its client leaves (watched by g.watch
	// until putExchange); nil for short non-streamed answers.
	abort *proxy.Abort
}

// targetInfo is what the gateway knows about each target it handed the proxy.
type targetInfo struct {
	name      string
	mode      routing.Mode
	predicted int
	uncached  int
	fallback  bool
	load      *replicaLoad
	// prefixAware targets are recorded by the policy when the request is
	// sent to them (routing.Recorder), from the blocks their filter showed.
	prefixAware   bool
	filterMatched int
	// stale: the replica's load figures are old or, for an orphan, gone;
	// its times to first token teach the cost model nothing.
	stale bool
}

func (g *Gateway) getExchange(s *Settings) *exchange {
	ex := g.exchanges.Get().(*exchange)
	ex.g, ex.s = g, s
	ex.tokenizeErr, ex.promptTokens, ex.attempts, ex.firstByte, ex.ttft = nil, 0, 0, false, 0
	ex.mediaPrefix, ex.measuresTTFT, ex.staleOnly, ex.promptEstimated = false, false, false, false
	ex.cands, ex.snapIdx, ex.keys, ex.targets, ex.info = ex.cands[:0], ex.snapIdx[:0], ex.keys[:0], ex.targets[:0], ex.info[:0]
	return ex
}

func (g *Gateway) putExchange(ex *exchange) {
	if ex.abort != nil {
		g.watch.remove(ex.abort)
		ex.abort = nil
	}
	ex.s, ex.ids, ex.loads = nil, nil, nil
	clear(ex.targets[:cap(ex.targets)])
	clear(ex.info[:cap(ex.info)])
	g.exchanges.Put(ex)
}

func (g *Gateway) serveCompletion(ctx *fasthttp.RequestCtx, k request.Kind) {
	var idBuf [maxRequestIDLen]byte
	id := requestID(&ctx.Request.Header, idBuf[:0])
	ctx.Response.Header.SetCanonical(hdrRequestID, id) // errors carry it too
	s := g.Settings()
	if err := s.authorize(ctx); err != nil {
		g.fail(ctx, err)
		return
	}
	var p *request.Request
	var err error
	path := string(ctx.Path())
	if k == request.Passthrough {
		p, err = request.ParsePassthrough(ctx.PostBody(), string(ctx.Request.Header.MultipartFormBoundary()))
		path = string(ctx.RequestURI()) // with its query, if any
	} else {
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
	ex := g.getExchange(s)
	ex.model, ex.path = p.Model, path
	ex.requestID = append(ex.requestID[:0], id...)
	if err := ex.decide(snap, p); err != nil {
		g.putExchange(ex)
		g.fail(ctx, err)
		return
	}
	ex.measuresTTFT = p.Stream && k != request.Passthrough
	body := ctx.PostBody()
	strip := false
	if p.Stream && !p.WantsUsage && k != request.Passthrough {
		if b, err := request.WithIncludeUsage(body, p.StreamOptions); err == nil {
			body, strip = b, true
		}
	}
	req := proxy.Request{
		ID:                ex.requestID,
		Path:              ex.path,
		Header:            &ctx.Request.Header,
		Body:              body,
		StripUsage:        strip,
		DropAuthorization: len(s.APIKeys) > 0,
		Stream:            p.Stream,
	}
	if p.Stream && s.ResumeStreams && k != request.Passthrough {
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
		// the request's last Finish (putExchange).
		ex.abort = &proxy.Abort{}
		req.Abort = ex.abort
		g.watch.add(ex.abort, ctx.Conn())
	}
	// ex belongs to the proxy from here: it is released on the last Finish,
	// which may run after this handler returns.
	g.fwd.Forward(ctx, &req, ex.targets, ex)
}

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
		if serves(&snap.Replicas[i], model) {
			return true
		}
	}
	return false
}

func serves(r *fleet.Replica, model string) bool {
	return r.Serves(model) || (r.Protocol == fleet.ProtocolStatic && len(r.Models) == 0)
}

// decide builds candidates, routes, and fills the targets to try.
func (ex *exchange) decide(snap *fleet.Snapshot, p *request.Request) error {
	g, s := ex.g, ex.s
	// The decision time is only logged (debug): clock reads cost on every
	// request otherwise.
	var t0 time.Time
	timed := g.log.GetLevel() <= zerolog.DebugLevel
	if timed {
		t0 = time.Now()
	}
	ms := s.Models[ex.model]
	ex.loads = g.loadsOf(snap)
	ex.req.Now = g.now()
	ex.req.Model = ex.model
	if ms.Base != "" {
		ex.req.Model = ms.Base // an adapter computes as its base model
	}
	known := len(ms.Fallback) > 0
	ejected := 0
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !serves(r, ex.model) {
			continue
		}
		known = true
		if !r.Online {
			continue
		}
		if ex.loads[i].eject.out(ex.req.Now.UnixNano()) {
			ejected++
			continue
		}
		ex.addCandidate(r, i)
	}
	if len(ex.cands) == 0 && ejected > 0 {
		// Every replica up is ejected: try them all the same (by load)
		// rather than answer 503; one may be back already.
		for i := range snap.Replicas {
			if r := &snap.Replicas[i]; r.Online && serves(r, ex.model) {
				ex.addCandidate(r, i)
			}
		}
	}
	if !known {
		return &request.Error{Status: 404, Type: "not_found_error", Message: fmt.Sprintf("model %q is not served here", ex.model)}
	}
	if len(ex.cands) == 0 {
		// No replica is known to be up. Those whose sidecar merely fell
		// silent (stale, e.g. a CPU-starved host) may well still serve: try
		// them by load before giving up; the proxy moves on if they fail.
		for i := range snap.Replicas {
			r := &snap.Replicas[i]
			if r.Stale && r.URL != "" && serves(r, ex.model) {
				ex.cands = append(ex.cands, routing.Candidate{Name: r.Name, Static: r.Protocol == fleet.ProtocolStatic})
				ex.snapIdx = append(ex.snapIdx, i)
				ex.staleOnly = true
			}
		}
	}
	if len(ex.cands) == 0 {
		if len(ms.Fallback) == 0 {
			return &request.Error{Status: 503, Type: "service_unavailable", Message: fmt.Sprintf("no replica of %q is available", ex.model)}
		}
		ex.tokens(p, ms)
		ex.d = routing.Decision{Pick: -1, Order: ex.d.Order[:0], Mode: routing.ModeFallback, Reason: "no replica online"}
		ex.addFallback(ms)
		if timed {
			ex.decideTime = time.Since(t0)
		}
		return nil
	}

	ex.tokens(p, ms)
	ex.req.PromptTokens, ex.req.PromptContinues = ex.promptTokens, ex.mediaPrefix
	ex.match(snap)
	ex.req.Keys = ex.keys
	s.Policy.Route(&ex.req, ex.cands, &ex.d)
	if timed {
		ex.decideTime = time.Since(t0)
	}
	if ex.tokenizeErr != nil && ex.d.Mode == routing.ModeCold {
		// Without tokens there is no prefix to place: this was load only.
		ex.d.Mode = routing.ModeBalance
	}

	spill := ms.SpillAfter > 0 && len(ms.Fallback) > 0 && ex.d.PredictedTTFT > ms.SpillAfter
	if spill {
		ex.d.Reason = "spilled to the fallback: predicted ttft over spill_after"
		g.metrics.spills.Inc()
		ex.addFallback(ms) // first; the replicas stay behind it as retries
	}
	replicas := 0
	for _, ci := range ex.d.Order {
		if replicas >= s.MaxAttempts {
			break
		}
		c := &ex.cands[ci]
		r := &snap.Replicas[ex.snapIndex(ci)]
		up, err := g.upstream(r)
		if err != nil {
			g.log.Warn().Err(err).Str("replica", r.Name).Msg("replica has an unusable URL")
			continue
		}
		matched := 0
		if c.PrefixAware {
			matched = c.MatchedTokens
		}
		mode := ex.d.Mode
		if ci == ex.d.Pick {
			matched = ex.d.PredictedCachedTokens
		} else if mode == routing.ModePrefix && matched == 0 {
			mode = routing.ModeBalance
		}
		if c.Static {
			mode = routing.ModeStatic
		}
		ex.targets = append(ex.targets, up)
		ex.info = append(ex.info, targetInfo{
			name: r.Name, mode: mode, predicted: matched,
			uncached: max(ex.promptTokens-matched, 0), load: ex.loads[ex.snapIndex(ci)],
			prefixAware: c.PrefixAware, filterMatched: c.MatchedTokens, stale: r.Stale,
		})
		replicas++
	}
	if !spill {
		ex.addFallback(ms)
	}
	if len(ex.targets) == 0 {
		return &request.Error{Status: 503, Type: "service_unavailable", Message: fmt.Sprintf("no replica of %q is available", ex.model)}
	}
	return nil
}

// addCandidate makes snapshot replica i a candidate.
func (ex *exchange) addCandidate(r *fleet.Replica, i int) {
	ex.cands = append(ex.cands, routing.Candidate{
		Name:        r.Name,
		PrefixAware: r.KVEvents && r.Selected && !r.Stale && r.Filter != nil,
		Static:      r.Protocol == fleet.ProtocolStatic,
	})
	ex.snapIdx = append(ex.snapIdx, i)
}

func (ex *exchange) addFallback(ms Model) {
	for _, up := range ms.Fallback {
		ex.targets = append(ex.targets, up)
		ex.info = append(ex.info, targetInfo{name: up.Name, mode: routing.ModeFallback, fallback: true, uncached: ex.promptTokens})
	}
}

// snapIndex returns the snapshot index of candidate ci.
func (ex *exchange) snapIndex(ci int) int { return ex.snapIdx[ci] }

// tokens tokenizes the prompt; a failure degrades to load-only routing.
func (ex *exchange) tokens(p *request.Request, ms Model) {
	pre, err := ex.encode(p, ms)
	if err != nil {
		if errors.Is(err, tokenize.ErrPromptTooLong) {
			ex.g.metrics.promptsTooLong.Inc()
		}
		ex.tokenizeErr = err
		ex.ids = nil
		ex.promptTokens = 0
		return
	}
	if pre.Estimated {
		ex.g.metrics.promptsCut.Inc()
	}
	ex.ids = pre.IDs
	ex.promptTokens, ex.promptEstimated = pre.Total, pre.Estimated
	ex.req.AffinityKey = 0
	ex.seed = blockkey.Seed(ms.Adapter, p.CacheSalt)
}

// encode returns the prompt's leading token ids and count, rendering and
// tokenizing no more of it than Settings.MaxPrefixBytes (tokenize.Bounds).
// A tokenizer that panics on some input is an error like any other: that
// request is routed by load, the router stays up, and the panic is counted
// and logged with its stack.
func (ex *exchange) encode(p *request.Request, ms Model) (pre tokenize.Prefixed, err error) {
	defer func() {
		if r := recover(); r != nil {
			pre, err = tokenize.Prefixed{}, fmt.Errorf("tokenizer panic: %v", r)
			ex.g.panicked("tokenizer_panic", r, debug.Stack()).Str("model", ex.model).
				Msg("tokenizer panicked; the request is routed by load")
		}
	}()
	tk := ex.s.tokenizer(ms)
	bounds := tokenize.Bounds{MaxTokens: ex.s.MaxPrefixTokens, MaxBytes: ex.s.MaxPrefixBytes}
	switch {
	case p.Kind == request.Passthrough:
		err = errLoadOnly
	case p.Kind == request.Completion && p.PromptIDs != nil:
		pre = tokenize.Prefixed{IDs: p.PromptIDs, Total: len(p.PromptIDs)}
	case tk == nil:
		err = errNoTokenizer
	case p.Kind == request.Completion:
		pre, err = tokenize.EncodePrefix(tk, p.PromptText, p.PromptSpecialTokens(), bounds)
	default:
		chat := p.ChatInput()
		chat.IDs, chat.Prompt = ex.idsBuf, &ex.promptBuf
		pre, err = tokenize.EncodeChatPrefix(tk, chat, bounds)
		if k, media := tokenize.MediaMessage(err); media && k > 0 {
			// The engine expands media into tokens the router cannot know,
			// but the messages before the first media part are rendered
			// the same in any conversation that starts with them: route on
			// their blocks (a shared system prompt, earlier text turns).
			chat.Messages = request.LeadingElements(p.Messages, k)
			chat.AddGenerationPrompt, chat.ContinueFinalMessage = false, false
			pre, err = tokenize.EncodeChatPrefix(tk, chat, bounds)
			ex.mediaPrefix = err == nil
		}
		if cap(pre.IDs) > cap(ex.idsBuf) && cap(pre.IDs) <= maxReusedIDs {
			ex.idsBuf = pre.IDs[:0] // grown by the tokenizer: keep the bigger one
		}
		if cap(ex.promptBuf) > maxReusedPrompt {
			ex.promptBuf = nil
		}
	}
	return pre, err
}

var (
	errNoTokenizer = fmt.Errorf("no tokenizer for this model")
	errLoadOnly    = fmt.Errorf("endpoint routed by load only")
)

// match computes block keys and each candidate's matched prefix and load.
func (ex *exchange) match(snap *fleet.Snapshot) {
	bs := 0
	for i := range ex.cands {
		if r := &snap.Replicas[ex.snapIdx[i]]; ex.cands[i].PrefixAware && r.BlockSize > 0 {
			bs = r.BlockSize
			break
		}
	}
	ex.req.BlockSize = bs
	ex.req.AffinityKey = 0
	ids := ex.ids
	if len(ids) > ex.s.MaxPrefixTokens {
		ids = ids[:ex.s.MaxPrefixTokens]
	}
	keyBS := bs
	if keyBS == 0 {
		keyBS = defaultBlockSize
	}
	if ex.tokenizeErr == nil {
		ex.keys = blockkey.Append(ex.keys[:0], ex.seed, ids, keyBS)
		if n := min(len(ex.keys), affinityBlocks); n > 0 {
			ex.req.AffinityKey = ex.keys[n-1]
		}
	}
	if bs > 0 && len(ex.keys) > 0 {
		if cap(ex.matchAll) < len(snap.Replicas) {
			ex.matchAll = make([]int, len(snap.Replicas))
		}
		ex.matchAll = ex.matchAll[:len(snap.Replicas)]
		snap.MatchPrefix(ex.keys, ex.matchAll)
		otherSize := false
		for i := range ex.cands {
			r := &snap.Replicas[ex.snapIdx[i]]
			if !ex.cands[i].PrefixAware {
				continue
			}
			if r.BlockSize != bs {
				otherSize = true
				continue
			}
			ex.cands[i].MatchedTokens = ex.cacheable(ex.matchAll[ex.snapIdx[i]], bs)
		}
		if otherSize {
			ex.matchOtherSizes(snap, ids, bs)
		}
	} else {
		ex.req.BlockSize = 0
		for i := range ex.cands {
			ex.cands[i].PrefixAware = ex.cands[i].PrefixAware && ex.tokenizeErr == nil
		}
	}
	if ex.tokenizeErr != nil {
		for i := range ex.cands {
			ex.cands[i].PrefixAware = false
		}
	}
	for i := range ex.cands {
		r := &snap.Replicas[ex.snapIdx[i]]
		c := &ex.cands[i]
		c.Waiting, c.Running = r.Load.Waiting, r.Load.Running
		mine := ex.loads[ex.snapIdx[i]]
		c.InflightRequests, c.PendingPrefillTokens = mine.clusterView(r.Load)
	}
}

// cacheable is what a replica whose filter holds the prompt's first blocks
// blocks (of bs tokens each) will serve from its cache: every policy, the
// cost model's uncached prefill and X-Kvmesh-Cached-Tokens read it, so all
// of them predict what the engine will report.
func (ex *exchange) cacheable(blocks, bs int) int {
	return min(blocks*bs, ex.req.MaxCachedTokens(bs))
}

// matchOtherSizes handles replicas whose engines use another block size
// (rare: a mixed fleet): their keys are computed for their size.
func (ex *exchange) matchOtherSizes(snap *fleet.Snapshot, ids []uint32, done int) {
	var keys []uint64
	for i := range ex.cands {
		r := &snap.Replicas[ex.snapIdx[i]]
		if !ex.cands[i].PrefixAware || r.BlockSize == done || r.BlockSize <= 0 {
			continue
		}
		keys = blockkey.Append(keys[:0], ex.seed, ids, r.BlockSize)
		snap.MatchPrefix(keys, ex.matchAll)
		ex.cands[i].MatchedTokens = ex.cacheable(ex.matchAll[ex.snapIdx[i]], r.BlockSize)
	}
}
