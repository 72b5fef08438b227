package routing

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/costfit"
)

var t0 = time.Unix(1_700_000_000, 0)

func fleetOf(n int) []Candidate {
	c := make([]Candidate, n)
	for i := range c {
		c[i] = Candidate{Name: fmt.Sprintf("r%d", i), PrefixAware: true}
	}
	return c
}

func route(t *testing.T, p Policy, req *Request, cands []Candidate) Decision {
	t.Helper()
	var d Decision
	p.Route(req, cands, &d)
	if len(cands) > 0 && (d.Pick < 0 || d.Order[0] != d.Pick || len(d.Order) != len(cands)) {
		t.Fatalf("bad decision %+v for %d candidates", d, len(cands))
	}
	return d
}

// dispatch routes req and records it at the pick, as the gateway does when
// it sends the request there.
func dispatch(t *testing.T, p Policy, req *Request, cands []Candidate) Decision {
	t.Helper()
	d := route(t, p, req, cands)
	if c := cands[d.Pick]; c.PrefixAware {
		p.(Recorder).Record(req, c.Name, c.MatchedTokens, req.Now)
	}
	return d
}

func mustPolicy(t *testing.T, name string) Policy {
	t.Helper()
	p, err := New(name, Config{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestKVAwarePrefersWarmReplicaWhileItsQueueIsCheaper(t *testing.T) {
	cands := fleetOf(3)
	cands[1].MatchedTokens = 6000
	cands[1].PendingPrefillTokens = 2000 // 60 ms queued vs 180 ms saved
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 7200, Now: t0}, cands)
	if d.Pick != 1 || d.Mode != ModePrefix || d.PredictedCachedTokens != 6000 {
		t.Fatalf("got pick %d mode %s cached %d; want warm r1 in prefix mode with 6000 cached", d.Pick, d.Mode, d.PredictedCachedTokens)
	}
}

func TestKVAwareLeavesWarmReplicaWhenItsQueueCostsMoreThanTheSaving(t *testing.T) {
	cands := fleetOf(3)
	cands[1].MatchedTokens = 6000
	cands[1].PendingPrefillTokens = 40000 // 1.2 s queued vs 180 ms saved
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 7200, Now: t0}, cands)
	if d.Pick == 1 {
		t.Fatalf("picked the overloaded warm replica: %+v", d)
	}
	if d.Mode != ModeBalance || d.PredictedCachedTokens != 0 {
		t.Fatalf("mode %s cached %d; want balance with nothing cached", d.Mode, d.PredictedCachedTokens)
	}
	if d.Order[len(d.Order)-1] != 1 {
		t.Fatalf("overloaded replica should be the last retry, order %v", d.Order)
	}
}

