package workload

import (
	"fmt"
	"time"
)

// Stream is one tenant's traffic at one priority in a Mix: a Poisson
// arrival rate and the shape of its prompts, as in Tenants (Groups shared
// contexts, each with users asking fixed questions), or, with Groups 0,
// every prompt unique (a context of ContextTokens nobody shares).
type Stream struct {
	Tenant, Priority string
	Rate             float64 // simulated requests per second
	Groups           int
	UsersPerGroup    int
	ContextTokens    int
	QuestionTokens   int
	OutputTokens     int
}

// TenantKey is the client API key of tenant, as the scenarios' router
// configs name it.
func TenantKey(tenant string) string { return "sk-loadtest-" + tenant }

// Mix generates streams side by side over d simulated time: the
// multi-tenant scenarios (overload, noisy). Each stream draws from its own
// random streams, so adding or removing one leaves the others' requests
// exactly as they were: a run without a stream is the same traffic minus it.
func Mix(name string, streams []Stream, seed uint64, d time.Duration) (Workload, error) {
	var reqs []Request
	for i, s := range streams {
		if s.Tenant == "" || s.Rate <= 0 || s.ContextTokens <= 0 || s.OutputTokens <= 0 || s.Groups < 0 ||
			s.Groups > 0 && (s.UsersPerGroup <= 0 || s.QuestionTokens <= 0) {
			return Workload{}, fmt.Errorf("workload %s: stream %d: invalid parameters %+v", name, i, s)
		}
		id := s.Tenant + "/" + s.Priority
		rng := streamRNG(seed, name+"/"+id+"/arrivals")
		contexts := make([]string, s.Groups)
		for g := range contexts {
			contexts[g] = Words(seed, fmt.Sprintf("%s/ctx/%d", id, g), s.ContextTokens)
		}
		questions := map[[2]int][]Message{}
		for n, at := range poisson(rng, d, s.Rate, func(time.Duration) float64 { return s.Rate }) {
			r := Request{At: at, MaxTokens: s.OutputTokens, Tenant: s.Tenant, Priority: s.Priority}
			if s.Groups == 0 {
				r.Key = fmt.Sprintf("%s/doc%d", id, n)
				r.Messages = []Message{{Role: "user", Content: Words(seed, r.Key, s.ContextTokens)}}
			} else {
				g, u := rng.IntN(s.Groups), rng.IntN(s.UsersPerGroup)
				r.Key = fmt.Sprintf("%s/g%d/u%d", id, g, u)
				msgs, ok := questions[[2]int{g, u}]
				if !ok {
					msgs = []Message{
						{Role: "system", Content: contexts[g]},
						{Role: "user", Content: Words(seed, fmt.Sprintf("%s/q/%d/%d", id, g, u), s.QuestionTokens)},
					}
					questions[[2]int{g, u}] = msgs
				}
				r.Messages = msgs
			}
			reqs = append(reqs, r)
		}
	}
	return finish(name, reqs)
}

// Keep returns w with only the requests keep accepts, the demand recounted.
func (w Workload) Keep(keep func(Request) bool) (Workload, error) {
	var reqs []Request
	for _, r := range w.Requests {
		if keep(r) {
			reqs = append(reqs, r)
		}
	}
	return finish(w.Scenario, reqs)
}
