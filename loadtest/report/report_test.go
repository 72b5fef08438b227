package report

import (
	"bytes"
	"encoding/json"
	"image/png"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"
)

func TestPercentileNearestRank(t *testing.T) {
	v := make([]float64, 100)
	for i := range v {
		v[i] = float64(i + 1)
	}
	for p, want := range map[float64]float64{50: 50, 90: 90, 99: 99, 100: 100, 0.5: 1} {
		if got := Percentile(v, p); got != want {
			t.Fatalf("p%v = %v, want %v", p, got, want)
		}
	}
	if got := Percentile([]float64{7}, 99); got != 7 {
		t.Fatalf("single value p99 = %v", got)
	}
	if got := Percentile(nil, 50); got != 0 {
		t.Fatalf("empty p50 = %v", got)
	}
	if got := Percentile([]float64{1, 2, 3}, 90); got != 3 {
		t.Fatalf("p90 of 3 values = %v, want 3", got)
	}
}

func TestSummarizeConvertsToSimulatedTime(t *testing.T) {
	ms := time.Millisecond
	recs := []Record{
		{Replica: "r0", Mode: "prefix", Start: 0, TTFT: 10 * ms, E2E: 100 * ms, PredictedCached: 80, ActualCached: 96, RouterPromptTokens: 100, PromptTokens: 100, OutputTokens: 10, Status: 200,
			Gaps: []time.Duration{5 * ms, 15 * ms}},
		{Replica: "r1", Mode: "cold", Start: 500 * ms, TTFT: 30 * ms, E2E: 500 * ms, PredictedCached: 0, ActualCached: 0, PromptTokens: 100, OutputTokens: 30, Status: 200},
		{Replica: "r0", Mode: "prefix", Start: 100 * ms, Status: 503, Err: "", FollowUp: true},
		{Start: 200 * ms, Err: "timeout before first token", FollowUp: true, StoredMissing: true},
	}
	s := Summarize(recs, 0.1, 2)
	// Two successes over wall [0, 1000 ms] = 10 simulated seconds.
	want := Summary{
		TTFT: Percentiles{P50: 100, P90: 300, P99: 300, Mean: 200},
		E2E:  Percentiles{P50: 1000, P90: 5000, P99: 5000, Mean: 3000},
		// Gaps of 5 and 15 wall ms; (E2E − TTFT) / (outputs − 1) of 90 ms
		// over 9 and 470 ms over 29.
		ITL:              Percentiles{P50: 50, P90: 150, P99: 150, Mean: 100},
		TPOT:             Percentiles{P50: 100, P90: 4700.0 / 29, P99: 4700.0 / 29, Mean: (100 + 4700.0/29) / 2},
		ThroughputRPS:    0.2,
		OutputTokensPerS: 4,
		Errors:           2,
		HitRatePredicted: 0.4,
		HitRateActual:    0.48,
		Degradations:     2,
		Requests:         4,
		Replicas:         map[string]int{"r0": 1, "r1": 1},
		Modes:            map[string]int{"prefix": 1, "cold": 1},
		ErrorKind:        map[string]int{"http 503": 1, "timeout before first token": 1},
		// The cold one (0 predicted, 0 cached) is exact, though the
		// router did not tokenize it; the prefix one is not.
		Served: 2, PredictedExact: 0.5, Tokenized: 1, PredictedExactTokenized: 0,
		FollowUps: 2, FollowUpsMissing: 1,
	}
	approx := func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }
	if !approx(s.ThroughputRPS, want.ThroughputRPS) || !approx(s.OutputTokensPerS, want.OutputTokensPerS) || !approx(s.TTFT.P50, 100) || !approx(s.TTFT.Mean, 200) || !approx(s.E2E.P90, 5000) ||
		!approx(s.ITL.P90, 150) || !approx(s.ITL.Mean, 100) || !approx(s.TPOT.P50, 100) || !approx(s.TPOT.P90, want.TPOT.P90) || !approx(s.TPOT.Mean, want.TPOT.Mean) {
		t.Fatalf("got %+v\nwant %+v", s, want)
	}
	s.ThroughputRPS, s.OutputTokensPerS, s.TTFT, s.E2E, s.ITL, s.TPOT = want.ThroughputRPS, want.OutputTokensPerS, want.TTFT, want.E2E, want.ITL, want.TPOT
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("got %+v\nwant %+v", s, want)
	}
}

func TestJSONShapeIsTheContract(t *testing.T) {
	r := Report{Scenario: "tenants", Replicas: 8, Routers: 1, TimeScale: 0.5, Order: []string{"kvaware", "random"},
		Policies: map[string]Summary{"kvaware": Summarize(nil, 1, 0), "random": Summarize(nil, 1, 0)}}
	var buf bytes.Buffer
	if err := r.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Scenario string                                `json:"scenario"`
		Policies map[string]map[string]json.RawMessage `json:"policies"`
	}
	if err := json.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"kvaware", "random"} {
		pol := doc.Policies[name]
		for _, k := range []string{"ttft_ms", "throughput_rps", "output_tokens_per_s", "errors", "hit_rate_predicted", "hit_rate_actual", "degradations"} {
			if _, ok := pol[k]; !ok {
				t.Fatalf("policy %s lacks %q: %s", name, k, buf.String())
			}
		}
		var ttft map[string]float64
		if err := json.Unmarshal(pol["ttft_ms"], &ttft); err != nil {
			t.Fatal(err)
		}
		keys := make([]string, 0, len(ttft))
		for k := range ttft {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		if !reflect.DeepEqual(keys, []string{"mean", "p50", "p90", "p99"}) {
			t.Fatalf("ttft_ms keys %v", keys)
		}
	}
}