// TestKVAwareCountsTheDecodeBatchOfAHotReplica: the state routers saw in a
// bad run of the loadtest's hot scenario through four routers (one tenant
// sending half the traffic stayed on one replica with a first-token wait
// of 241 ms while a cold prefill elsewhere costs ≈ 100 ms): 40 running
// sequences and 1,200 prefill tokens queued. Each running sequence costs a
// new request ≈ 1.5 ms (a step and a half of decoding it), so the next
// request goes to an idle replica cold; at the former 0.5 ms it stayed.
func TestKVAwareCountsTheDecodeBatchOfAHotReplica(t *testing.T) {
	cands := fleetOf(3)
	cands[1].MatchedTokens = 3008
	cands[1].Running = 40
	cands[1].PendingPrefillTokens = 1200
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 3320, Now: t0}, cands)
	if d.Pick == 1 {
		t.Fatalf("stayed on the hot replica: %+v", d)
	}
	p, err := New("kvaware", Config{PerRunning: 500 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	if d := route(t, p, &Request{PromptTokens: 3320, Now: t0}, cands); d.Pick != 1 {
		t.Fatalf("at 0.5 ms per running sequence the hot replica should still win: %+v", d)
	}
}

func TestCalibrationLearnsWhatARunningSequenceCosts(t *testing.T) {
	// Configured with the old 0.5 ms per running sequence, as if for
	// another GPU; the engines measure 1.5 ms.
	p, err := New("kvaware", Config{PerRunning: 500 * time.Microsecond, Calibrate: true})
	if err != nil {
		t.Fatal(err)
	}
	cands := fleetOf(3)
	cands[1].MatchedTokens = 3008
	cands[1].Running = 40
	cands[1].PendingPrefillTokens = 1200
	hot := func(model string) int {
		return route(t, p, &Request{Model: model, PromptTokens: 3320, Now: t0}, cands).Pick
	}
	if hot("llama") != 1 {
		t.Fatal("before learning, 0.5 ms per running sequence should keep the hot replica")
	}
	l := p.(Learner)
	for i := range 2000 {
		c := Candidate{Name: "r0", PrefixAware: true, Running: i % 50, PendingPrefillTokens: (i * 7919) % 6000}
		prompt, cached := 500+(i*104729)%4000, (i%3)*256
		work := c.PendingPrefillTokens + prompt - cached
		ttft := 5*time.Millisecond + time.Duration(work)*30*time.Microsecond + time.Duration(c.Running)*1500*time.Microsecond
		l.Learn(&Request{Model: "llama", PromptTokens: prompt}, &c, cached, ttft)
	}
	if d := route(t, p, &Request{Model: "llama", PromptTokens: 3320, Now: t0}, cands); d.Pick == 1 {
		t.Fatalf("after learning, stayed on the hot replica: %+v", d)
	}
	if hot("qwen") != 1 {
		t.Fatal("another model's decisions moved with llama's costs")
	}
	var got []string
	p.(CostModeler).CostModels(func(model string, k costfit.Coefficients, n float64) {
		got = append(got, fmt.Sprintf("%s %v %v %.0f", model, k.PerToken.Round(time.Microsecond), k.PerRunning.Round(100*time.Microsecond), n))
	})
	// 2,000 observations weigh 1,264 after forgetting (1 − 1/2000 each).
	if want := "llama 30µs 1.5ms 1264"; len(got) != 1 || got[0] != want {
		t.Errorf("cost models %q, want [%s]", got, want)
	}
}

func TestWithoutCalibrationDecisionsKeepTheConfiguredCosts(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	cands := fleetOf(3)
	cands[1].MatchedTokens = 3008
	cands[1].Running = 40
	cands[1].PendingPrefillTokens = 1200
	before := route(t, p, &Request{Model: "m", PromptTokens: 3320, Now: t0}, cands)
	for i := range 500 {
		c := Candidate{Name: "r0", Running: i % 50}
		p.(Learner).Learn(&Request{Model: "m", PromptTokens: 1000}, &c, 0, time.Duration(c.Running)*10*time.Millisecond)
	}
	after := route(t, p, &Request{Model: "m", PromptTokens: 3320, Now: t0}, cands)
	if after.Pick != before.Pick || after.PredictedTTFT != before.PredictedTTFT {
		t.Fatalf("the fit steered a decision with calibration off: %+v, then %+v", before, after)
	}
	n := 0
	p.(CostModeler).CostModels(func(_ string, k costfit.Coefficients, _ float64) {
		n++
		if k.PerRunning <= 1500*time.Microsecond {
			t.Errorf("the fit should still follow the observations: %+v", k)
		}
	})
	if n != 1 {
		t.Fatalf("%d cost models fitted, want 1 (fitted and exported with calibration off too)", n)
	}
}

func TestKVAwareIgnoresFiltersItCannotTrust(t *testing.T) {
	cands := fleetOf(2)
	cands[0].MatchedTokens = 5000
	cands[0].PrefixAware = false // stale or unselected: load only
	cands[0].Running = 5
	d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 6000, Now: t0}, cands)
	if d.Pick != 1 || d.PredictedCachedTokens != 0 {
		t.Fatalf("a stale filter steered the request: %+v", d)
	}
}

