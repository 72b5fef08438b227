package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/loadtest/report"
)

// The same flags give the same report bytes, in loadtest's JSON shape, and
// the plot is written.
func TestSameFlagsSameReport(t *testing.T) {
	dir := t.TempDir()
	var reports [2][]byte
	for i := range reports {
		path := filepath.Join(dir, "r.json")
		var stdout, stderr bytes.Buffer
		args := []string{"--scenario", "hot", "--replicas", "4", "--routers", "2", "--max-requests", "150",
			"--policies", "kvaware,round-robin,oracle", "--loss", "0.05", "--seed", "3",
			"--json", path, "--plot", filepath.Join(dir, "r.png")}
		if err := run(args, &stdout, &stderr); err != nil {
			t.Fatalf("%v\n%s", err, stderr.String())
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		reports[i] = b
		if !strings.Contains(stderr.String(), "µs per request") || !strings.Contains(stderr.String(), "into router-0") || !strings.Contains(stdout.String(), "oracle") {
			t.Fatalf("no per-policy line or table:\n%s\n%s", stderr.String(), stdout.String())
		}
	}
	if !bytes.Equal(reports[0], reports[1]) {
		t.Fatalf("reports differ:\n%s\n%s", reports[0], reports[1])
	}
	var rep fleetReport
	if err := json.Unmarshal(reports[0], &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Scenario != "hot" || rep.Replicas != 4 || rep.Routers != 2 || rep.Requests != 150 || len(rep.Order) != 3 {
		t.Fatalf("report setup %+v", rep)
	}
	for _, p := range rep.Order {
		if s := rep.Policies[p]; s.Errors != 0 || s.Requests != 150 || s.TTFT.P50 <= 0 {
			t.Fatalf("%s: %+v", p, s)
		}
		if f := rep.Fleet[p]; f.Kinds["load"].Messages == 0 || f.BytesPerS <= 0 || f.RouterMemory.Sidecars != 4 || f.RouterBytesPerReplica <= f.FilterBytesPerReplica {
			t.Fatalf("%s: fleet figures %+v", p, f)
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, "r.png")); err != nil || fi.Size() == 0 {
		t.Fatalf("plot: %v", err)
	}
}

func TestBadFlags(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("routing:\n  load_bound: 0.5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--config", bad, "--max-requests", "5"}, // load bound under 1
		{"--scenario", "nope"},
		{"--policies", "random", "--max-requests", "5"},
		{"--routers", "0"},
		{"--scenario", "overload", "--replicas", "4"}, // cannot be scaled
		{"extra"},
	} {
		var out bytes.Buffer
		if err := run(args, &out, &out); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	var out bytes.Buffer
	if err := run([]string{"-h"}, &out, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "KVMESH_DELTA_INTERVAL") {
		t.Fatalf("-h: %v\n%s", err, out.String())
	}
}

func TestFollowUpHitCountsLaterTurnsOnly(t *testing.T) {
	recs := []report.Record{
		{Key: "c1/t0", Status: 200, PromptTokens: 100, ActualCached: 0},
		{Key: "c1/t1", Status: 200, PromptTokens: 200, ActualCached: 96},
		{Key: "c2/t3", Status: 200, PromptTokens: 300, ActualCached: 288},
		{Key: "c2/t4", Err: "unfinished", PromptTokens: 400},
		{Key: "g1/u2", Status: 200, PromptTokens: 500, ActualCached: 500},
	}
	if hit, n := followUpHit(recs); n != 2 || hit != float64(96+288)/500 {
		t.Fatalf("follow-ups %d, hit %v", n, hit)
	}
}
