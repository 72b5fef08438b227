package kvevents

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/rs/zerolog"
)

// recorder is a Handler that remembers what it was given, in order.
type recorder struct {
	mu     sync.Mutex
	log    []string // "batch 3" or "reset"
	seqs   []uint64
	resets []string
	bad    []string // batches whose content does not match their seq
}

func (r *recorder) HandleBatch(seq uint64, b *Batch) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.log = append(r.log, fmt.Sprintf("batch %d", seq))
	r.seqs = append(r.seqs, seq)
	// testBatch(seq, gen) stamps ts = seq and one block hash = seq.
	if len(b.Events) != 1 || b.Events[0].BlockHashes[0] != seq || uint64(b.TS) != seq {
		r.bad = append(r.bad, fmt.Sprintf("seq %d: %+v", seq, *b))
	}
}

func (r *recorder) HandleReset(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.log = append(r.log, "reset")
	r.resets = append(r.resets, reason)
}

func (r *recorder) snapshot() (seqs []uint64, resets []string, log []string, bad []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.seqs), slices.Clone(r.resets), slices.Clone(r.log), slices.Clone(r.bad)
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.seqs)
}

func testBatch(seq uint64) *Batch {
	return &Batch{TS: float64(seq), DPRank: 0, Events: []Event{{Kind: KindBlockStored,
		BlockHashes: []uint64{seq}, TokenIDs: exampleTokens, BlockSize: 16, Medium: "GPU"}}}
}

func seqRange(from, to uint64) []uint64 {
	var out []uint64
	for s := from; s <= to; s++ {
		out = append(out, s)
	}
	return out
}

// freeEndpoint returns a loopback TCP endpoint nobody listens on.
func freeEndpoint(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://" + l.Addr().String()
}

func testLogger(t *testing.T) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)
}

// startPublisher binds a publisher on loopback (ports chosen by the caller or
// by the kernel) regardless of vLLM's wildcard rule, which would bind every
// interface.
func startPublisher(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	cfg.Logger = testLogger(t)
	p, err := newPublisher(cfg, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func startSubscriber(t *testing.T, cfg SubscriberConfig, h Handler, tune ...func(*Subscriber)) *Subscriber {
	t.Helper()
	cfg.Logger = testLogger(t)
	s := NewSubscriber(cfg, h)
	s.minBackoff = 20 * time.Millisecond
	s.replayIdle = time.Second
	for _, f := range tune {
		f(s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("Run did not return after cancel")
		}
	})
	return s
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitSubscribed waits until a subscriber's subscription reached the
// publisher, so nothing published next is lost to the slow-joiner effect.
func waitSubscribed(t *testing.T, p *Publisher) {
	waitFor(t, "a subscribed peer", func() bool {
		pub := p.currentPub()
		return pub != nil && len(pub.(zmq4.Topics).Topics()) > 0
	})
}

func publishRange(t *testing.T, p *Publisher, from, to uint64) {
	t.Helper()
	for s := from; s <= to; s++ {
		if err := p.Publish(testBatch(s)); err != nil {
			t.Fatal(err)
		}
	}
}

func assertDelivered(t *testing.T, rec *recorder, want []uint64, wantResets int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d batches", len(want)), func() bool { return rec.count() >= len(want) })
	time.Sleep(50 * time.Millisecond) // nothing extra should follow
	seqs, resets, log, bad := rec.snapshot()
	if !slices.Equal(seqs, want) {
		t.Fatalf("delivered %v\nwant %v\nlog %v", seqs, want, log)
	}
	if len(resets) != wantResets {
		t.Fatalf("resets %q, want %d", resets, wantResets)
	}
	if len(bad) > 0 {
		t.Fatalf("batches with wrong content: %v", bad)
	}
}

func TestPubSubDeliversInOrder(t *testing.T) {
	p := startPublisher(t, PublisherConfig{Topic: "kv@pod@m"})
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), Topic: "kv@"}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 499)
	assertDelivered(t, rec, seqRange(0, 499), 0)
	st := s.Stats()
	if st.Messages != 500 || st.Batches != 500 || st.Gaps != 0 || st.LastSeq != 499 || !st.Connected {
		t.Fatalf("stats %+v", st)
	}
	if ps := p.Stats(); ps.Published != 500 || ps.Sent != 500 || ps.Dropped != 0 {
		t.Fatalf("publisher stats %+v", ps)
	}
}

