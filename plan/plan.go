// Package plan turns one parsed request into the targets a router tries,
// in order: which replicas serve its model and are up, how much of its
// prompt each holds (tokens, block keys, the replicas' filters), what the
// routing policy makes of that, and where the model's fallback endpoints go.
// It is a pure function of its input: the fleet snapshot, the router's own
// per-replica load, the request, the settings in force and the time, with
// no clock read, metric, log line or connection inside. The caller maps
// targets to connections and observes how they answer.
//
// A Plan is reused from one request to the next (its slices are scratch),
// so a decision allocates only what the tokenizer does.
package plan

import (
	"errors"
	"fmt"
	"hash/fnv"
	"runtime/debug"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/storedchain"
	"github.com/kvmesh/kvmesh/tokenize"
)

// defaultBlockSize keys prompts when no candidate announces one (static
// upstreams only): it still gives consistent hashing a stable affinity key.
const defaultBlockSize = 16

// affinityBlocks is how many leading blocks place a cold prefix.
const affinityBlocks = 4

// maxReusedIDs bounds the id buffer a Plan keeps (1 MiB), so one huge
// prompt does not pin its buffer for good.
const maxReusedIDs = 1 << 18

// maxReusedPrompt bounds the prompt buffer a Plan keeps.
const maxReusedPrompt = 1 << 20

// Load is what the router itself knows of one replica, beside what its
// sidecar gossiped.
type Load struct {
	// Requests and PrefillTokens are this router's work in flight there:
	// requests dispatched and not finished, and their uncached prompt
	// tokens until the first byte came back.
	Requests, PrefillTokens int
	// Ejected: a request could not reach it lately; it is out of routing
	// for a while.
	Ejected bool
	// Unusable: its URL cannot be dialled; it is never a target.
	Unusable bool
}

// Model is how the router treats one model name.
type Model struct {
	// Tokenizer tokenizes its prompts (nil: routed by load only).
	Tokenizer tokenize.Model
	// Adapter is set when the name is a LoRA adapter: its block keys are
	// seeded with it. Base names the model it adapts, whose cost it has.
	Adapter, Base string
	// Fallback names the endpoints that take requests no replica can
	// serve, in order.
	Fallback []string
	// SpillAfter, with a Fallback, puts the fallback first when the best
	// replica's predicted time to first token is over it (0: never).
	SpillAfter time.Duration
}

// Settings are the bounds a decision works within.
type Settings struct {
	Policy routing.Policy
	// MaxPrefixTokens caps the tokens matched; MaxPrefixBytes the prompt
	// bytes rendered and tokenized to find them (tokenize.Bounds).
	MaxPrefixTokens, MaxPrefixBytes int
	// MaxAttempts bounds the replicas tried, not counting the fallback.
	MaxAttempts int
	// IgnoreTiers matches GPU blocks only, blind to the blocks replicas
	// hold on offload tiers (as a router that predates tiers): for
	// comparing tier-priced routing with tier-blind.
	IgnoreTiers bool
	// Split is when a model whose replicas announce prefill and decode
	// roles has a request prefilled on one replica and decoded on another.
	Split Split
	// SplitMinUncached is SplitAuto's threshold: a request is split when
	// the best decode-capable replica would have to compute at least this
	// many of its prompt tokens itself (the router's config derives it
	// from the cost model: the prefill time that would stall the decodes
	// running there).
	SplitMinUncached int
}

// Split is when a request to a disaggregated model is split.
type Split uint8

// The split modes.
const (
	// SplitAuto splits when the uncached part of the prompt on the best
	// decode-capable replica reaches SplitMinUncached: a short or cached
	// prompt is served whole there, where its prefill stalls little.
	SplitAuto Split = iota
	// SplitAlways splits every request a prefill replica can take.
	SplitAlways
	// SplitNever serves every request whole on a decode-capable replica.
	SplitNever
)

// ParseSplit reads a split mode by name: auto, always or never.
func ParseSplit(s string) (Split, error) {
	switch s {
	case "auto", "":
		return SplitAuto, nil
	case "always":
		return SplitAlways, nil
	case "never":
		return SplitNever, nil
	}
	return SplitAuto, fmt.Errorf("split %q: want auto, always or never", s)
}

func (s Split) String() string {
	switch s {
	case SplitAlways:
		return "always"
	case SplitNever:
		return "never"
	}
	return "auto"
}

