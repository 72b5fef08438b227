package engine

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/kvevents"
)

// serveOne runs one request of max_tokens 1 to its end and returns its
// time to first token (the step durations until its token), its cached
// tokens and the step's events.
func serveOne(t *testing.T, e *Engine, id uint64, prompt []uint32) (time.Duration, int, []kvevents.Event) {
	t.Helper()
	ttft, out, events := serveReq(t, e, Request{ID: id, Prompt: prompt, MaxTokens: 1})
	return ttft, out.CachedTokens, events
}

// mpStr is msgpack's fixstr (enough for these field names).
func mpStr(s string) []byte { return append([]byte{0xa0 | byte(len(s))}, s...) }

// mpUint is msgpack's smallest unsigned encoding of v.
func mpUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v < 1<<8:
		return append(b, 0xcc, byte(v))
	case v < 1<<16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v < 1<<32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

// cpuStoredBytes is, written out by hand, the map vLLM's OffloadingConnector
// (CPU backend, self_describing_kv_events) sends for one offloaded block:
// BlockStored with its hash, parent (nil for the first block), tokens and
// block size, no LoRA, medium "CPU", group 0, full attention, no extra keys.
func cpuStoredBytes(hash uint64, parent *uint64, tokens []uint32, blockSize uint64) []byte {
	b := []byte{0x8a}
	b = append(append(b, mpStr("type")...), mpStr("BlockStored")...)
	b = mpUint(append(append(b, mpStr("block_hashes")...), 0x91), hash)
	b = append(b, mpStr("parent_block_hash")...)
	if parent == nil {
		b = append(b, 0xc0)
	} else {
		b = mpUint(b, *parent)
	}
	b = append(append(b, mpStr("token_ids")...), 0x90|byte(len(tokens)))
	for _, tok := range tokens {
		b = mpUint(b, uint64(tok))
	}
	b = mpUint(append(b, mpStr("block_size")...), blockSize)
	b = append(append(b, mpStr("lora_id")...), 0xc0)
	b = append(append(b, mpStr("medium")...), mpStr("CPU")...)
	b = append(append(b, mpStr("lora_name")...), 0xc0)
	b = append(append(b, mpStr("group_idx")...), 0x00)
	return append(append(b, mpStr("kv_cache_spec_kind")...), mpStr("full_attention")...)
}

// cpuRemovedBytes is the connector's BlockRemoved of evicted blocks.
func cpuRemovedBytes(hashes []uint64) []byte {
	b := []byte{0x84}
	b = append(append(b, mpStr("type")...), mpStr("BlockRemoved")...)
	b = append(append(b, mpStr("block_hashes")...), 0x90|byte(len(hashes)))
	for _, h := range hashes {
		b = mpUint(b, h)
	}
	b = append(append(b, mpStr("medium")...), mpStr("CPU")...)
	return append(append(b, mpStr("group_idx")...), 0x00)
}

// eventBytes encodes events in vLLM's map layout, one after another.
func eventBytes(evs []kvevents.Event) [][]byte {
	var out [][]byte
	for i := range evs {
		enc := kvevents.AppendBatch(nil, &kvevents.Batch{DPRank: -1, Events: evs[i : i+1]}, kvevents.FormatVLLMMap)
		// [ts, [event]]: skip the array header, the float64 and the
		// one-element array header.
		out = append(out, enc[1+9+1:])
	}
	return out
}