func TestLateJoinerCatchesUpByReplay(t *testing.T) {
	p := startPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0"})
	publishRange(t, p, 0, 49) // nobody listens yet
	waitFor(t, "sent", func() bool { return p.Stats().Sent == 50 })
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 50, 59)
	assertDelivered(t, rec, seqRange(0, 59), 0)
	if st := s.Stats(); st.Replayed < 50 || st.Resets != 0 || st.ReplayErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestGapIsFilledByReplay(t *testing.T) {
	p := startPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0"})
	p.skipSend = func(seq uint64) bool { return seq >= 10 && seq < 20 || seq == 25 }
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 39)
	assertDelivered(t, rec, seqRange(0, 39), 0)
	if st := s.Stats(); st.Gaps == 0 || st.Replayed < 11 || st.Resets != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestGapBeyondTheRingResets(t *testing.T) {
	p := startPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 4})
	p.skipSend = func(seq uint64) bool { return seq >= 10 && seq < 20 }
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 9)
	waitFor(t, "first 10", func() bool { return rec.count() == 10 })
	publishRange(t, p, 10, 29)
	waitFor(t, "seq 29", func() bool { return s.Stats().LastSeq == 29 })
	seqs, resets, log, _ := rec.snapshot()
	if len(resets) != 1 || !strings.Contains(resets[0], "no longer covers") {
		t.Fatalf("resets %q, log %v", resets, log)
	}
	// 0..9, the reset, then a contiguous run to 29 starting where the ring
	// started (at most 4 back from the first live seq 20).
	i := slices.Index(log, "reset")
	if i != 10 || !slices.Equal(seqs[:10], seqRange(0, 9)) {
		t.Fatalf("log %v", log)
	}
	after := seqs[10:]
	if after[0] < 16 || after[0] > 20 || !slices.Equal(after, seqRange(after[0], 29)) {
		t.Fatalf("after the reset got %v", after)
	}
}

func TestGapWithoutReplayResets(t *testing.T) {
	p := startPublisher(t, PublisherConfig{})
	p.skipSend = func(seq uint64) bool { return seq == 5 }
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 9)
	want := append(seqRange(0, 4), seqRange(6, 9)...)
	assertDelivered(t, rec, want, 1)
	_, _, log, _ := rec.snapshot()
	if log[5] != "reset" {
		t.Fatalf("log %v", log)
	}
	if st := s.Stats(); st.Gaps != 1 || st.Resets != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPublisherRestartResetsThenDelivers(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	p1 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay}, rec)
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 19)
	waitFor(t, "20 batches", func() bool { return rec.count() == 20 })
	if err := p1.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "disconnect", func() bool { return !s.Stats().Connected })

	p2 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	waitSubscribed(t, p2)
	publishRange(t, p2, 0, 4)
	waitFor(t, "25 batches", func() bool { return rec.count() == 25 })
	seqs, resets, log, bad := rec.snapshot()
	if len(resets) != 1 || !strings.Contains(resets[0], "restarted") || log[20] != "reset" {
		t.Fatalf("resets %q log %v", resets, log)
	}
	if !slices.Equal(seqs, append(seqRange(0, 19), seqRange(0, 4)...)) || len(bad) > 0 {
		t.Fatalf("seqs %v bad %v", seqs, bad)
	}
	if st := s.Stats(); st.Reconnects == 0 || !st.Connected {
		t.Fatalf("stats %+v", st)
	}
}