func TestTableHasOneRowPerPolicy(t *testing.T) {
	r := Report{Scenario: "hot", Replicas: 4, Routers: 1, TimeScale: 1, KVBlocks: 100, DemandBlocks: 280,
		Order:    []string{"least-loaded", "kvaware"},
		Policies: map[string]Summary{"least-loaded": {TTFT: Percentiles{P90: 1234}}, "kvaware": {TTFT: Percentiles{P90: 56}, Errors: 3, RouterCPUPerRequestUs: 87.4}}}
	var buf bytes.Buffer
	if err := r.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 5 || !strings.Contains(lines[3], "least-loaded") || !strings.Contains(lines[3], "1234") || !strings.Contains(lines[4], "kvaware") ||
		!strings.HasSuffix(strings.TrimSpace(lines[4]), " 87") || !strings.Contains(lines[2], "router CPU µs/req") {
		t.Fatalf("table:\n%s", out)
	}
	if !strings.Contains(lines[0], "70% of fleet") || !strings.Contains(lines[0], "2.8× one replica") {
		t.Fatalf("header: %s", lines[0])
	}
}

func TestTableShowsPredictionsOnceServed(t *testing.T) {
	recs := []Record{
		{Status: 200, TTFT: 1, PredictedCached: 32, ActualCached: 32, RouterPromptTokens: 40},
		{Status: 200, TTFT: 1, PredictedCached: 0, ActualCached: 48, RouterPromptTokens: 0, FollowUp: true},
		{Status: 404, Err: "http 404", FollowUp: true, StoredMissing: true},
	}
	r := Report{Order: []string{"kvaware"}, Policies: map[string]Summary{"kvaware": Summarize(recs, 1, 0)}}
	var out strings.Builder
	if err := r.WriteTable(&out); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^ +kvaware +2 +50\.0% +1 +100\.0% +2 +1 *$`).MatchString(out.String()) {
		t.Errorf("no prediction row with 2 served, 50%% exact, 1 tokenized, 100%% of it exact, 2 follow-ups, 1 not found:\n%s", out.String())
	}
}

func TestPlotWritesAPNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cdf.png")
	err := PlotCDF(path, "tenants", []string{"a", "b", "empty"}, map[string][]float64{
		"a": {0, 1, 5, 20, 400}, "b": {100, 2000, 30000},
	})
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() < 500 || b.Dy() < 300 {
		t.Fatalf("image %v", b)
	}
	if err := PlotCDF(path, "x", []string{"a"}, nil); err == nil {
		t.Fatal("plotting nothing succeeded")
	}
}

func TestGroupsByTenantAndPriority(t *testing.T) {
	ms := time.Millisecond
	recs := []Record{
		{Tenant: "a", Priority: "critical", Status: 200, TTFT: 10 * ms, E2E: 20 * ms, QueueMs: 4},
		{Tenant: "a", Priority: "critical", Status: 200, TTFT: 30 * ms, E2E: 40 * ms, QueueMs: -1},
		{Tenant: "b", Priority: "sheddable", Status: 503, RetryAfter: true, RejectReason: "saturated", Err: "http 503"},
		{Tenant: "b", Priority: "sheddable", Status: 429, RetryAfter: true, RejectReason: "over_share", Err: "http 429"},
		{Tenant: "b", Priority: "sheddable", Status: 503, Err: "http 503"}, // no Retry-After: a failure
		{Tenant: "b", Priority: "standard", Err: "drain deadline passed"},
	}
	s := Summarize(recs, 0.5, 0)
	a, b := s.Tenants["a"], s.Tenants["b"]
	if a.Requests != 2 || a.Served != 2 || a.TTFT.P90 != 60 || a.QueueP90Ms != 8 || len(a.Rejected) != 0 {
		t.Errorf("a: %+v", a)
	}
	if b.Requests != 4 || b.Served != 0 || b.Failed != 2 || b.Rejected["503 saturated"] != 1 || b.Rejected["429 over_share"] != 1 {
		t.Errorf("b: %+v", b)
	}
	if p := s.Priorities["sheddable"]; p.Requests != 3 || p.Failed != 1 || len(s.Priorities) != 3 {
		t.Errorf("priorities: %+v", s.Priorities)
	}
	var out strings.Builder
	r := Report{Order: []string{"kvaware"}, Policies: map[string]Summary{"kvaware": s}}
	if err := r.WriteTable(&out); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^ +kvaware +priority +sheddable +3 +0 +1 +2 `).MatchString(out.String()) {
		t.Errorf("no sheddable row with 3 requests, 1 failed, 2 rejected:\n%s", out.String())
	}
	if s := Summarize(recs[:0], 1, 0); s.Tenants != nil || s.Priorities != nil {
		t.Errorf("groups without tenants: %+v", s)
	}
}
