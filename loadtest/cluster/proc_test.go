package cluster

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func waitGroupSize(t *testing.T, pgid, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(liveInGroup(pgid)) < n {
		if time.Now().After(deadline) {
			t.Fatalf("group %d never reached %d processes", pgid, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startStubborn starts a group of three processes that ignore SIGTERM.
func startStubborn(t *testing.T) *Proc {
	t.Helper()
	p, err := StartProc("stubborn", "/bin/sh", []string{"-c", `trap "" TERM; sleep 60 & sleep 60; wait`}, nil, filepath.Join(t.TempDir(), "p.log"))
	if err != nil {
		t.Fatal(err)
	}
	waitGroupSize(t, p.Pid(), 3)
	return p
}

// assertGone fails unless p is reaped and nothing is left in its group.
func assertGone(t *testing.T, p *Proc) {
	t.Helper()
	if left := liveInGroup(p.Pid()); len(left) > 0 {
		t.Fatalf("processes left in group: %v", left)
	}
	if done, _ := p.Exited(); !done {
		t.Fatal("not reaped")
	}
}

func TestStopTerminatesTheWholeGroup(t *testing.T) {
	log := filepath.Join(t.TempDir(), "p.log")
	p, err := StartProc("pair", "/bin/sh", []string{"-c", "sleep 60 & sleep 60"}, nil, log)
	if err != nil {
		t.Fatal(err)
	}
	waitGroupSize(t, p.Pid(), 3)
	start := time.Now()
	if killed := p.Stop(5 * time.Second); killed {
		t.Fatal("SIGTERM was not enough for sleep")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("stop took %v", d)
	}
	assertGone(t, p)
	p.Stop(time.Second) // idempotent
	data, _ := os.ReadFile(log)
	if !strings.HasPrefix(string(data), "# /bin/sh -c sleep 60 & sleep 60") {
		t.Fatalf("log header: %q", data)
	}
}

func TestStopKillsWhatIgnoresSIGTERM(t *testing.T) {
	p := startStubborn(t)
	start := time.Now()
	if killed := p.Stop(300 * time.Millisecond); !killed {
		t.Fatal("a process ignoring SIGTERM stopped without SIGKILL")
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 3*time.Second {
		t.Fatalf("stop took %v, want just over the grace period", d)
	}
	deadline := time.Now().Add(2 * time.Second)
	for len(liveInGroup(p.Pid())) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("left: %v", liveInGroup(p.Pid()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestPortPickerHandsOutDistinctPorts(t *testing.T) {
	var pp portPicker
	seen := map[int]bool{}
	for range 50 {
		port, err := pp.gossip()
		if err != nil {
			t.Fatal(err)
		}
		if seen[port] {
			t.Fatalf("port %d handed out twice", port)
		}
		seen[port] = true
	}
}

func TestLeftoversFindsMarkedProcesses(t *testing.T) {
	marker := RunEnv + "=test-" + strconv.Itoa(os.Getpid())
	env := childEnv(append(os.Environ(), "KVMESH_POLICY=random"), "test-"+strconv.Itoa(os.Getpid()))
	for _, kv := range env {
		if strings.HasPrefix(kv, "KVMESH_POLICY") {
			t.Fatal("the load test's own KVMESH_* variables leak to children")
		}
	}
	p, err := StartProc("marked", "/bin/sh", []string{"-c", "sleep 60 & sleep 60"}, env, filepath.Join(t.TempDir(), "p.log"))
	if err != nil {
		t.Fatal(err)
	}
	waitGroupSize(t, p.Pid(), 3)
	if n := len(Leftovers(marker)); n != 3 {
		t.Fatalf("found %d marked processes, want 3", n)
	}
	p.Stop(2 * time.Second)
	if left := Leftovers(marker); len(left) != 0 {
		t.Fatalf("still found %v", left)
	}
}

func TestCPUCountsWhatTheProcessBurned(t *testing.T) {
	p, err := StartProc("spin", "/bin/sh", []string{"-c", "while :; do :; done"}, nil, filepath.Join(t.TempDir(), "p.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop(time.Second)
	start := time.Now()
	time.Sleep(600 * time.Millisecond)
	cpu, ok := p.CPU()
	wall := time.Since(start)
	// A busy loop on a shared 2-core machine gets at least a third of one.
	if !ok || cpu < 200*time.Millisecond || cpu > wall+50*time.Millisecond {
		t.Fatalf("CPU %v (ok %v) over %v of wall", cpu, ok, wall)
	}
	p.Stop(time.Second)
	if _, ok := p.CPU(); ok {
		t.Fatal("CPU of a reaped process")
	}
}

func TestKillTakesTheGroupAwayAtOnce(t *testing.T) {
	p := startStubborn(t)
	start := time.Now()
	p.Kill()
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("kill took %v", d)
	}
	assertGone(t, p)
	if !p.dead.Load() {
		t.Fatal("a killed process is not marked as taken away on purpose")
	}
	if killed := p.Stop(time.Second); killed {
		t.Fatal("Stop after Kill reported needing SIGKILL again")
	}
}