func TestGarbageIsCountedAndSkipped(t *testing.T) {
	ep := freeEndpoint(t)
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(zmqLog))
	defer pub.Close()
	if err := pub.Listen(ep); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep}, rec)
	waitFor(t, "subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
	good := func(seq uint64) zmq4.Msg {
		return zmq4.NewMsgFrom([]byte("t"), seqBytes(seq), AppendBatch(nil, testBatch(seq), FormatVLLMArray))
	}
	msgs := []zmq4.Msg{
		good(0),
		zmq4.NewMsgFrom([]byte("junk")), // 1 frame
		zmq4.NewMsgFrom([]byte("t"), []byte{0, 1}, []byte{0x90}),         // short seq
		zmq4.NewMsgFrom([]byte("t"), seqBytes(1), []byte{0xc1, 0xff}),    // not msgpack
		zmq4.NewMsgFrom([]byte("t"), seqBytes(2), []byte{}, []byte("x")), // 4 frames
		good(2),
		good(3),
	}
	for _, m := range msgs {
		if err := pub.SendMulti(m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "all messages", func() bool { return s.Stats().Messages == uint64(len(msgs)) })
	st := s.Stats()
	if st.Malformed != 3 || st.DecodeErrors != 1 || st.Batches != 3 || st.Resets != 0 || st.LastSeq != 3 {
		t.Fatalf("stats %+v", st)
	}
	seqs, _, _, bad := rec.snapshot()
	if !slices.Equal(seqs, []uint64{0, 2, 3}) || len(bad) > 0 {
		t.Fatalf("seqs %v bad %v", seqs, bad)
	}
}

func TestBindModeWithConnectingPublisher(t *testing.T) {
	ep := freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true}, rec)
	waitFor(t, "listening", func() bool { return s.Stats().Connected })
	if publisherBinds(ep) {
		t.Fatalf("%s should connect", ep)
	}
	p, err := NewPublisher(PublisherConfig{Endpoint: ep, Logger: testLogger(t), Format: FormatSGLang})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	waitSubscribed(t, p)
	publishRange(t, p, 0, 99)
	assertDelivered(t, rec, seqRange(0, 99), 0)
}

func TestSubscriberConfigErrors(t *testing.T) {
	if err := NewSubscriber(SubscriberConfig{}, &recorder{}).Run(context.Background()); err == nil {
		t.Fatal("Run without endpoint succeeded")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + l.Addr().String(), Bind: true}, &recorder{})
	if err := s.Run(ctx); err == nil || ctx.Err() != nil {
		t.Fatalf("Run on a taken port: %v (ctx %v)", err, ctx.Err())
	}
}

func TestPublisherAfterClose(t *testing.T) {
	p := startPublisher(t, PublisherConfig{})
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(testBatch(0)); err != ErrClosed {
		t.Fatalf("Publish after Close: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// A publisher that restarted and already passed the old sequence numbers
// before the subscriber reconnected is caught by the replay check: the batch
// under the last delivered number has other bytes. Its history is then
// replayed from 0.
func TestRestartSeenOnlyThroughReplay(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	p1 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay}, rec,
		func(s *Subscriber) { s.minBackoff = 300 * time.Millisecond }) // reconnect after p2 published
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 9)
	waitFor(t, "10 batches", func() bool { return rec.count() == 10 })
	p1.Close()

	p2 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	for seq := uint64(0); seq < 15; seq++ {
		b := testBatch(seq)
		b.DPRank = 1 // other bytes under the same numbers
		if err := p2.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "p2 sent", func() bool { return p2.Stats().Sent == 15 })
	waitSubscribed(t, p2)
	publishRange(t, p2, 15, 16)
	waitFor(t, "seq 16", func() bool { return s.Stats().LastSeq == 16 && rec.count() >= 27 })
	seqs, resets, log, bad := rec.snapshot()
	if len(resets) != 1 || log[10] != "reset" || len(bad) > 0 {
		t.Fatalf("resets %q log %v bad %v", resets, log, bad)
	}
	if !slices.Equal(seqs, append(seqRange(0, 9), seqRange(0, 16)...)) {
		t.Fatalf("seqs %v", seqs)
	}
}

