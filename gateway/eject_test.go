package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/enginesim"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/tokenize"
)

func TestEjectionBacksOffAndResets(t *testing.T) {
	var e ejection
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	if e.out(t0.UnixNano()) {
		t.Fatal("out before any failure")
	}
	if d := e.failed(t0); d != ejectBase {
		t.Fatalf("first ejection %v, want %v", d, ejectBase)
	}
	if !e.out(at(999*time.Millisecond).UnixNano()) || e.out(at(ejectBase).UnixNano()) {
		t.Fatal("not out for exactly the first period")
	}
	// Requests that were in flight together fail together: one ejection.
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); e.failed(at(500 * time.Millisecond)) }()
	}
	wg.Wait()
	// Failing again when back doubles the period, up to ejectMax.
	now, want := at(ejectBase), 2*ejectBase
	for range 8 {
		if d := e.failed(now); d != want {
			t.Fatalf("ejection at %v: %v, want %v", now.Sub(t0), d, want)
		}
		now = now.Add(want)
		want = min(2*want, ejectMax)
	}
	e.reached()
	if e.out(now.UnixNano()) || e.failed(now) != ejectBase {
		t.Fatal("an answer did not reset the back-off")
	}
}

// TestEjectedReplicaComesBack: the only replica refuses, is ejected, and is
// still tried while nothing else could serve; once it listens again the
// next request reaches it and it is back in routing (/admin/replicas,
// kvmesh_router_ejections_total).
func TestEjectedReplicaComesBack(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("flaky", "http://"+addr, []string{testModel})
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status < 500 {
		t.Fatalf("a refusing replica served: %d", res.status)
	}
	if res := r.get(t, "/admin/replicas"); !strings.Contains(res.body, `"ejected_ms":`) || strings.Contains(res.body, `"ejected_ms":0`) {
		t.Fatalf("not shown ejected: %s", res.body)
	}
	if !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_ejections_total{replica="flaky"} 1`) {
		t.Fatal("ejection not counted")
	}
	sim, err := enginesim.New(enginesim.Config{Model: testModel, Tokenizer: tokenize.Builtin{},
		Engine: engine.Config{BlockSize: 16, KVBlocks: 4096, MaxNumSeqs: 16, MaxNumBatchedTokens: 8192, MaxModelLen: 8192}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go sim.Run(ctx)
	ln, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("port %s taken meanwhile: %v", addr, err)
	}
	srv := &fasthttp.Server{Handler: sim.Handler}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Shutdown() })
	if res := r.post(t, "/v1/chat/completions", chatBody); res.status != 200 || res.header["x-kvmesh-replica"] != "flaky" {
		t.Fatalf("the replica back up, still ejected: %d %s", res.status, res.body)
	}
	if res := r.get(t, "/admin/replicas"); !strings.Contains(res.body, `"ejected_ms":0`) {
		t.Fatalf("still shown ejected: %s", res.body)
	}
}

func TestOnlyAnswerlessFailuresEject(t *testing.T) {
	refused := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	for _, c := range []struct {
		name string
		r    proxy.Result
		want bool
	}{
		{"refused", proxy.Result{Err: refused}, true},
		{"timed out waiting for a stream's headers", proxy.Result{Err: fasthttp.ErrTimeout}, true},
		{"non-streamed answer overran the timeout", proxy.Result{Err: fasthttp.ErrTimeout, Overran: true}, false},
		{"answered 503", proxy.Result{Status: 503}, false},
		{"client gone", proxy.Result{Err: refused, ClientGone: true}, false},
		{"router's own panic", proxy.Result{Err: refused, Internal: true}, false},
		{"router out of connections", proxy.Result{Err: fasthttp.ErrNoFreeConns}, false},
		{"router out of file descriptors", proxy.Result{Err: fmt.Errorf("dial: %w", &net.OpError{Op: "dial", Err: os.NewSyscallError("socket", syscall.EMFILE)})}, false},
		{"host out of file descriptors", proxy.Result{Err: &net.OpError{Op: "dial", Err: os.NewSyscallError("socket", syscall.ENFILE)}}, false},
	} {
		if got := unreachable(c.r); got != c.want {
			t.Errorf("%s: unreachable %v, want %v", c.name, got, c.want)
		}
	}
}

// TestEjectedReplicasDoNotMakeARouterReady: a static upstream is online by
// configuration; once this router ejected it for refusing connections, it
// no longer counts toward /ready, so load balancers stop sending requests
// that could only fail.
func TestEjectedReplicasDoNotMakeARouterReady(t *testing.T) {
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("dead", refusedURL(t), []string{testModel})
	if res := r.get(t, "/ready"); res.status != 200 {
		t.Fatalf("before any request: %d %s", res.status, res.body)
	}
	if res := r.post(t, "/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":1}`); res.status != 503 {
		t.Fatalf("request to a dead upstream: %d %s", res.status, res.body)
	}
	if res := r.get(t, "/ready"); res.status != 503 || !strings.Contains(res.body, "1 ejected") || res.header["retry-after"] == "" {
		t.Fatalf("ready with its only upstream ejected: %d %v %s", res.status, res.header, res.body)
	}
	r.table.AddStatic("alive", startEngine(t, testModel), []string{testModel})
	if res := r.get(t, "/ready"); res.status != 200 || !strings.Contains(res.body, `"ejected_replicas":1`) || !strings.Contains(res.body, `"live_replicas":1`) {
		t.Fatalf("one live, one ejected: %d %s", res.status, res.body)
	}
}
