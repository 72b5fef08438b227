package workload

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/tokenize"
)

func keysOf(t *testing.T, msgs []Message) []uint64 {
	t.Helper()
	ids, err := Tokenize(msgs)
	if err != nil {
		t.Fatal(err)
	}
	return blockkey.Append(nil, blockkey.Seed("", ""), ids, BlockSize)
}

func commonPrefix(a, b []uint64) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestWordsAreOneBuiltinTokenEach(t *testing.T) {
	for _, n := range []int{1, 2, 17, 512, 6000} {
		ids, err := tokenize.Builtin{}.Encode(Words(7, "x", n), false)
		if err != nil {
			t.Fatal(err)
		}
		if len(ids) != n {
			t.Fatalf("Words(%d) = %d builtin tokens", n, len(ids))
		}
	}
	if Words(7, "x", 50) == Words(8, "x", 50) || Words(7, "x", 50) == Words(7, "y", 50) {
		t.Fatal("different seeds or names gave the same words")
	}
	if Words(7, "x", 50) != Words(7, "x", 50) {
		t.Fatal("Words is not deterministic")
	}
}

func tenantsParams() TenantsParams {
	return TenantsParams{Groups: 6, UsersPerGroup: 3, ContextTokens: 600, QuestionTokens: 120, OutputTokens: 10, RateStart: 20, RateEnd: 60}
}

func TestTenantsSizesCountsAndSharedPrefixes(t *testing.T) {
	d := 20 * time.Second
	w, err := Tenants("tenants", tenantsParams(), 1, d)
	if err != nil {
		t.Fatal(err)
	}
	// Mean rate 40/s over 20 s: 800 expected, Poisson sd ≈ 28.
	if n := len(w.Requests); n < 700 || n > 900 {
		t.Fatalf("%d requests, want ≈800", n)
	}
	// The ramp: the second half carries more than the first.
	half := 0
	for i, r := range w.Requests {
		if i > 0 && r.At < w.Requests[i-1].At {
			t.Fatal("requests not sorted by arrival")
		}
		if r.At < d/2 {
			half++
		}
		// system "<|system|>\n"+ctx+"\n" + user "<|user|>\n"+q+"\n" + "<|assistant|>\n"
		if want := 600 + 120 + 20; r.PromptTokens != want {
			t.Fatalf("%s: %d prompt tokens, want %d", r.Key, r.PromptTokens, want)
		}
	}
	if frac := float64(half) / float64(len(w.Requests)); frac < 0.28 || frac > 0.40 {
		t.Fatalf("first half holds %.2f of requests; a 20→60 ramp puts 1/3 there", frac)
	}
	// Same group: the whole context's blocks are shared; different groups: none.
	byGroup := map[string][][]uint64{}
	for _, r := range w.Requests {
		g := strings.Split(r.Key, "/")[0]
		if len(byGroup[g]) < 2 && (len(byGroup[g]) == 0 || r.Key != w.Requests[0].Key) {
			byGroup[g] = append(byGroup[g], keysOf(t, r.Messages))
		}
	}
	ctxBlocks := (600 + 7) / BlockSize
	var firsts [][]uint64
	for g, ks := range byGroup {
		if len(ks) == 2 {
			if n := commonPrefix(ks[0], ks[1]); n < ctxBlocks {
				t.Fatalf("group %s: %d shared blocks, want ≥ %d", g, n, ctxBlocks)
			}
		}
		firsts = append(firsts, ks[0])
	}
	for i := range firsts {
		for j := i + 1; j < len(firsts); j++ {
			if n := commonPrefix(firsts[i], firsts[j]); n != 0 {
				t.Fatalf("two groups share %d blocks", n)
			}
		}
	}
	// Demand: 6 contexts + 18 questions, ≈ (6·600 + 18·120)/16 blocks.
	if want := (6*600 + 18*(120+20)) / BlockSize; w.DemandBlocks < want*9/10 || w.DemandBlocks > want*11/10 {
		t.Fatalf("demand %d blocks, want ≈%d", w.DemandBlocks, want)
	}
}