// Input is everything one decision reads.
type Input struct {
	Snapshot *fleet.Snapshot
	// Loads is the router's own view of each replica, parallel to
	// Snapshot.Replicas.
	Loads   []Load
	Request *request.Request
	// Model is the name asked for: Request.Model, or the fleet's only
	// model when the body names none.
	Model    string
	Settings Settings
	// ModelSettings is how the router treats Model.
	ModelSettings Model
	Now           time.Time
	// Session is the session the client named (a session header), "" for
	// none: a placement hint the policy gets as routing.Request.Session.
	Session string
	// Replica, when set, is the only replica that can serve the request
	// (it holds the state the request continues): no other replica and no
	// fallback is tried. StoredBy names what that state is, for the 404
	// when the replica is gone.
	Replica, StoredBy string
	// Continued, for a request that continues a stored response, is its
	// prompt as far as the router could rebuild it (package storedchain):
	// nil routes it, and predicts it, as a prompt of unknown tokens.
	Continued *storedchain.Continued
}

// Target is one place to send the request, with what the proxy's observer
// needs about it.
type Target struct {
	// Replica is the snapshot index of the replica; -1 for a fallback
	// endpoint, whose index in Model.Fallback is Fallback (-1 otherwise).
	Replica, Fallback int
	Name              string
	// Mode is how it was chosen (the X-Kvmesh-Mode header).
	Mode routing.Mode
	// PredictedCached is the prompt tokens it is expected to serve from
	// its cache (X-Kvmesh-Cached-Tokens); Uncached the rest, the prefill
	// it adds to the replica's load until the first byte.
	PredictedCached, Uncached int
	// PredictedOffloaded is the part of PredictedCached held only on an
	// offload tier, loaded back rather than found on the GPU
	// (X-Kvmesh-Offloaded-Tokens).
	PredictedOffloaded int
	// PrefixAware targets are recorded by the policy when the request is
	// sent to them (routing.Recorder), with the blocks their filter showed
	// (FilterMatched tokens).
	PrefixAware   bool
	FilterMatched int
	// Stale: the replica's load figures are old or, for an orphan, gone.
	Stale bool
	// Picked is the decision's pick.
	Picked bool
	// Teaches: a time to first token measured here is what the decision
	// predicted, so it may teach the cost model (see teaches).
	Teaches bool
	// Split: the target decodes the prefill a Plan.Prefill target made
	// (it is sent the prefill's kv_transfer_params).
	Split bool
}

// Prompt is what tokenizing the request gave.
type Prompt struct {
	// IDs are its leading token ids (at most what MaxPrefixBytes rendered).
	IDs []uint32
	// Tokens counts its tokens: exactly, or by estimate past the window
	// tokenized when Estimated.
	Tokens    int
	Estimated bool
	// MediaPrefix: the chat holds media, and IDs are the text before the
	// first media part (the engine expands media into unknown tokens).
	MediaPrefix bool
	// Err is why there are no ids (the request is then routed by load): no
	// tokenizer, a passthrough endpoint, a prompt over the bounds, or a
	// tokenizer that failed or panicked (*TokenizerPanic).
	Err error
}

// TokenizerPanic is a panic recovered from a tokenizer: that request is
// routed by load, and the caller reports it.
type TokenizerPanic struct {
	Value any
	Stack []byte
}

func (p *TokenizerPanic) Error() string { return fmt.Sprintf("tokenizer panic: %v", p.Value) }

// Errors a Prompt may hold when no tokenizer applies.
var (
	ErrNoTokenizer = errors.New("no tokenizer for this model")
	ErrLoadOnly    = errors.New("endpoint routed by load only")
	// ErrStoredState: the engine prepends a stored response to the prompt,
	// which the router could not rebuild (Input.Continued nil, or keyed
	// by another block size than the replica's).
	ErrStoredState = errors.New("the prompt continues a stored response")
)

