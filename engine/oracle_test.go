package engine

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
)

// Holds and Backlog are what a simulator's oracle reads: the cache
// and the prefill queue exactly as they stand between steps.
func TestHoldsAndBacklog(t *testing.T) {
	e := testEngine(t, 4, 64)
	prompt := seqTokens(1, 18) // 4 full blocks and 2 tokens
	hashes := blockkey.Append(nil, e.Config().HashSeed, prompt, 4)
	if err := e.Add(Request{ID: 1, Prompt: prompt, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	if got := e.Backlog(); got != (Backlog{PrefillTokens: 18}) {
		t.Fatalf("queued cold prompt: backlog %+v, want 18 tokens to prefill", got)
	}
	if e.Holds(hashes[0]) {
		t.Fatal("a block held before any step")
	}
	e.Step(0) // prefills all 18 tokens, caches 4 blocks, first token
	for i, h := range hashes {
		if !e.Holds(h) {
			t.Fatalf("block %d not held after its prefill", i)
		}
	}
	if got := e.Backlog(); got != (Backlog{Running: 1, DecodeContext: 18}) {
		t.Fatalf("decoding request: backlog %+v, want 1 running over 18 tokens", got)
	}
	// A sibling sharing the first 3 blocks waits with 6 tokens to compute
	// (18 − 12 cached).
	sibling := append(seqTokens(1, 12), seqTokens(100, 6)...)
	if err := e.Add(Request{ID: 2, Prompt: sibling, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if got := e.Backlog(); got != (Backlog{PrefillTokens: 6, Running: 1, DecodeContext: 18}) {
		t.Fatalf("warm sibling waiting: backlog %+v, want 6 tokens to prefill", got)
	}
}
