package kvevents

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/rs/zerolog"
)

// PublisherConfig configures a Publisher the way vLLM's --kv-events-config
// configures ZmqEventPublisher.
type PublisherConfig struct {
	// Endpoint is bound when it has a wildcard host ("*" or "::") or is
	// ipc:// or inproc://, and connected to otherwise (vLLM's rule).
	Endpoint string
	// ReplayEndpoint, if set, is bound to a ROUTER that replays the last
	// BufferSteps batches on request.
	ReplayEndpoint string
	Topic          string
	BufferSteps    int // replay ring size in batches; 0 means vLLM's 10000
	Format         Format
	// MaxMessageBytes and HandshakeTimeout bound what each connecting peer
	// (subscriber or replay client) can make the publisher spend, as for
	// a Subscriber; 0 means the defaults.
	MaxMessageBytes  int64
	HandshakeTimeout time.Duration
	Logger           zerolog.Logger
}

// ErrQueueFull is returned by Publish when the send queue is full and the
// batch was dropped; its sequence number is skipped, so subscribers see the
// loss as a gap.
var ErrQueueFull = errors.New("kvevents: publisher queue full, batch dropped")

// ErrClosed is returned by Publish after Close.
var ErrClosed = errors.New("kvevents: publisher closed")

const (
	defaultBufferSteps = 10000
	publishQueueSize   = 4096
	pubHWM             = 100000 // vLLM's default PUB high-water mark
)

// PublisherStats are counters since NewPublisher.
type PublisherStats struct {
	Published      uint64 // batches accepted by Publish
	Dropped        uint64 // batches dropped because the queue was full
	Sent           uint64 // messages handed to the PUB socket
	ReplayRequests uint64 // well-formed replay requests served
	Replayed       uint64 // batches sent in replies
	// Connections dropped for a message over MaxMessageBytes, or before
	// their handshake completed (see SubscriberStats).
	Oversized, HandshakeFailures uint64
}

// Publisher publishes KV event batches like vLLM's ZmqEventPublisher: 3-frame
// messages [topic, seq8, payload] on a PUB socket, numbered 0, 1, 2, … from
// its creation, with an optional replay ROUTER. Publish never blocks for
// long: encoding happens in the caller, sending in a goroutine behind a
// bounded queue.
type Publisher struct {
	cfg    PublisherConfig
	log    zerolog.Logger
	ctx    context.Context // carries guard to the sockets
	cancel context.CancelFunc
	wg     sync.WaitGroup
	guard  *connGuard

	mu      sync.Mutex // guards nextSeq, closed and sends on queue
	nextSeq uint64
	closed  bool
	queue   chan ringEntry
	sent    chan struct{} // closed when the sender has drained the queue

	sockMu sync.Mutex
	pub    zmq4.Socket // nil while a connecting publisher is (re)dialing
	router zmq4.Socket
	ring   ring

	stats struct{ published, dropped, sent, replayRequests, replayed atomic.Uint64 }

	// skipSend, set by tests, keeps chosen batches off the PUB socket (they
	// still enter the replay ring) to simulate lost messages.
	skipSend func(seq uint64) bool
}

type ringEntry struct {
	seq     uint64
	payload []byte
}

// ring keeps the last cap batches for replay.
type ring struct {
	mu      sync.Mutex
	entries []ringEntry
	next    int // index the next entry goes to once full
}

func (r *ring) add(e ringEntry, capacity int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.entries) < capacity {
		r.entries = append(r.entries, e)
		return
	}
	r.entries[r.next] = e
	r.next = (r.next + 1) % capacity
}

// from returns the retained entries with seq >= start, oldest first.
func (r *ring) from(start uint64) []ringEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []ringEntry
	n := len(r.entries)
	for i := 0; i < n; i++ {
		e := r.entries[(r.next+i)%n]
		if e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// publisherBinds is vLLM's rule for the PUB endpoint.
func publisherBinds(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}

// NewPublisher opens the sockets and starts sending. A binding endpoint that
// cannot be bound is an error; a connecting one is dialed in the background
// (and re-dialed if the subscriber goes away), dropping messages meanwhile
// as a PUB socket without peers does.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	return newPublisher(cfg, publisherBinds(cfg.Endpoint))
}

