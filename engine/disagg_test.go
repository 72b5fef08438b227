package engine

import (
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/kvevents"
)

func disaggEngine(t *testing.T, kvBlocks int) *Engine {
	t.Helper()
	e, err := New(Config{BlockSize: 16, KVBlocks: kvBlocks, MaxNumSeqs: 16, MaxNumBatchedTokens: 8192, MaxModelLen: min(8192, 16*kvBlocks), Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// serveReq runs r alone on e until its first token: the engine time it
// took, its first output and the events meanwhile.
func serveReq(t *testing.T, e *Engine, r Request) (time.Duration, Output, []kvevents.Event) {
	t.Helper()
	if err := e.Add(r); err != nil {
		t.Fatal(err)
	}
	var ttft time.Duration
	var events []kvevents.Event
	for range 200 {
		res := e.Step(0)
		ttft += res.Duration
		if res.Events != nil {
			events = append(events, res.Events.Events...)
		}
		for _, o := range res.Outputs {
			if o.ID == r.ID && o.First {
				return ttft, o, events
			}
		}
	}
	t.Fatalf("request %d produced no token in 200 steps", r.ID)
	return 0, Output{}, nil
}

// TestSplitTTFT is the figure: an 8,000-token prompt computed on a prefill
// engine, its 8,000 tokens of KV received by a decode engine at 3.3 µs
// each, then its last token computed there, against the same prompt served
// by one engine. Exact engine times from the default profile.
func TestSplitTTFT(t *testing.T) {
	const n = 8000
	p := seqTokens(1, n)
	aggregated, _, _ := serveReq(t, disaggEngine(t, 1024), Request{ID: 1, Prompt: p, MaxTokens: 1})

	pe := disaggEngine(t, 1024)
	prefill, out, _ := serveReq(t, pe, Request{ID: 1, Prompt: p, MaxTokens: 1, RemoteDecode: true})
	if out.Finished != FinishLength || len(out.HeldBlocks) != n/16 {
		t.Fatalf("prefill's last output %+v: want 500 held blocks", out)
	}
	if st := pe.Stats(); st.HeldRequests != 1 || st.HeldBlocks != 500 || st.UsedBlocks != 500 {
		t.Fatalf("after the prefill: %+v", st)
	}

	de := disaggEngine(t, 1024)
	decode, first, events := serveReq(t, de, Request{ID: 7, Prompt: p, MaxTokens: 4, RemotePrefill: true})
	transfer := time.Duration(3.3e3 * n)
	// The last prompt token's step: floor, one token, attending to 7,999.
	last := DefaultCost.duration(stepWork{prefillTokens: 1, attentionPairs: 7999 + 0.5})
	if d := decode - transfer - last; d < 0 || d > time.Millisecond {
		t.Fatalf("decode TTFT %v, want the transfer %v plus the last token's step %v (and under 1 ms of waiting slices)", decode, transfer, last)
	}
	if first.CachedTokens != n-1 {
		t.Fatalf("decode cached %d, want %d: all but the last prompt token", first.CachedTokens, n-1)
	}
	t.Logf("TTFT of an %d-token prompt: aggregated %v; split %v = prefill %v + transfer and last token %v",
		n, aggregated.Round(10*time.Microsecond), (prefill + decode).Round(10*time.Microsecond), prefill.Round(10*time.Microsecond), decode.Round(10*time.Microsecond))
	if prefill != aggregated {
		t.Fatalf("prefill %v differs from the aggregated TTFT %v", prefill, aggregated)
	}

	// The received blocks are announced as vLLM's decode side caches them:
	// the blocks of the first 7,999 tokens when the receive is done, then
	// the last block once its last token is scheduled.
	if len(events) != 2 || events[0].Kind != kvevents.KindBlockStored || len(events[0].BlockHashes) != 499 ||
		len(events[1].BlockHashes) != 1 || !events[1].HasParent || events[1].ParentHash != events[0].BlockHashes[498] {
		t.Fatalf("decode events %+v", events)
	}
	if !maps.Equal(pe.Resident(), de.Resident()) {
		t.Fatal("the decode engine does not hold the blocks the prefill engine computed")
	}
	if st := de.Stats(); st.ExternalQueries != n || st.ExternalHits != n || st.PrefixHits != 0 {
		t.Fatalf("decode stats %+v", st)
	}

	if !pe.Release(1) || pe.Release(1) {
		t.Fatal("Release: want true once, then false")
	}
	if st := pe.Stats(); st.HeldRequests != 0 || st.UsedBlocks != 0 || st.CachedBlocks != 500 {
		t.Fatalf("after release: %+v", st)
	}
}

// TestTransferSkipsTheLocalHit: a decode engine holding part of the
// prefix receives only the rest, and transfers queue on one link.
func TestTransferSkipsTheLocalHit(t *testing.T) {
	e := disaggEngine(t, 1024)
	p := seqTokens(1, 1000)
	serveReq(t, e, Request{ID: 1, Prompt: p[:640], MaxTokens: 1}) // caches 640 tokens = 40 blocks
	got, out, _ := serveReq(t, e, Request{ID: 2, Prompt: p, MaxTokens: 1, RemotePrefill: true})
	transfer := time.Duration(3.3e3 * 360)
	last := DefaultCost.duration(stepWork{prefillTokens: 1, attentionPairs: 999 + 0.5})
	if d := got - transfer - last; d < 0 || d > time.Millisecond || out.CachedTokens != 999 {
		t.Fatalf("TTFT %v (cached %d), want the transfer of 360 tokens %v plus %v", got, out.CachedTokens, transfer, last)
	}
	if st := e.Stats(); st.PrefixHits != 640 || st.ExternalHits != 360 {
		t.Fatalf("stats %+v", st)
	}

	// Two receives at once: the second waits for the first on the link.
	e = disaggEngine(t, 1024)
	for id := uint64(1); id <= 2; id++ {
		if err := e.Add(Request{ID: id, Prompt: seqTokens(int(id)*10000, 1000), MaxTokens: 1, RemotePrefill: true}); err != nil {
			t.Fatal(err)
		}
	}
	var clock time.Duration
	firstAt := map[uint64]time.Duration{}
	for i := 0; e.HasWork() && i < 100; i++ {
		res := e.Step(0)
		clock += res.Duration
		for _, o := range res.Outputs {
			firstAt[o.ID] = clock
		}
	}
	one := time.Duration(3.3e3 * 1000)
	if firstAt[1] < one || firstAt[2] < 2*one || firstAt[2]-firstAt[1] < one-time.Millisecond {
		t.Fatalf("first tokens at %v: want the second a transfer (%v) after the first", firstAt, one)
	}
}

// TestHeldBlocks: only a prefill that finishes at its length holds its
// blocks; an abort frees them, a receive aborted midway frees its blocks,
// and a reset refuses while blocks are held, as vLLM's does.
func TestHeldBlocks(t *testing.T) {
	e := disaggEngine(t, 64)
	if err := e.Add(Request{ID: 1, Prompt: seqTokens(1, 100), MaxTokens: 1, RemoteDecode: true}); err != nil {
		t.Fatal(err)
	}
	e.Abort(1)
	if st := e.Stats(); st.HeldRequests != 0 || st.UsedBlocks != 0 {
		t.Fatalf("aborted prefill: %+v", st)
	}
	_, out, _ := serveReq(t, e, Request{ID: 2, Prompt: seqTokens(1, 100), MaxTokens: 1, RemoteDecode: true})
	if held := slices.Compact(slices.Sorted(slices.Values(out.HeldBlocks))); len(held) != 7 || len(out.HeldBlocks) != 7 {
		t.Fatalf("held %v, want the 7 blocks of 100 tokens", out.HeldBlocks)
	}
	if err := e.Add(Request{ID: 2, Prompt: seqTokens(1, 10), MaxTokens: 1}); err != ErrDuplicateID {
		t.Fatalf("reusing a held id: %v", err)
	}
	if _, ok := e.ResetPrefixCache(0); ok {
		t.Fatal("reset while blocks are held")
	}
	e.Release(2)
	if _, ok := e.ResetPrefixCache(0); !ok {
		t.Fatal("reset refused after the release")
	}

	if err := e.Add(Request{ID: 3, Prompt: seqTokens(1, 100), MaxTokens: 2, RemotePrefill: true}); err != nil {
		t.Fatal(err)
	}
	e.Step(0) // the receive starts
	if st := e.Stats(); st.UsedBlocks != 7 || st.Waiting != 1 {
		t.Fatalf("receiving: %+v", st)
	}
	e.Abort(3)
	if st := e.Stats(); st.UsedBlocks != 0 || e.HasWork() {
		t.Fatalf("aborted receive: %+v", st)
	}
	if _, err := New(Config{BlockSize: 4, KVBlocks: 8, MaxNumSeqs: 1, MaxNumBatchedTokens: 8, MaxModelLen: 8, TransferUsPerToken: -1}); err == nil {
		t.Fatal("negative transfer cost accepted")
	}
}

// TestRandomDisaggregatedWorkload: requests of both sides at random, with
// aborts and releases, keep the events' replay equal to the cache, the
// held blocks counted, and leave nothing used once drained and released.
func TestRandomDisaggregatedWorkload(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	e, err := New(Config{BlockSize: 4, KVBlocks: 40, MaxNumSeqs: 6, MaxNumBatchedTokens: 24, MaxModelLen: 64, Cost: DefaultCost, TransferUsPerToken: 100})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	held := map[uint64][]int32{}
	var heldIDs []uint64
	var next uint64
	received, stalls := 0, 0
	for i := range 3000 {
		if rng.IntN(3) == 0 && e.Stats().Waiting < 20 {
			next++
			p := seqTokens(rng.IntN(3)*1000, 1+rng.IntN(40))
			r := Request{ID: next, Prompt: p, MaxTokens: 1 + rng.IntN(6), OutputSeed: next}
			switch rng.IntN(3) {
			case 0:
				r.RemoteDecode, r.MaxTokens = true, 1
			case 1:
				r.RemotePrefill = true
			}
			if err := e.Add(r); err != nil {
				t.Fatal(err)
			}
		}
		if rng.IntN(40) == 0 && next > 0 {
			e.Abort(uint64(1 + rng.IntN(int(next))))
		}
		res := e.Step(float64(i))
		stalled := false
		if res.Scheduled == 0 && res.Duration == 0 && e.HasWork() {
			stalls++ // held blocks fill the cache: release the oldest
			stalled = true
		}
		if (stalled || rng.IntN(25) == 0) && len(heldIDs) > 0 {
			if !e.Release(heldIDs[0]) {
				t.Fatalf("step %d: held %d unknown to Release", i, heldIDs[0])
			}
			delete(held, heldIDs[0])
			heldIDs = heldIDs[1:]
		}
		if res.Events != nil {
			if err := rec.Publish(res.Events); err != nil {
				t.Fatal(err)
			}
		}
		for _, o := range res.Outputs {
			if o.HeldBlocks != nil {
				held[o.ID] = o.HeldBlocks
				heldIDs = append(heldIDs, o.ID)
			}
			if o.First && o.CachedTokens > 0 && o.CachedTokens%4 != 0 {
				received++ // all but the last prompt token: a receive
			}
		}
		st := e.Stats()
		n, distinct := 0, map[int32]bool{}
		for _, bs := range held {
			n += len(bs)
			for _, b := range bs {
				distinct[b] = true
			}
		}
		// Held requests may share prefix blocks: used counts each once.
		if st.HeldRequests != len(held) || st.HeldBlocks != n || st.UsedBlocks > 40 || st.UsedBlocks < len(distinct) {
			t.Fatalf("step %d: %+v, %d held requests of %d blocks", i, st, len(held), n)
		}
		if !maps.Equal(rec.resident, e.Resident()) {
			t.Fatalf("step %d: replay differs from the cache", i)
		}
	}
	t.Logf("%d receives, %d stalled steps, %+v", received, stalls, e.Stats())
	for _, id := range heldIDs {
		e.Release(id)
	}
	for i := 0; e.HasWork() && i < 5000; i++ {
		res := e.Step(0)
		for _, o := range res.Outputs {
			if o.HeldBlocks != nil {
				e.Release(o.ID)
			}
		}
	}
	if st := e.Stats(); st.UsedBlocks != 0 || e.HasWork() || received == 0 {
		t.Fatalf("after draining: %+v, %d receives seen", st, received)
	}
}
