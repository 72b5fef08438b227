package workload

import (
	"slices"
	"testing"
	"time"
)

var testStreams = []Stream{
	{Tenant: "a", Priority: "critical", Rate: 10, Groups: 2, UsersPerGroup: 3, ContextTokens: 64, QuestionTokens: 8, OutputTokens: 4},
	{Tenant: "b", Priority: "sheddable", Rate: 30, ContextTokens: 48, OutputTokens: 4},
}

// TestMixStreamsAreIndependent: removing a stream leaves the others'
// requests exactly as they were, so "without=X" runs are the same traffic
// minus X.
func TestMixStreamsAreIndependent(t *testing.T) {
	both, err := Mix("m", testStreams, 7, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	alone, err := Mix("m", testStreams[:1], 7, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	kept, err := both.Keep(func(r Request) bool { return r.Tenant == "a" })
	if err != nil {
		t.Fatal(err)
	}
	if len(alone.Requests) == 0 || !slices.EqualFunc(alone.Requests, kept.Requests, func(x, y Request) bool {
		return x.At == y.At && x.Key == y.Key && x.PromptTokens == y.PromptTokens && x.Messages[0].Content == y.Messages[0].Content
	}) {
		t.Fatalf("stream a alone: %d requests; kept from both: %d, or they differ", len(alone.Requests), len(kept.Requests))
	}
	if kept.DemandBlocks != alone.DemandBlocks || kept.DemandBlocks >= both.DemandBlocks {
		t.Fatalf("demand: kept %d alone %d both %d", kept.DemandBlocks, alone.DemandBlocks, both.DemandBlocks)
	}
	counts := map[string]int{}
	unique := map[string]bool{}
	for _, r := range both.Requests {
		counts[r.Tenant+"/"+r.Priority]++
		if r.Tenant == "b" {
			if unique[r.Key] || r.PromptTokens < 48 {
				t.Fatalf("b's prompts are unique and 48 tokens: %s, %d tokens", r.Key, r.PromptTokens)
			}
			unique[r.Key] = true
		}
	}
	// Poisson counts over 10 s: 100 and 300 expected.
	if counts["a/critical"] < 70 || counts["a/critical"] > 130 || counts["b/sheddable"] < 250 || counts["b/sheddable"] > 350 {
		t.Fatalf("counts %v", counts)
	}
}

func TestMixRejectsBadStreams(t *testing.T) {
	for _, s := range []Stream{
		{Rate: 1, ContextTokens: 1, OutputTokens: 1},                         // no tenant
		{Tenant: "a", ContextTokens: 1, OutputTokens: 1},                     // no rate
		{Tenant: "a", Rate: 1, Groups: 2, ContextTokens: 8, OutputTokens: 1}, // groups without users
	} {
		if _, err := Mix("m", []Stream{s}, 1, time.Second); err == nil {
			t.Errorf("%+v accepted", s)
		}
	}
}
