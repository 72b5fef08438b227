package gossip

import (
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
)

var testKey = []byte("0123456789abcdef0123456789abcdef")

func testLog() zerolog.Logger {
	if os.Getenv("GOSSIP_TEST_LOG") != "" {
		return zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(zerolog.DebugLevel)
	}
	return zerolog.Nop()
}

func baseConfig(name string, join ...string) Config {
	return Config{Name: name, BindAddr: "127.0.0.1:0", Join: join, Key: testKey, Label: "kvmesh-test", Logger: testLog()}
}

func startTestRouter(t testing.TB, name string, join ...string) (*RouterNode, *fleet.Table) {
	t.Helper()
	tb := fleet.NewTable(fleet.TableConfig{})
	r, err := StartRouter(RouterConfig{Config: baseConfig(name, join...)}, tb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Leave(0) })
	return r, tb
}

func startTestSidecar(t testing.TB, name string, join ...string) (*SidecarNode, *bloom.Generations) {
	t.Helper()
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 4096, MaxDeltaKeys: 150}, uint64(time.Now().UnixNano()), time.Now())
	s, err := StartSidecar(SidecarConfig{Config: baseConfig(name, join...), Models: []string{"m"}, EngineURL: "http://" + name,
		Protocol: fleet.ProtocolVLLM, BlockSize: 16, Filter: g})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Leave(0) })
	return s, g
}

// waitFor polls cond every 5 ms until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

func replica(tb *fleet.Table, name string) (fleet.Replica, bool) {
	s := tb.Snapshot()
	if i := s.Find(name); i >= 0 {
		return s.Replicas[i], true
	}
	return fleet.Replica{}, false
}

func hasKey(tb *fleet.Table, name string, key uint64) bool {
	s := tb.Snapshot()
	i := s.Find(name)
	if i < 0 {
		return false
	}
	matched := make([]int, len(s.Replicas))
	s.MatchPrefix([]uint64{key}, matched)
	return matched[i] == 1
}

func TestSidecarFeedsRouterTable(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	s, g := startTestSidecar(t, "a", r.Addr())
	waitFor(t, 3*time.Second, "replica in table", func() bool { _, ok := replica(tb, "a"); return ok })

	g.Add(11)
	waitFor(t, 2*time.Second, "key 11 at router", func() bool { return hasKey(tb, "a", 11) })
	s.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 3, Running: 2, KVUsage: 0.25})
	waitFor(t, 2*time.Second, "load at router", func() bool {
		rep, _ := replica(tb, "a")
		return rep.Load.Waiting == 3 && rep.Load.Running == 2 && rep.Load.KVUsage == 0.25
	})
	rep, _ := replica(tb, "a")
	if !rep.Online || !rep.KVEvents || rep.URL != "http://a" || rep.BlockSize != 16 || rep.Models[0] != "m" {
		t.Fatalf("%+v", rep)
	}

	// Rebuild: generation 2 without key 11 replaces generation 1.
	g.Remove(11)
	g.Rebuild(time.Now(), func(yield func(uint64) bool) { yield(12) })
	waitFor(t, 2*time.Second, "generation 2", func() bool {
		rep, _ := replica(tb, "a")
		return rep.FilterGeneration == 2 && hasKey(tb, "a", 12) && !hasKey(tb, "a", 11)
	})

	// In-flight work this router reports comes back through the sidecar.
	r.ReportInflight("a", 4, 1000)
	waitFor(t, 2*time.Second, "in-flight summed at sidecar", func() bool {
		req, tok := s.Inflight()
		return req == 4 && tok == 1000
	})

	// Unhealthy engine: offline at once.
	s.SetEngineLoad(EngineLoad{Healthy: false})
	d := waitFor(t, time.Second, "offline", func() bool { rep, _ := replica(tb, "a"); return !rep.Online })
	t.Logf("unhealthy engine offline at the router after %v", d)
	if rep, _ := replica(tb, "a"); rep.Filter != nil {
		t.Fatal("offline replica kept its filter")
	}
}

