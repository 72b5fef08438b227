package sidecar

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/blockkey"
	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/tokenize"
)

func testLog() zerolog.Logger {
	if os.Getenv("SIDECAR_TEST_LOG") != "" {
		return zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(zerolog.DebugLevel)
	}
	return zerolog.Nop()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startEngine serves an enginesim on loopback; events go to sink (nil: none).
func startEngine(t *testing.T, sink engine.EventSink) (url string, stop func()) {
	t.Helper()
	return startEngineWithKey(t, sink, "")
}

// startEngineWithKey is startEngine for an engine whose /v1 calls need
// apiKey, as vllm serve --api-key.
func startEngineWithKey(t *testing.T, sink engine.EventSink, apiKey string) (url string, stop func()) {
	t.Helper()
	srv, err := enginesim.New(enginesim.Config{
		Model: "sim", Tokenizer: tokenize.Builtin{}, TimeScale: 0, APIKey: apiKey,
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 16, MaxNumBatchedTokens: 2048, MaxModelLen: 4096}, Events: sink, Logger: testLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Run(ctx); close(done) }()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &fasthttp.Server{Handler: srv.Handler, CloseOnShutdown: true}
	go func() { _ = hs.Serve(l) }()
	var once bool
	stop = func() {
		if once {
			return
		}
		once = true
		_ = hs.Shutdown()
		cancel()
		<-done
	}
	t.Cleanup(stop)
	return "http://" + l.Addr().String(), stop
}

type running struct {
	s    *Sidecar
	stop func()
	err  chan error
}

func startSidecar(t *testing.T, cfg Config) *running {
	t.Helper()
	cfg.Logger = testLog()
	cfg.ScrapeInterval = 50 * time.Millisecond
	if cfg.Gossip.BindAddr == "" {
		cfg.Gossip.BindAddr = "127.0.0.1:0"
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{s: s, err: make(chan error, 1)}
	go func() { r.err <- s.Run(ctx) }()
	var stopped bool
	r.stop = func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-r.err; err != nil {
				t.Errorf("sidecar Run: %v", err)
			}
		}
	}
	t.Cleanup(r.stop)
	return r
}

// settle bounds waits for sockets and gossip to converge. It is generous: a
// healthy run converges in well under a second, but ZMQ's slow joiner and
// memberlist under a -race build sharing two cores with other packages'
// tests once took over 5 s (TestEngineRestartRebuildsSet in CI).
const settle = 15 * time.Second

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// chain builds a BlockStored event for blocks of tokens continuing parent
// (engine hashes are arbitrary, as a real engine's are) and returns the
// kvmesh keys those blocks must get.
func chain(hashBase uint64, parent *uint64, parentKey uint64, tokens []uint32, bs int) (kvevents.Event, []uint64) {
	n := len(tokens) / bs
	ev := kvevents.Event{Kind: kvevents.KindBlockStored, TokenIDs: tokens, BlockSize: bs}
	for i := range n {
		ev.BlockHashes = append(ev.BlockHashes, hashBase+uint64(i))
	}
	if parent != nil {
		ev.ParentHash, ev.HasParent = *parent, true
	}
	return ev, blockkey.Append(nil, parentKey, tokens, bs)
}

func tokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

func status(t *testing.T, addr string) Status {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

func residentKeys(s *Sidecar) map[uint64]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[uint64]bool{}
	for _, k := range s.set.AppendKeys(nil) {
		out[k] = true
	}
	return out
}

