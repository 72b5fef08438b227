package kvevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
	"github.com/rs/zerolog"
)

// Every tcp:// socket of this package reaches the network through
// guardedTransport, so that no one peer can kill or starve the process
// through go-zeromq, which on its own
//   - allocates whatever size a frame header declares (2^40 bytes: out of
//     memory; 2^63 and more: a makeslice panic), and
//   - runs each handshake inline in its accept loop without a deadline, so
//     one connection that never greets blocks every later peer.
// The guard bounds each message by its frame headers before go-zeromq sees
// them, and on a listening socket takes each new connection through the
// peer's part of the handshake in a goroutine of its own, under a deadline,
// handing go-zeromq only connections whose handshake is already read.
// ipc:// is left alone: its peers are local, picked by the socket file's
// permissions (and go-zeromq removes the file only for ipc:// endpoints).

const (
	// DefaultMaxMessageBytes bounds one message from a peer. A KV event
	// batch is one engine step, and with vLLM's chunked prefill a step
	// stores at most max_num_batched_tokens tokens (8192 by default) of
	// new blocks and evicts about as many: encoded, 50 KB for 8192 tokens,
	// 6.4 MB for 2^20 (8-byte hashes; vLLM's 32-byte sha256 ones add 3 MB).
	// 16 MiB holds a step of over 1.5 million tokens.
	DefaultMaxMessageBytes = 16 << 20
	// DefaultHandshakeTimeout bounds the ZMTP handshake of one connection;
	// a publisher on the same host or network greets in milliseconds.
	DefaultHandshakeTimeout = 5 * time.Second

	// minMessageBytes keeps the limit above any handshake command.
	minMessageBytes = 4 << 10
	// maxMessageBytes keeps the frameReader's sums far from overflowing.
	maxMessageBytes = 1 << 40
)

// guardScheme is the transport that tcp:// endpoints are given to go-zeromq
// as; go-zeromq's transports are global and "tcp" is its own.
const guardScheme = "kvmesh-tcp"