func newPublisher(cfg PublisherConfig, bind bool) (*Publisher, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("kvevents: publisher needs an endpoint")
	}
	if cfg.BufferSteps <= 0 {
		cfg.BufferSteps = defaultBufferSteps
	}
	log := cfg.Logger.With().Str("endpoint", cfg.Endpoint).Logger()
	guard, err := newConnGuard(cfg.MaxMessageBytes, cfg.HandshakeTimeout, log)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(withGuard(context.Background(), guard))
	p := &Publisher{
		cfg: cfg, ctx: ctx, cancel: cancel, guard: guard, log: log,
		queue: make(chan ringEntry, publishQueueSize),
		sent:  make(chan struct{}),
	}
	if bind {
		pub := p.newPub()
		if err := pub.Listen(guarded(cfg.Endpoint)); err != nil {
			cancel()
			pub.Close()
			return nil, fmt.Errorf("kvevents: bind %s: %w", cfg.Endpoint, err)
		}
		p.pub = pub
	} else {
		p.wg.Add(1)
		go p.connect()
	}
	if cfg.ReplayEndpoint != "" {
		router := zmq4.NewRouter(ctx, zmq4.WithLogger(zmqLog))
		if err := router.Listen(guarded(cfg.ReplayEndpoint)); err != nil {
			p.cancel()
			router.Close()
			p.wg.Wait()
			if p.pub != nil {
				p.pub.Close()
			}
			return nil, fmt.Errorf("kvevents: bind replay %s: %w", cfg.ReplayEndpoint, err)
		}
		p.router = router
		p.wg.Add(1)
		go p.serveReplay()
	}
	p.wg.Add(1)
	go p.send()
	return p, nil
}

func (p *Publisher) newPub() zmq4.Socket {
	pub := zmq4.NewPub(p.ctx, zmq4.WithDialerRetry(250*time.Millisecond), zmq4.WithDialerMaxRetries(-1), zmq4.WithLogger(zmqLog))
	_ = pub.SetOption(zmq4.OptionHWM, pubHWM)
	return pub
}

// Endpoint is the PUB address actually bound (useful with port 0), or the
// configured endpoint for a connecting publisher.
func (p *Publisher) Endpoint() string { return boundEndpoint(p.cfg.Endpoint, p.currentPub()) }

// ReplayEndpoint is the ROUTER address actually bound, "" without replay.
func (p *Publisher) ReplayEndpoint() string {
	if p.router == nil {
		return ""
	}
	return boundEndpoint(p.cfg.ReplayEndpoint, p.router)
}

func boundEndpoint(configured string, s zmq4.Socket) string {
	if s == nil || s.Addr() == nil {
		return configured
	}
	scheme, _, _ := strings.Cut(configured, "://")
	return scheme + "://" + s.Addr().String()
}

func (p *Publisher) currentPub() zmq4.Socket {
	p.sockMu.Lock()
	defer p.sockMu.Unlock()
	return p.pub
}

// Publish numbers b, encodes it and queues it for sending. It does not keep
// b. It returns ErrQueueFull (the batch is dropped and counted) when the
// sender is too far behind, and ErrClosed after Close.
func (p *Publisher) Publish(b *Batch) error {
	payload := AppendBatch(nil, b, p.cfg.Format)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	seq := p.nextSeq
	p.nextSeq++
	select {
	case p.queue <- ringEntry{seq, payload}:
		p.stats.published.Add(1)
		return nil
	default:
		p.stats.dropped.Add(1)
		return ErrQueueFull
	}
}

