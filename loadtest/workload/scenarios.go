package workload

import (
	"fmt"
	"time"
)

// TenantsParams shape the tenants scenario (llm-d's shared-prefix
// benchmark): Groups tenants each with a long shared context, users asking
// their own questions, arrivals ramping from RateStart to RateEnd. With
// HotShare > 0 group 0 receives that fraction of all requests (the hot
// scenario).
type TenantsParams struct {
	Groups         int
	UsersPerGroup  int
	ContextTokens  int
	QuestionTokens int
	OutputTokens   int
	// RateStart and RateEnd are simulated requests per second, ramped
	// linearly over the run.
	RateStart, RateEnd float64
	HotShare           float64
}

// Tenants generates the tenants (or hot) workload over d simulated time.
// Each user has one fixed question, asked again whenever drawn, as in
// llm-d's benchmark where every group holds a fixed set of prompts.
func Tenants(name string, p TenantsParams, seed uint64, d time.Duration) (Workload, error) {
	if p.Groups <= 0 || p.UsersPerGroup <= 0 || p.ContextTokens <= 0 || p.QuestionTokens <= 0 || p.OutputTokens <= 0 {
		return Workload{}, fmt.Errorf("workload %s: groups, users, context, question and output must be positive: %+v", name, p)
	}
	if p.HotShare < 0 || p.HotShare >= 1 {
		return Workload{}, fmt.Errorf("workload %s: hot share %v outside [0,1)", name, p.HotShare)
	}
	rng := streamRNG(seed, name+"/arrivals")
	secs := d.Seconds()
	rate := func(t time.Duration) float64 {
		if secs <= 0 {
			return p.RateStart
		}
		return p.RateStart + (p.RateEnd-p.RateStart)*t.Seconds()/secs
	}
	arrivals := poisson(rng, d, max(p.RateStart, p.RateEnd), rate)

	contexts := make([]string, p.Groups)
	for g := range contexts {
		contexts[g] = Words(seed, fmt.Sprintf("ctx/%d", g), p.ContextTokens)
	}
	questions := map[[2]int][]Message{}
	reqs := make([]Request, 0, len(arrivals))
	for _, at := range arrivals {
		g := rng.IntN(p.Groups)
		if p.HotShare > 0 {
			if rng.Float64() < p.HotShare {
				g = 0
			} else if p.Groups > 1 {
				g = 1 + rng.IntN(p.Groups-1)
			}
		}
		u := rng.IntN(p.UsersPerGroup)
		msgs, ok := questions[[2]int{g, u}]
		if !ok {
			msgs = []Message{
				{Role: "system", Content: contexts[g]},
				{Role: "user", Content: Words(seed, fmt.Sprintf("q/%d/%d", g, u), p.QuestionTokens)},
			}
			questions[[2]int{g, u}] = msgs
		}
		reqs = append(reqs, Request{At: at, Key: fmt.Sprintf("g%d/u%d", g, u), Messages: msgs, MaxTokens: p.OutputTokens})
	}
	return finish(name, reqs)
}

// MultiturnParams shape the multiturn scenario: conversations arrive as a
// Poisson process, each a few turns apart, every prompt carrying the whole
// history so far. Lengths follow ShareGPT-like log-normal distributions.
type MultiturnParams struct {
	ConversationRate   float64 // new conversations per simulated second
	MinTurns, MaxTurns int
	// SystemPrompts distinct system prompts of SystemTokens are shared by
	// the conversations (an app's few personas).
	SystemPrompts, SystemTokens int
	UserMedian, AssistantMedian float64 // tokens
	MaxUser, MaxAssistant       int
	ThinkTime                   time.Duration // mean gap between turns
}

// Multiturn generates the multiturn workload over d simulated time.
// Assistant turns in the history are the workload's own deterministic text
// of the requested length, not the engine's output, so the traffic is the
// same for every policy; the cached prefix a turn can reuse is then the
// previous turn's prompt.
func Multiturn(p MultiturnParams, seed uint64, d time.Duration) (Workload, error) {
	const name = "multiturn"
	if p.ConversationRate <= 0 || p.MinTurns <= 0 || p.MaxTurns < p.MinTurns || p.UserMedian <= 0 || p.AssistantMedian <= 0 || p.ThinkTime <= 0 {
		return Workload{}, fmt.Errorf("workload %s: invalid parameters %+v", name, p)
	}
	rng := streamRNG(seed, name+"/arrivals")
	starts := poisson(rng, d, p.ConversationRate, func(time.Duration) float64 { return p.ConversationRate })
	systems := make([]string, max(p.SystemPrompts, 0))
	for i := range systems {
		systems[i] = Words(seed, fmt.Sprintf("sys/%d", i), p.SystemTokens)
	}
	var reqs []Request
	for c, start := range starts {
		turns := p.MinTurns + rng.IntN(p.MaxTurns-p.MinTurns+1)
		var history []Message
		if len(systems) > 0 {
			history = append(history, Message{Role: "system", Content: systems[rng.IntN(len(systems))]})
		}
		at := start
		for t := range turns {
			if at >= d {
				break
			}
			user := logNormalInt(rng, p.UserMedian, 0.8, 4, max(p.MaxUser, 4))
			out := logNormalInt(rng, p.AssistantMedian, 0.6, 4, max(p.MaxAssistant, 4))
			history = append(history, Message{Role: "user", Content: Words(seed, fmt.Sprintf("c%d/u%d", c, t), user)})
			msgs := append([]Message(nil), history...)
			reqs = append(reqs, Request{At: at, Key: fmt.Sprintf("c%d/t%d", c, t), Messages: msgs, MaxTokens: out})
			history = append(history, Message{Role: "assistant", Content: Words(seed, fmt.Sprintf("c%d/a%d", c, t), out)})
			gap := time.Duration(float64(p.ThinkTime) * (0.5 + rng.Float64()))
			at += gap
		}
	}
	return finish(name, reqs)
}

// NoCacheParams shape the nocache scenario: unique summarization-like
// prompts at a constant Poisson rate; caching has nothing to win.
type NoCacheParams struct {
	Rate                      float64 // simulated requests per second
	InputMedian, OutputMedian float64 // tokens
	MaxInput, MaxOutput       int
}

// NoCache generates the nocache workload over d simulated time.
func NoCache(p NoCacheParams, seed uint64, d time.Duration) (Workload, error) {
	const name = "nocache"
	if p.Rate <= 0 || p.InputMedian <= 0 || p.OutputMedian <= 0 {
		return Workload{}, fmt.Errorf("workload %s: invalid parameters %+v", name, p)
	}
	rng := streamRNG(seed, name+"/arrivals")
	arrivals := poisson(rng, d, p.Rate, func(time.Duration) float64 { return p.Rate })
	reqs := make([]Request, 0, len(arrivals))
	for i, at := range arrivals {
		in := logNormalInt(rng, p.InputMedian, 0.4, 16, max(p.MaxInput, 16))
		out := logNormalInt(rng, p.OutputMedian, 0.4, 4, max(p.MaxOutput, 4))
		msgs := []Message{{Role: "user", Content: Words(seed, fmt.Sprintf("doc/%d", i), in)}}
		reqs = append(reqs, Request{At: at, Key: fmt.Sprintf("doc%d", i), Messages: msgs, MaxTokens: out})
	}
	return finish(name, reqs)
}