func TestColdPrefixesLandWhereEveryRouterAgrees(t *testing.T) {
	for key := uint64(1); key < 200; key++ {
		req := &Request{PromptTokens: 3000, AffinityKey: key * 0x9e3779b97f4a7c15, Now: t0}
		a := route(t, mustPolicy(t, "kvaware"), req, fleetOf(8))
		b := route(t, mustPolicy(t, "kvaware"), req, fleetOf(8))
		if a.Pick != b.Pick || a.Mode != ModeCold {
			t.Fatalf("two routers disagree on a cold prefix (%d vs %d, mode %s)", a.Pick, b.Pick, a.Mode)
		}
	}
}

func TestColdPrefixesGoOnlyToPrefixAwareHomes(t *testing.T) {
	for key := uint64(1); key < 100; key++ {
		cands := fleetOf(3)
		cands[2].PrefixAware = false // unselected: load only
		d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 500, AffinityKey: key * 0x9e3779b97f4a7c15, Now: t0}, cands)
		if d.Pick == 2 {
			t.Fatalf("key %d: a cold prefix was placed on a load-only replica", key)
		}
	}
}

func TestColdPlacementSpreadsKeys(t *testing.T) {
	counts := map[int]int{}
	for key := uint64(1); key <= 800; key++ {
		d := route(t, mustPolicy(t, "kvaware"), &Request{PromptTokens: 100, AffinityKey: key * 0x9e3779b97f4a7c15, Now: t0}, fleetOf(8))
		counts[d.Pick]++
	}
	for i := range 8 {
		if counts[i] < 60 || counts[i] > 140 {
			t.Fatalf("replica %d got %d of 800 cold prefixes; want about 100 each: %v", i, counts[i], counts)
		}
	}
}

func TestColdHomeYieldsWhenBusy(t *testing.T) {
	req := &Request{PromptTokens: 3000, AffinityKey: 42, Now: t0}
	home := route(t, mustPolicy(t, "kvaware"), req, fleetOf(4)).Pick
	cands := fleetOf(4)
	cands[home].PendingPrefillTokens = 50000
	if d := route(t, mustPolicy(t, "kvaware"), req, cands); d.Pick == home {
		t.Fatalf("cold prefix sent to its home despite 1.5 s of queued prefill")
	}
}

func TestSpeculativeRecordsCoLocateSiblingsUntilTheyExpire(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	keys := []uint64{101, 102, 103, 104}
	first := dispatch(t, p, &Request{PromptTokens: 70, Keys: keys, BlockSize: 16, AffinityKey: 7, Now: t0}, fleetOf(4))

	// A sibling shares three blocks; no filter shows them yet.
	sibling := &Request{PromptTokens: 80, Keys: []uint64{101, 102, 103, 999}, BlockSize: 16, AffinityKey: 7, Now: t0.Add(100 * time.Millisecond)}
	cands := fleetOf(4)
	d := dispatch(t, p, sibling, cands)
	if d.Pick != first.Pick || d.Mode != ModePrefix || d.PredictedCachedTokens != 48 {
		t.Fatalf("sibling: pick %d mode %s cached %d; want r%d, prefix, 48", d.Pick, d.Mode, d.PredictedCachedTokens, first.Pick)
	}

	later := *sibling
	later.Now = t0.Add(time.Minute)
	if d := dispatch(t, p, &later, fleetOf(4)); d.PredictedCachedTokens != 0 {
		t.Fatalf("expired speculative record still predicts %d cached tokens", d.PredictedCachedTokens)
	}
}