// Stats returns a snapshot of the counters.
func (p *Publisher) Stats() PublisherStats {
	return PublisherStats{
		Published: p.stats.published.Load(), Dropped: p.stats.dropped.Load(), Sent: p.stats.sent.Load(),
		ReplayRequests: p.stats.replayRequests.Load(), Replayed: p.stats.replayed.Load(),
		Oversized: p.guard.oversized.Load(), HandshakeFailures: p.guard.failed.Load(),
	}
}

// send moves queued batches into the replay ring and onto the PUB socket.
// The ring comes first, so a subscriber that sees a batch can replay it.
func (p *Publisher) send() {
	defer p.wg.Done()
	defer close(p.sent)
	topic := []byte(p.cfg.Topic)
	for e := range p.queue {
		p.ring.add(e, p.cfg.BufferSteps)
		if p.skipSend != nil && p.skipSend(e.seq) {
			continue
		}
		pub := p.currentPub()
		if pub == nil {
			continue // not connected: lost like on a PUB without peers
		}
		if err := pub.SendMulti(zmq4.NewMsgFrom(topic, seqBytes(e.seq), e.payload)); err != nil {
			p.log.Debug().Err(err).Uint64("seq", e.seq).Msg("kv events send failed")
			continue
		}
		p.stats.sent.Add(1)
	}
}

// connect keeps a connecting PUB dialed. go-zeromq does not redial a lost
// peer by itself (its automatic reconnect races with Close), so a socket
// with no subscribed peer for a while is replaced by a fresh one.
func (p *Publisher) connect() {
	defer p.wg.Done()
	const poll = 200 * time.Millisecond
	for p.ctx.Err() == nil {
		pub := p.newPub()
		if err := pub.Dial(guarded(p.cfg.Endpoint)); err != nil { // retries until connected or closed
			pub.Close()
			select { // a handshake failure returns at once: do not spin
			case <-p.ctx.Done():
			case <-time.After(time.Second):
			}
			continue
		}
		p.sockMu.Lock()
		p.pub = pub
		p.sockMu.Unlock()
		p.log.Info().Msg("kv events publisher connected")
		idle := 0
		for p.ctx.Err() == nil && idle < 10 {
			select {
			case <-p.ctx.Done():
			case <-time.After(poll):
			}
			if len(pub.(zmq4.Topics).Topics()) == 0 {
				idle++
			} else {
				idle = 0
			}
		}
		p.sockMu.Lock()
		p.pub = nil
		p.sockMu.Unlock()
		pub.Close()
	}
}

// serveReplay answers [identity, "", start8] with every retained batch from
// start on, as ["", topic, seq8, payload] (vLLM v0.26+ layout), then the end
// marker ["", "", FF×8, ""].
func (p *Publisher) serveReplay() {
	defer p.wg.Done()
	topic := []byte(p.cfg.Topic)
	for {
		msg, err := p.router.Recv()
		if p.ctx.Err() != nil {
			return
		}
		if err != nil {
			continue
		}
		id, start, ok := parseReplayRequest(msg.Frames)
		if !ok {
			p.log.Debug().Int("frames", len(msg.Frames)).Msg("kv events replay request ignored")
			continue
		}
		p.stats.replayRequests.Add(1)
		for _, e := range p.ring.from(start) {
			if err := p.router.SendMulti(zmq4.NewMsgFrom(id, nil, topic, seqBytes(e.seq), e.payload)); err != nil {
				break
			}
			p.stats.replayed.Add(1)
		}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, nil, endSeq, nil))
	}
}

// Close stops sending, after handing what is queued to the socket, and
// closes the sockets.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.queue)
	p.mu.Unlock()

	// Let the sender hand what is queued to the socket, for up to a second
	// as vLLM does on shutdown.
	select {
	case <-p.sent:
	case <-time.After(time.Second):
	}
	p.cancel()
	var err error
	if p.router != nil {
		err = p.router.Close()
	}
	p.wg.Wait()
	if pub := p.currentPub(); pub != nil {
		if e := pub.Close(); err == nil {
			err = e
		}
	}
	return err
}