// TestEngineBlocksReachRouter runs enginesim + sidecar + router: a
// completion stores blocks at the engine, and the router's table holds every
// resident key with the sidecar's generation and key count.
func TestEngineBlocksReachRouter(t *testing.T) {
	zmqAddr := freeAddr(t)
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + zmqAddr, ReplayEndpoint: "tcp://127.0.0.1:0", Logger: testLog()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	url, _ := startEngine(t, pub)

	tb := fleet.NewTable(fleet.TableConfig{})
	router, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: testLog()}}, tb)
	if err != nil {
		t.Fatal(err)
	}
	defer router.Leave(0)

	listen := freeAddr(t)
	sc := startSidecar(t, Config{Name: "e1", EngineURL: url, KVEventsBind: "tcp://" + zmqAddr, KVReplay: pub.ReplayEndpoint(),
		Listen: listen, Gossip: gossip.Config{Join: []string{router.Addr()}}})
	waitFor(t, settle, "sidecar up", func() bool {
		_, err := http.Get("http://" + listen + "/health")
		return err == nil
	})
	waitFor(t, settle, "replica online at router", func() bool {
		s := tb.Snapshot()
		i := s.Find("e1")
		return i >= 0 && s.Replicas[i].Online && len(s.Replicas[i].Models) == 1 && s.Replicas[i].Models[0] == "sim"
	})
	// Before any KV event the router knows the block size from the
	// engine's cache configuration (its /metrics): the first filter with
	// keys is usable at once, not only after a later metadata broadcast.
	if s := tb.Snapshot(); s.Replicas[s.Find("e1")].BlockSize != 16 {
		t.Fatalf("block size %d at the router before any KV event, want the engine's 16", s.Replicas[s.Find("e1")].BlockSize)
	}

	// The engine's PUB dials the sidecar in the background; a batch
	// published before it is connected is lost (as with vLLM), and the next
	// one's sequence gap is filled from the replay ring.
	for i := 0; status(t, listen).ResidentBlocks == 0; i++ {
		if i == 50 {
			t.Fatalf("no blocks resident after %d completions; publisher %+v", i, pub.Stats())
		}
		prompt := strings.Repeat(fmt.Sprintf("request %d: the quick brown fox jumps over the lazy dog ", i), 10)
		resp, err := http.Post(url+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":4}`, prompt)))
		if err != nil {
			t.Fatal(err)
		}
		cbody, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("completion: %s %s", resp.Status, cbody)
		}
		time.Sleep(100 * time.Millisecond)
	}
	waitFor(t, settle, "router agrees with sidecar", func() bool {
		st := status(t, listen)
		s := tb.Snapshot()
		i := s.Find("e1")
		return i >= 0 && s.Replicas[i].FilterGeneration == st.FilterGeneration && s.Replicas[i].FilterKeys == st.FilterKeys &&
			st.FilterKeys >= st.ResidentBlocks && s.Replicas[i].BlockSize == 16
	})
	keys := residentKeys(sc.s)
	s := tb.Snapshot()
	i := s.Find("e1")
	matched := make([]int, len(s.Replicas))
	for k := range keys {
		s.MatchPrefix([]uint64{k}, matched)
		if matched[i] != 1 {
			t.Fatalf("resident key %x not in the router's filter", k)
		}
	}
	st := status(t, listen)
	if st.Name != "e1" || st.Model != "sim" || st.BlockSize != 16 || !st.EngineHealthy || st.OrphanBlocks != 0 || st.EventsReceived == 0 {
		t.Fatalf("status %+v", st)
	}
	t.Logf("%d resident blocks, generation %d, visible at the router", len(keys), st.FilterGeneration)

	// /metrics speaks Prometheus.
	mresp, err := http.Get("http://" + listen + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if !strings.Contains(string(body), "kvmesh_sidecar_resident_blocks ") {
		t.Fatalf("metrics:\n%s", body)
	}

	// SIGTERM path: the sidecar leaves and the router drops it at once.
	sc.stop()
	waitFor(t, 2*time.Second, "replica gone", func() bool {
		s := tb.Snapshot()
		i := s.Find("e1")
		return i < 0 || !s.Replicas[i].Online
	})
}

// TestEngineRestartRebuildsSet: a publisher that starts over at sequence 0
// is an engine restart: the set is cleared, counted, and rebuilt from the new
// stream under a new filter epoch.
func TestEngineRestartRebuildsSet(t *testing.T) {
	url, _ := startEngine(t, nil)
	zmqAddr := freeAddr(t)
	sc := startSidecar(t, Config{Name: "e1", EngineURL: url, KVEventsBind: "tcp://" + zmqAddr})
	publish := func(p *kvevents.Publisher, evs ...kvevents.Event) {
		if err := p.Publish(&kvevents.Batch{Events: evs, DPRank: -1}); err != nil {
			t.Fatal(err)
		}
	}
	connect := func() *kvevents.Publisher {
		p, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + zmqAddr, Logger: testLog()})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	p1 := connect()
	evA, keysA := chain(100, nil, blockkey.Seed("", ""), tokens(0, 64), 16)
	waitFor(t, settle, "first batch", func() bool {
		publish(p1, evA) // repeated until the slow joiner sees one; stores are reference counted
		time.Sleep(20 * time.Millisecond)
		return len(residentKeys(sc.s)) == len(keysA)
	})
	epoch1, gen1 := sc.s.Status().FilterEpoch, sc.s.Status().FilterGeneration
	p1.Close()

	p2 := connect()
	defer p2.Close()
	evB, keysB := chain(900, nil, blockkey.Seed("", ""), tokens(5000, 32), 16)
	waitFor(t, settle, "restart detected and set rebuilt", func() bool {
		publish(p2, evB)
		time.Sleep(20 * time.Millisecond)
		st := sc.s.Status()
		return st.EngineResets >= 1 && st.ResidentBlocks == len(keysB)
	})
	got := residentKeys(sc.s)
	for _, k := range keysA {
		if got[k] {
			t.Fatal("block from before the restart still resident")
		}
	}
	for _, k := range keysB {
		if !got[k] {
			t.Fatal("block after the restart missing")
		}
	}
	st := sc.s.Status()
	if st.FilterEpoch == epoch1 {
		t.Fatal("filter epoch unchanged after engine restart")
	}
	if st.FilterGeneration <= gen1 {
		t.Fatalf("filter generation went from %d to %d: operators must see it grow across a restart", gen1, st.FilterGeneration)
	}
	t.Logf("engine restart: resets=%d reasons=%q resident=%d", st.EngineResets, st.ResetReasons, st.ResidentBlocks)
}

