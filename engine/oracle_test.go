package engine

import (
	"testing"

	"github.com/kvmesh/kvmesh/blockkey"
)

// Holds and PendingPrefill are what a simulator's oracle reads: the cache
// and the prefill queue exactly as they stand between steps.
func TestHoldsAndPendingPrefill(t *testing.T) {
	e := testEngine(t, 4, 64)
	prompt := seqTokens(1, 18) // 4 full blocks and 2 tokens
	hashes := blockkey.Append(nil, e.Config().HashSeed, prompt, 4)
	if err := e.Add(Request{ID: 1, Prompt: prompt, MaxTokens: 2}); err != nil {
		t.Fatal(err)
	}
	if got := e.PendingPrefill(); got != 18 {
		t.Fatalf("queued cold prompt: pending %d, want 18", got)
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
	if got := e.PendingPrefill(); got != 0 {
		t.Fatalf("decoding request: pending %d, want 0", got)
	}
	// A sibling sharing the first 3 blocks waits with 6 tokens to compute
	// (18 − 12 cached).
	sibling := append(seqTokens(1, 12), seqTokens(100, 6)...)
	if err := e.Add(Request{ID: 2, Prompt: sibling, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if got := e.PendingPrefill(); got != 6 {
		t.Fatalf("warm sibling waiting: pending %d, want 6", got)
	}
}
