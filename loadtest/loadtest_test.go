package loadtest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/loadtest/cluster"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// binDir is where make build puts the binaries, seen from this package.
var binDir = filepath.Join("..", "bin")

func needBins(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := os.Stat(filepath.Join(binDir, n)); err != nil {
			t.Skipf("bin/%s missing (%v): run make build first; this test drives the real binaries", n, err)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startEnginesim runs bin/enginesim at time-scale 0.05 until the test ends
// and returns its base URL.
func startEnginesim(t *testing.T) string {
	t.Helper()
	needBins(t, "enginesim")
	port := freePort(t)
	p, err := cluster.StartProc("enginesim", filepath.Join(binDir, "enginesim"), []string{
		"--listen", fmt.Sprintf("127.0.0.1:%d", port), "--model", "sim", "--time-scale", "0.05", "--kv-blocks", "4096",
	}, nil, filepath.Join(t.TempDir(), "enginesim.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(5 * time.Second) })
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return base
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("enginesim not healthy: %v\n%s", err, p.TailLog(2000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestClientAgainstEnginesim replays a small tenants workload straight into
// one real enginesim: TTFT before E2E, usage read from the stream, and the
// second asking of a prompt served from cache.
func TestClientAgainstEnginesim(t *testing.T) {
	base := startEnginesim(t)
	params := workload.TenantsParams{Groups: 2, UsersPerGroup: 2, ContextTokens: 400, QuestionTokens: 50, OutputTokens: 5, RateStart: 20, RateEnd: 20}
	w, err := workload.Tenants("t", params, 1, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient("sim")
	res := Replay(context.Background(), c, w, ReplayOptions{Targets: []string{base}, TimeScale: 0.05, Drain: 10 * time.Second})
	doneAt := map[string]time.Duration{}
	repeats := 0
	for _, r := range res.Records {
		if !r.OK() {
			t.Fatalf("%s failed: status %d %s", r.Key, r.Status, r.Err)
		}
		if r.TTFT <= 0 || r.E2E < r.TTFT {
			t.Fatalf("%s: ttft %v e2e %v", r.Key, r.TTFT, r.E2E)
		}
		if r.OutputTokens != 5 {
			t.Fatalf("%s: %d output tokens, want 5", r.Key, r.OutputTokens)
		}
		want := 400 + 50 + 20
		if r.PromptTokens != want {
			t.Fatalf("%s: engine counted %d prompt tokens, workload %d", r.Key, r.PromptTokens, want)
		}
		if end, ok := doneAt[r.Key]; ok && end < r.Start {
			// Asked before and done: every full block is cached.
			repeats++
			if r.ActualCached != want/16*16 && r.ActualCached != (want-1)/16*16 {
				t.Fatalf("%s repeated: %d cached tokens of %d", r.Key, r.ActualCached, want)
			}
		}
		if _, ok := doneAt[r.Key]; !ok {
			doneAt[r.Key] = r.Start + r.E2E
		}
	}
	if repeats == 0 {
		t.Fatal("no repeated prompt to check the cache with")
	}
	if s := report.Summarize(res.Records, 0.05, 0); s.HitRateActual < 0.5 || s.Errors != 0 {
		t.Fatalf("summary %+v", s)
	}
}

func TestReplayRecordsFailuresWithoutTargets(t *testing.T) {
	w, err := workload.Tenants("t", SmokeParams, 1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// A port nobody listens on: connection refused, recorded, not fatal.
	base := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	w.Truncate(5)
	res := Replay(context.Background(), NewClient("sim"), w, ReplayOptions{Targets: []string{base}, TimeScale: 0.01, Drain: 5 * time.Second})
	for _, r := range res.Records {
		if r.OK() || !strings.HasPrefix(r.Err, "connect:") {
			t.Fatalf("record %+v, want a connect error", r)
		}
	}
	s := report.Summarize(res.Records, 1, 0)
	if s.Errors != 5 {
		t.Fatalf("%d errors, want 5", s.Errors)
	}
}

func TestSumCounter(t *testing.T) {
	text := `# HELP kvmesh_router_degradations_total Switches into least-load mode.
# TYPE kvmesh_router_degradations_total counter
kvmesh_router_degradations_total{direction="enter"} 3
kvmesh_router_degradations_total{direction="exit"} 2
kvmesh_router_degradations_totalx 100
kvmesh_router_routes_total{mode="prefix"} 7
`
	n, err := sumCounter(strings.NewReader(text), "kvmesh_router_degradations_total")
	if err != nil || n != 5 {
		t.Fatalf("got %d, %v; want 5", n, err)
	}
	n, err = sumCounter(strings.NewReader("kvmesh_router_degradations_total 4\n"), "kvmesh_router_degradations_total")
	if err != nil || n != 4 {
		t.Fatalf("unlabelled: %d, %v", n, err)
	}
	if _, err := sumCounter(strings.NewReader("other 1\n"), "kvmesh_router_degradations_total"); err == nil {
		t.Fatal("missing metric not reported")
	}
}

// TestSmokeClusterRealBinaries is the --smoke run: a real cluster of
// enginesim, sidecar and router processes, two policies, no errors, and no
// process left behind.
func TestSmokeClusterRealBinaries(t *testing.T) {
	needBins(t, "enginesim", "sidecar", "router")
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	res, err := Bench(ctx, Config{Scenario: Smoke, Routers: 2, Seed: 1, MaxRequests: SmokeMaxRequests,
		BinDir: binDir, OutDir: out, Drain: 20 * time.Second, Log: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range Smoke.Policies {
		s, ok := res.Report.Policies[name]
		if !ok {
			t.Fatalf("no result for %s", name)
		}
		if s.Errors != 0 || s.Requests == 0 {
			t.Fatalf("%s: %d errors (%v) in %d requests; logs in %s", name, s.Errors, s.ErrorKind, s.Requests, out)
		}
		if len(s.Replicas) == 0 || s.Replicas[""] > 0 {
			t.Fatalf("%s: replicas %v: X-Kvmesh-Replica missing", name, s.Replicas)
		}
	}
	if kv := res.Report.Policies["kvaware"]; kv.HitRateActual < 0.3 {
		t.Fatalf("kvaware actual hit rate %.2f on a shared-prefix workload", kv.HitRateActual)
	}
}

func TestReadStream(t *testing.T) {
	const ok = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\" a\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\" b\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n" +
		"data: [DONE]\n\n"
	cases := []struct {
		name, body                string
		err                       string
		prompt, out, cached, ttft int // ttft: 1 when set
	}{
		{"ok", ok, "", 40, 2, 32, 1},
		{"no usage", strings.Replace(ok, "\"usage\"", "\"x\"", 1), "", 7, 2, 0, 1},
		{"no done", strings.TrimSuffix(ok, "data: [DONE]\n\n"), "stream ended without [DONE]", 40, 2, 32, 1},
		{"error event", "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: {\"error\":{\"message\":\"upstream died\"}}\n\n", "stream error: upstream died", 7, 0, 0, 1},
		{"empty", "data: [DONE]\n\n", "stream had no content", 7, 0, 0, 0},
		{"garbage", "data: {nope\n\n", "stream: bad chunk", 7, 0, 0, 0},
	}
	for _, c := range cases {
		rec := report.Record{PromptTokens: 7}
		readStream(context.Background(), strings.NewReader(c.body), time.Now(), &rec, nil)
		if !strings.HasPrefix(rec.Err, c.err) || (c.err == "") != (rec.Err == "") {
			t.Errorf("%s: err %q, want %q", c.name, rec.Err, c.err)
		}
		if rec.PromptTokens != c.prompt || rec.OutputTokens != c.out || rec.ActualCached != c.cached || (rec.TTFT > 0) != (c.ttft == 1) {
			t.Errorf("%s: record %+v", c.name, rec)
		}
	}
}

func FuzzReadStream(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\" a\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"usage\":{\"prompt_tokens\":3,\"prompt_tokens_details\":null}}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var rec report.Record
		readStream(context.Background(), bytes.NewReader(data), time.Now(), &rec, nil)
		if rec.Err == "" && rec.TTFT <= 0 {
			t.Fatalf("success without a first token: %+v", rec)
		}
	})
}

func FuzzSumCounter(f *testing.F) {
	f.Add([]byte("kvmesh_router_degradations_total{a=\"b\"} 3\n"))
	f.Add([]byte("kvmesh_router_degradations_total 1e3\nkvmesh_router_degradations_total{x=\"}\"} NaN\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = sumCounter(bytes.NewReader(data), "kvmesh_router_degradations_total")
	})
}

func TestKillTargetsNameOneOfEachPool(t *testing.T) {
	got, err := KillTargets(Pools(3, 8))
	if err != nil || !slices.Equal(got, []int{0, 3}) {
		t.Fatalf("KillTargets(3 of 8) = %v, %v; want [0 3]", got, err)
	}
	for _, roles := range [][]string{nil, Pools(0, 4), Pools(4, 4)} {
		if got, err := KillTargets(roles); err == nil {
			t.Errorf("KillTargets(%v) = %v without a prefill and a decode pool", roles, got)
		}
	}
}

// TestKillAtKillsAPrefillAndADecodeEngine runs the smoke workload split
// over 2 prefill + 2 decode replicas and kills one of each mid-run: the
// report names both, every request is counted served or failed, and the
// run is no error (a killed engine is no dead process).
func TestKillAtKillsAPrefillAndADecodeEngine(t *testing.T) {
	needBins(t, "enginesim", "sidecar", "router")
	sc := Smoke
	sc.Name, sc.Replicas, sc.KVRoles, sc.Duration = "smoke-pd", 4, Pools(2, 4), 2*time.Second
	sc.Policies = []string{"kvaware+always"}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	res, err := Bench(ctx, Config{Scenario: sc, Routers: 1, Seed: 1, MaxRequests: SmokeMaxRequests, KillAt: 500 * time.Millisecond,
		BinDir: binDir, OutDir: out, Drain: 20 * time.Second, RouterArgs: []string{"--resume-streams"},
		Log: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	s := res.Report.Policies["kvaware+always"]
	if want := []string{"enginesim-0", "enginesim-2"}; !slices.Equal(s.Killed, want) {
		t.Fatalf("killed %v, want %v; logs in %s", s.Killed, want, out)
	}
	if s.Served+s.Errors != s.Requests || s.Requests == 0 {
		t.Fatalf("%d served + %d failed of %d requests; logs in %s", s.Served, s.Errors, s.Requests, out)
	}
	t.Logf("%d of %d served, %d failed (%v), split %d", s.Served, s.Requests, s.Errors, s.ErrorKind, s.Modes["split"])
	var buf strings.Builder
	if err := res.Report.WriteTable(&buf); err != nil || !strings.Contains(buf.String(), "killed enginesim-0, enginesim-2 during the run") {
		t.Fatalf("table does not report the kill (%v):\n%s", err, buf.String())
	}
}