func TestInflightIsSummedOverRouters(t *testing.T) {
	r1, tb1 := startTestRouter(t, "r1")
	r2, tb2 := startTestRouter(t, "r2", r1.Addr())
	r3, tb3 := startTestRouter(t, "r3", r1.Addr())
	s, _ := startTestSidecar(t, "a", r1.Addr())
	waitFor(t, 3*time.Second, "sidecar sees the routers", func() bool { return s.Routers() == 3 })
	r1.ReportInflight("a", 2, 100)
	r2.ReportInflight("a", 3, 50)
	r3.ReportInflight("a", 4, 20)
	// Each router learns the others' work; its own it counts itself.
	waitFor(t, 2*time.Second, "every router sees the other routers' in-flight", func() bool {
		a, _ := replica(tb1, "a")
		b, _ := replica(tb2, "a")
		c, _ := replica(tb3, "a")
		others := func(l fleet.Load) [2]int { return [2]int{l.OthersInflightRequests, l.OthersInflightPrefillTokens} }
		return others(a.Load) == [2]int{7, 70} && others(b.Load) == [2]int{6, 120} && others(c.Load) == [2]int{5, 150}
	})
	if req, pre := s.Inflight(); req != 9 || pre != 170 {
		t.Errorf("sidecar's sum %d requests, %d tokens; want 9, 170", req, pre)
	}
	// A router that dies takes its share with it (expired at the sidecar).
	r2.abort()
	waitFor(t, 3*time.Second, "dead router's share expired", func() bool {
		a, _ := replica(tb1, "a")
		return a.Load.OthersInflightRequests == 4
	})
}

// TestDoneIsReportedThrice: reports are datagrams, so the report that a
// router's work at a replica is done goes three times (one lost would leave
// the other routers counting that work until the sidecar expires it), then
// the router falls quiet there.
func TestDoneIsReportedThrice(t *testing.T) {
	r1, _ := startTestRouter(t, "r1")
	s, _ := startTestSidecar(t, "a", r1.Addr())
	waitFor(t, 3*time.Second, "sidecar sees the router", func() bool { return s.Routers() == 1 })
	r1.ReportInflight("a", 1, 10)
	waitFor(t, 2*time.Second, "work reported", func() bool { req, pre := s.Inflight(); return req == 1 && pre == 10 })
	sent := func() uint64 { return r1.d.stats.Sent[filterstream.KindInflight].Load() }
	before := sent()
	r1.ReportInflight("a", 0, 0)
	waitFor(t, 2*time.Second, "done reported", func() bool { req, pre := s.Inflight(); return req == 0 && pre == 0 })
	time.Sleep(10 * 2 * 50 * time.Millisecond) // ten report intervals
	after := sent()
	// A report of the work may have left between reading before and the
	// change: 3 or 4.
	if n := after - before; n < 3 || n > 4 {
		t.Fatalf("%d reports after the work ended, want 3 reports of none", n)
	}
	time.Sleep(300 * time.Millisecond)
	if n := sent() - after; n != 0 {
		t.Fatalf("%d more reports while idle", n)
	}
}

// TestOwnFinishedWorkIsNeverCounted: a router's own share never comes back
// to it in the load records, so a request it has seen finish is not counted
// again while the sidecar's sum still holds its last report (it was, for up
// to a load interval after each report, which could steer the next turn of
// a conversation away from the replica that holds its prefix).
func TestOwnFinishedWorkIsNeverCounted(t *testing.T) {
	r1, tb1 := startTestRouter(t, "r1")
	_, tb2 := startTestRouter(t, "r2", r1.Addr())
	s, _ := startTestSidecar(t, "a", r1.Addr())
	waitFor(t, 3*time.Second, "sidecar sees both routers", func() bool { return s.Routers() == 2 })
	for round := range 5 {
		r1.ReportInflight("a", 1, 800)
		waitFor(t, 2*time.Second, "r2 sees r1's request", func() bool {
			b, _ := replica(tb2, "a")
			return b.Load.OthersInflightRequests == 1 && b.Load.OthersInflightPrefillTokens == 800
		})
		r1.ReportInflight("a", 0, 0)
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
			if a, _ := replica(tb1, "a"); a.Load.OthersInflightRequests != 0 || a.Load.OthersInflightPrefillTokens != 0 {
				t.Fatalf("round %d: r1 counts its own work as another router's: %+v", round, a.Load)
			}
		}
		waitFor(t, 2*time.Second, "r2 sees it finish", func() bool {
			b, _ := replica(tb2, "a")
			return b.Load.OthersInflightRequests == 0 && b.Load.OthersInflightPrefillTokens == 0
		})
	}
}

