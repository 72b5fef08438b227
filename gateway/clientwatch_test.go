package gateway

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

// TestClientLeavingStopsTheEngine: a client that hangs up on a long
// non-streamed request gets the engine's connection closed within a second
// (the engine then stops generating), and the router counts it.
func TestClientLeavingStopsTheEngine(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	closed := make(chan time.Time, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		for { // an engine generating for minutes, noticing a close
			if _, err := c.Read(buf); err != nil {
				closed <- time.Now()
				return
			}
		}
	}()
	r := newRouter(t, Settings{}, 1<<20)
	r.table.AddStatic("slow", "http://"+ln.Addr().String(), []string{testModel})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"sim","max_tokens":2000,"messages":[{"role":"user","content":"Write a long essay"}]}`
	fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	time.Sleep(300 * time.Millisecond)
	_ = c.Close()
	left := time.Now()
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