func TestWorkloadsAreDeterministicPerSeed(t *testing.T) {
	gen := func(seed uint64) []Workload {
		a, err := Tenants("tenants", tenantsParams(), seed, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		b, err := Multiturn(multiturnParams(), seed, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c, err := NoCache(NoCacheParams{Rate: 10, InputMedian: 300, OutputMedian: 20, MaxInput: 1000, MaxOutput: 50}, seed, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return []Workload{a, b, c}
	}
	one, again, other := gen(3), gen(3), gen(4)
	if !reflect.DeepEqual(one, again) {
		t.Fatal("same seed, different workloads")
	}
	for i := range one {
		if reflect.DeepEqual(one[i].Requests, other[i].Requests) {
			t.Fatalf("%s: seeds 3 and 4 gave the same workload", one[i].Scenario)
		}
	}
}

func TestHotShare(t *testing.T) {
	p := tenantsParams()
	p.HotShare = 0.5
	p.RateStart, p.RateEnd = 100, 100
	w, err := Tenants("hot", p, 9, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	hot := 0
	for _, r := range w.Requests {
		if strings.HasPrefix(r.Key, "g0/") {
			hot++
		}
	}
	if frac := float64(hot) / float64(len(w.Requests)); math.Abs(frac-0.5) > 0.04 {
		t.Fatalf("hot tenant got %.3f of %d requests, want 0.5", frac, len(w.Requests))
	}
}

func multiturnParams() MultiturnParams {
	return MultiturnParams{ConversationRate: 2, MinTurns: 3, MaxTurns: 6, SystemPrompts: 2, SystemTokens: 100,
		UserMedian: 80, AssistantMedian: 120, MaxUser: 500, MaxAssistant: 300, ThinkTime: 2 * time.Second}
}

func TestMultiturnPromptsGrowByPrefix(t *testing.T) {
	w, err := Multiturn(multiturnParams(), 5, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string]Request{}
	for _, r := range w.Requests {
		byKey[r.Key] = r
	}
	checked := 0
	for _, r := range w.Requests {
		var c, turn int
		if _, err := fmt.Sscanf(r.Key, "c%d/t%d", &c, &turn); err != nil {
			t.Fatal(err)
		}
		if turn == 0 {
			continue
		}
		prev, ok := byKey[fmt.Sprintf("c%d/t%d", c, turn-1)]
		if !ok {
			t.Fatalf("%s without its previous turn", r.Key)
		}
		if r.At <= prev.At {
			t.Fatalf("%s arrives before its previous turn", r.Key)
		}
		a, err := Tokenize(prev.Messages)
		if err != nil {
			t.Fatal(err)
		}
		b, err := Tokenize(r.Messages)
		if err != nil {
			t.Fatal(err)
		}
		// The next prompt holds the previous prompt, the assistant's reply of
		// MaxTokens words and the new question.
		if len(b) <= len(a)+prev.MaxTokens || !reflect.DeepEqual(a, b[:len(a)]) {
			t.Fatalf("%s does not extend %s token for token", r.Key, fmt.Sprintf("c%d/t%d", c, turn-1))
		}
		checked++
	}
	if checked < 20 {
		t.Fatalf("only %d follow-up turns checked", checked)
	}
}

func TestNoCachePromptsShareNoBlock(t *testing.T) {
	w, err := NoCache(NoCacheParams{Rate: 20, InputMedian: 400, OutputMedian: 30, MaxInput: 2000, MaxOutput: 100}, 2, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint64]string{}
	total := 0
	for _, r := range w.Requests {
		total += r.PromptTokens
		for _, k := range keysOf(t, r.Messages) {
			if other, dup := seen[k]; dup {
				t.Fatalf("%s and %s share a block", r.Key, other)
			}
			seen[k] = r.Key
		}
	}
	if mean := float64(total) / float64(len(w.Requests)); mean < 350 || mean > 520 {
		t.Fatalf("mean prompt %.0f tokens, want ≈ 400·e^(0.08)+13", mean)
	}
}

const sampleTrace = `{"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]}
{"timestamp": 10, "input_length": 1400, "output_length": 700, "hash_ids": [0, 1, 3]}

{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 4]}
{"timestamp": 9000, "input_length": 10, "output_length": 5, "hash_ids": [9]}
`

func TestTraceBlocksBecomeSharedTokenPrefixes(t *testing.T) {
	p := TraceParams{Window: 5 * time.Second, Speedup: 2, MaxOutput: 500}
	recs, err := ParseTrace(strings.NewReader(sampleTrace), p)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 3 {
		t.Fatalf("%d records in a 5 s window, want 3", len(recs))
	}
	w, err := Trace(recs, p, 11)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range w.Requests {
		// "<|user|>\n" + input words + "\n<|assistant|>\n"
		if want := recs[i].InputLength + 13; r.PromptTokens != want {
			t.Fatalf("record %d: %d prompt tokens, want %d", i, r.PromptTokens, want)
		}
	}
	if w.Requests[1].At != 5*time.Millisecond || w.Requests[2].At != 1500*time.Millisecond {
		t.Fatalf("arrivals %v, %v; want the trace's 10 ms and 3 s halved", w.Requests[1].At, w.Requests[2].At)
	}
	if w.Requests[1].MaxTokens != 500 {
		t.Fatalf("output %d, want capped at 500", w.Requests[1].MaxTokens)
	}
	k0, k1, k2 := keysOf(t, w.Requests[0].Messages), keysOf(t, w.Requests[1].Messages), keysOf(t, w.Requests[2].Messages)
	// Requests 0 and 1 share hash ids 0,1: 1024 words after the 6-token
	// header, i.e. (6+1024)/16 = 64 full blocks; request 2 shares block 0 only.
	if n := commonPrefix(k0, k1); n != (6+1024)/16 {
		t.Fatalf("records sharing two hash ids share %d blocks, want %d", n, (6+1024)/16)
	}
	if n := commonPrefix(k0, k2); n != (6+512)/16 {
		t.Fatalf("records sharing one hash id share %d blocks, want %d", n, (6+512)/16)
	}
}

func TestTraceRejectsBadLines(t *testing.T) {
	for _, bad := range []string{
		`{"timestamp": 0, "input_length": -1, "output_length": 5, "hash_ids": []}`,
		`{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1,2,3]}`,
		`{"timestamp": "x"}`,
		`not json`,
		"{\"timestamp\": 5, \"input_length\": 1}\n{\"timestamp\": 4, \"input_length\": 1}",
		``,
	} {
		if _, err := ParseTrace(strings.NewReader(bad), TraceParams{}); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

func TestRealTraceHead(t *testing.T) {
	path := filepath.Join("..", "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Skipf("no Mooncake trace at %s: %v", path, err)
	}
	recs, err := ParseTrace(bytes.NewReader(data), TraceParams{Limit: 40})
	if err != nil {
		t.Fatal(err)
	}
	w, err := Trace(recs, TraceParams{Limit: 40}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 40 {
		t.Fatalf("%d requests, want 40", len(w.Requests))
	}
	for i, r := range w.Requests {
		if r.PromptTokens != recs[i].InputLength+13 {
			t.Fatalf("record %d: %d tokens for input_length %d", i, r.PromptTokens, recs[i].InputLength)
		}
	}
}

func FuzzParseTrace(f *testing.F) {
	f.Add([]byte(sampleTrace))
	f.Add([]byte(`{"timestamp": 1, "input_length": 0, "output_length": 0, "hash_ids": null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := ParseTrace(bytes.NewReader(data), TraceParams{Limit: 8})
		if err != nil {
			return
		}
		for _, r := range recs {
			if r.InputLength > 1<<14 {
				return // valid but slow to synthesize; sizes are tested above
			}
		}
		w, err := Trace(recs, TraceParams{MaxOutput: 16}, 1)
		if err != nil {
			return
		}
		for i, r := range w.Requests {
			if r.MaxTokens < 1 || r.MaxTokens > 16 {
				t.Fatalf("output %d outside [1,16]", r.MaxTokens)
			}
			if recs[i].InputLength > 0 && r.PromptTokens != recs[i].InputLength+13 {
				t.Fatalf("%d tokens for input_length %d", r.PromptTokens, recs[i].InputLength)
			}
		}
	})
}