func TestRouteClearIsClusterWide(t *testing.T) {
	r1, tb1 := startTestRouter(t, "r1")
	var cleared atomic.Int32
	tb2 := fleet.NewTable(fleet.TableConfig{})
	cfg := RouterConfig{Config: baseConfig("r2", r1.Addr()), OnClearRoutes: func([]string) { cleared.Add(1) }}
	r2, err := StartRouter(cfg, tb2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r2.Leave(0) })

	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 4096}, 5, time.Now())
	var rebuilds atomic.Int32
	sc, err := StartSidecar(SidecarConfig{Config: baseConfig("a", r1.Addr()), Protocol: fleet.ProtocolVLLM, Filter: g,
		OnClearRoutes: func() {
			rebuilds.Add(1)
			g.Rebuild(time.Now(), func(yield func(uint64) bool) { yield(21) })
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sc.Leave(0) })
	g.Add(21)
	waitFor(t, 3*time.Second, "key at both routers", func() bool { return hasKey(tb1, "a", 21) && hasKey(tb2, "a", 21) })
	waitFor(t, 3*time.Second, "r1 knows r2", func() bool { r1.mu.Lock(); defer r1.mu.Unlock(); return r1.recv.Routers() == 1 })

	r1.ClearRoutes(nil)
	if hasKey(tb1, "a", 21) {
		t.Fatal("clearing router still matches")
	}
	waitFor(t, 2*time.Second, "other router notified, sidecar rebuilt", func() bool { return cleared.Load() == 1 && rebuilds.Load() == 1 })
	waitFor(t, 2*time.Second, "fresh generation at both", func() bool {
		a, _ := replica(tb1, "a")
		b, _ := replica(tb2, "a")
		return a.FilterGeneration == 2 && b.FilterGeneration == 2 && hasKey(tb1, "a", 21) && hasKey(tb2, "a", 21)
	})
}

// TestKilledSidecarsReplicaIsAnOrphanWithinOneSecond: a sidecar killed
// (kill -9) takes its filter and load figures out of routing within a
// second; its replica stays, an orphan routed by load, also once
// memberlist declares the sidecar dead: its engine may well still serve.
func TestKilledSidecarsReplicaIsAnOrphanWithinOneSecond(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	s, g := startTestSidecar(t, "a", r.Addr())
	g.Add(5)
	s.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 3})
	waitFor(t, 3*time.Second, "key at router", func() bool { return hasKey(tb, "a", 5) })
	s.crash() // no leave message, no last load record (as kill -9)
	killed := time.Now()
	waitFor(t, time.Second, "orphan", func() bool { rep, _ := replica(tb, "a"); return rep.Orphan })
	d := time.Since(killed)
	if rep, _ := replica(tb, "a"); !rep.Online || hasKey(tb, "a", 5) || rep.Load.Waiting != 0 {
		t.Fatalf("orphan: %+v", rep)
	}
	t.Logf("killed sidecar's filter out of routing after %v", d)
	waitFor(t, 10*time.Second, "sidecar declared dead", func() bool { return r.Members() == 1 })
	if rep, ok := replica(tb, "a"); !ok || !rep.Online || !rep.Orphan {
		t.Fatalf("after memberlist's verdict: %+v (listed %v)", rep, ok)
	}
}

// TestSidecarLeavingTakesItsReplicaOut: a sidecar that leaves on purpose
// (a drain) takes its replica out of routing at once (that a lost copy of
// its leaving record does not change this, filterstream's tests show).
func TestSidecarLeavingTakesItsReplicaOut(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	s, _ := startTestSidecar(t, "a", r.Addr())
	s.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 3})
	waitFor(t, 3*time.Second, "replica", func() bool { rep, _ := replica(tb, "a"); return rep.Online && rep.Load.Waiting == 3 })
	if err := s.Leave(time.Second); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Second, "replica removed", func() bool { _, ok := replica(tb, "a"); return !ok })
}