// Plan is one decision: the targets to try and what led to them. Its
// zero value is ready; Decide refills it, reusing its buffers.
type Plan struct {
	// Targets are the replicas to try in order (at most MaxAttempts) and
	// the fallback endpoints, first when Spilled, else last.
	Targets []Target
	// Prefill, when not empty, makes the plan a split one: the request is
	// first prefilled at one of these (in order, prefix-aware), then
	// decoded by the Split targets that lead Targets (by load). After them
	// comes the best decode-capable replica serving the request whole,
	// which catches a transfer no decode replica could read.
	Prefill []Target
	// Request, Candidates and Decision are what the policy was asked and
	// answered: a Recorder and a Learner are told of them.
	Request    routing.Request
	Candidates []routing.Candidate
	Decision   routing.Decision
	Prompt     Prompt
	// StaleOnly: no replica was known up; the candidates are replicas
	// whose sidecars fell silent, tried by load.
	StaleOnly bool
	// Spilled: the fallback goes first (predicted wait over SpillAfter).
	Spilled bool
	// Unusable lists the snapshot indexes of replicas the policy ordered
	// but whose URL cannot be dialled, skipped.
	Unusable []int

	snapIdx []int // snapshot index of each candidate, parallel to Candidates
	// pool and poolIdx are one role's candidates and their indexes in
	// Candidates (a split plan's); wholeOrder keeps its whole decision's
	// order while the prefill is decided.
	pool       []routing.Candidate
	poolIdx    []int
	wholeOrder []int
	matchAll   []int
	keys       []uint64
	keyOffset  int // blocks before keys[0] (a continued prompt's history)
	sizeKeys   []uint64
	idsBuf     []uint32
	promptBuf  []byte
	seed       uint64
}

// PickCandidate returns the candidate the policy picked, nil when none.
func (p *Plan) PickCandidate() *routing.Candidate {
	if p.Decision.Pick < 0 {
		return nil
	}
	return &p.Candidates[p.Decision.Pick]
}

func (p *Plan) reset() {
	p.Targets, p.Candidates, p.Unusable, p.snapIdx = p.Targets[:0], p.Candidates[:0], p.Unusable[:0], p.snapIdx[:0]
	p.Prefill = p.Prefill[:0]
	p.Prompt = Prompt{}
	p.StaleOnly, p.Spilled = false, false
	p.Request = routing.Request{Keys: p.Request.Keys[:0]}
	p.Decision = routing.Decision{Order: p.Decision.Order[:0]}
}

// Release drops what p points into (the prompt's ids, its targets' names)
// and the buffers one huge prompt grew, before p is pooled. Candidates keep
// their names: clearing fifty of them on every request costs more than the
// few strings of an old snapshot they hold on to.
func (p *Plan) Release() {
	clear(p.Targets[:cap(p.Targets)])
	clear(p.Prefill[:cap(p.Prefill)])
	p.Prompt = Prompt{}
	p.Request = routing.Request{Keys: p.Request.Keys[:0]}
	if cap(p.promptBuf) > maxReusedPrompt {
		p.promptBuf = nil
	}
}

// Decide fills p from in: the targets to try, or the client error to
// answer (a *request.Error: 404 for a model nobody serves, 503 when no
// replica nor fallback can take it).
func (p *Plan) Decide(in *Input) error {
	p.reset()
	snap, ms, model := in.Snapshot, &in.ModelSettings, in.Model
	p.Request.Now = in.Now
	p.Request.Model = model
	p.Request.Session = SessionKey(in.Session)
	if ms.Base != "" {
		p.Request.Model = ms.Base // an adapter computes as its base model
	}
	if in.Replica != "" {
		return p.decidePinned(in)
	}
	known := len(ms.Fallback) > 0
	ejected := 0
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !Serves(r, model) {
			continue
		}
		known = true
		if !r.Online {
			continue
		}
		if in.Loads[i].Ejected {
			ejected++
			continue
		}
		p.addCandidate(r, i)
	}
	if len(p.Candidates) == 0 && ejected > 0 {
		// Every replica up is ejected: try them all the same (by load)
		// rather than answer 503; one may be back already.
		for i := range snap.Replicas {
			if r := &snap.Replicas[i]; r.Online && Serves(r, model) {
				p.addCandidate(r, i)
			}
		}
	}
	if !known {
		return &request.Error{Status: 404, Type: "not_found_error", Message: fmt.Sprintf("model %q is not served here", model)}
	}
	if len(p.Candidates) == 0 {
		// No replica is known to be up. Those whose sidecar merely fell
		// silent (stale, e.g. a CPU-starved host) may well still serve: try
		// them by load before giving up; the proxy moves on if they fail.
		for i := range snap.Replicas {
			r := &snap.Replicas[i]
			if r.Stale && r.URL != "" && Serves(r, model) {
				p.Candidates = append(p.Candidates, routing.Candidate{Name: r.Name, Static: r.Protocol == fleet.ProtocolStatic})
				p.snapIdx = append(p.snapIdx, i)
				p.StaleOnly = true
			}
		}
	}
	if len(p.Candidates) == 0 {
		if len(ms.Fallback) == 0 {
			return noReplica(model)
		}
		p.tokens(in)
		p.Decision = routing.Decision{Pick: -1, Order: p.Decision.Order[:0], Mode: routing.ModeFallback, Reason: "no replica online"}
		p.addFallback(ms)
		return nil
	}

	p.tokens(in)
	p.Request.PromptTokens, p.Request.PromptContinues = p.Prompt.Tokens, p.Prompt.MediaPrefix
	p.match(in)
	p.Request.Keys = p.keys
	if p.disaggregated(snap) {
		return p.decideSplit(in)
	}
	p.Request.Rank = p.rank(in)
	in.Settings.Policy.Route(&p.Request, p.Candidates, &p.Decision)
	return p.targetsFrom(in)
}