// TestSpeculativeRecordsExtendWhatTheFilterShows: records start where the
// chosen replica's filter stopped, and a sibling's match is the filter's
// blocks plus the recorded ones after them.
func TestSpeculativeRecordsExtendWhatTheFilterShows(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	kv := p.(*kvaware)
	keys := []uint64{201, 202, 203, 204, 205}
	cands := fleetOf(4)
	cands[2].MatchedTokens = 32 // the filter shows two blocks
	first := dispatch(t, p, &Request{PromptTokens: 80, Keys: keys, BlockSize: 16, Now: t0}, cands)
	if first.Pick != 2 {
		t.Fatalf("pick %d, want the replica holding the prefix", first.Pick)
	}
	if n := len(kv.spec.cur); n != 3 {
		t.Fatalf("%d records, want 3 (only the blocks the filter did not show)", n)
	}
	sibling := &Request{PromptTokens: 80, Keys: []uint64{201, 202, 203, 204, 999}, BlockSize: 16, Now: t0.Add(50 * time.Millisecond)}
	d := dispatch(t, p, sibling, cands)
	if d.Pick != 2 || d.PredictedCachedTokens != 64 {
		t.Fatalf("sibling: pick %d cached %d; want r2 with 64 (32 from the filter, 32 recorded)", d.Pick, d.PredictedCachedTokens)
	}
	// A replica whose filter stops earlier cannot claim records that begin
	// past its own prefix.
	other := fleetOf(4)
	other[2].MatchedTokens = 0
	if d := dispatch(t, p, sibling, other); d.PredictedCachedTokens != 0 {
		t.Fatalf("records counted from block 0 although they start at block 2: %d", d.PredictedCachedTokens)
	}
}

func TestSpeculativeRecordsStayBounded(t *testing.T) {
	p, _ := New("kvaware", Config{SpeculativeMaxKeys: 1000})
	kv := p.(*kvaware)
	for i := range 500 {
		keys := []uint64{uint64(i)*10 + 1, uint64(i)*10 + 2, uint64(i)*10 + 3}
		dispatch(t, p, &Request{PromptTokens: 48, Keys: keys, BlockSize: 16, Now: t0}, fleetOf(2))
	}
	if n := len(kv.spec.cur) + len(kv.spec.prev); n > 1000 {
		t.Fatalf("%d speculative records kept, bound is 1000", n)
	}
	// The newest records survive rotation.
	d := dispatch(t, p, &Request{PromptTokens: 49, Keys: []uint64{4991, 4992, 4993}, BlockSize: 16, Now: t0}, fleetOf(2))
	if d.PredictedCachedTokens != 48 {
		t.Fatalf("newest record lost: predicted %d", d.PredictedCachedTokens)
	}
}

// TestRecordsForgetReplicaNamesPastTheBound: rollouts bring new replica
// names without end; the names records can refer to stay bounded.
func TestRecordsForgetReplicaNamesPastTheBound(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	req := &Request{PromptTokens: 40, Keys: []uint64{1, 2}, BlockSize: 16, Now: t0}
	for i := range maxSpecNames + 10 {
		p.(Recorder).Record(req, fmt.Sprintf("pod-%d", i), 0, t0)
	}
	if n := len(p.(*kvaware).spec.names); n > maxSpecNames {
		t.Fatalf("%d names kept, bound %d", n, maxSpecNames)
	}
	// The newest record still counts.
	cands := []Candidate{{Name: fmt.Sprintf("pod-%d", maxSpecNames+9), PrefixAware: true}, {Name: "other", PrefixAware: true}}
	if d := route(t, p, req, cands); d.Pick != 0 || d.PredictedCachedTokens != 32 {
		t.Fatalf("newest record lost: pick %d cached %d", d.Pick, d.PredictedCachedTokens)
	}
}

func TestClearRecordsForgetsSpeculation(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	req := &Request{PromptTokens: 40, Keys: []uint64{1, 2}, BlockSize: 16, Now: t0}
	first := dispatch(t, p, req, fleetOf(3))
	p.(Clearer).ClearRecords([]string{fmt.Sprintf("r%d", first.Pick)})
	if d := dispatch(t, p, req, fleetOf(3)); d.PredictedCachedTokens != 0 {
		t.Fatal("cleared records still predicted a hit")
	}
}