// TestSequenceGapNeverGuesses: batches published before the sidecar
// listened are lost. With replay they are recovered exactly; without it,
// blocks whose parents were lost are counted as orphans, never keyed.
func TestSequenceGapNeverGuesses(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		t.Run(fmt.Sprint("replay=", withReplay), func(t *testing.T) {
			url, _ := startEngine(t, nil)
			endpoint := "ipc://" + t.TempDir() + "/kv.sock" // bound by the publisher, as vLLM's tcp://*:5557
			cfg := kvevents.PublisherConfig{Endpoint: endpoint, Logger: testLog()}
			if withReplay {
				cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
			}
			p, err := kvevents.NewPublisher(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			// Batches 0..1 go nowhere: nobody listens yet.
			root, rootKeys := chain(10, nil, blockkey.Seed("", ""), tokens(0, 32), 16)
			last := uint64(11)
			mid, midKeys := chain(20, &last, rootKeys[1], tokens(32, 32), 16)
			for _, ev := range []kvevents.Event{root, mid} {
				if err := p.Publish(&kvevents.Batch{Events: []kvevents.Event{ev}, DPRank: -1}); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 2*time.Second, "lost batches sent", func() bool { return p.Stats().Sent >= 2 })

			sccfg := Config{Name: "e1", EngineURL: url, KVEvents: endpoint}
			if withReplay {
				sccfg.KVReplay = p.ReplayEndpoint()
			}
			sc := startSidecar(t, sccfg)
			lastMid := uint64(21)
			tail, tailKeys := chain(30, &lastMid, midKeys[1], tokens(64, 16), 16)
			truth := map[uint64]bool{}
			for _, ks := range [][]uint64{rootKeys, midKeys, tailKeys} {
				for _, k := range ks {
					truth[k] = true
				}
			}
			waitFor(t, settle, "tail delivered", func() bool {
				_ = p.Publish(&kvevents.Batch{Events: []kvevents.Event{tail}, DPRank: -1})
				time.Sleep(30 * time.Millisecond)
				st := sc.s.Status()
				return st.ResidentBlocks > 0 || st.OrphanBlocks > 0
			})
			got := residentKeys(sc.s)
			for k := range got {
				if !truth[k] {
					t.Fatalf("key %x resident but never stored", k)
				}
			}
			st := sc.s.Status()
			if withReplay {
				if len(got) != len(truth) || st.OrphanBlocks != 0 || st.Replayed < 2 {
					t.Fatalf("replay: %d/%d keys, %d orphans, %d replayed", len(got), len(truth), st.OrphanBlocks, st.Replayed)
				}
			} else if len(got) != 0 || st.OrphanBlocks == 0 {
				t.Fatalf("no replay: %d keys resident, %d orphans", len(got), st.OrphanBlocks)
			}
			t.Logf("replay=%v: resident %d, orphans %d, replayed %d, resets %d", withReplay, st.ResidentBlocks, st.OrphanBlocks, st.Replayed, st.EngineResets)
		})
	}
}