// rank is how many of the decision's order targetsFrom may read: the
// replicas it tries and those it skips as unusable on the way.
func (p *Plan) rank(in *Input) int {
	n := max(in.Settings.MaxAttempts, 1)
	for _, i := range p.snapIdx {
		if in.Loads[i].Unusable {
			n++
		}
	}
	return n
}

// targetsFrom fills p.Targets from p.Decision: the replicas it orders, at
// most MaxAttempts of them, and the model's fallback endpoints, first when
// the pick's predicted time to first token is over SpillAfter.
func (p *Plan) targetsFrom(in *Input) error {
	snap, ms, model := in.Snapshot, &in.ModelSettings, in.Model
	// Without tokens there is no prefix to place: this was load only.
	p.fixMode(&p.Decision)
	p.Spilled = ms.SpillAfter > 0 && len(ms.Fallback) > 0 && p.Decision.PredictedTTFT > ms.SpillAfter
	if p.Spilled {
		p.Decision.Reason = "spilled to the fallback: predicted ttft over spill_after"
		p.addFallback(ms) // first; the replicas stay behind it as retries
	}
	replicas := 0
	for _, ci := range p.Decision.Order {
		if replicas >= in.Settings.MaxAttempts {
			break
		}
		i := p.snapIdx[ci]
		if in.Loads[i].Unusable {
			p.Unusable = append(p.Unusable, i)
			continue
		}
		p.Targets = append(p.Targets, p.target(snap, ci, &p.Decision))
		replicas++
	}
	if !p.Spilled {
		p.addFallback(ms)
	}
	if len(p.Targets) == 0 {
		return noReplica(model)
	}
	return nil
}

// decidePinned plans a request only in.Replica can serve: it is the one
// target, tried whatever its load or state; when it has left the fleet the
// request is a 404 that says so, never another replica's answer.
func (p *Plan) decidePinned(in *Input) error {
	snap := in.Snapshot
	i := snap.Find(in.Replica)
	if i < 0 || !snap.Replicas[i].Online && !snap.Replicas[i].Stale {
		return &request.Error{Status: 404, Type: "invalid_request_error", Message: fmt.Sprintf(
			"%s was stored by replica %q, which is no longer in the fleet: a stored response lives in the engine that made it", in.StoredBy, in.Replica)}
	}
	if r := &snap.Replicas[i]; !Serves(r, in.Model) {
		return &request.Error{Status: 404, Type: "invalid_request_error", Message: fmt.Sprintf(
			"%s was stored by replica %q, which does not serve model %q", in.StoredBy, in.Replica, in.Model)}
	}
	p.addCandidate(&snap.Replicas[i], i)
	p.tokens(in)
	p.Request.PromptTokens = p.Prompt.Tokens
	p.match(in)
	if p.keyOffset == 0 {
		// A continued prompt's keys start past its first block: the
		// policy's records, which index keys by block, do not apply.
		p.Request.Keys = p.keys
	}
	in.Settings.Policy.Route(&p.Request, p.Candidates, &p.Decision)
	if p.Prompt.Err != nil && p.Decision.Mode == routing.ModeCold {
		p.Decision.Mode = routing.ModeBalance
	}
	if in.Loads[i].Unusable || len(p.Decision.Order) == 0 {
		p.Unusable = append(p.Unusable, i)
		return noReplica(in.Model)
	}
	p.Targets = append(p.Targets, p.target(snap, 0, &p.Decision))
	return nil
}

