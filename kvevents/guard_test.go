package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The listener sends go-zeromq's greeting ahead of it and swallows
// go-zeromq's own copy: both must be the same bytes.
func TestNullGreetingIsZmq4s(t *testing.T) {
	ours, theirs := net.Pipe()
	defer theirs.Close()
	go func() {
		_, _ = zmq4.Open(ours, null.Security(), zmq4.Sub, nil, true, nil)
		ours.Close()
	}()
	var got [greetingLen]byte
	if _, err := io.ReadFull(theirs, got[:]); err != nil {
		t.Fatal(err)
	}
	if got != nullGreeting {
		t.Fatalf("go-zeromq greets with\n% x\nnot\n% x", got, nullGreeting)
	}
}

// readyCommand is a peer's NULL-mechanism READY naming its socket type.
func readyCommand(socketType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(socketType)))
	body = append(body, socketType...)
	return append([]byte{0x04, byte(len(body))}, body...)
}

// longFrameHeader declares a message frame of size bytes.
func longFrameHeader(size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flagLong}, size)
}

// rawPeer connects to a Bind-mode subscriber over plain TCP and sends pre.
func rawPeer(t *testing.T, endpoint string, pre ...[]byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(endpoint, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for _, b := range pre {
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// assertClosedByPeer reads what the subscriber sends until it closes.
func assertClosedByPeer(t *testing.T, c net.Conn, within time.Duration) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("connection not closed by the subscriber within %v: %v", within, err)
	}
}

// A peer declaring a huge frame, in its handshake or after it, is dropped
// before go-zeromq allocates the frame (2^50 bytes: a makeslice panic
// without the guard), and other publishers go on being served.
func TestBindModeDropsAPeerDeclaringAHugeFrame(t *testing.T) {
	s, rec, connect := startBindSubscriber(t)
	huge := longFrameHeader(1 << 50)
	inHandshake := rawPeer(t, s.cfg.Endpoint, nullGreeting[:], huge)
	afterHandshake := rawPeer(t, s.cfg.Endpoint, nullGreeting[:], readyCommand("PUB"))
	time.Sleep(100 * time.Millisecond) // let it join before it misbehaves
	if _, err := afterHandshake.Write(huge); err != nil {
		t.Fatal(err)
	}
	assertClosedByPeer(t, inHandshake, 2*time.Second)
	assertClosedByPeer(t, afterHandshake, 2*time.Second)
	waitFor(t, "two oversized peers counted", func() bool { return s.Stats().Oversized == 2 })

	p := connect()
	defer p.Close()
	waitSubscribed(t, p)
	publishRange(t, p, 0, 2)
	assertDelivered(t, rec, seqRange(0, 2), 0)
	if st := s.Stats(); st.HandshakeFailures != 0 || st.Oversized != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// A message of many frames is bounded as a whole, not frame by frame.
func TestManySmallFramesAreBoundedAsOneMessage(t *testing.T) {
	var in bytes.Buffer
	in.Write(nullGreeting[:])
	for range 100 {
		in.Write([]byte{flagMore, 0})
	}
	fr := newFrameReader(&in, 64*frameCost)
	_, err := io.Copy(io.Discard, &fr)
	var tooLarge *MessageTooLargeError
	if !errors.As(err, &tooLarge) || tooLarge.Message != 65*frameCost {
		t.Fatalf("err %v", err)
	}
}

// Peers that connect and never greet, or stop halfway, hold up no other
// publisher (go-zeromq alone handshakes inline in its accept loop: one such
// peer blocked everyone), and are closed at the handshake deadline.
func TestBindModeSilentPeersHoldUpNoPublisher(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true, ReplayEndpoint: replay, HandshakeTimeout: 2 * time.Second}, rec)
	waitFor(t, "listening", func() bool { return s.Stats().Connected })
	silent := rawPeer(t, ep)
	halfway := rawPeer(t, ep, nullGreeting[:10])
	greetedOnly := rawPeer(t, ep, nullGreeting[:])
	time.Sleep(100 * time.Millisecond) // the peers are in before the publisher

	start := time.Now()
	p, err := newPublisher(PublisherConfig{Endpoint: ep, ReplayEndpoint: replay, Logger: testLogger(t)}, false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for rec.count() == 0 && time.Since(start) < time.Second {
		if err := p.Publish(testBatch(0)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if rec.count() == 0 {
		t.Fatalf("no batch from the publisher within 1s while silent peers were connected")
	}
	t.Logf("first batch after %v", time.Since(start))
	for _, c := range []net.Conn{silent, halfway, greetedOnly} {
		assertClosedByPeer(t, c, 3*time.Second)
	}
	waitFor(t, "three handshake failures", func() bool { return s.Stats().HandshakeFailures == 3 })
}

// In connect mode a "publisher" that accepts and never greets, or declares
// a huge frame, fails the dial; the subscriber counts it and redials.
func TestConnectModeBoundsThePublisher(t *testing.T) {
	for _, tc := range []struct {
		name string
		send []byte
	}{{"silent", nil}, {"huge frame", append(nullGreeting[:], longFrameHeader(1<<50)...)}} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					_, _ = c.Write(tc.send)
					go func() { _, _ = io.Copy(io.Discard, c); c.Close() }()
				}
			}()
			s := startSubscriber(t, SubscriberConfig{Endpoint: "tcp://" + l.Addr().String(), HandshakeTimeout: 200 * time.Millisecond}, &recorder{})
			waitFor(t, "two refused dials", func() bool {
				st := s.Stats()
				return st.HandshakeFailures+st.Oversized >= 2
			})
		})
	}
}

func TestGuardConfigErrors(t *testing.T) {
	for _, tc := range []SubscriberConfig{
		{Endpoint: "tcp://127.0.0.1:1", MaxMessageBytes: 100},
		{Endpoint: "tcp://127.0.0.1:1", MaxMessageBytes: 1 << 50},
		{Endpoint: "tcp://127.0.0.1:1", HandshakeTimeout: -time.Second},
	} {
		if err := NewSubscriber(tc, &recorder{}).Run(t.Context()); err == nil {
			t.Errorf("%+v: no error", tc)
		}
	}
}
