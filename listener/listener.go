// Package listener keeps a server accepting connections through accept
// errors. fasthttp's accept loop takes any error but a timeout or a closed
// listener as permanent and returns it from Serve: at the open-file limit
// (EMFILE: 1,100 slow connections against nofile=1024) the router exited
// and took every stream in flight with it. A Guarded listener never passes
// such an error on: it counts it, logs it, waits (5 ms, doubling up to 1 s,
// as net/http does) and accepts again, so what is open keeps being served
// and new connections are taken once descriptors are free again. Only a
// closed listener ends Accept.
package listener

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Backoff bounds between failed accepts.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = time.Second
	// logEvery spaces the warnings of a run of errors: at the open-file
	// limit every retry fails.
	logEvery = 10 * time.Second
)

// Guarded is a net.Listener whose Accept retries after errors.
type Guarded struct {
	net.Listener
	log    zerolog.Logger
	errors atomic.Uint64

	closed    chan struct{}
	closeOnce sync.Once

	mu      sync.Mutex // serialises the backoff state between Accept calls
	backoff time.Duration
	logged  time.Time
	unseen  uint64 // errors since the last warning
}

// Guard wraps ln. Errors are logged to log, at most one line every 10 s.
func Guard(ln net.Listener, log zerolog.Logger) *Guarded {
	return &Guarded{Listener: ln, log: log, closed: make(chan struct{})}
}

// Errors returns how many accepts have failed (a counter for /metrics).
func (g *Guarded) Errors() uint64 { return g.errors.Load() }

// Accept returns the next connection, or an error once the listener is
// closed.
func (g *Guarded) Accept() (net.Conn, error) {
	for {
		c, err := g.Listener.Accept()
		if err == nil {
			g.mu.Lock()
			g.backoff = 0
			g.mu.Unlock()
			return c, nil
		}
		if errors.Is(err, net.ErrClosed) {
			return nil, err
		}
		select {
		case <-g.closed:
			return nil, net.ErrClosed
		case <-time.After(g.failed(err)):
		}
	}
}

// failed counts err and returns how long to wait before the next accept.
func (g *Guarded) failed(err error) time.Duration {
	g.errors.Add(1)
	g.mu.Lock()
	defer g.mu.Unlock()
	g.backoff = min(max(2*g.backoff, minBackoff), maxBackoff)
	g.unseen++
	if now := time.Now(); now.Sub(g.logged) >= logEvery {
		g.log.Warn().Err(err).Str("listen", g.Addr().String()).Uint64("errors", g.unseen).Dur("retry_in", g.backoff).
			Msg("accepting connections failed; still serving those open, retrying")
		g.logged, g.unseen = now, 0
	}
	return g.backoff
}

// Close closes the listener and ends an Accept waiting to retry.
func (g *Guarded) Close() error {
	g.closeOnce.Do(func() { close(g.closed) })
	return g.Listener.Close()
}