func noReplica(model string) error {
	return &request.Error{Status: 503, Type: "service_unavailable", Message: fmt.Sprintf("no replica of %q is available", model)}
}

// target is candidate ci as a target: its mode and predicted cache hit as
// decision d sees them.
func (p *Plan) target(snap *fleet.Snapshot, ci int, d *routing.Decision) Target {
	c := &p.Candidates[ci]
	r := &snap.Replicas[p.snapIdx[ci]]
	matched, offloaded := 0, 0
	if c.PrefixAware {
		matched, offloaded = c.MatchedTokens, c.OffloadedTokens
	}
	mode := d.Mode
	picked := ci == d.Pick
	if picked {
		matched, offloaded = d.PredictedCachedTokens, d.PredictedOffloadedTokens
	} else if mode == routing.ModePrefix && matched == 0 {
		mode = routing.ModeBalance
	}
	if c.Static {
		mode = routing.ModeStatic
	}
	t := Target{
		Replica: p.snapIdx[ci], Fallback: -1, Name: r.Name, Mode: mode,
		PredictedCached: matched, PredictedOffloaded: offloaded, Uncached: max(p.Prompt.Tokens-matched, 0),
		PrefixAware: c.PrefixAware, FilterMatched: c.MatchedTokens, Stale: r.Stale, Picked: picked,
	}
	t.Teaches = p.teaches(&t)
	return t
}

// teaches reports whether a time to first token measured at t is what the
// decision predicted, so that a Learner may calibrate on it: t is the
// replica picked, with current load figures, for a prompt whose tokens
// were all counted exactly. (Whether the answer then measured one, a
// stream's first event on the first try, is the observer's to tell.)
func (p *Plan) teaches(t *Target) bool {
	pr := &p.Prompt
	return t.Picked && t.Replica >= 0 && !t.Stale && !p.StaleOnly &&
		pr.Err == nil && !pr.MediaPrefix && !pr.Estimated
}

// addCandidate makes snapshot replica i a candidate.
func (p *Plan) addCandidate(r *fleet.Replica, i int) {
	p.Candidates = append(p.Candidates, routing.Candidate{
		Name:        r.Name,
		PrefixAware: r.KVEvents && r.Selected && !r.Stale && r.Filter != nil,
		Static:      r.Protocol == fleet.ProtocolStatic,
	})
	p.snapIdx = append(p.snapIdx, i)
}

func (p *Plan) addFallback(ms *Model) {
	for k, name := range ms.Fallback {
		p.Targets = append(p.Targets, Target{Replica: -1, Fallback: k, Name: name, Mode: routing.ModeFallback, Uncached: p.Prompt.Tokens})
	}
}

// Serves reports whether replica r takes requests for model: it serves the
// name, or it is a static upstream configured without models (any).
func Serves(r *fleet.Replica, model string) bool {
	return r.Serves(model) || (r.Protocol == fleet.ProtocolStatic && len(r.Models) == 0)
}

// tokens tokenizes the prompt into p.Prompt; a failure leaves no ids, and
// the request is routed by load.
func (p *Plan) tokens(in *Input) {
	pre, media, err := p.encode(in)
	if err != nil {
		p.Prompt = Prompt{Err: err}
		return
	}
	p.Prompt = Prompt{IDs: pre.IDs, Tokens: pre.Total, Estimated: pre.Estimated, MediaPrefix: media}
	p.Request.AffinityKey = 0
	p.seed = blockkey.Seed(in.ModelSettings.Adapter, in.Request.CacheSalt)
}