func init() {
	if err := zmq4.RegisterTransport(guardScheme, guardedTransport{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

// guarded is endpoint as given to go-zeromq.
func guarded(endpoint string) string {
	if rest, ok := strings.CutPrefix(endpoint, "tcp://"); ok {
		return guardScheme + "://" + rest
	}
	return endpoint
}

var (
	errHandshakeTimeout = errors.New("kvevents: ZMTP handshake not completed in time")
	errNotZMTP          = errors.New("kvevents: peer greeting is not ZMTP 3.x")
	errGreetingDiffers  = errors.New("kvevents: go-zeromq's greeting differs from the one sent ahead of it")
)

// connGuard is what the guard enforces for one socket and what it counts.
// go-zeromq gives its transport nothing but the socket's context, so the
// guard travels in it (withGuard).
type connGuard struct {
	maxMessage uint64
	handshake  time.Duration
	oversized  atomic.Uint64
	failed     atomic.Uint64
	// One line a minute for each kind: the counters carry the rest, and a
	// peer that retries must not flood the log.
	oversizedLog, failedLog zerolog.Logger
}

func newConnGuard(maxMessage int64, handshake time.Duration, log zerolog.Logger) (*connGuard, error) {
	switch {
	case maxMessage == 0:
		maxMessage = DefaultMaxMessageBytes
	case maxMessage < minMessageBytes || maxMessage > maxMessageBytes:
		return nil, fmt.Errorf("kvevents: max message bytes %d out of range [%d, %d]", maxMessage, minMessageBytes, int64(maxMessageBytes))
	}
	switch {
	case handshake == 0:
		handshake = DefaultHandshakeTimeout
	case handshake < 0:
		return nil, fmt.Errorf("kvevents: negative handshake timeout %v", handshake)
	}
	sampled := func() zerolog.Logger { return log.Sample(&zerolog.BurstSampler{Burst: 1, Period: time.Minute}) }
	return &connGuard{maxMessage: uint64(maxMessage), handshake: handshake, oversizedLog: sampled(), failedLog: sampled()}, nil
}

type guardKey struct{}

func withGuard(ctx context.Context, g *connGuard) context.Context {
	return context.WithValue(ctx, guardKey{}, g)
}

// guardFrom falls back to the defaults, counted nowhere, for a socket made
// without one.
func guardFrom(ctx context.Context) *connGuard {
	if g, ok := ctx.Value(guardKey{}).(*connGuard); ok {
		return g
	}
	g, _ := newConnGuard(0, 0, zerolog.Nop())
	return g
}

// dropped counts and logs a connection the guard closed.
func (g *connGuard) dropped(remote net.Addr, err error) {
	if tooLarge := (*MessageTooLargeError)(nil); errors.As(err, &tooLarge) {
		n := g.oversized.Add(1)
		g.oversizedLog.Warn().Err(err).Stringer("peer", remote).Uint64("dropped_total", n).Msg("kv events connection dropped: message over the limit")
		return
	}
	n := g.failed.Add(1)
	g.failedLog.Warn().Err(err).Stringer("peer", remote).Uint64("failed_total", n).Msg("kv events connection dropped: ZMTP handshake failed")
}

type guardedTransport struct{ transport.Transport }

func (t guardedTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	conn, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return guardFrom(ctx).wrap(conn), nil
}

func (t guardedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	gl := &guardedListener{Listener: l, g: guardFrom(ctx), ready: make(chan net.Conn), done: make(chan struct{})}
	go gl.run()
	return gl, nil
}

// guardedConn bounds what its peer sends (frameReader) and closes itself if
// the handshake is not over by the deadline: go-zeromq neither sets one nor
// closes a connection whose handshake failed.
type guardedConn struct {
	net.Conn
	g         *connGuard
	fr        frameReader
	timer     *time.Timer // drops the connection at the handshake deadline
	handshook bool        // the timer is stopped: go-zeromq reads past the handshake
	reported  atomic.Bool // the connection was dropped and counted
	// Listener side: the peer's handshake, read ahead for go-zeromq to read
	// again, and our greeting, sent ahead, which go-zeromq will send again.
	pending, swallow []byte
}

func (g *connGuard) wrap(conn net.Conn) *guardedConn {
	c := &guardedConn{Conn: conn, g: g}
	c.fr = newFrameReader(conn, g.maxMessage)
	c.timer = time.AfterFunc(g.handshake, func() { c.drop(errHandshakeTimeout) })
	return c
}

// fail drops the connection for err from a goroutine using it.
func (c *guardedConn) fail(err error) {
	c.timer.Stop()
	c.drop(err)
}

// drop closes the connection for err and counts it, once: whatever fails
// on the closed connection next reports nothing more.
func (c *guardedConn) drop(err error) {
	if c.reported.CompareAndSwap(false, true) {
		c.g.dropped(c.RemoteAddr(), err)
	}
	c.Conn.Close()
}

func (c *guardedConn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	if !c.handshook && c.fr.messages > 0 {
		// go-zeromq reads past the peer's handshake (its one command)
		// only once it has accepted it.
		c.handshook = true
		c.timer.Stop()
	}
	n, err := c.fr.Read(p)
	if tooLarge := (*MessageTooLargeError)(nil); errors.As(err, &tooLarge) {
		c.fail(err)
	}
	return n, err
}

func (c *guardedConn) Write(p []byte) (int, error) {
	if len(c.swallow) == 0 {
		return c.Conn.Write(p)
	}
	k := min(len(p), len(c.swallow))
	if !bytes.Equal(p[:k], c.swallow[:k]) {
		c.fail(errGreetingDiffers)
		return 0, errGreetingDiffers
	}
	c.swallow = c.swallow[k:]
	if k == len(p) {
		return k, nil
	}
	n, err := c.Conn.Write(p[k:])
	return k + n, err
}

// nullGreeting is the greeting go-zeromq sends with the NULL mechanism:
// signature, version 3.0, "NULL", as-server 0, filler (TestNullGreeting
// pins it to go-zeromq's own).
var nullGreeting = func() (g [greetingLen]byte) {
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	return g
}()

// greet reads the peer's greeting and first command ahead of go-zeromq,
// which then finds them without waiting. The peer needs our greeting first
// (libzmq sends its 10-byte signature, then waits for ours before the rest
// of its greeting, and its READY only after ours), so it is sent here and
// go-zeromq's copy of it swallowed.
func (c *guardedConn) greet() error {
	if _, err := c.Conn.Write(nullGreeting[:]); err != nil {
		return err
	}
	c.swallow = nullGreeting[:]
	c.pending = make([]byte, greetingLen, 2*greetingLen)
	if _, err := io.ReadFull(&c.fr, c.pending); err != nil {
		return err
	}
	// The signature and major version, so that something else than ZMTP
	// is told at once, not at the deadline.
	if c.pending[0] != 0xff || c.pending[9]&1 == 0 || c.pending[10] < 3 {
		return errNotZMTP
	}
	var buf [512]byte
	for c.fr.messages == 0 {
		n, err := c.fr.Read(buf[:])
		c.pending = append(c.pending, buf[:n]...)
		if err != nil {
			return err
		}
	}
	return nil
}

// guardedListener hands go-zeromq's accept loop only connections whose
// peer has greeted; each greets in a goroutine of its own, so a silent or
// slow one holds up no other.
type guardedListener struct {
	net.Listener
	g     *connGuard
	ready chan net.Conn
	done  chan struct{}
	stop  sync.Once
}

func (l *guardedListener) run() {
	for {
		conn, err := l.Listener.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			case <-time.After(50 * time.Millisecond): // e.g. out of descriptors: do not spin
			}
			continue
		}
		go l.admit(conn)
	}
}

func (l *guardedListener) admit(conn net.Conn) {
	c := l.g.wrap(conn)
	if err := c.greet(); err != nil {
		c.fail(err) // counted as a timeout if that is what closed it
		return
	}
	select {
	case l.ready <- c:
	case <-l.done:
		c.Conn.Close()
	}
}

func (l *guardedListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *guardedListener) Close() error {
	l.stop.Do(func() { close(l.done) })
	return l.Listener.Close()
}
