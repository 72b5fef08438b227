package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

func testEngine(t testing.TB, blockSize, kvBlocks int) *Engine {
	t.Helper()
	e, err := New(Config{
		BlockSize: blockSize, KVBlocks: kvBlocks, MaxNumSeqs: 256,
		MaxNumBatchedTokens: 8192, MaxModelLen: blockSize * kvBlocks, Cost: DefaultCost,
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// seqTokens returns n token ids starting at base.
func seqTokens(base, n int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = uint32(base + i)
	}
	return ts
}

// recorder collects published batches, sends each through the wire codec
// (msgpack bytes, vLLM's map format) and replays the decoded events into a
// multiset of resident hashes, the way a sidecar must.
type recorder struct {
	wire     []byte
	decoded  kvevents.Batch
	batches  []*kvevents.Batch
	resident map[uint64]int
	stored   []uint64
	removed  []uint64
}

func newRecorder() *recorder { return &recorder{resident: map[uint64]int{}} }

func (r *recorder) Publish(b *kvevents.Batch) error {
	r.batches = append(r.batches, b)
	r.wire = kvevents.AppendBatch(r.wire[:0], b, kvevents.FormatVLLMMap)
	if err := kvevents.DecodeBatch(r.wire, &r.decoded); err != nil {
		return err
	}
	if len(r.decoded.Events) != len(b.Events) {
		return fmt.Errorf("%d events encoded, %d decoded", len(b.Events), len(r.decoded.Events))
	}
	for _, ev := range r.decoded.Events {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			for _, h := range ev.BlockHashes {
				r.resident[h]++
				r.stored = append(r.stored, h)
			}
		case kvevents.KindBlockRemoved:
			for _, h := range ev.BlockHashes {
				r.resident[h]--
				if r.resident[h] == 0 {
					delete(r.resident, h)
				}
				r.removed = append(r.removed, h)
			}
		case kvevents.KindAllBlocksCleared:
			clear(r.resident)
		}
	}
	return nil
}

// run steps e until idle, publishing to sink; it returns the outputs by
// request id and fails after maxSteps.
func run(t testing.TB, e *Engine, sink EventSink, maxSteps int) map[uint64][]Output {
	t.Helper()
	outs := map[uint64][]Output{}
	for i := 0; e.HasWork(); i++ {
		if i == maxSteps {
			t.Fatalf("engine still busy after %d steps: %+v", maxSteps, e.Stats())
		}
		res := e.Step(float64(i))
		for _, o := range res.Outputs {
			outs[o.ID] = append(outs[o.ID], o)
		}
		if res.Events != nil {
			if err := sink.Publish(res.Events); err != nil {
				t.Fatal(err)
			}
		}
	}
	return outs
}

func mustAdd(t testing.TB, e *Engine, id uint64, prompt []uint32, maxTokens int) {
	t.Helper()
	if err := e.Add(Request{ID: id, Prompt: prompt, MaxTokens: maxTokens, OutputSeed: id}); err != nil {
		t.Fatal(err)
	}
}

func cachedOf(outs []Output) int { return outs[len(outs)-1].CachedTokens }

func TestRepeatHitsAllFullBlocksButTheLastToken(t *testing.T) {
	for _, c := range []struct{ promptLen, want int }{
		{100, 96},    // 6 full blocks of 16
		{2001, 2000}, // 125 full blocks
		{64, 48},     // whole blocks: vLLM recomputes the last token, so the last block misses
		{15, 0},      // no full block
	} {
		e := testEngine(t, 16, 1024)
		rec := newRecorder()
		p := seqTokens(7, c.promptLen)
		mustAdd(t, e, 1, p, 4)
		first := run(t, e, rec, 100)
		mustAdd(t, e, 2, p, 4)
		second := run(t, e, rec, 100)
		if got := cachedOf(first[1]); got != 0 {
			t.Fatalf("%d tokens: first request cached %d, want 0", c.promptLen, got)
		}
		if got := cachedOf(second[2]); got != c.want {
			t.Fatalf("%d tokens: repeat cached %d, want %d", c.promptLen, got, c.want)
		}
		st := e.Stats()
		if st.PrefixQueries != uint64(2*c.promptLen) || st.PrefixHits != uint64(c.want) {
			t.Fatalf("%d tokens: prefix queries/hits %d/%d, want %d/%d", c.promptLen, st.PrefixQueries, st.PrefixHits, 2*c.promptLen, c.want)
		}
	}
}

func TestLongestResidentPrefixIsReused(t *testing.T) {
	e := testEngine(t, 16, 1024)
	rec := newRecorder()
	a := seqTokens(1, 64)
	mustAdd(t, e, 1, a, 1)
	run(t, e, rec, 10)
	// Shares 40 tokens (2 full blocks and a half) with a, then diverges.
	b := append(append([]uint32{}, a[:40]...), seqTokens(5000, 40)...)
	mustAdd(t, e, 2, b, 1)
	outs := run(t, e, rec, 10)
	if got := cachedOf(outs[2]); got != 32 {
		t.Fatalf("cached %d tokens, want 32 (two shared full blocks)", got)
	}
	// The diverging request's own blocks chain on the shared ones.
	want := blockkey.Append(nil, DefaultHashSeed, b, 16)
	last := rec.batches[len(rec.batches)-1].Events
	if len(last) != 1 || last[0].Kind != kvevents.KindBlockStored {
		t.Fatalf("second request's events %+v, want one BlockStored", last)
	}
	ev := last[0]
	if !ev.HasParent || ev.ParentHash != want[1] || len(ev.BlockHashes) != 3 || ev.BlockHashes[0] != want[2] || ev.BlockHashes[2] != want[4] {
		t.Fatalf("BlockStored %+v, want blocks 2..4 of %v with parent %x", ev, want, want[1])
	}
	// vLLM v0.26's fields for a text-only full-attention model.
	if !ev.HasGroupIdx || ev.GroupIdx != 0 || ev.SpecKind != "full_attention" || string(ev.ExtraKeys) != "\x93\xc0\xc0\xc0" {
		t.Fatalf("BlockStored group %v/%d, spec kind %q, extra keys % x; want group_idx 0, full_attention, [nil nil nil]", ev.HasGroupIdx, ev.GroupIdx, ev.SpecKind, ev.ExtraKeys)
	}
	if len(ev.TokenIDs) != 48 || ev.TokenIDs[0] != b[32] || ev.BlockSize != 16 || ev.Medium != "GPU" {
		t.Fatalf("BlockStored tokens/size/medium wrong: %d tokens, first %d, size %d, medium %q", len(ev.TokenIDs), ev.TokenIDs[0], ev.BlockSize, ev.Medium)
	}
}

func TestEvictionIsLeastRecentlyUsed(t *testing.T) {
	// 8 blocks of 4. Prompts of 8 tokens and one output token use two
	// blocks each (the sampled token is never computed).
	e := testEngine(t, 4, 8)
	rec := newRecorder()
	prompts := map[string][]uint32{}
	for i, name := range []string{"A", "B", "C", "D"} {
		prompts[name] = seqTokens(100*(i+1), 8)
		mustAdd(t, e, uint64(i+1), prompts[name], 1)
		run(t, e, rec, 10)
	}
	if len(rec.removed) != 0 {
		t.Fatalf("evictions before the cache was full: %v", rec.removed)
	}
	key := func(name string, i int) uint64 {
		return blockkey.Append(nil, DefaultHashSeed, prompts[name], 4)[i]
	}
	// A again with one more token: hits both of A's blocks (refreshing
	// them) and needs one new block, which evicts the oldest free one.
	mustAdd(t, e, 10, append(append([]uint32{}, prompts["A"]...), 9999), 1)
	outs := run(t, e, rec, 10)
	if got := cachedOf(outs[10]); got != 8 {
		t.Fatalf("A+1 cached %d, want 8", got)
	}
	// A fresh prompt needs two blocks: next oldest.
	mustAdd(t, e, 11, seqTokens(900, 8), 1)
	run(t, e, rec, 10)
	// Each sequence's tail is freed before its head, so B's second block
	// goes first, then B's first, then C's second; A survives.
	want := []uint64{key("B", 1), key("B", 0), key("C", 1)}
	if len(rec.removed) != len(want) {
		t.Fatalf("removed %d blocks %x, want %x", len(rec.removed), rec.removed, want)
	}
	for i := range want {
		if rec.removed[i] != want[i] {
			t.Fatalf("eviction %d: %x, want %x (order %x)", i, rec.removed[i], want[i], rec.removed)
		}
	}
	if res := e.Resident(); res[key("A", 0)] != 1 || res[key("A", 1)] != 1 {
		t.Fatal("recently used A was evicted")
	}
}

func TestReferencedBlocksAreNeverEvicted(t *testing.T) {
	// 16 blocks of 4; a long request holds its blocks while short ones
	// churn through the rest of the cache and evict each other.
	e := testEngine(t, 4, 16)
	rec := newRecorder()
	long := seqTokens(1, 20)
	mustAdd(t, e, 1, long, 30)
	held := blockkey.Append(nil, DefaultHashSeed, long, 4)
	for r := range 20 {
		mustAdd(t, e, uint64(100+r), seqTokens(1000*(r+1), 6), 2)
	}
	longDone := false
	for i := 0; e.HasWork(); i++ {
		if i > 500 {
			t.Fatal("engine did not drain")
		}
		res := e.Step(0)
		if res.Events != nil {
			if err := rec.Publish(res.Events); err != nil {
				t.Fatal(err)
			}
		}
		for _, o := range res.Outputs {
			longDone = longDone || (o.ID == 1 && o.Finished != NotFinished)
		}
		if longDone {
			continue
		}
		resident := e.Resident()
		for _, k := range held {
			if resident[k] == 0 {
				t.Fatalf("step %d: block %x of the running request is no longer cached", i, k)
			}
		}
	}
	if len(rec.removed) < 10 {
		t.Fatalf("only %d evictions: no pressure on the cache", len(rec.removed))
	}
	if st := e.Stats(); st.FinishedRequests != 21 || st.UsedBlocks != 0 {
		t.Fatalf("finished %d requests with %d blocks still used, want 21 and 0", st.FinishedRequests, st.UsedBlocks)
	}
}

func TestEventsReproduceResidentSet(t *testing.T) {
	// The figure: a scripted sequence of requests (shared
	// prefixes, concurrency, preemption, evictions, aborts, a reset)
	// whose events, replayed into a multiset, equal the cache's own
	// resident set after every step.
	e := testEngine(t, 4, 24)
	rec := newRecorder()
	check := func(when string) {
		t.Helper()
		got, want := rec.resident, e.Resident()
		if len(got) != len(want) {
			t.Fatalf("%s: replayed %d hashes, engine holds %d", when, len(got), len(want))
		}
		for h, n := range want {
			if got[h] != n {
				t.Fatalf("%s: hash %x replayed ×%d, engine ×%d", when, h, got[h], n)
			}
		}
	}
	step := func(n int, when string) {
		for range n {
			if !e.HasWork() {
				break
			}
			res := e.Step(0)
			if res.Events != nil {
				if err := rec.Publish(res.Events); err != nil {
					t.Fatal(err)
				}
			}
			check(when)
		}
	}
	system := seqTokens(1, 12)
	prompt := func(tail, n int) []uint32 {
		return append(append([]uint32{}, system...), seqTokens(tail, n)...)
	}
	id := uint64(0)
	add := func(p []uint32, maxTokens int) uint64 {
		id++
		mustAdd(t, e, id, p, maxTokens)
		return id
	}
	// The same prompt twice at once: the second hits the first's prompt
	// blocks, but both decode the same tokens (same seed, like greedy
	// sampling) into blocks of their own, which vLLM caches twice.
	for range 2 {
		id++
		if err := e.Add(Request{ID: id, Prompt: prompt(100, 10), MaxTokens: 6, OutputSeed: 7}); err != nil {
			t.Fatal(err)
		}
	}
	add(prompt(200, 30), 9)
	step(3, "shared prefix")
	dups := 0
	for _, n := range e.Resident() {
		if n > 1 {
			dups++
		}
	}
	if dups == 0 {
		t.Fatal("two identical prompts computed at once left no duplicate blocks (vLLM stores both)")
	}
	victim := add(prompt(300, 20), 20)
	step(2, "before abort")
	e.Abort(victim)
	check("after abort")
	for r := range 12 { // more than fits: queueing, preemption, eviction
		add(prompt(1000*(r+1), 8+r), 3+r%5)
	}
	step(400, "churn")
	if len(rec.removed) == 0 {
		t.Fatal("script produced no evictions")
	}
	if b, ok := e.ResetPrefixCache(1); !ok {
		t.Fatal("reset refused on an idle engine")
	} else {
		if err := rec.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	check("after reset")
	add(prompt(100, 10), 2)
	step(20, "after reset")
	t.Logf("%d batches, %d stored, %d removed, stats %+v", len(rec.batches), len(rec.stored), len(rec.removed), e.Stats())
}

func TestRandomWorkloadKeepsInvariants(t *testing.T) {
	t.Run("fcfs", func(t *testing.T) { randomWorkload(t, false) })
	t.Run("priority", func(t *testing.T) { randomWorkload(t, true) })
}

func randomWorkload(t *testing.T, priority bool) {
	rng := rand.New(rand.NewPCG(1, 2))
	e, err := New(Config{BlockSize: 4, KVBlocks: 40, MaxNumSeqs: 6, MaxNumBatchedTokens: 24, MaxModelLen: 64, Cost: DefaultCost, PriorityScheduling: priority})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	live := map[uint64]int{} // id → max tokens
	var liveIDs []uint64     // add order, for deterministic aborts
	got := map[uint64]int{}  // tokens received
	var prompts [][]uint32
	var next uint64
	maxCopies := 0
	for i := range 3000 {
		if rng.IntN(3) == 0 && len(live) < 30 {
			next++
			n := 1 + rng.IntN(40)
			p := append(seqTokens(rng.IntN(3)*1000, rng.IntN(n+1)), seqTokens(rng.IntN(1<<20), n)...)
			p = p[:min(len(p), 50)]
			seed := next
			if len(prompts) > 0 && rng.IntN(4) == 0 {
				// A repeat with the same output: duplicate decode blocks.
				p, seed = prompts[rng.IntN(len(prompts))], 0
			}
			prompts = append(prompts, p)
			maxTokens := 1 + rng.IntN(14)
			prio := 0
			if priority {
				prio = rng.IntN(3) - 1
			}
			if err := e.Add(Request{ID: next, Prompt: p, MaxTokens: maxTokens, OutputSeed: seed, Priority: prio}); err != nil {
				t.Fatal(err)
			}
			live[next] = maxTokens
			liveIDs = append(liveIDs, next)
		}
		if rng.IntN(50) == 0 {
			for len(liveIDs) > 0 {
				id := liveIDs[rng.IntN(len(liveIDs))]
				liveIDs = slices.DeleteFunc(liveIDs, func(x uint64) bool { return x == id })
				if _, ok := live[id]; ok {
					if !e.Abort(id) {
						t.Fatalf("step %d: live request %d unknown to Abort", i, id)
					}
					delete(live, id)
					break
				}
			}
		}
		res := e.Step(float64(i))
		if res.Events != nil {
			if err := rec.Publish(res.Events); err != nil {
				t.Fatal(err)
			}
		}
		for _, o := range res.Outputs {
			if o.HasToken {
				got[o.ID]++
			}
			if o.First != (got[o.ID] == 1) || o.Generated != got[o.ID] {
				t.Fatalf("step %d: request %d output %+v after %d tokens", i, o.ID, o, got[o.ID])
			}
			if o.Finished != NotFinished {
				// Preempted or not, a request ends with exactly its
				// max_tokens outputs.
				if got[o.ID] != live[o.ID] {
					t.Fatalf("step %d: request %d finished with %d tokens, want %d", i, o.ID, got[o.ID], live[o.ID])
				}
				delete(live, o.ID)
			}
		}
		st := e.Stats()
		if st.Running > 6 || st.UsedBlocks > 40 {
			t.Fatalf("step %d: %d running, %d blocks used", i, st.Running, st.UsedBlocks)
		}
		want := e.Resident()
		copies := 0
		for _, n := range want {
			copies += n
		}
		if copies != st.CachedBlocks {
			t.Fatalf("step %d: stats count %d cached blocks, resident set %d", i, st.CachedBlocks, copies)
		}
		if len(want) != len(rec.resident) {
			t.Fatalf("step %d: replay holds %d hashes, engine %d", i, len(rec.resident), len(want))
		}
		for h, n := range want {
			if rec.resident[h] != n {
				t.Fatalf("step %d: hash %x ×%d replayed, ×%d resident", i, h, rec.resident[h], n)
			}
			maxCopies = max(maxCopies, n)
		}
	}
	if maxCopies < 2 {
		t.Fatal("no duplicate blocks: the random workload misses vLLM's double stores")
	}
	run(t, e, rec, 5000)
	if st := e.Stats(); st.UsedBlocks != 0 || st.Preemptions == 0 {
		t.Fatalf("after draining: %d blocks used, %d preemptions (want 0 and some)", st.UsedBlocks, st.Preemptions)
	}
}

func TestAddRejectsBadRequestsAndStaysHealthy(t *testing.T) {
	e := testEngine(t, 16, 8) // max model length 128
	for _, r := range []Request{
		{ID: 1},
		{ID: 1, Prompt: seqTokens(0, 10), MaxTokens: 0},
		{ID: 1, Prompt: seqTokens(0, 120), MaxTokens: 9},
	} {
		if err := e.Add(r); err == nil {
			t.Fatalf("accepted %d-token prompt with max_tokens %d", len(r.Prompt), r.MaxTokens)
		}
	}
	mustAdd(t, e, 1, seqTokens(0, 120), 8)
	if err := e.Add(Request{ID: 1, Prompt: seqTokens(0, 3), MaxTokens: 1}); err != ErrDuplicateID {
		t.Fatalf("duplicate id: %v", err)
	}
	outs := run(t, e, newRecorder(), 100)
	if n := len(outs[1]); n != 8 || outs[1][7].Finished != FinishLength {
		t.Fatalf("%d outputs, want 8 ending with FinishLength", n)
	}
	if _, err := New(Config{BlockSize: 16, KVBlocks: 4, MaxNumSeqs: 1, MaxNumBatchedTokens: 16, MaxModelLen: 100}); err == nil {
		t.Fatal("accepted a max model length that cannot fit in the cache")
	}
}

func TestChunkedPrefillAndTiming(t *testing.T) {
	e, err := New(Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 32768, Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	mustAdd(t, e, 1, seqTokens(0, 2048), 2)
	first := e.Step(0)
	// 5 ms floor + 2048·28.2 µs + 2048²/2·0.917 ns ≈ 64.7 ms.
	if d := first.Duration; d < 64*time.Millisecond || d > 66*time.Millisecond || !first.Outputs[0].First {
		t.Fatalf("cold 2048-token prefill took %v (first token %v), want ≈64.7 ms", d, first.Outputs)
	}
	run(t, e, newRecorder(), 10)
	mustAdd(t, e, 2, seqTokens(0, 2048), 1)
	if d := e.Step(0).Duration; d > 7*time.Millisecond {
		t.Fatalf("warm prefill (2032 cached) took %v, want ≈ the 5 ms floor", d)
	}
	// 16,384 tokens exceed the 8,192-token budget: two chunks, the second
	// attending to the first.
	mustAdd(t, e, 3, seqTokens(1<<20, 16384), 1)
	a, b := e.Step(0), e.Step(0)
	if len(a.Outputs) != 0 || len(b.Outputs) != 1 {
		t.Fatalf("chunked prefill outputs %d then %d, want 0 then 1", len(a.Outputs), len(b.Outputs))
	}
	if b.Duration <= a.Duration {
		t.Fatalf("second chunk %v not slower than first %v despite attending to it", b.Duration, a.Duration)
	}
	// Calibration: 16,384 cold ≈ 584 ms; two chunks plus two floors.
	if total := a.Duration + b.Duration; total < 570*time.Millisecond || total > 610*time.Millisecond {
		t.Fatalf("16k prefill in two chunks took %v, want ≈ 595 ms", total)
	}
}

func TestParseCostProfile(t *testing.T) {
	p, err := ParseCostProfile(DefaultCost, "floor_ms=2, decode_us_per_seq=10")
	if err != nil || p.FloorMs != 2 || p.DecodeUsPerSeq != 10 || p.PrefillUsPerToken != DefaultCost.PrefillUsPerToken {
		t.Fatalf("key=value: %+v %v", p, err)
	}
	p, err = ParseCostProfile(DefaultCost, `{"prefill_ns_per_pair":0}`)
	if err != nil || p.PrefillNsPerPair != 0 || p.FloorMs != 5 {
		t.Fatalf("json: %+v %v", p, err)
	}
	for _, bad := range []string{"floor=1", "floor_ms", "floor_ms=x", "floor_ms=-1", `{"nope":1}`, `{`, "floor_ms=NaN"} {
		if _, err := ParseCostProfile(DefaultCost, bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

func FuzzParseCostProfile(f *testing.F) {
	f.Add("floor_ms=2,decode_us_per_seq=10")
	f.Add(`{"floor_ms":1}`)
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParseCostProfile(DefaultCost, s)
		if err == nil && (p.FloorMs < 0 || p.DecodeUsPerSeq < 0) {
			t.Fatalf("negative profile accepted: %+v", p)
		}
	})
}

// BenchmarkStepDecodeBatch64 is one decode step of 64 running sequences
// (200-token prompts, growing): the engine loop's CPU per step. A batch
// decodes 20,000 tokens; the next one starts, off the clock, when it ends.
func BenchmarkStepDecodeBatch64(b *testing.B) {
	e, err := New(Config{BlockSize: 16, KVBlocks: 1 << 18, MaxNumSeqs: 256, MaxNumBatchedTokens: 1 << 16, MaxModelLen: 1 << 16, Cost: DefaultCost})
	if err != nil {
		b.Fatal(err)
	}
	const maxTokens = 20000
	batch := func(round uint64) {
		for i := range uint64(64) {
			id := round*64 + i
			if err := e.Add(Request{ID: id, Prompt: seqTokens(int(id)*1000, 200), MaxTokens: maxTokens, OutputSeed: id}); err != nil {
				b.Fatal(err)
			}
		}
		e.Step(0) // prefill
	}
	batch(0)
	b.ReportAllocs()
	step, round := 0, uint64(0)
	for b.Loop() {
		if step++; step == maxTokens {
			b.StopTimer()
			for e.HasWork() {
				e.Step(0)
			}
			round++
			batch(round)
			step = 1
			b.StartTimer()
		}
		if res := e.Step(0); len(res.Outputs) != 64 {
			b.Fatalf("step %d: %d outputs, want 64 (%+v)", step, len(res.Outputs), e.Stats())
		}
	}
}

func priorityEngine(t *testing.T, kvBlocks, maxSeqs int, priority bool) *Engine {
	t.Helper()
	e, err := New(Config{
		BlockSize: 4, KVBlocks: kvBlocks, MaxNumSeqs: maxSeqs, MaxNumBatchedTokens: 8192,
		MaxModelLen: 4 * kvBlocks, Cost: DefaultCost, PriorityScheduling: priority,
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// firstTokens steps e until idle and returns request ids in the order their
// first tokens came out.
func firstTokens(t *testing.T, e *Engine) []uint64 {
	t.Helper()
	var order []uint64
	for step := 0; e.HasWork(); step++ {
		if step > 10000 {
			t.Fatal("engine never went idle")
		}
		for _, o := range e.Step(0).Outputs {
			if o.First {
				order = append(order, o.ID)
			}
		}
	}
	return order
}

func TestPriorityNeedsPriorityScheduling(t *testing.T) {
	e := priorityEngine(t, 64, 4, false)
	if err := e.Add(Request{ID: 1, Prompt: seqTokens(0, 8), MaxTokens: 1, Priority: 1}); err != ErrPriority {
		t.Fatalf("priority 1 without priority scheduling: %v", err)
	}
	if err := e.Add(Request{ID: 1, Prompt: seqTokens(0, 8), MaxTokens: 1}); err != nil {
		t.Fatalf("priority 0: %v", err)
	}
}

// One running sequence at a time: the waiting queue is served by priority,
// then arrival; without priority scheduling, by arrival alone.
func TestWaitingQueueByPriorityThenArrival(t *testing.T) {
	for _, tc := range []struct {
		priority bool
		want     []uint64
	}{{true, []uint64{2, 4, 3, 1}}, {false, []uint64{1, 2, 3, 4}}} {
		e := priorityEngine(t, 64, 1, tc.priority)
		for i, p := range []int{2, 0, 1, 0} {
			if !tc.priority {
				p = 0
			}
			if err := e.Add(Request{ID: uint64(i + 1), Prompt: seqTokens(100*i, 8), MaxTokens: 2, Priority: p}); err != nil {
				t.Fatal(err)
			}
		}
		if got := firstTokens(t, e); !slices.Equal(got, tc.want) {
			t.Fatalf("priority scheduling %v: first tokens in order %v, want %v", tc.priority, got, tc.want)
		}
	}
}

// When a running sequence needs a block and none is free, FCFS preempts the
// newest running sequence; priority scheduling preempts the lowest-priority
// one, however old, and its place in the queue is by priority too.
func TestPreemptionVictimFollowsThePolicy(t *testing.T) {
	for _, tc := range []struct {
		priority bool
		victim   uint64
	}{{true, 1}, {false, 2}} {
		// 6 blocks of 4 tokens; two 8-token prompts take 2 blocks each plus
		// a block each for decoding; the third decode block is short.
		// Request 1, low priority, runs first; request 2 joins it a step
		// later, so request 2 is the newer of the two.
		e := priorityEngine(t, 6, 4, tc.priority)
		prio := map[uint64]int{1: 5, 2: 0}
		for _, id := range []uint64{1, 2} {
			p := prio[id]
			if !tc.priority {
				p = 0
			}
			if err := e.Add(Request{ID: id, Prompt: seqTokens(int(100*id), 8), MaxTokens: 12, Priority: p}); err != nil {
				t.Fatal(err)
			}
			e.Step(0)
		}
		var preemptedFirst uint64
		for step := 0; e.HasWork() && step < 1000; step++ {
			e.Step(0)
			if e.Stats().Preemptions > 0 && preemptedFirst == 0 {
				if len(e.waiting) != 1 {
					t.Fatalf("%d waiting after the first preemption", len(e.waiting))
				}
				preemptedFirst = e.waiting[0].id
			}
		}
		if preemptedFirst != tc.victim {
			t.Fatalf("priority scheduling %v: request %d preempted first, want %d", tc.priority, preemptedFirst, tc.victim)
		}
		if e.Stats().UsedBlocks != 0 {
			t.Fatal("blocks left in use")
		}
	}
}
