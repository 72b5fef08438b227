package gateway

import (
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// TestClientLeavingStopsTheEngine: a client that hangs up on a long
// non-streamed request gets the engine's connection closed within a second
// (the engine then stops generating), and the router counts it.
func TestClientLeavingStopsTheEngine(t *testing.T) {
	engine, closed := workingEngine(t, "")
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("slow", engine, []string{testModel})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"sim","max_tokens":2000,"messages":[{"role":"user","content":"Write a long essay"}]}`
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	time.Sleep(300 * time.Millisecond)
	_ = c.Close()
	wantEngineStopped(t, r, closed, time.Now())
}

// TestClientLeavingAStreamBeforeItsFirstEventStopsTheEngine: engines send
// a stream's headers before queueing and prefill, so for a while the relay
// writes nothing that would fail; a client hanging up then must still get
// the engine's connection closed.
func TestClientLeavingAStreamBeforeItsFirstEventStopsTheEngine(t *testing.T) {
	// The headers at once, the first event never (a long prefill).
	engine, closed := workingEngine(t, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("prefilling", engine, []string{testModel})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"sim","stream":true,"max_tokens":20,"messages":[{"role":"user","content":"Summarise this long book"}]}`
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	head := make([]byte, 4096)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(head); err != nil || !strings.HasPrefix(string(head[:n]), "HTTP/1.1 200") {
		t.Fatalf("stream headers: %q %v", head[:n], err)
	}
	_ = c.Close()
	wantEngineStopped(t, r, closed, time.Now())
	if n := r.g.Inflight(); n != 0 {
		t.Errorf("%d requests still in flight", n)
	}
}

// workingEngine serves one request by writing head (if any) and then
// working on it for good, as an engine generating or prefilling for
// minutes; closed tells when the router closed the connection.
func workingEngine(t *testing.T, head string) (url string, closed <-chan time.Time) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	ch := make(chan time.Time, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		if _, err := c.Read(buf); err != nil {
			ch <- time.Now()
			return
		}
		_, _ = io.WriteString(c, head)
		for {
			if _, err := c.Read(buf); err != nil {
				ch <- time.Now()
				return
			}
		}
	}()
	return "http://" + ln.Addr().String(), ch
}

// wantEngineStopped checks that the engine's connection closed within a
// second of the client leaving, and that the router counted the client gone.
func wantEngineStopped(t *testing.T, r *testRouter, closed <-chan time.Time, left time.Time) {
	t.Helper()
	select {
	case at := <-closed:
		t.Logf("the engine's connection closed %v after the client left", at.Sub(left).Round(time.Millisecond))
		if d := at.Sub(left); d > time.Second {
			t.Errorf("took %v, want under a second", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the engine kept working for a client that left")
	}
	deadline := time.Now().Add(2 * time.Second)
	for !strings.Contains(r.get(t, "/metrics").body, `kvmesh_router_errors_total{type="client_gone"} 1`) {
		if time.Now().After(deadline) {
			t.Fatal("client_gone not counted")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
