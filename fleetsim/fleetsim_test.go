package fleetsim

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/loadtest"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// tenants is a short tenants workload: a few hundred requests.
func tenants(t testing.TB) *workload.Workload {
	t.Helper()
	w, err := workload.Tenants("tenants", loadtest.TenantsParams, 1, 8*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return &w
}

func summarize(t testing.TB, cfg Config, w *workload.Workload) (report.Summary, []byte) {
	t.Helper()
	res, err := Run(cfg, w)
	if err != nil {
		t.Fatal(err)
	}
	sum := report.Summarize(res.Records, 1, res.Degradations)
	var b bytes.Buffer
	rep := report.Report{Scenario: "tenants", Replicas: cfg.Replicas, Routers: cfg.Routers, TimeScale: 1, Seed: cfg.Seed,
		Requests: len(w.Requests), Order: []string{cfg.Policy}, Policies: map[string]report.Summary{cfg.Policy: sum}}
	if err := rep.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	return sum, b.Bytes()
}

func TestSameSeedSameReport(t *testing.T) {
	w := tenants(t)
	for _, policy := range []string{"kvaware", "round-robin", OracleName, GuessName} {
		t.Run(policy, func(t *testing.T) {
			cfg := Config{Replicas: 4, Routers: 2, Policy: policy, Seed: 7, Engine: engineFor(w),
				Network: Network{Delay: time.Millisecond, Jitter: 2 * time.Millisecond, Loss: 0.05}}
			sum, first := summarize(t, cfg, w)
			_, second := summarize(t, cfg, w)
			if !bytes.Equal(first, second) {
				t.Fatalf("two runs with seed 7 differ:\n%s\n%s", first, second)
			}
			if sum.Errors != 0 || sum.Requests != len(w.Requests) {
				t.Fatalf("%d errors over %d requests (%v)", sum.Errors, sum.Requests, sum.ErrorKind)
			}
			cfg.Seed = 8
			if _, other := summarize(t, cfg, w); bytes.Equal(first, other) {
				t.Fatal("seeds 7 and 8 gave the same report: the seed reaches nothing")
			}
		})
	}
}

func engineFor(w *workload.Workload) engine.Config {
	return engine.Config{KVBlocks: loadtest.Scenarios("", workload.TraceParams{})["tenants"].KVBlocks(*w, 4)}
}

// oneRequest is a workload of one chat at time 0.
func oneRequest(t testing.TB) *workload.Workload {
	t.Helper()
	w := workload.Workload{Scenario: "one", BlockSize: workload.BlockSize, Requests: []workload.Request{{
		Key: "only", MaxTokens: 3,
		Messages: []workload.Message{{Role: "user", Content: workload.Words(1, "only", 500)}},
	}}}
	ids, err := workload.Tokenize(w.Requests[0].Messages)
	if err != nil {
		t.Fatal(err)
	}
	w.Requests[0].PromptTokens = len(ids)
	return &w
}

// TTFT is simulated time from arrival to the end of the engine step that
// produced the first token: for a lone request, exactly its prefill step
// as the engine prices it.
func TestTTFTIsTheEngineStepThatProducesTheFirstToken(t *testing.T) {
	w := oneRequest(t)
	ids, _ := workload.Tokenize(w.Requests[0].Messages)
	cfg := engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192, MaxModelLen: 32768, Cost: engine.DefaultCost}
	e, err := engine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Add(engine.Request{ID: 1, Prompt: ids, MaxTokens: 3}); err != nil {
		t.Fatal(err)
	}
	want := e.Step(0).Duration
	for _, policy := range []string{"kvaware", OracleName} {
		res, err := Run(Config{Replicas: 3, Routers: 2, Policy: policy, Engine: cfg, Seed: 1}, w)
		if err != nil {
			t.Fatal(err)
		}
		r := res.Records[0]
		if !r.OK() || r.TTFT != want || r.OutputTokens != 3 || r.ActualCached != 0 || r.PromptTokens != len(ids) {
			t.Fatalf("%s: record %+v, want ttft %v, 3 tokens, none cached, %d prompt tokens", policy, r, want, len(ids))
		}
	}
}

// The filter stream repairs what a lossy network drops: with a fifth of
// the datagrams lost every request is still served, and the routers still
// find most cached prefixes through their filters.
func TestLossyNetworkStillRoutesByPrefix(t *testing.T) {
	w := tenants(t)
	cfg := Config{Replicas: 4, Routers: 2, Policy: "kvaware", Seed: 3, Engine: engineFor(w),
		Network: Network{Delay: 2 * time.Millisecond, Jitter: 5 * time.Millisecond, Loss: 0.2}}
	sum, _ := summarize(t, cfg, w)
	if sum.Errors != 0 {
		t.Fatalf("%d errors: %v", sum.Errors, sum.ErrorKind)
	}
	if sum.HitRateActual < 0.35 || sum.Modes["prefix"] < len(w.Requests)/4 {
		t.Fatalf("hit rate %.2f, %d prefix-routed of %d: the filters did not get through", sum.HitRateActual, sum.Modes["prefix"], len(w.Requests))
	}
}

func TestRandomPolicyIsRefused(t *testing.T) {
	if _, err := Run(Config{Replicas: 1, Routers: 1, Policy: "random"}, oneRequest(t)); err == nil {
		t.Fatal("random accepted: its draws are not seeded")
	}
}

// Router-0's gossip figures are the messages it was sent while requests
// arrived: every sidecar's load record once per load interval, deltas
// carrying the filters' growth, bytes as the encoder writes them; its
// memory holds one mirrored filter per sidecar.
func TestGossipIntoRouterAndItsMemory(t *testing.T) {
	w := tenants(t)
	cfg := Config{Replicas: 4, Routers: 2, Policy: "kvaware", Seed: 3, Engine: engineFor(w)}
	res, err := Run(cfg, w)
	if err != nil {
		t.Fatal(err)
	}
	g := &res.Gossip
	if g.Window != w.Span() {
		t.Fatalf("window %v, arrivals span %v", g.Window, w.Span())
	}
	loads := g.Messages[filterstream.KindLoad]
	want := int64(cfg.Replicas) * int64(g.Window/(100*time.Millisecond))
	if loads < want-int64(cfg.Replicas) || loads > want+int64(cfg.Replicas) {
		t.Fatalf("%d load records into router-0 over %v from %d sidecars, want %d ± %d", loads, g.Window, cfg.Replicas, want, cfg.Replicas)
	}
	lm := filterstream.Message{Kind: filterstream.KindLoad, From: "sidecar-0", Load: filterstream.Load{Healthy: true}}
	if min := int64(len(lm.Append(nil))); g.Bytes[filterstream.KindLoad] < loads*min {
		t.Fatalf("%d load records in %d bytes, each at least %d", loads, g.Bytes[filterstream.KindLoad], min)
	}
	if g.Messages[filterstream.KindDelta] == 0 || g.Bytes[filterstream.KindDelta] <= 8*g.Messages[filterstream.KindDelta] {
		t.Fatalf("deltas: %d messages, %d bytes", g.Messages[filterstream.KindDelta], g.Bytes[filterstream.KindDelta])
	}
	m := res.RouterMemory
	words := len(bloom.NewFilter(1<<16, 0.01).Words())
	if m.Sidecars != cfg.Replicas || m.FilterBytes != cfg.Replicas*8*words || m.TableBytes <= 0 || m.PerReplica() <= float64(8*words) {
		t.Fatalf("router memory %+v, want %d sidecars with %d-word filters", m, cfg.Replicas, words)
	}
}
