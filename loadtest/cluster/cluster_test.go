package cluster

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
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

// TestRealClusterStartsAndLeavesNothing starts 2 replicas and 2 routers,
// checks every router lists both replicas, and that Stop leaves no process.
func TestRealClusterStartsAndLeavesNothing(t *testing.T) {
	needBins(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Start(ctx, Config{BinDir: binDir, OutDir: t.TempDir(), Replicas: 2, Routers: 2, Policy: "kvaware",
		KVBlocks: 4096, TimeScale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	marker := RunEnv + "=" + c.RunID
	if n := len(Leftovers(marker)); n != 6 {
		t.Errorf("%d marked processes running, want 6", n)
	}
	for _, r := range c.Routers {
		resp, err := http.Get(r + "/admin/replicas")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var reps []Replica
		if err := json.Unmarshal(body, &reps); err != nil {
			t.Fatalf("%s: %v: %s", r, err, body)
		}
		if len(reps) != 2 {
			t.Fatalf("%s lists %d replicas: %s", r, len(reps), body)
		}
	}
	start := time.Now()
	if killed := c.Stop(); len(killed) > 0 {
		t.Errorf("needed SIGKILL: %v", killed)
	}
	t.Logf("stop took %v", time.Since(start))
	if left := Leftovers(marker); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
	c.Stop() // idempotent
}

// TestFailedStartCleansUp: an enginesim that refuses its flags makes Start
// fail fast, naming the process and its log, with nothing left running.
func TestFailedStartCleansUp(t *testing.T) {
	needBins(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	c, err := Start(ctx, Config{BinDir: binDir, OutDir: t.TempDir(), Replicas: 3, Routers: 1, Policy: "kvaware",
		KVBlocks: 1, TimeScale: 0.1})
	if err == nil {
		c.Stop()
		t.Fatal("a cluster of 1-block engines started")
	}
	if !strings.Contains(err.Error(), "enginesim-") || !strings.Contains(err.Error(), ".log") {
		t.Fatalf("error does not name the process and its log: %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("failing start took %v", d)
	}
	// Nothing of any run of this test binary's clusters may remain; the
	// marker prefix matches every cluster, so only this test's are alive.
	time.Sleep(100 * time.Millisecond)
	for _, pid := range Leftovers(RunEnv + "=") {
		if data, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline")); strings.Contains(string(data), "--kv-blocks\x001\x00") {
			t.Fatalf("process %d of the failed cluster still runs", pid)
		}
	}
}

// TestRealDataParallelCluster starts one enginesim of 2 data-parallel
// ranks with a sidecar per rank: the router lists both ranks online and
// each rank's events reach its own sidecar.
func TestRealDataParallelCluster(t *testing.T) {
	needBins(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Start(ctx, Config{BinDir: binDir, OutDir: t.TempDir(), Replicas: 1, DataParallelSize: 2, Routers: 1, Policy: "kvaware",
		KVBlocks: 4096, TimeScale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	if len(c.Engines) != 1 || strings.Join(c.Names, ",") != "replica-0-rank-0,replica-0-rank-1" || len(c.Sidecars) != 2 {
		t.Fatalf("engines %v, replicas %v", c.Engines, c.Names)
	}
	// One request per rank, named by the header: each rank's sidecar sees
	// its own stored blocks.
	for rank := range 2 {
		body := `{"model":"sim","prompt":"` + strings.Repeat("word ", 100) + `","max_tokens":1}`
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.Engines[0]+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-data-parallel-rank", strconv.Itoa(rank))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("rank %d: status %d", rank, resp.StatusCode)
		}
	}
	for _, sc := range c.Sidecars {
		deadline := time.Now().Add(10 * time.Second)
		for {
			resp, err := http.Get(sc + "/status")
			if err != nil {
				t.Fatal(err)
			}
			var st struct {
				Resident int `json:"resident_blocks"`
			}
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil && st.Resident > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no resident block (%v)", sc, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func TestPortRunsAreConsecutiveAndDistinct(t *testing.T) {
	p := &portPicker{}
	seen := map[int]bool{}
	lo, hi := listenRange()
	for range 5 {
		first, err := p.run(4)
		if err != nil {
			t.Fatal(err)
		}
		if first < lo || first+4 > hi {
			t.Fatalf("run %d–%d outside [%d, %d), below the ephemeral ports", first, first+3, lo, hi)
		}
		for port := first; port < first+4; port++ {
			if seen[port] || !p.used[port] {
				t.Fatalf("port %d handed out twice or not marked used", port)
			}
			seen[port] = true
		}
	}
	if single, err := p.tcp(); err != nil || seen[single] {
		t.Fatalf("single port %d (%v) among the runs", single, err)
	}
}

// TestKillEngineIsNoFailureOfTheRun: on a prefill + decode pair, only the
// prefill engine gets PrefillEngineArgs; an engine killed on purpose is
// gone (its port refuses), its sidecar stays, and Exited does not count
// it; an unknown server is an error.
func TestKillEngineIsNoFailureOfTheRun(t *testing.T) {
	needBins(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := t.TempDir()
	c, err := Start(ctx, Config{BinDir: binDir, OutDir: out, Replicas: 2, Routers: 1, Policy: "kvaware",
		KVBlocks: 4096, TimeScale: 0.1, KVRoles: []string{"prefill", "decode"},
		PrefillEngineArgs: []string{"--max-num-batched-tokens", "4096"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	for i, want := range []bool{true, false} {
		head, _ := os.ReadFile(filepath.Join(out, "enginesim-"+strconv.Itoa(i)+".log"))
		line, _, _ := strings.Cut(string(head), "\n")
		if got := strings.Contains(line, "--max-num-batched-tokens 4096"); got != want {
			t.Errorf("engine %d started as %q: prefill args there %v, want %v", i, line, got, want)
		}
	}
	name, err := c.KillEngine(1)
	if err != nil || name != "enginesim-1" {
		t.Fatalf("KillEngine(1) = %q, %v", name, err)
	}
	if resp, err := http.Get(c.Engines[1] + "/health"); err == nil {
		resp.Body.Close()
		t.Fatal("the killed engine still answers")
	}
	if resp, err := http.Get(c.Sidecars[1] + "/health"); err != nil {
		t.Fatalf("its sidecar went too: %v", err)
	} else {
		resp.Body.Close()
	}
	if err := c.Exited(); err != nil {
		t.Fatalf("a deliberate kill counted as a failure: %v", err)
	}
	if _, err := c.KillEngine(2); err == nil {
		t.Fatal("killing an engine server that does not exist succeeded")
	}
}