// TestGarbageOnEventSocketIsSkipped: malformed frames and undecodable
// payloads are counted; valid batches around them still apply.
func TestGarbageOnEventSocketIsSkipped(t *testing.T) {
	url, _ := startEngine(t, nil)
	zmqAddr := freeAddr(t)
	sc := startSidecar(t, Config{Name: "e1", EngineURL: url, KVEventsBind: "tcp://" + zmqAddr})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	waitFor(t, settle, "raw publisher connected", func() bool { return pub.Dial("tcp://"+zmqAddr) == nil })

	seq := func(n uint64) []byte {
		b := make([]byte, 8)
		for i := range 8 {
			b[7-i] = byte(n >> (8 * i))
		}
		return b
	}
	ev, keys := chain(1, nil, blockkey.Seed("", ""), tokens(0, 32), 16)
	good := kvevents.AppendBatch(nil, &kvevents.Batch{Events: []kvevents.Event{ev}, DPRank: -1}, kvevents.FormatVLLMArray)
	waitFor(t, settle, "garbage counted, good batch applied", func() bool {
		_ = pub.Send(zmq4.NewMsgFrom([]byte("topic"), []byte{1, 2, 3}, []byte("x")))         // bad sequence frame
		_ = pub.Send(zmq4.NewMsgFrom([]byte("only one frame")))                              // bad frame count
		_ = pub.Send(zmq4.NewMsgFrom([]byte(""), seq(0), []byte("\xc1 not msgpack at all"))) // undecodable payload
		_ = pub.Send(zmq4.NewMsgFrom([]byte(""), seq(1), good))
		time.Sleep(20 * time.Millisecond)
		st := sc.s.Status()
		return st.Malformed >= 2 && st.DecodeErrors >= 1 && st.ResidentBlocks == len(keys)
	})
	st := sc.s.Status()
	if !st.EngineHealthy {
		t.Fatal("sidecar unhealthy after garbage")
	}
	t.Logf("garbage: malformed %d, decode errors %d, resident %d", st.Malformed, st.DecodeErrors, st.ResidentBlocks)
}

func TestUnhealthyEngineIsAnnouncedOffline(t *testing.T) {
	url, stopEngine := startEngine(t, nil)
	tb := fleet.NewTable(fleet.TableConfig{})
	router, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: testLog()}}, tb)
	if err != nil {
		t.Fatal(err)
	}
	defer router.Leave(0)
	startSidecar(t, Config{Name: "e1", EngineURL: url, Gossip: gossip.Config{Join: []string{router.Addr()}}})
	online := func() bool {
		s := tb.Snapshot()
		i := s.Find("e1")
		return i >= 0 && s.Replicas[i].Online
	}
	waitFor(t, settle, "online", online)
	if s := tb.Snapshot(); s.Replicas[s.Find("e1")].KVEvents {
		t.Fatal("a sidecar without KV events announced a filter")
	}
	stopEngine()
	start := time.Now()
	waitFor(t, 2*time.Second, "offline", func() bool { return !online() })
	t.Logf("engine down → offline at the router in %v", time.Since(start))
}

