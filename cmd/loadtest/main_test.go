package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/loadtest/cluster"
)

var binDir = filepath.Join("..", "..", "bin")

func needBins(t *testing.T) {
	t.Helper()
	for _, n := range []string{"enginesim", "sidecar", "router"} {
		if _, err := os.Stat(filepath.Join(binDir, n)); err != nil {
			t.Skipf("bin/%s missing (%v): run make build first; this test starts the real binaries", n, err)
		}
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--scenario", "nope"},
		{"--log-level", "loud"},
		{"extra"},
	} {
		if err := run(args); err == nil {
			t.Fatalf("%q accepted", args)
		}
	}
}

// TestSmokeWritesJSONAndPlot runs --smoke end to end on the real binaries.
func TestSmokeWritesJSONAndPlot(t *testing.T) {
	needBins(t)
	dir := t.TempDir()
	js, png := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.png")
	if err := run([]string{"--smoke", "--bin", binDir, "--out", dir, "--json", js, "--plot", png, "--log-level", "warn"}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Policies map[string]struct {
			TTFT   map[string]float64 `json:"ttft_ms"`
			Errors *int               `json:"errors"`
		} `json:"policies"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Policies) != 2 || doc.Policies["kvaware"].TTFT["p90"] <= 0 || doc.Policies["kvaware"].Errors == nil {
		t.Fatalf("report: %s", data)
	}
	if st, err := os.Stat(png); err != nil || st.Size() < 1000 {
		t.Fatalf("plot: %v", err)
	}
}

// TestInterruptTearsDown sends SIGINT while the smoke cluster runs: run
// returns promptly and no process of the cluster survives.
func TestInterruptTearsDown(t *testing.T) {
	needBins(t)
	tag := "LOADTEST_INTERRUPT_TEST=" + strconv.Itoa(os.Getpid())
	t.Setenv("LOADTEST_INTERRUPT_TEST", strconv.Itoa(os.Getpid()))
	done := make(chan error, 1)
	go func() {
		done <- run([]string{"--smoke", "--bin", binDir, "--out", t.TempDir(), "--duration", "20s", "--max-requests", "100000", "--log-level", "warn"})
	}()
	deadline := time.Now().Add(45 * time.Second)
	for len(cluster.Leftovers(tag)) < 6 {
		if time.Now().After(deadline) {
			t.Fatal("the smoke cluster never came up")
		}
		select {
		case err := <-done:
			t.Fatalf("run ended before the interrupt: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	time.Sleep(time.Second)
	interrupted := time.Now()
	if err := syscall.Kill(os.Getpid(), syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("an interrupted run reported success")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("run did not return within 20 s of SIGINT")
	}
	t.Logf("torn down %v after SIGINT", time.Since(interrupted))
	if left := cluster.Leftovers(tag); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}