// TestHostTierReloadsEvictedPrefix: a 4-block prefix the GPU pool evicted
// (two blocks of it) but the host tier holds is loaded back at the CPU cost
// per token, not recomputed, and the events say which medium holds what,
// byte for byte as vLLM's OffloadingConnector sends them.
func TestHostTierReloadsEvictedPrefix(t *testing.T) {
	cost := CostProfile{FloorMs: 1, PrefillUsPerToken: 10}
	e, err := New(Config{BlockSize: 4, KVBlocks: 6, CPUBlocks: 6, CPULoadUsPerToken: 2, MaxNumSeqs: 4,
		MaxNumBatchedTokens: 64, MaxModelLen: 24, Cost: cost})
	if err != nil {
		t.Fatal(err)
	}
	a := seqTokens(1000, 17) // four full blocks and one token
	b := seqTokens(2000, 13) // three full blocks and one token
	ha := blockkey.Append(nil, e.Config().HashSeed, a, 4)
	hb := blockkey.Append(nil, e.Config().HashSeed, b, 4)

	// A, cold: computed (1 ms + 17 × 10 µs); its blocks stored on GPU
	// (tokens, no parent) and written through to the host tier.
	ttft, cached, evs := serveOne(t, e, 1, a)
	if ttft != 1170*time.Microsecond || cached != 0 {
		t.Fatalf("cold A: %v, %d cached; want 1.17ms, 0", ttft, cached)
	}
	wire := eventBytes(evs)
	if len(evs) != 5 || evs[0].Medium != "GPU" || !slices.Equal(evs[0].BlockHashes, ha) {
		t.Fatalf("cold A events %+v", evs)
	}
	for i := range 4 {
		var parent *uint64
		if i > 0 {
			parent = &ha[i-1]
		}
		if want := cpuStoredBytes(ha[i], parent, a[i*4:i*4+4], 4); !bytes.Equal(wire[1+i], want) {
			t.Fatalf("CPU event of block %d\n% x,\nwant\n% x", i, wire[1+i], want)
		}
	}

	// B takes four GPU blocks: two of A's cached ones go (GPU
	// BlockRemoved), and the full host tier evicts its oldest block, A's
	// first, to store B's three.
	_, _, evs = serveOne(t, e, 2, b)
	var gpuRemoved []uint64
	for _, ev := range evs {
		if ev.Kind == kvevents.KindBlockRemoved && ev.Medium == "GPU" {
			gpuRemoved = append(gpuRemoved, ev.BlockHashes...)
		}
	}
	wire = eventBytes(evs)
	n := len(evs)
	if !slices.Equal(gpuRemoved, []uint64{ha[3], ha[2]}) || n < 4 || !bytes.Equal(wire[n-4], cpuRemovedBytes(ha[:1])) ||
		!bytes.Equal(wire[n-3], cpuStoredBytes(hb[0], nil, b[:4], 4)) || !bytes.Equal(wire[n-1], cpuStoredBytes(hb[2], &hb[1], b[8:12], 4)) {
		t.Fatalf("B: GPU removed %x (want A's last two), events %+v", gpuRemoved, evs)
	}
	if got := e.Offloaded(); !slices.Equal(got, []uint64{ha[1], ha[2], ha[3], hb[0], hb[1], hb[2]}) {
		t.Fatalf("host tier holds %x", got)
	}

	// A again: two blocks from the GPU pool, two loaded from the host tier
	// (8 tokens × 2 µs), one token computed: 1 ms + 10 µs + 16 µs.
	ttft, cached, evs = serveOne(t, e, 3, a)
	if ttft != 1026*time.Microsecond || cached != 16 {
		t.Fatalf("A from the host tier: %v, %d cached; want 1.026ms, 16", ttft, cached)
	}
	// The loaded blocks are GPU blocks again (a GPU BlockStored, parent
	// A's second block); the host tier already holds them: no CPU event.
	last := evs[len(evs)-1]
	if last.Kind != kvevents.KindBlockStored || last.Medium != "GPU" || !slices.Equal(last.BlockHashes, ha[2:4]) ||
		!last.HasParent || last.ParentHash != ha[1] || !slices.Equal(last.TokenIDs, a[8:16]) {
		t.Fatalf("A reloaded: last event %+v", last)
	}
	for _, ev := range evs {
		if ev.Medium == "CPU" {
			t.Fatalf("A reloaded: CPU event %+v", ev)
		}
	}

	// A once more: all four blocks on the GPU, one token computed.
	ttft, cached, _ = serveOne(t, e, 4, a)
	if ttft != 1010*time.Microsecond || cached != 16 {
		t.Fatalf("A from the GPU pool: %v, %d cached; want 1.01ms, 16", ttft, cached)
	}
	st := e.Stats()
	if st.PrefixHits != 8+16 || st.ExternalHits != 8 || st.ExternalQueries != 17+13+9+1 || st.OffloadedBlocks != 6 {
		t.Fatalf("stats %+v", st)
	}
}

func TestHostTierOff(t *testing.T) {
	e := testEngine(t, 4, 6)
	serveOne(t, e, 1, seqTokens(0, 17))
	_, _, evs := serveOne(t, e, 2, seqTokens(100, 13))
	for _, ev := range evs {
		if ev.Medium != "GPU" && ev.Kind != kvevents.KindAllBlocksCleared {
			t.Fatalf("event on medium %q without a host tier", ev.Medium)
		}
	}
	if _, cached, _ := serveOne(t, e, 3, seqTokens(0, 17)); cached != 8 {
		t.Fatalf("%d cached, want the 8 tokens left on the GPU", cached)
	}
	if e.Offloaded() != nil || e.Stats().ExternalQueries != 0 {
		t.Fatal("host tier state without a host tier")
	}
}