// TestRecordsFollowTheDispatch: a prompt is remembered where it was sent,
// not where Route meant it to go: retried at another replica, its siblings
// follow it there; spilled to a fallback (never sent to a replica), it
// leaves no record.
func TestRecordsFollowTheDispatch(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	keys := []uint64{301, 302, 303, 304}
	req := &Request{PromptTokens: 70, Keys: keys, BlockSize: 16, AffinityKey: 9, Now: t0}
	first := route(t, p, req, fleetOf(4))
	retriedAt := (first.Pick + 1) % 4
	// The pick failed before its first byte; the next replica, whose filter
	// showed one block, got the request.
	p.(Recorder).Record(req, fmt.Sprintf("r%d", retriedAt), 16, req.Now)

	sibling := &Request{PromptTokens: 80, Keys: []uint64{301, 302, 303, 999}, BlockSize: 16, AffinityKey: 9, Now: t0.Add(100 * time.Millisecond)}
	cands := fleetOf(4)
	cands[retriedAt].MatchedTokens = 16
	d := route(t, p, sibling, cands)
	if d.Pick != retriedAt || d.Mode != ModePrefix || d.PredictedCachedTokens != 48 {
		t.Fatalf("sibling: pick %d mode %s cached %d; want r%d (where the request went), prefix, 48", d.Pick, d.Mode, d.PredictedCachedTokens, retriedAt)
	}

	// Spilled: routed, never recorded.
	q := mustPolicy(t, "kvaware")
	route(t, q, req, fleetOf(4))
	if d := route(t, q, sibling, fleetOf(4)); d.PredictedCachedTokens != 0 {
		t.Fatalf("a request no replica got still predicts %d cached tokens at r%d", d.PredictedCachedTokens, d.Pick)
	}
}

func TestImbalanceSwitchesToLeastLoadAndBack(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	deg := p.(Degrader)
	cands := fleetOf(4)
	cands[0].MatchedTokens = 8000
	cands[0].PendingPrefillTokens = 400000 // 12 s of queue on one replica
	d := route(t, p, &Request{PromptTokens: 8100, Now: t0}, cands)
	if !d.Degraded || d.Mode != ModeBalance || d.Pick == 0 || deg.Degradations() != 1 {
		t.Fatalf("no least-load switch under severe imbalance: %+v, degradations %d", d, deg.Degradations())
	}
	if d.PredictedTTFT <= 0 {
		t.Fatal("no predicted ttft in least-load mode (spill_after reads it)")
	}
	route(t, p, &Request{PromptTokens: 8100, Now: t0}, cands)
	if deg.Degradations() != 1 {
		t.Fatal("staying degraded counted as a new degradation")
	}
	cands[0].PendingPrefillTokens = 0
	d = route(t, p, &Request{PromptTokens: 8100, Now: t0}, cands)
	if d.Degraded || deg.Degraded() || d.Pick != 0 {
		t.Fatalf("did not recover once balanced: %+v", d)
	}
}

