// Package workload generates the seeded request streams the load test
// replays through each routing policy.
//
// Everything here is pure: parameters and a seed in, a list of timed chat
// requests out, identical for every policy so policies are compared on the
// same traffic. Times are simulated engine time (the cluster's enginesim
// runs --time-scale times faster; the runner scales arrivals accordingly).
// Prompts are made of pseudo-words so the builtin tokenizer, which router
// and enginesim share, turns them into a known number of tokens.
package workload

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/tokenize"
)

// Message is one chat message as sent in the request body.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Request is one chat completion to send.
type Request struct {
	// At is the arrival time, in simulated time since the run started.
	At time.Duration
	// Key names what the prompt is made of ("g12/u3", "c7/t2", "trace/41");
	// requests with the same Key have the same prompt.
	Key       string
	Messages  []Message
	MaxTokens int
	// Tenant names the client population that sends it (the client sends
	// the API key TenantKey(Tenant)); Priority is its X-Kvmesh-Priority.
	// Both empty outside the multi-tenant scenarios.
	Tenant, Priority string
	// PromptTokens is the builtin tokenizer's count of the rendered chat,
	// generation prompt included: what the engine will report as
	// usage.prompt_tokens.
	PromptTokens int
	// After is the Key of the request whose answer this one needs (an
	// agent's previous turn): it is sent only once that one is done.
	After string
	// Agent, when set, makes this a tool-using conversation's turn, sent
	// through the Responses API (or as the chat it amounts to); Messages
	// then only approximate its prompt (answers unknown until sent).
	Agent *AgentTurn
}

// Workload is one scenario's requests, sorted by arrival.
type Workload struct {
	Scenario string
	Requests []Request
	// DemandBlocks is the number of distinct full KV blocks (of BlockSize
	// tokens) all prompts together occupy: the cache capacity the scenario
	// asks of the fleet to hold everything once.
	DemandBlocks int
	BlockSize    int
}

// BlockSize is the engine block size the workloads are measured in
// (enginesim's and vLLM's default).
const BlockSize = 16

// Tokenize renders msgs as a chat with the generation prompt and returns
// the builtin token ids, exactly as router and enginesim compute them.
func Tokenize(msgs []Message) ([]uint32, error) {
	return encodeChat(msgs, true)
}

func encodeChat(msgs []Message, generationPrompt bool) ([]uint32, error) {
	raw, err := json.Marshal(msgs)
	if err != nil {
		return nil, err
	}
	_, ids, err := tokenize.Builtin{}.EncodeChat(tokenize.Chat{Messages: raw, AddGenerationPrompt: generationPrompt})
	return ids, err
}

// Tokenizer gives Tokenize's ids for a workload's prompts, tokenizing each
// message that recurs across them (a tenant's shared prefix, a
// conversation's history) once. That is exact because the builtin chat
// template opens every message with "<|", and the builtin tokenizer always
// ends a token before a '<' that follows the '\n' closing the previous
// message: a prompt's ids are its messages' ids, one after another, then
// the generation prompt's.
type Tokenizer struct {
	// left counts the prompts still to be tokenized that hold each message
	// of more than one prompt; ids keeps a message's ids while any is left.
	left map[Message]int
	ids  map[Message][]uint32
	gen  []uint32
}

// NewTokenizer returns a Tokenizer for reqs' prompts, each distinct Key to
// be tokenized once.
func NewTokenizer(reqs []Request) *Tokenizer {
	t := &Tokenizer{left: map[Message]int{}, ids: map[Message][]uint32{}}
	seen := make(map[string]bool, len(reqs))
	for i := range reqs {
		if seen[reqs[i].Key] {
			continue
		}
		seen[reqs[i].Key] = true
		for _, m := range reqs[i].Messages {
			t.left[m]++
		}
	}
	for m, n := range t.left {
		if n < 2 {
			delete(t.left, m)
		}
	}
	return t
}

// Tokenize returns Tokenize(msgs).
func (t *Tokenizer) Tokenize(msgs []Message) ([]uint32, error) {
	if t.gen == nil {
		gen, err := encodeChat([]Message{}, true)
		if err != nil {
			return nil, err
		}
		t.gen = gen
	}
	var out []uint32
	for _, m := range msgs {
		ids, ok := t.ids[m]
		if !ok {
			var err error
			if ids, err = encodeChat([]Message{m}, false); err != nil {
				return nil, err
			}
		}
		out = append(out, ids...)
		if n, shared := t.left[m]; shared {
			if n <= 1 {
				delete(t.left, m)
				delete(t.ids, m)
			} else {
				t.left[m], t.ids[m] = n-1, ids
			}
		}
	}
	return append(out, t.gen...), nil
}

// finish sorts requests, counts prompt tokens and the distinct blocks they
// occupy. Requests sharing a Key are tokenized once.
func finish(name string, reqs []Request) (Workload, error) {
	sort.SliceStable(reqs, func(i, j int) bool { return reqs[i].At < reqs[j].At })
	counted := map[string]int{}
	blocks := map[uint64]struct{}{}
	seed := blockkey.Seed("", "")
	var keys []uint64
	tok := NewTokenizer(reqs)
	for i := range reqs {
		if n, ok := counted[reqs[i].Key]; ok {
			reqs[i].PromptTokens = n
			continue
		}
		ids, err := tok.Tokenize(reqs[i].Messages)
		if err != nil {
			return Workload{}, fmt.Errorf("workload %s: request %s: %w", name, reqs[i].Key, err)
		}
		reqs[i].PromptTokens = len(ids)
		counted[reqs[i].Key] = len(ids)
		keys = blockkey.Append(keys[:0], seed, ids, BlockSize)
		for _, k := range keys {
			blocks[k] = struct{}{}
		}
	}
	return Workload{Scenario: name, Requests: reqs, DemandBlocks: len(blocks), BlockSize: BlockSize}, nil
}

// Truncate keeps at most n requests (the earliest); n <= 0 keeps all.
func (w *Workload) Truncate(n int) {
	if n > 0 && len(w.Requests) > n {
		w.Requests = w.Requests[:n]
	}
}

// Span returns the arrival time of the last request.
func (w Workload) Span() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].At
}

// poisson returns the arrival times of a Poisson process whose rate (per
// simulated second) is rate(t) ≤ maxRate, over [0, d), by thinning.
func poisson(rng *rand.Rand, d time.Duration, maxRate float64, rate func(t time.Duration) float64) []time.Duration {
	if maxRate <= 0 || d <= 0 {
		return nil
	}
	var out []time.Duration
	t := 0.0
	for {
		t += rng.ExpFloat64() / maxRate
		at := time.Duration(t * float64(time.Second))
		if at >= d {
			return out
		}
		if rng.Float64()*maxRate < rate(at) {
			out = append(out, at)
		}
	}
}

// logNormalInt draws a length with the given median and log-sigma, clamped.
func logNormalInt(rng *rand.Rand, median float64, sigma float64, lo, hi int) int {
	v := int(math.Round(median * math.Exp(sigma*rng.NormFloat64())))
	return max(lo, min(hi, v))
}