// TestHostTierSkipsJobsLargerThanItself: the connector stores nothing of
// a job it cannot fit, and a reset empties both tiers.
func TestHostTierSkipsJobsLargerThanItself(t *testing.T) {
	e, err := New(Config{BlockSize: 4, KVBlocks: 16, CPUBlocks: 3, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, MaxModelLen: 64, Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	_, _, evs := serveOne(t, e, 1, seqTokens(0, 17))
	for _, ev := range evs {
		if ev.Medium == "CPU" {
			t.Fatalf("CPU event for a 4-block job on a 3-block tier: %+v", ev)
		}
	}
	serveOne(t, e, 2, seqTokens(100, 9))
	if len(e.Offloaded()) != 2 {
		t.Fatalf("host tier holds %d blocks, want 2", len(e.Offloaded()))
	}
	if _, ok := e.ResetPrefixCache(0); !ok || e.Offloaded() != nil && len(e.Offloaded()) != 0 {
		t.Fatalf("reset left %d offloaded blocks", len(e.Offloaded()))
	}
}

// TestTTFTByTier is the figure: time to first token of an 8,000-token
// prompt with the default cost profile and CPU load cost, computed from
// scratch, with its prefix loaded from the host tier, and with its prefix
// on the GPU (one request at a time; engine time, no queueing).
func TestTTFTByTier(t *testing.T) {
	const promptLen = 8000
	// 501 GPU blocks: one 8,000-token request fills them all.
	e, err := New(Config{BlockSize: 16, KVBlocks: 501, CPUBlocks: 2000, MaxNumSeqs: 16,
		MaxNumBatchedTokens: 8192, MaxModelLen: 8016, Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	p := seqTokens(1, promptLen)
	recompute, _, _ := serveOne(t, e, 1, p)
	gpu, gpuCached, _ := serveOne(t, e, 2, p)
	serveOne(t, e, 3, seqTokens(100000, promptLen+15)) // needs all 501 blocks: pushes all of p out of the GPU pool
	cpu, cpuCached, _ := serveOne(t, e, 4, p)
	t.Logf("TTFT of an %d-token prompt: recompute %v, host-tier hit %v (%d cached), GPU hit %v (%d cached)",
		promptLen, recompute.Round(10*time.Microsecond), cpu.Round(10*time.Microsecond), cpuCached, gpu.Round(10*time.Microsecond), gpuCached)
	if !(gpu < cpu && cpu < recompute) || gpuCached != 7984 || cpuCached != 7984 {
		t.Fatalf("recompute %v, CPU %v (%d cached), GPU %v (%d cached)", recompute, cpu, cpuCached, gpu, gpuCached)
	}
	// The host hit costs the GPU hit plus 7,984 tokens × 2.6 µs.
	if d := cpu - gpu; d < 20700*time.Microsecond || d > 20800*time.Microsecond {
		t.Fatalf("CPU − GPU = %v, want 7,984 × 2.6 µs ≈ 20.76 ms", d)
	}
}

func TestHostTierConfigErrors(t *testing.T) {
	for _, c := range []Config{
		{BlockSize: 4, KVBlocks: 8, MaxNumSeqs: 1, MaxNumBatchedTokens: 8, MaxModelLen: 8, CPUBlocks: -1},
		{BlockSize: 4, KVBlocks: 8, MaxNumSeqs: 1, MaxNumBatchedTokens: 8, MaxModelLen: 8, CPUBlocks: 8, CPULoadUsPerToken: -1},
	} {
		if _, err := New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
	e, _ := New(Config{BlockSize: 4, KVBlocks: 8, MaxNumSeqs: 1, MaxNumBatchedTokens: 8, MaxModelLen: 8, CPUBlocks: 8})
	if got := e.Config().CPULoadUsPerToken; got != DefaultCPULoadUsPerToken {
		t.Fatalf("default CPU load cost %v", got)
	}
}

// mediaRecorder replays events per medium, through the wire codec, and
// checks each CPU BlockStored describes its block: the hash is the chain's
// next from its parent (the seed without one) over its tokens.
type mediaRecorder struct {
	seed     uint64
	wire     []byte
	decoded  kvevents.Batch
	resident map[string]map[uint64]int
	removed  map[string]int
}

func (r *mediaRecorder) Publish(b *kvevents.Batch) error {
	r.wire = kvevents.AppendBatch(r.wire[:0], b, kvevents.FormatVLLMMap)
	if err := kvevents.DecodeBatch(r.wire, &r.decoded); err != nil {
		return err
	}
	for _, ev := range r.decoded.Events {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			if ev.Medium == "CPU" {
				parent := r.seed
				if ev.HasParent {
					parent = ev.ParentHash
				}
				if len(ev.BlockHashes) != 1 || blockkey.Next(parent, ev.TokenIDs) != ev.BlockHashes[0] {
					return fmt.Errorf("CPU BlockStored %+v does not describe its block", ev)
				}
			}
			for _, h := range ev.BlockHashes {
				r.resident[ev.Medium][h]++
			}
		case kvevents.KindBlockRemoved:
			r.removed[ev.Medium] += len(ev.BlockHashes)
			for _, h := range ev.BlockHashes {
				m := r.resident[ev.Medium]
				if m[h]--; m[h] == 0 {
					delete(m, h)
				} else if m[h] < 0 {
					return fmt.Errorf("%s block %x removed more often than stored", ev.Medium, h)
				}
			}
		case kvevents.KindAllBlocksCleared:
			for _, m := range r.resident {
				clear(m)
			}
		}
	}
	return nil
}

// TestHostTierRandomWorkload: shared prefixes, evictions from both tiers,
// loads, aborts and resets, checked after every step: replaying the
// events per medium gives the GPU pool's multiset and the host tier's set.
func TestHostTierRandomWorkload(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	e, err := New(Config{BlockSize: 4, KVBlocks: 40, CPUBlocks: 90, MaxNumSeqs: 6, MaxNumBatchedTokens: 24, MaxModelLen: 64, Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	rec := &mediaRecorder{seed: e.Config().HashSeed, resident: map[string]map[uint64]int{"GPU": {}, "CPU": {}}, removed: map[string]int{}}
	var next uint64
	live := map[uint64]bool{}
	resets := 0
	for i := range 4000 {
		if rng.IntN(3) == 0 && len(live) < 20 {
			next++
			p := append(seqTokens(rng.IntN(8)*1000, 4*rng.IntN(8)), seqTokens(rng.IntN(1<<20), 1+rng.IntN(12))...)
			if err := e.Add(Request{ID: next, Prompt: p, MaxTokens: 1 + rng.IntN(10), OutputSeed: next}); err != nil {
				t.Fatal(err)
			}
			live[next] = true
		}
		if rng.IntN(60) == 0 && len(live) > 0 {
			id := slices.Min(slices.Collect(maps.Keys(live))) // the oldest: deterministic
			e.Abort(id)
			delete(live, id)
		}
		if rng.IntN(500) == 0 {
			// Drain (vLLM refuses a reset while requests hold blocks),
			// then reset both tiers.
			run(t, e, rec, 1000)
			clear(live)
			b, ok := e.ResetPrefixCache(float64(i))
			if !ok {
				t.Fatalf("step %d: reset refused on an idle engine", i)
			}
			resets++
			if err := rec.Publish(b); err != nil {
				t.Fatal(err)
			}
		}
		res := e.Step(float64(i))
		if e.HasWork() && res.Scheduled == 0 && res.Duration == 0 {
			t.Fatalf("step %d: work left but the step neither computed nor waited: %+v", i, e.Stats())
		}
		if res.Events != nil {
			if err := rec.Publish(res.Events); err != nil {
				t.Fatalf("step %d: %v", i, err)
			}
		}
		for _, o := range res.Outputs {
			if o.Finished != NotFinished {
				delete(live, o.ID)
			}
		}
		gpu := e.Resident()
		if len(gpu) != len(rec.resident["GPU"]) {
			t.Fatalf("step %d: GPU replay holds %d hashes, engine %d", i, len(rec.resident["GPU"]), len(gpu))
		}
		for h, n := range gpu {
			if rec.resident["GPU"][h] != n {
				t.Fatalf("step %d: GPU hash %x ×%d replayed, ×%d resident", i, h, rec.resident["GPU"][h], n)
			}
		}
		cpu := e.Offloaded()
		if len(cpu) != len(rec.resident["CPU"]) || len(cpu) > 90 {
			t.Fatalf("step %d: CPU replay holds %d hashes, host tier %d", i, len(rec.resident["CPU"]), len(cpu))
		}
		for _, h := range cpu {
			if rec.resident["CPU"][h] != 1 {
				t.Fatalf("step %d: CPU hash %x ×%d replayed", i, h, rec.resident["CPU"][h])
			}
		}
	}
	run(t, e, rec, 1000)
	if len(e.host.pinned) != 0 || e.loading != 0 {
		t.Fatalf("drained engine still pins %d host blocks, counts %d loading", len(e.host.pinned), e.loading)
	}
	st := e.Stats()
	t.Logf("%d steps: %d tokens loaded from the host tier of %d queried, %d GPU hits, blocks evicted %v, %d resets",
		st.Steps, st.ExternalHits, st.ExternalQueries, st.PrefixHits, rec.removed, resets)
	if st.ExternalHits == 0 || resets == 0 || rec.removed["CPU"] == 0 || rec.removed["GPU"] == 0 {
		t.Fatalf("workload did not exercise loads (%d tokens), evictions (%v) and resets (%d)", st.ExternalHits, rec.removed, resets)
	}
}

// TestHostTierLoadOverlapsCompute: a request loading its prefix from the
// host tier waits while another is computed, then is admitted; the load
// (8 tokens × 100 µs) hides under the other's step.
func TestHostTierLoadOverlapsCompute(t *testing.T) {
	cost := CostProfile{FloorMs: 1, PrefillUsPerToken: 10}
	e, err := New(Config{BlockSize: 4, KVBlocks: 8, CPUBlocks: 16, CPULoadUsPerToken: 100, MaxNumSeqs: 4,
		MaxNumBatchedTokens: 64, MaxModelLen: 32, Cost: cost})
	if err != nil {
		t.Fatal(err)
	}
	a := seqTokens(1000, 17)
	serveOne(t, e, 1, a)
	serveOne(t, e, 2, seqTokens(2000, 21)) // evicts A's last two blocks from the GPU
	mustAdd(t, e, 3, a, 1)
	mustAdd(t, e, 4, seqTokens(3000, 5), 1)
	first := func(res StepResult) []uint64 {
		var ids []uint64
		for _, o := range res.Outputs {
			if o.First {
				ids = append(ids, o.ID)
			}
		}
		return ids
	}
	// Step 1: A's two blocks start loading (0.8 ms), C is computed.
	res := e.Step(0)
	if got := first(res); res.Duration != 1050*time.Microsecond || !slices.Equal(got, []uint64{4}) {
		t.Fatalf("step 1: %v, first tokens of %v; want 1.05ms and C's", res.Duration, got)
	}
	if st := e.Stats(); st.Waiting != 1 || st.ExternalHits != 8 {
		t.Fatalf("step 1: %+v", st)
	}
	// Step 2: A's load is done (0.8 ms ≤ 1.05 ms): admitted, one token left.
	res = e.Step(0)
	if got := first(res); res.Duration != 1010*time.Microsecond || !slices.Equal(got, []uint64{3}) || res.Outputs[0].CachedTokens != 16 {
		t.Fatalf("step 2: %v, outputs %+v; want 1.01ms and A's with 16 cached", res.Duration, res.Outputs)
	}
}

// TestHostTierPlaceholderEvents: without self_describing_kv_events, vLLM's
// default, the connector's BlockStored is a placeholder naming the block by
// hash alone (_placeholder_stored): no parent, no tokens, block size 0.
func TestHostTierPlaceholderEvents(t *testing.T) {
	e, err := New(Config{BlockSize: 4, KVBlocks: 8, CPUBlocks: 8, CPUPlaceholderEvents: true, MaxNumSeqs: 4,
		MaxNumBatchedTokens: 64, MaxModelLen: 32, Cost: DefaultCost})
	if err != nil {
		t.Fatal(err)
	}
	a := seqTokens(1000, 9)
	ha := blockkey.Append(nil, e.Config().HashSeed, a, 4)
	_, _, evs := serveOne(t, e, 1, a)
	wire := eventBytes(evs)
	placeholder := func(h uint64) []byte {
		b := []byte{0x89}
		b = append(append(b, mpStr("type")...), mpStr("BlockStored")...)
		b = mpUint(append(append(b, mpStr("block_hashes")...), 0x91), h)
		b = append(append(b, mpStr("parent_block_hash")...), 0xc0)
		b = append(append(b, mpStr("token_ids")...), 0x90)
		b = append(append(b, mpStr("block_size")...), 0x00)
		b = append(append(b, mpStr("lora_id")...), 0xc0)
		b = append(append(b, mpStr("medium")...), mpStr("CPU")...)
		b = append(append(b, mpStr("lora_name")...), 0xc0)
		return append(append(b, mpStr("group_idx")...), 0x00)
	}
	if len(wire) != 3 || !bytes.Equal(wire[1], placeholder(ha[0])) || !bytes.Equal(wire[2], placeholder(ha[1])) {
		t.Fatalf("events %+v,\nCPU % x\nwant % x", evs, wire[1:], placeholder(ha[0]))
	}
}
