package listener

import (
	"errors"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"
)

// failing fails its first n accepts with EMFILE, as the kernel does at the
// open-file limit, then accepts from the real listener.
type failing struct {
	net.Listener
	mu sync.Mutex
	n  int
}

func (f *failing) Accept() (net.Conn, error) {
	f.mu.Lock()
	if f.n > 0 {
		f.n--
		f.mu.Unlock()
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: f.Addr(), Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	f.mu.Unlock()
	return f.Listener.Accept()
}

func loopback(t *testing.T) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// TestServesOnAfterAcceptErrors: a fasthttp server whose accepts fail with
// EMFILE keeps running (unguarded, Serve returned the error: the router
// exited) and serves once they succeed again; every failure is counted.
func TestServesOnAfterAcceptErrors(t *testing.T) {
	const n = 6
	ok := func(ctx *fasthttp.RequestCtx) { ctx.SetBodyString("ok") }
	bare := loopback(t)
	defer bare.Close()
	unguarded := make(chan error, 1)
	go func() { unguarded <- (&fasthttp.Server{Handler: ok}).Serve(&failing{Listener: bare, n: 1}) }()
	select {
	case err := <-unguarded:
		if !errors.Is(err, syscall.EMFILE) {
			t.Fatalf("unguarded Serve ended with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the unguarded server survived EMFILE: the guard is no longer needed?")
	}

	inner := loopback(t)
	srv := &fasthttp.Server{Handler: ok}
	g := Guard(&failing{Listener: inner, n: n}, zerolog.Nop())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(g) }()
	start := time.Now()
	status, body, err := fasthttp.GetTimeout(nil, "http://"+inner.Addr().String()+"/", 5*time.Second)
	if err != nil || status != 200 || string(body) != "ok" {
		t.Fatalf("after %d accept errors: %d %q %v", n, status, body, err)
	}
	// 5+10+20+40+80+160 ms of backoff.
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("served after %v: the accepts did not back off", d)
	}
	if got := g.Errors(); got != n {
		t.Errorf("Errors() = %d, want %d", got, n)
	}
	if err := srv.Shutdown(); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve after Shutdown: %v", err)
	}
}

// TestCloseEndsTheBackoff: closing the listener ends an Accept that is
// waiting to retry at once, with the error a closed listener gives.
func TestCloseEndsTheBackoff(t *testing.T) {
	g := Guard(&failing{Listener: loopback(t), n: 1 << 30}, zerolog.Nop())
	done := make(chan error, 1)
	go func() { _, err := g.Accept(); done <- err }()
	for g.Errors() < 8 { // waiting a second now
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v", err)
		}
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Errorf("Accept returned %v after Close", d)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Accept still waiting after Close")
	}
}