// encode returns the prompt's leading token ids and count, rendering and
// tokenizing no more of it than MaxPrefixBytes (tokenize.Bounds), and
// whether they are a media chat's text prefix. A tokenizer that panics on
// some input is an error like any other (*TokenizerPanic).
func (p *Plan) encode(in *Input) (pre tokenize.Prefixed, media bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			pre, media, err = tokenize.Prefixed{}, false, &TokenizerPanic{Value: r, Stack: debug.Stack()}
		}
	}()
	req, tk := in.Request, in.ModelSettings.Tokenizer
	bounds := tokenize.Bounds{MaxTokens: in.Settings.MaxPrefixTokens, MaxBytes: in.Settings.MaxPrefixBytes}
	switch {
	case req.Kind != request.Completion && !req.Kind.RendersAsChat(): // a passthrough
		err = ErrLoadOnly
	case req.Unconvertible != nil:
		err = req.Unconvertible
	case req.PreviousResponseID != "" && in.Continued != nil:
		pre = tokenize.Prefixed{IDs: in.Continued.IDs, Total: in.Continued.Tokens()}
	case req.PreviousResponseID != "":
		err = ErrStoredState
	case req.Kind == request.Completion && req.PromptIDs != nil:
		pre = tokenize.Prefixed{IDs: req.PromptIDs, Total: len(req.PromptIDs)}
	case tk == nil:
		err = ErrNoTokenizer
	case req.Kind == request.Completion:
		pre, err = tokenize.EncodePrefix(tk, req.PromptText, req.PromptSpecialTokens(), bounds)
	default:
		chat := req.ChatInput()
		chat.IDs, chat.Prompt = p.idsBuf, &p.promptBuf
		pre, err = tokenize.EncodeChatPrefix(tk, chat, bounds)
		if k, isMedia := tokenize.MediaMessage(err); isMedia && k > 0 {
			// The engine expands media into tokens the router cannot know,
			// but the messages before the first media part are rendered
			// the same in any conversation that starts with them: route on
			// their blocks (a shared system prompt, earlier text turns).
			chat.Messages = request.LeadingElements(req.Messages, k)
			chat.AddGenerationPrompt, chat.ContinueFinalMessage = false, false
			pre, err = tokenize.EncodeChatPrefix(tk, chat, bounds)
			media = err == nil
		}
		if cap(pre.IDs) > cap(p.idsBuf) && cap(pre.IDs) <= maxReusedIDs {
			p.idsBuf = pre.IDs[:0] // grown by the tokenizer: keep the bigger one
		}
		if cap(p.promptBuf) > maxReusedPrompt {
			p.promptBuf = nil
		}
	}
	return pre, media, err
}

// match computes block keys and each candidate's matched prefix and load.
func (p *Plan) match(in *Input) {
	snap := in.Snapshot
	bs := 0
	for i := range p.Candidates {
		if r := &snap.Replicas[p.snapIdx[i]]; p.Candidates[i].PrefixAware && r.BlockSize > 0 {
			bs = r.BlockSize
			break
		}
	}
	p.Request.BlockSize = bs
	p.Request.AffinityKey = 0
	ids := p.Prompt.IDs
	if len(ids) > in.Settings.MaxPrefixTokens {
		ids = ids[:in.Settings.MaxPrefixTokens]
	}
	keyBS := bs
	if keyBS == 0 {
		keyBS = defaultBlockSize
	}
	p.keys, p.keyOffset = p.keys[:0], 0
	switch c := in.Continued; {
	case p.Prompt.Err != nil:
	case c != nil && in.Request.PreviousResponseID != "":
		// The stored history's blocks are known by the last one's key: the
		// keys start there, and a match of any counts the blocks before.
		if c.BlockSize != bs {
			p.Prompt.Err = ErrStoredState
			break
		}
		parent := p.seed
		if c.Blocks > 0 {
			parent, p.keyOffset = c.Last, c.Blocks-1
			p.keys = append(p.keys, c.Last)
		}
		p.keys = blockkey.Append(p.keys, parent, ids, keyBS)
	default:
		p.keys = blockkey.Append(p.keys, p.seed, ids, keyBS)
		if n := min(len(p.keys), affinityBlocks); n > 0 {
			p.Request.AffinityKey = p.keys[n-1]
		}
	}
	if bs > 0 && len(p.keys) > 0 {
		if cap(p.matchAll) < len(snap.Replicas) {
			p.matchAll = make([]int, len(snap.Replicas))
		}
		p.matchAll = p.matchAll[:len(snap.Replicas)]
		snap.MatchPrefix(p.keys, p.matchAll)
		otherSize := false
		for i := range p.Candidates {
			r := &snap.Replicas[p.snapIdx[i]]
			if !p.Candidates[i].PrefixAware {
				continue
			}
			if r.BlockSize != bs {
				otherSize = true
				continue
			}
			p.setMatch(snap, i, p.keys, p.matchAll[p.snapIdx[i]], bs, !in.Settings.IgnoreTiers)
		}
		if otherSize {
			p.matchOtherSizes(snap, ids, bs, !in.Settings.IgnoreTiers)
		}
	} else {
		p.Request.BlockSize = 0
		for i := range p.Candidates {
			p.Candidates[i].PrefixAware = p.Candidates[i].PrefixAware && p.Prompt.Err == nil
		}
	}
	if p.Prompt.Err != nil {
		for i := range p.Candidates {
			p.Candidates[i].PrefixAware = false
		}
	}
	for i := range p.Candidates {
		si := p.snapIdx[i]
		r, c, mine := &snap.Replicas[si], &p.Candidates[i], &in.Loads[si]
		c.Waiting, c.Running = r.Load.Waiting, r.Load.Running
		// This router's exact counts beside the other routers' in-flight
		// work the replica's sidecar last gossiped.
		c.InflightRequests = r.Load.OthersInflightRequests + mine.Requests
		c.PendingPrefillTokens = r.Load.OthersInflightPrefillTokens + mine.PrefillTokens
	}
}