// vLLM before v0.26 replies [seq8, payload] after the delimiter, and ends
// with [FF×8, ""]; a raw ROUTER plays that publisher here.
func TestReplayAcceptsTheOlderTwoFrameLayout(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(zmqLog))
	defer pub.Close()
	router := zmq4.NewRouter(ctx, zmq4.WithLogger(zmqLog))
	defer router.Close()
	if err := pub.Listen(ep); err != nil {
		t.Fatal(err)
	}
	if err := router.Listen(replay); err != nil {
		t.Fatal(err)
	}
	payload := func(seq uint64) []byte { return AppendBatch(nil, testBatch(seq), FormatVLLMArray) }
	requests := make(chan uint64, 4)
	go func() {
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			id, start, ok := parseReplayRequest(msg.Frames)
			if !ok {
				continue
			}
			requests <- start
			for seq := start; seq <= 5; seq++ {
				router.SendMulti(zmq4.NewMsgFrom(id, nil, seqBytes(seq), payload(seq)))
			}
			router.SendMulti(zmq4.NewMsgFrom(id, nil, endSeq, nil))
		}
	}()
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay}, rec)
	waitFor(t, "subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
	if err := pub.SendMulti(zmq4.NewMsgFrom(nil, seqBytes(5), payload(5))); err != nil {
		t.Fatal(err)
	}
	assertDelivered(t, rec, seqRange(0, 5), 0)
	if start := <-requests; start != 0 {
		t.Fatalf("replay requested from %d, want 0", start)
	}
	if st := s.Stats(); st.Replayed != 6 || st.Duplicates != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// pythonWithZMQ returns a python3 that has pyzmq and msgpack (Debian:
// python3-zmq, python3-msgpack), or "" if there is none.
func pythonWithZMQ() string {
	for _, py := range []string{"python3", "/usr/bin/python3"} {
		if err := exec.Command(py, "-c", "import zmq, msgpack").Run(); err == nil {
			return py
		}
	}
	return ""
}

// The subscriber against real libzmq sockets shaped like vLLM's publisher,
// in both replay layouts and both event encodings, with batches lost on the
// live stream that only the replay ROUTER can supply; in Bind mode libzmq's
// PUB connects, so its handshake runs through the listener's guard.
func TestInteropWithLibzmqPublisher(t *testing.T) {
	py := pythonWithZMQ()
	if py == "" {
		t.Skip("no python3 with pyzmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	}
	for _, tc := range []struct {
		layout, format string
		bind           bool
	}{{"new", "map", false}, {"old", "array", false}, {"new", "map", true}, {"old", "array", true}} {
		t.Run(fmt.Sprintf("%s-%s-bind=%v", tc.layout, tc.format, tc.bind), func(t *testing.T) {
			ep, replay := freeEndpoint(t), freeEndpoint(t)
			rec := &recorder{}
			var s *Subscriber
			pubMode := "bind"
			if tc.bind {
				pubMode = "connect"
				s = startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true, ReplayEndpoint: replay, Topic: "kv@"}, rec)
				waitFor(t, "listening", func() bool { return s.Stats().Connected })
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, py, "testdata/vllm_publisher.py", ep, replay, tc.layout, tc.format, "40", "0,1,17,18,19", pubMode)
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Wait()
			defer stdin.Close()
			lines := bufio.NewScanner(stdout)
			if !lines.Scan() || lines.Text() != "ready" {
				t.Fatalf("publisher did not start: %q", lines.Text())
			}
			if !tc.bind {
				s = startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay, Topic: "kv@"}, rec)
				waitFor(t, "connection", func() bool { return s.Stats().Connected })
				time.Sleep(100 * time.Millisecond) // let libzmq register the subscription
			}
			io.WriteString(stdin, "go\n")
			if !lines.Scan() || lines.Text() != "done" {
				t.Fatalf("publisher did not finish: %q", lines.Text())
			}
			assertDelivered(t, rec, seqRange(0, 39), 0)
			if st := s.Stats(); st.Replayed < 5 || st.Resets != 0 || st.DecodeErrors != 0 || st.HandshakeFailures != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func TestSubscriberStartedBeforePublisher(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay}, rec)
	time.Sleep(300 * time.Millisecond) // dialing a port nobody listens on yet
	if s.Stats().Connected {
		t.Fatal("connected to nothing")
	}
	p := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	waitSubscribed(t, p)
	publishRange(t, p, 0, 9)
	assertDelivered(t, rec, seqRange(0, 9), 0)
}

func TestBindModeConnectingPublisherRestarts(t *testing.T) {
	ep := freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true}, rec)
	waitFor(t, "listening", func() bool { return s.Stats().Connected })
	p1, err := NewPublisher(PublisherConfig{Endpoint: ep, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 9)
	waitFor(t, "10 batches", func() bool { return rec.count() == 10 })
	p1.Close()
	p2, err := NewPublisher(PublisherConfig{Endpoint: ep, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	waitSubscribed(t, p2)
	publishRange(t, p2, 0, 4)
	assertDelivered(t, rec, append(seqRange(0, 9), seqRange(0, 4)...), 1)
	if _, _, log, _ := rec.snapshot(); log[10] != "reset" {
		t.Fatalf("log %v", log)
	}
}

// A connecting publisher that restarts and is first heard above 0 (its early
// batches were lost before it was subscribed) must still count as a restart,
// not pass for duplicates of numbers already delivered.
func TestBindModeRestartFirstHeardMidStream(t *testing.T) {
	ep := freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true}, rec)
	waitFor(t, "listening", func() bool { return s.Stats().Connected })
	p1, err := NewPublisher(PublisherConfig{Endpoint: ep, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 29)
	waitFor(t, "30 batches", func() bool { return rec.count() == 30 })
	p1.Close()
	p2, err := NewPublisher(PublisherConfig{Endpoint: ep, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	p2.skipSend = func(seq uint64) bool { return seq < 25 } // lost before it connected
	publishRange(t, p2, 0, 24)
	waitSubscribed(t, p2)
	publishRange(t, p2, 25, 27)
	assertDelivered(t, rec, append(seqRange(0, 29), 25, 26, 27), 1)
}

// An engine that restarts and stores nothing yet sends no batch whose number
// could reveal the restart; the reconnect itself must be checked against the
// replay ring, or the sidecar keeps listing blocks the engine lost.
func TestRestartWithoutNewBatchesResetsOnReconnect(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	p1 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, ReplayEndpoint: replay}, rec)
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 9)
	waitFor(t, "10 batches", func() bool { return rec.count() == 10 })
	if err := p1.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "disconnect", func() bool { return !s.Stats().Connected })

	p2 := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	waitSubscribed(t, p2)
	waitFor(t, "reset on reconnect", func() bool { return s.Stats().Resets == 1 })
	_, resets, _, _ := rec.snapshot()
	if len(resets) != 1 || !strings.Contains(resets[0], "restarted") {
		t.Fatalf("resets %q", resets)
	}
}