// Models served by different replicas are imbalanced or not each on its
// own: one model's least-load mode neither counts again each time another
// model's balanced fleet would end it, nor routes that model by load.
func TestImbalanceIsJudgedPerModel(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	deg := p.(Degrader)
	a := fleetOf(3)
	a[0].PendingPrefillTokens = 400000 // 12 s of queue against none: past imbalance_enter
	b := fleetOf(3)
	b[0].MatchedTokens = 96000
	b[0].PendingPrefillTokens = 100000 // 3 s against 1.2 s: between exit and enter
	b[1].PendingPrefillTokens, b[2].PendingPrefillTokens = 40000, 40000
	c := fleetOf(2) // idle: would end least-load mode at once
	reqA := &Request{Model: "A", PromptTokens: 8100, Now: t0}
	reqB := &Request{Model: "B", PromptTokens: 100000, Now: t0}
	reqC := &Request{Model: "C", PromptTokens: 8100, Now: t0}

	for i := range 10 {
		if d := route(t, p, reqA, a); !d.Degraded || d.Pick == 0 {
			t.Fatalf("round %d: imbalanced model A not in least-load mode: %+v", i, d)
		}
		if d := route(t, p, reqB, b); d.Degraded || d.Mode != ModePrefix || d.Pick != 0 {
			t.Fatalf("round %d: model B routed %+v; want its warm r0 by prefix (3.1 s predicted against 4.2 s)", i, d)
		}
		if d := route(t, p, reqC, c); d.Degraded {
			t.Fatalf("round %d: balanced model C in least-load mode: %+v", i, d)
		}
	}
	if n := deg.Degradations(); n != 1 || !deg.Degraded() {
		t.Fatalf("degradations %d, degraded %v after A stayed imbalanced; want 1, true", n, deg.Degraded())
	}

	// B enters too; each leaves when its own fleet recovers.
	b[0].PendingPrefillTokens = 400000
	if d := route(t, p, reqB, b); !d.Degraded || deg.Degradations() != 2 {
		t.Fatalf("model B did not switch to least-load mode: %+v, degradations %d", d, deg.Degradations())
	}
	a[0].PendingPrefillTokens = 0
	if d := route(t, p, reqA, a); d.Degraded {
		t.Fatalf("model A still in least-load mode once balanced: %+v", d)
	}
	if d := route(t, p, reqB, b); !d.Degraded || !deg.Degraded() {
		t.Fatalf("model B left least-load mode when A recovered: %+v, degraded %v", d, deg.Degraded())
	}
	b[0].PendingPrefillTokens = 0
	if d := route(t, p, reqB, b); d.Degraded || deg.Degraded() || deg.Degradations() != 2 {
		t.Fatalf("model B did not recover once balanced: %+v, degraded %v, degradations %d", d, deg.Degraded(), deg.Degradations())
	}
}

func TestStaticUpstreamsAreLoadBalancedTargets(t *testing.T) {
	cands := []Candidate{{Name: "s0", Static: true, Running: 3}, {Name: "s1", Static: true}}
	for _, name := range Names {
		d := route(t, mustPolicy(t, name), &Request{PromptTokens: 10, Now: t0}, cands)
		if d.Mode != ModeStatic {
			t.Fatalf("%s: mode %s for a static upstream", name, d.Mode)
		}
	}
}

func TestNoCandidates(t *testing.T) {
	for _, name := range Names {
		var d Decision
		mustPolicy(t, name).Route(&Request{PromptTokens: 10, Now: t0}, nil, &d)
		if d.Pick != -1 || len(d.Order) != 0 {
			t.Fatalf("%s: %+v with no candidates", name, d)
		}
	}
}

func TestBaselines(t *testing.T) {
	cands := fleetOf(3)
	cands[0].Running, cands[1].Running, cands[2].Running = 5, 1, 3
	cands[0].MatchedTokens = 900

	if d := route(t, mustPolicy(t, "least-loaded"), &Request{PromptTokens: 1000, Now: t0}, cands); d.Pick != 1 {
		t.Fatalf("least-loaded picked %d", d.Pick)
	}
	if d := route(t, mustPolicy(t, "prefix-pin"), &Request{PromptTokens: 1000, Now: t0}, cands); d.Pick != 0 || d.PredictedCachedTokens != 900 {
		t.Fatalf("prefix-pin: %+v", d)
	}
	rr := mustPolicy(t, "round-robin")
	seen := map[int]bool{}
	for range 3 {
		seen[route(t, rr, &Request{Now: t0}, cands).Pick] = true
	}
	if len(seen) != 3 {
		t.Fatalf("round-robin visited %v", seen)
	}
	// chwbl: same key, same replica, until it is loaded past the bound.
	ch := mustPolicy(t, "chwbl")
	idle := fleetOf(4)
	home := route(t, ch, &Request{AffinityKey: 99, Now: t0}, idle).Pick
	idle[home].InflightRequests = 10
	if d := route(t, ch, &Request{AffinityKey: 99, Now: t0}, idle); d.Pick == home {
		t.Fatal("chwbl ignored its load bound")
	}
	if _, err := New("nope", Config{}); err == nil {
		t.Fatal("unknown policy accepted")
	}
}