func TestWrongKeyOrLabelIsRejectedAndCounted(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	// A sidecar with the wrong key, then one with the wrong label.
	for _, c := range []struct {
		name  string
		key   []byte
		label string
	}{{"badkey", []byte("ffffffffffffffffffffffffffffffff"), "kvmesh-test"}, {"badlabel", testKey, "other"}} {
		cfg := SidecarConfig{Config: Config{Name: c.name, BindAddr: "127.0.0.1:0", Key: c.key, Label: c.label, Logger: testLog()}}
		s, err := StartSidecar(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.ml.Join([]string{r.Addr()}); err == nil {
			t.Errorf("%s: join succeeded", c.name)
		}
		_ = s.Leave(0)
	}
	// Garbage datagrams straight at the router's port.
	conn, err := net.Dial("udp", r.Addr())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		_, _ = conn.Write([]byte(fmt.Sprintf("garbage %d %s", i, base64.StdEncoding.EncodeToString(testKey[:i]))))
	}
	conn.Close()
	waitFor(t, 2*time.Second, "rejections counted", func() bool {
		st := r.Stats()
		return st.RejectedDecrypt > 0 && st.RejectedLabel >= 20
	})
	st := r.Stats()
	t.Logf("rejected: label %d, decrypt %d, malformed %d", st.RejectedLabel, st.RejectedDecrypt, st.RejectedMalformed)
	if _, ok := replica(tb, "badkey"); ok {
		t.Fatal("wrong-key sidecar got into the table")
	}
	// Still healthy: a good sidecar joins and is fed.
	_, g := startTestSidecar(t, "good", r.Addr())
	g.Add(9)
	waitFor(t, 3*time.Second, "good sidecar fed", func() bool { return hasKey(tb, "good", 9) })
}

func TestParseKey(t *testing.T) {
	for _, n := range []int{16, 24, 32} {
		k, err := ParseKey(base64.StdEncoding.EncodeToString(make([]byte, n)))
		if err != nil || len(k) != n {
			t.Fatal(n, err)
		}
	}
	for _, s := range []string{"!!", base64.StdEncoding.EncodeToString(make([]byte, 20))} {
		if _, err := ParseKey(s); err == nil {
			t.Fatalf("%q accepted", s)
		}
	}
	if k, err := ParseKey(""); k != nil || err != nil {
		t.Fatal("empty key")
	}
}

// abort stops the member without a word to the cluster, as a crash would.
func (n *node) abort() {
	if !n.down.Swap(true) {
		close(n.quit)
		_ = n.ml.Shutdown()
	}
}

// crash stops a sidecar as kill -9 would: no last load record, no leave.
func (s *SidecarNode) crash() {
	s.abort() // first, so the loop's final load record cannot get out
	s.stopLoops()
}

// TestLoadOnlySidecarRestartedUnderItsNameIsHeard: a load-only sidecar (no
// KV events) restarts under the same name and address before the router
// declares it dead, as a restarted container does. Its load sequence starts
// again at 1, far below the old process's; its records must still count.
func TestLoadOnlySidecarRestartedUnderItsNameIsHeard(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	start := func(addr string, every time.Duration) *SidecarNode {
		cfg := baseConfig("a", r.Addr())
		if addr != "" {
			cfg.BindAddr = addr
		}
		s, err := StartSidecar(SidecarConfig{Config: cfg, Models: []string{"m"}, EngineURL: "http://a",
			Protocol: fleet.ProtocolVLLM, BlockSize: 16, LoadInterval: every})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	s1 := start("", 5*time.Millisecond) // runs its sequence up fast
	s1.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 1})
	waitFor(t, 3*time.Second, "waiting 1", func() bool { rep, ok := replica(tb, "a"); return ok && rep.Load.Waiting == 1 })
	time.Sleep(500 * time.Millisecond) // ~100 load records
	addr := s1.Addr()
	s1.crash()
	s2 := start(addr, 0)
	t.Cleanup(func() { _ = s2.Leave(0) })
	s2.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 7})
	waitFor(t, 2*time.Second, "restarted sidecar's load", func() bool {
		rep, ok := replica(tb, "a")
		return ok && rep.Online && rep.Load.Waiting == 7
	})
}