// Without a replay endpoint nothing can prove the publisher is the same one.
func TestReconnectWithoutReplayResets(t *testing.T) {
	ep := freeEndpoint(t)
	p1 := startPublisher(t, PublisherConfig{Endpoint: ep})
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep}, rec)
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 2)
	waitFor(t, "3 batches", func() bool { return rec.count() == 3 })
	if err := p1.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "disconnect", func() bool { return !s.Stats().Connected })
	p2 := startPublisher(t, PublisherConfig{Endpoint: ep})
	waitSubscribed(t, p2)
	waitFor(t, "reset on reconnect", func() bool { return s.Stats().Resets == 1 })
}

// tcpProxy forwards a listen address to a target, to cut a connection
// without closing either end: kill drops every connection and stops
// listening, start listens again on the same address.
type tcpProxy struct {
	addr, target string
	mu           sync.Mutex
	l            net.Listener
	conns        []net.Conn
}

func (p *tcpProxy) start(t *testing.T) {
	t.Helper()
	l, err := net.Listen("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.l = l
	p.mu.Unlock()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			go func() { io.Copy(u, c); u.Close(); c.Close() }()
			go func() { io.Copy(c, u); u.Close(); c.Close() }()
		}
	}()
}

func (p *tcpProxy) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.l.Close()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// A connection to the same publisher that drops and comes back (a network
// blip) loses what was published meanwhile; the ring that proves the
// publisher did not restart also holds those batches, and they are applied
// at once, not when a later live batch reveals the gap (never, on an idle
// engine).
func TestReconnectCatchesUpFromTheRing(t *testing.T) {
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	p := startPublisher(t, PublisherConfig{Endpoint: ep, ReplayEndpoint: replay})
	proxyEP := freeEndpoint(t)
	px := &tcpProxy{addr: strings.TrimPrefix(proxyEP, "tcp://"), target: strings.TrimPrefix(ep, "tcp://")}
	px.start(t)
	t.Cleanup(px.kill)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: proxyEP, ReplayEndpoint: replay}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 4)
	waitFor(t, "5 batches", func() bool { return rec.count() == 5 })

	px.kill()
	waitFor(t, "disconnect", func() bool { return !s.Stats().Connected })
	waitFor(t, "publisher without subscriber", func() bool {
		pub := p.currentPub()
		return pub != nil && len(pub.(zmq4.Topics).Topics()) == 0
	})
	publishRange(t, p, 5, 7) // lost on the PUB: nobody subscribed
	waitFor(t, "sent", func() bool { return p.Stats().Sent == 8 })
	px.start(t)
	waitSubscribed(t, p)
	assertDelivered(t, rec, seqRange(0, 7), 0)
	if st := s.Stats(); st.Reconnects == 0 || st.Replayed != 3 || st.Duplicates != 0 {
		t.Fatalf("stats %+v", st)
	}
	publishRange(t, p, 8, 9) // live again, after the replayed ones
	assertDelivered(t, rec, seqRange(0, 9), 0)
}