// cacheable is what a replica whose filter holds the prompt's first blocks
// blocks (of bs tokens each) will serve from its cache: every policy, the
// cost model's uncached prefill and X-Kvmesh-Cached-Tokens read it, so all
// of them predict what the engine will report.
func (p *Plan) cacheable(blocks, bs int) int {
	return min(blocks*bs, p.Request.MaxCachedTokens(bs))
}

// matchOtherSizes handles replicas whose engines use another block size
// (rare: a mixed fleet): their keys are computed for their size.
func (p *Plan) matchOtherSizes(snap *fleet.Snapshot, ids []uint32, done int, tiers bool) {
	for i := range p.Candidates {
		r := &snap.Replicas[p.snapIdx[i]]
		if !p.Candidates[i].PrefixAware || r.BlockSize == done || r.BlockSize <= 0 {
			continue
		}
		p.sizeKeys = blockkey.Append(p.sizeKeys[:0], p.seed, ids, r.BlockSize)
		snap.MatchPrefix(p.sizeKeys, p.matchAll)
		p.setMatch(snap, i, p.sizeKeys, p.matchAll[p.snapIdx[i]], r.BlockSize, tiers)
	}
}

// setMatch sets candidate i's matched tokens from the gpu leading blocks
// (of bs tokens) of keys its filter holds and, with tiers, the blocks one
// of its offload tiers holds where those stop (the first of its tiers,
// in the order its sidecar prefers them, that continues the prefix): a
// block evicted from the GPU and kept in host memory is loaded back, not
// computed, and the engine counts it cached.
func (p *Plan) setMatch(snap *fleet.Snapshot, i int, keys []uint64, gpu, bs int, tiers bool) {
	c := &p.Candidates[i]
	si := p.snapIdx[i]
	c.MatchedTokens, c.OffloadedTokens, c.OffloadMedium = p.cacheable(p.blocks(gpu), bs), 0, ""
	if !tiers || gpu >= len(keys) || c.MatchedTokens >= p.Request.MaxCachedTokens(bs) {
		return
	}
	for _, m := range snap.Replicas[si].OffloadMedia {
		if n := snap.MatchTier(si, keys, gpu, blockkey.TierSalt(m)); n > 0 {
			total := p.cacheable(p.blocks(gpu+n), bs)
			c.OffloadedTokens, c.OffloadMedium = total-c.MatchedTokens, m
			c.MatchedTokens = total
			return
		}
	}
}

// blocks is the prompt's leading blocks held where the first n of p.keys
// are: a continued prompt's keys start at its history's last block.
func (p *Plan) blocks(n int) int {
	if n == 0 {
		return 0
	}
	return p.keyOffset + n
}

// SessionKey is the routing.Request.Session of a session id: the same on
// every router (FNV-1a, mixed), never 0, which means none; 0 for "".
func SessionKey(id string) uint64 {
	if id == "" {
		return 0
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(id))
	if k := blockkey.Remix(h.Sum64()); k != 0 {
		return k
	}
	return 1
}