func TestSidecarJoinsRouterThatStartsLater(t *testing.T) {
	// Reserve the router's address, point the sidecar at it, then start the router there.
	probe, err := StartRouter(RouterConfig{Config: baseConfig("probe")}, fleet.NewTable(fleet.TableConfig{}))
	if err != nil {
		t.Fatal(err)
	}
	addr := probe.Addr()
	_ = probe.Leave(0)
	_, g := startTestSidecar(t, "a", addr)
	time.Sleep(300 * time.Millisecond)
	tb := fleet.NewTable(fleet.TableConfig{})
	cfg := baseConfig("r1")
	cfg.BindAddr = addr
	r, err := StartRouter(RouterConfig{Config: cfg}, tb)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Leave(0) })
	g.Add(3)
	waitFor(t, 5*time.Second, "late router fed", func() bool { return hasKey(tb, "a", 3) })
}

// The largest filter filterstream.MaxFilterPayload allows, from a sidecar with the
// longest name, still reaches a router over the encrypted, labelled stream.
func TestLargestFilterReachesRouter(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	name := strings.Repeat("n", 200)
	capacity := bloom.MaxCapacity(0.01, filterstream.MaxFilterPayload)
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: capacity}, 1, time.Now())
	if size := bloom.SnapshotSize(g.Stats().M); size > filterstream.MaxFilterPayload || size < filterstream.MaxFilterPayload-1<<16 {
		t.Fatalf("snapshot of %d bytes for capacity %d, limit %d", size, capacity, filterstream.MaxFilterPayload)
	}
	s, err := StartSidecar(SidecarConfig{Config: baseConfig(name, r.Addr()), Models: []string{"m"}, EngineURL: "http://a",
		Protocol: fleet.ProtocolVLLM, BlockSize: 16, Filter: g})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Leave(0) })
	g.Add(11)
	waitFor(t, 10*time.Second, "key of the largest filter at router", func() bool { return hasKey(tb, name, 11) })
	t.Logf("capacity %d at fpr 0.01: snapshot of %d bytes delivered", capacity, bloom.SnapshotSize(g.Stats().M))
}

// TestTenantUsageReachesTheOtherRouters: a router's per-tenant report
// arrives at every other router, named by its sender.
func TestTenantUsageReachesTheOtherRouters(t *testing.T) {
	r1, _ := startTestRouter(t, "r1")
	type report struct {
		from  string
		usage []filterstream.TenantUsage
	}
	got := make(chan report, 64)
	cfg := RouterConfig{Config: baseConfig("r2", r1.Addr()), OnTenantUsage: func(from string, u []filterstream.TenantUsage) {
		select {
		case got <- report{from, u}:
		default:
		}
	}}
	r2, err := StartRouter(cfg, fleet.NewTable(fleet.TableConfig{}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r2.Leave(0) })
	waitFor(t, 3*time.Second, "r1 knows r2", func() bool { r1.mu.Lock(); defer r1.mu.Unlock(); return r1.recv.Routers() == 1 })
	want := []filterstream.TenantUsage{{Tenant: "search", Requests: 7, Tokens: 7000, ReservedTokens: 100}}
	deadline := time.After(3 * time.Second)
	for {
		r1.ShareTenantUsage(want) // datagrams: sent each interval in use
		select {
		case rep := <-got:
			if rep.from != "router/r1" || len(rep.usage) != 1 || rep.usage[0] != want[0] {
				t.Fatalf("r2 got %+v", rep)
			}
			return
		case <-time.After(100 * time.Millisecond):
		case <-deadline:
			t.Fatalf("no report reached r2: received %v", r2.Stats().Received)
		}
	}
}