// TestLoadBoundSpillsOffABusyHomeInAQuietFleet: CHWBL's capacity is
// ceil(bound × (requests+1) / replicas). With fewer requests out than
// replicas it is 1, so a home already serving 8 while 15 replicas idle must
// yield; the unrounded bound fitted nobody and kept the busy home.
func TestLoadBoundSpillsOffABusyHomeInAQuietFleet(t *testing.T) {
	const key = 12345
	for _, name := range []string{"chwbl", "kvaware"} {
		cands := fleetOf(16)
		home := route(t, mustPolicy(t, name), &Request{AffinityKey: key, PromptTokens: 100, Now: t0}, cands).Pick
		cands[home].Running, cands[home].InflightRequests = 8, 8
		if d := route(t, mustPolicy(t, name), &Request{AffinityKey: key, PromptTokens: 100, Now: t0}, cands); d.Pick == home {
			t.Errorf("%s: the home with 8 outstanding kept the key while 15 replicas idle", name)
		}
	}
	// Busy and balanced: the home is within the bound and keeps the key.
	ch := mustPolicy(t, "chwbl")
	cands := fleetOf(4)
	for i := range cands {
		cands[i].InflightRequests = 4
	}
	home := route(t, ch, &Request{AffinityKey: key, Now: t0}, fleetOf(4)).Pick
	if d := route(t, ch, &Request{AffinityKey: key, Now: t0}, cands); d.Pick != home {
		t.Errorf("chwbl moved a key off its home in a balanced fleet (home %d, picked %d)", home, d.Pick)
	}
}

// TestRoundRobinTurnsPerModel: one policy serves every model; two models
// taking turns must each still visit all their replicas.
func TestRoundRobinTurnsPerModel(t *testing.T) {
	rr := mustPolicy(t, "round-robin")
	a, b := fleetOf(2), fleetOf(2)
	seen := map[int]int{}
	for range 100 {
		seen[route(t, rr, &Request{Model: "A", Now: t0}, a).Pick]++
		route(t, rr, &Request{Model: "B", Now: t0}, b)
	}
	if seen[0] != 50 || seen[1] != 50 {
		t.Fatalf("model A's two replicas got %v of 100 requests, want 50 each", seen)
	}
}

// TestKVAwareRouteAllocatesNothing: a decision among up to 64 candidates
// keeps its scratch space on the stack, as the router's request path
// expects of a policy.
func TestKVAwareRouteAllocatesNothing(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	cands := fleetOf(50)
	for i := range cands {
		cands[i].MatchedTokens = (i % 5) * 512
		cands[i].Running = i % 7
		cands[i].PendingPrefillTokens = (i % 3) * 1000
	}
	req := &Request{Model: "m", PromptTokens: 4096, BlockSize: 16, AffinityKey: 0x9e3779b97f4a7c15, Now: t0}
	var d Decision
	if allocs := testing.AllocsPerRun(100, func() { p.Route(req, cands, &d) }); allocs != 0 {
		t.Fatalf("kvaware allocates %.0f times a decision among 50 candidates", allocs)
	}
}

