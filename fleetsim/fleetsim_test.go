package fleetsim

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/engine"
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
	for _, policy := range []string{"kvaware", "round-robin", OracleName} {
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