// startBindSubscriber starts a Bind-mode subscriber with a replay
// endpoint; connect makes a publisher (an engine) that connects to it.
func startBindSubscriber(t *testing.T) (*Subscriber, *recorder, func() *Publisher) {
	t.Helper()
	ep, replay := freeEndpoint(t), freeEndpoint(t)
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: ep, Bind: true, ReplayEndpoint: replay}, rec)
	waitFor(t, "listening", func() bool { return s.Stats().Connected })
	return s, rec, func() *Publisher {
		t.Helper()
		p, err := newPublisher(PublisherConfig{Endpoint: ep, ReplayEndpoint: replay, Logger: testLogger(t)}, false)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
}

// Bind mode: an engine that restarts and stays idle sends nothing whose
// number could reveal the restart. Its publisher connecting is checked
// against the replay ring, as a redial is in dial mode.
func TestBindModeRestartWithoutNewBatchesResets(t *testing.T) {
	s, rec, connect := startBindSubscriber(t)
	p1 := connect()
	waitSubscribed(t, p1)
	publishRange(t, p1, 0, 9)
	waitFor(t, "10 batches", func() bool { return rec.count() == 10 })
	p1.Close()
	p2 := connect()
	defer p2.Close()
	waitSubscribed(t, p2)
	waitFor(t, "reset on the restarted publisher's arrival", func() bool { return s.Stats().Resets == 1 })
	if _, resets, _, _ := rec.snapshot(); !strings.Contains(resets[0], "restarted") {
		t.Fatalf("resets %q", resets)
	}
	publishRange(t, p2, 0, 2)
	assertDelivered(t, rec, append(seqRange(0, 9), 0, 1, 2), 1)
}

// Bind mode: a publisher that connects while the engine is the same one
// (its ring holds our last batch) passes the check without a reset, and what
// the ring holds after our last batch is applied at once.
func TestBindModeJoinOfTheSameEngineCatchesUp(t *testing.T) {
	s, rec, connect := startBindSubscriber(t)
	p := connect()
	defer p.Close()
	p.skipSend = func(seq uint64) bool { return seq >= 5 } // in the ring only
	waitSubscribed(t, p)
	publishRange(t, p, 0, 4)
	waitFor(t, "5 batches", func() bool { return rec.count() == 5 })
	publishRange(t, p, 5, 7)
	waitFor(t, "ring filled", func() bool { return len(p.ring.from(7)) == 1 })

	// The engine's publisher connecting a second time, as libzmq does after a
	// network blip while the old connection is not yet seen to be dead.
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(zmqLog))
	defer pub.Close()
	if err := pub.Dial(s.cfg.Endpoint); err != nil {
		t.Fatal(err)
	}
	assertDelivered(t, rec, seqRange(0, 7), 0)
	if st := s.Stats(); st.Replayed != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// The ring no longer holds our last batch but still every missing one (its
// oldest is the one right after ours): on a live connection the publisher is
// known to be the same, so the gap is filled without a reset.
func TestGapFilledByARingStartingRightAfterTheLastBatch(t *testing.T) {
	p := startPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 6})
	p.skipSend = func(seq uint64) bool { return seq >= 5 && seq <= 9 }
	rec := &recorder{}
	s := startSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()}, rec)
	waitSubscribed(t, p)
	publishRange(t, p, 0, 4)
	waitFor(t, "5 batches", func() bool { return rec.count() == 5 })
	publishRange(t, p, 5, 10) // the ring holds 5..10, the live stream only 10
	assertDelivered(t, rec, seqRange(0, 10), 0)
	if st := s.Stats(); st.Gaps != 1 || st.Replayed < 5 {
		t.Fatalf("stats %+v", st)
	}
}