func TestParseLoRAIDs(t *testing.T) {
	got, err := ParseLoRAIDs(" sql-lora=1, chat=2 ,")
	if err != nil || len(got) != 2 || got[1] != "sql-lora" || got[2] != "chat" {
		t.Fatalf("got %v, %v", got, err)
	}
	for _, bad := range []string{"sql-lora", "=3", "x=0", "x=y", "a=1,b=1"} {
		if _, err := ParseLoRAIDs(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestEngineAPIKey: an engine started with an API key refuses /v1/models;
// the sidecar given the key learns the model and announces it, one without
// it announces none.
func TestEngineAPIKey(t *testing.T) {
	url, _ := startEngineWithKey(t, nil, "engine-secret")
	tb := fleet.NewTable(fleet.TableConfig{})
	router, err := gossip.StartRouter(gossip.RouterConfig{Config: gossip.Config{Name: "r1", BindAddr: "127.0.0.1:0", Logger: testLog()}}, tb)
	if err != nil {
		t.Fatal(err)
	}
	defer router.Leave(0)
	join := gossip.Config{Join: []string{router.Addr()}}
	startSidecar(t, Config{Name: "with-key", EngineURL: url, EngineAPIKey: "engine-secret", Gossip: join})
	startSidecar(t, Config{Name: "without-key", EngineURL: url, Gossip: join})
	models := func(name string) []string {
		s := tb.Snapshot()
		if i := s.Find(name); i >= 0 {
			return s.Replicas[i].Models
		}
		return nil
	}
	waitFor(t, settle, "the keyed sidecar's models", func() bool { return slices.Equal(models("with-key"), []string{"sim"}) })
	waitFor(t, settle, "the other sidecar to join", func() bool { return tb.Snapshot().Find("without-key") >= 0 })
	if m := models("without-key"); len(m) != 0 {
		t.Errorf("a sidecar without the key announced models %v", m)
	}
}

// TestRefusedModelsLogOncePerMinute: a sidecar missing the engine's key is
// refused /v1/models at every scrape (20 a second here); it says so once a
// minute, not every time.
func TestRefusedModelsLogOncePerMinute(t *testing.T) {
	url, _ := startEngineWithKey(t, nil, "engine-secret")
	var out lockedBuffer
	s, err := New(Config{Name: "without-key", EngineURL: url, Logger: zerolog.New(&out), ScrapeInterval: 50 * time.Millisecond,
		Gossip: gossip.Config{BindAddr: "127.0.0.1:0"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	time.Sleep(time.Second)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out.String(), "engine refuses to list its models"); n != 1 {
		t.Fatalf("%d refusal lines in a second, want 1:\n%s", n, out.String())
	}
	if !strings.Contains(out.String(), "--engine-api-key") {
		t.Errorf("the refusal does not say which flag to look at:\n%s", out.String())
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSlowMetricsKeepTheirCadence: an engine that takes 100 ms to render
// /metrics is still read every interval (a stale queue misroutes; spacing
// reads out was tried and reverted), and the read time shows in /status.
func TestSlowMetricsKeepTheirCadence(t *testing.T) {
	srv, err := enginesim.New(enginesim.Config{
		Model: "sim", Tokenizer: tokenize.Builtin{},
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 16, MaxNumBatchedTokens: 2048, MaxModelLen: 4096}, Logger: testLog(),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go srv.Run(ctx)
	var metricsReads, healthChecks atomic.Int32
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &fasthttp.Server{Handler: func(c *fasthttp.RequestCtx) {
		switch string(c.Path()) {
		case "/metrics":
			metricsReads.Add(1)
			time.Sleep(100 * time.Millisecond)
		case "/health":
			healthChecks.Add(1)
		}
		srv.Handler(c)
	}}
	go func() { _ = hs.Serve(l) }()
	defer func() { _ = hs.Shutdown() }()
	statusAddr := freeAddr(t)
	startSidecar(t, Config{Name: "e1", EngineURL: "http://" + l.Addr().String(), Listen: statusAddr}) // 50 ms interval
	time.Sleep(1500 * time.Millisecond)
	reads, checks := metricsReads.Load(), healthChecks.Load()
	t.Logf("in 1.5 s: %d /metrics reads, %d /health checks", reads, checks)
	if reads < 8 || checks < 8 {
		t.Errorf("%d /metrics reads and %d /health checks in 1.5 s, want one each per interval the reads allow (≥ 8)", reads, checks)
	}
	if st := status(t, statusAddr); st.MetricsReadMS < 100 {
		t.Errorf("metrics_read_ms %v, want ≥ 100", st.MetricsReadMS)
	}
}

// A peer on the bind port that greets and then declares a 2^50-byte frame
// is dropped and counted in /metrics; a publisher after it is served.
func TestOversizedEventPeerIsDroppedAndCounted(t *testing.T) {
	url, _ := startEngine(t, nil)
	zmqAddr := freeAddr(t)
	sc := startSidecar(t, Config{Name: "e1", EngineURL: url, KVEventsBind: "tcp://" + zmqAddr})
	var raw net.Conn
	waitFor(t, settle, "bind port up", func() bool {
		c, err := net.Dial("tcp", zmqAddr)
		raw = c
		return err == nil
	})
	defer raw.Close()
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
	copy(greeting[12:], "NULL")
	huge := []byte{0x02, 0, 4, 0, 0, 0, 0, 0, 0} // 2^50 bytes
	if _, err := raw.Write(append(greeting, huge...)); err != nil {
		t.Fatal(err)
	}
	_ = raw.SetReadDeadline(time.Now().Add(settle))
	if _, err := io.Copy(io.Discard, raw); err != nil {
		t.Fatalf("oversized peer not dropped: %v", err)
	}
	rec := httptest.NewRecorder()
	sc.s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if !strings.Contains(rec.Body.String(), "kvmesh_sidecar_event_oversized_total 1\n") {
		t.Fatalf("metrics:\n%s", rec.Body.String())
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	waitFor(t, settle, "publisher connected", func() bool { return pub.Dial("tcp://"+zmqAddr) == nil })
	ev, keys := chain(1, nil, blockkey.Seed("", ""), tokens(0, 32), 16)
	good := kvevents.AppendBatch(nil, &kvevents.Batch{Events: []kvevents.Event{ev}, DPRank: -1}, kvevents.FormatVLLMArray)
	waitFor(t, settle, "batch applied", func() bool {
		_ = pub.Send(zmq4.NewMsgFrom([]byte(""), make([]byte, 8), good))
		time.Sleep(20 * time.Millisecond)
		return sc.s.Status().ResidentBlocks == len(keys)
	})
	if st := sc.s.Status(); st.EventOversized != 1 || st.EventHandshakeFailures != 0 {
		t.Fatalf("status %+v", st)
	}
}