func BenchmarkKVAwareRoute50(b *testing.B) {
	p, _ := New("kvaware", Config{})
	cands := fleetOf(50)
	for i := range cands {
		cands[i].MatchedTokens = (i % 5) * 512
		cands[i].Running = i % 7
		cands[i].PendingPrefillTokens = (i % 3) * 1000
	}
	keys := make([]uint64, 256)
	for i := range keys {
		keys[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	req := &Request{PromptTokens: 4096, Keys: keys, BlockSize: 16, AffinityKey: keys[0], Now: t0}
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		p.Route(req, cands, &d)
	}
}

// BenchmarkKVAwareRouteCold50 places a prefix nobody holds among 50
// replicas: the consistent-hash order of every prefix-aware candidate.
func BenchmarkKVAwareRouteCold50(b *testing.B) {
	p, _ := New("kvaware", Config{})
	cands := fleetOf(50)
	for i := range cands {
		cands[i].Running = i % 7
	}
	req := &Request{PromptTokens: 4096, AffinityKey: 0x9e3779b97f4a7c15, Now: t0}
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		p.Route(req, cands, &d)
	}
}

// TestExactRepeatPredictsAsTheEngineCounts: a speculative record covering
// every block of a prompt predicts what vLLM will serve from its cache, which
// never includes the last prompt token (engine.TestRepeatHitsAllFullBlocksButTheLastToken
// holds enginesim to the same rule).
func TestExactRepeatPredictsAsTheEngineCounts(t *testing.T) {
	const bs = 16
	for _, c := range []struct{ n, want int }{
		{bs - 1, 0}, {bs, 0}, {bs + 1, bs}, {2 * bs, bs}, {3 * bs, 2 * bs}, {3*bs + 1, 3 * bs},
	} {
		if got := CacheableTokens(c.n, bs); got != c.want {
			t.Errorf("CacheableTokens(%d, %d) = %d, want %d", c.n, bs, got, c.want)
		}
		p := mustPolicy(t, "kvaware")
		keys := make([]uint64, c.n/bs)
		for i := range keys {
			keys[i] = uint64(c.n*100 + i + 1)
		}
		req := &Request{PromptTokens: c.n, Keys: keys, BlockSize: bs, AffinityKey: 5, Now: t0}
		dispatch(t, p, req, fleetOf(3))
		if d := route(t, p, req, fleetOf(3)); d.PredictedCachedTokens != c.want {
			t.Errorf("%d-token repeat predicted %d cached, the engine caches %d", c.n, d.PredictedCachedTokens, c.want)
		}
	}
	// The text before a chat's media: the engine's prompt goes on, so the
	// last of these blocks can hit too.
	media := &Request{PromptTokens: 3 * bs, PromptContinues: true}
	if got := media.MaxCachedTokens(bs); got != 3*bs {
		t.Errorf("a prompt continuing past %d tokens may hit %d, want %d", 3*bs, got, 3*bs)
	}
	if CacheableTokens(0, bs) != 0 || CacheableTokens(10, 0) != 0 {
		t.Error("an empty prompt or an unknown block size must predict nothing")
	}
}

// TestLargeFleetIsNotImbalancedByItsLongestQueueAlone: over 256 busy
// replicas the longest queue is far above the mean by chance alone; what
// counts is the top eighth against the rest, so a few outliers leave kvaware
// routing by cost, while a hot eighth of the fleet still switches it.
func TestLargeFleetIsNotImbalancedByItsLongestQueueAlone(t *testing.T) {
	p := mustPolicy(t, "kvaware")
	cands := fleetOf(256)
	for i := range cands {
		cands[i].PendingPrefillTokens = 40000 + (i*7919)%40000 // 1.2–2.4 s
	}
	cands[17].PendingPrefillTokens = 400000 // 12 s, and two more at 6 s
	cands[99].PendingPrefillTokens, cands[200].PendingPrefillTokens = 200000, 200000
	if d := route(t, p, &Request{PromptTokens: 1000, Now: t0}, cands); d.Degraded {
		t.Fatalf("three outliers in 256 switched to least-load mode: %+v", d)
	}
	for i := range 32 {
		cands[i*8].PendingPrefillTokens = 400000
	}
	if d := route(t, p, &Request{PromptTokens: 1000, Now: t0}, cands); !d.Degraded {
		t.Fatalf("a hot eighth of the fleet did not switch to least-load mode: %+v", d)
	}
}
