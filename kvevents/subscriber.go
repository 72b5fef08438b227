package kvevents

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/rs/zerolog"
)

// SubscriberConfig says where a Subscriber gets its events.
type SubscriberConfig struct {
	// Endpoint is the engine's PUB endpoint to connect to (tcp://host:port),
	// or, with Bind, the endpoint to listen on for publishers that connect.
	Endpoint string
	Bind     bool
	// ReplayEndpoint is the engine's replay ROUTER; "" disables replay, so
	// every gap becomes a reset.
	ReplayEndpoint string
	// Topic is a prefix filter on the topic frame; "" accepts every topic.
	Topic string
	// MaxMessageBytes bounds each message a peer sends, handshake included
	// (0: DefaultMaxMessageBytes); a peer that declares more is dropped.
	MaxMessageBytes int64
	// HandshakeTimeout bounds each connection's ZMTP handshake (0:
	// DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration
	Logger           zerolog.Logger
}

// Handler receives what a Subscriber decodes. Both methods are called from
// the goroutine running Run, one call at a time, in sequence order.
type Handler interface {
	// HandleBatch gets each batch once, in order. b and its slices are
	// reused after the call returns: copy what must outlive it.
	HandleBatch(seq uint64, b *Batch)
	// HandleReset says batches were lost for good (the publisher restarted,
	// or a gap could not be replayed): state built from earlier batches is
	// no longer exact and must be dropped. Batches that follow start afresh.
	HandleReset(reason string)
}

// SubscriberStats are counters since NewSubscriber.
type SubscriberStats struct {
	Messages     uint64 // live messages received, well-formed or not
	Batches      uint64 // batches handed to HandleBatch (live and replayed)
	Malformed    uint64 // messages with a wrong frame count or sequence frame
	DecodeErrors uint64 // payloads that were not a valid KVEventBatch (skipped)
	Filtered     uint64 // messages for another topic
	Duplicates   uint64 // live batches already delivered by a replay
	Gaps         uint64 // times batches were found missing
	Replayed     uint64 // batches delivered from a replay
	ReplayErrors uint64 // replays that failed (dial, timeout, bad reply)
	Resets       uint64 // HandleReset calls
	Reconnects   uint64 // sockets re-created after the publisher went away
	Oversized    uint64 // connections dropped for a message over MaxMessageBytes
	// HandshakeFailures are connections dropped before their ZMTP
	// handshake completed: not ZMTP, closed early, or over HandshakeTimeout.
	HandshakeFailures uint64
	LastSeq           uint64 // sequence number of the last delivered batch
	Connected         bool   // connected to the publisher (Bind: listening)
}

// Subscriber is a long-running ZMQ SUB client for one engine's KV events:
// it keeps the socket drained, detects gaps and publisher restarts from the
// sequence numbers, fills gaps from the replay endpoint and reconnects when
// the publisher goes away.
type Subscriber struct {
	cfg SubscriberConfig
	h   Handler
	log zerolog.Logger
	// guard bounds every connection of the subscriber's sockets; guardErr
	// is a configuration it refused, returned by Run.
	guard    *connGuard
	guardErr error

	// Timeouts; fields so tests can shorten them.
	minBackoff, maxBackoff time.Duration
	replayIdle             time.Duration // max wait for the next replay reply
	replayTotal            time.Duration // max duration of one replay
	replayCooldown         time.Duration // after a failed replay, reset instead of retrying

	running atomic.Bool
	stats   struct {
		messages, batches, malformed, decodeErrors, filtered, duplicates,
		gaps, replayed, replayErrors, resets, reconnects, lastSeq atomic.Uint64
		connected atomic.Bool
	}

	// Owned by the goroutine in Run.
	seq           sequencer
	batch         Batch
	noReplayUntil time.Time
}

// NewSubscriber returns a Subscriber that calls h; start it with Run.
func NewSubscriber(cfg SubscriberConfig, h Handler) *Subscriber {
	s := &Subscriber{
		cfg: cfg, h: h,
		log:            cfg.Logger.With().Str("endpoint", cfg.Endpoint).Logger(),
		minBackoff:     100 * time.Millisecond,
		maxBackoff:     5 * time.Second,
		replayIdle:     2 * time.Second,
		replayTotal:    time.Minute,
		replayCooldown: 10 * time.Second,
	}
	s.guard, s.guardErr = newConnGuard(cfg.MaxMessageBytes, cfg.HandshakeTimeout, s.log)
	return s
}

// Stats returns a snapshot of the counters; safe from any goroutine.
func (s *Subscriber) Stats() SubscriberStats {
	st := &s.stats
	out := SubscriberStats{
		Messages: st.messages.Load(), Batches: st.batches.Load(), Malformed: st.malformed.Load(),
		DecodeErrors: st.decodeErrors.Load(), Filtered: st.filtered.Load(), Duplicates: st.duplicates.Load(),
		Gaps: st.gaps.Load(), Replayed: st.replayed.Load(), ReplayErrors: st.replayErrors.Load(),
		Resets: st.resets.Load(), Reconnects: st.reconnects.Load(), LastSeq: st.lastSeq.Load(),
		Connected: st.connected.Load(),
	}
	if s.guard != nil {
		out.Oversized, out.HandshakeFailures = s.guard.oversized.Load(), s.guard.failed.Load()
	}
	return out
}

// zmqLog keeps go-zeromq's own stderr logging out of the process output.
var zmqLog = log.New(io.Discard, "", 0)

// Run receives until ctx is done, reconnecting with backoff whenever the
// publisher goes away. It returns nil when ctx ends, and an error only if the
// configuration is unusable (no endpoint, or Bind cannot listen at start).
func (s *Subscriber) Run(ctx context.Context) error {
	if s.cfg.Endpoint == "" {
		return errors.New("kvevents: subscriber needs an endpoint")
	}
	if s.guardErr != nil {
		return s.guardErr
	}
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("kvevents: Subscriber.Run called twice")
	}
	defer s.running.Store(false)
	ctx = withGuard(ctx, s.guard) // for every socket made from it

	backoff := s.minBackoff
	for attempt := 0; ctx.Err() == nil; attempt++ {
		received, err := s.session(ctx, attempt)
		if ctx.Err() != nil {
			return nil
		}
		var le *listenError
		if errors.As(err, &le) && attempt == 0 {
			return err
		}
		if received {
			backoff = s.minBackoff
		}
		s.log.Info().Err(err).Dur("retry_in", backoff).Msg("kv events connection lost; reconnecting")
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, s.maxBackoff)
	}
	return nil
}

type listenError struct{ err error }

func (e *listenError) Error() string { return e.err.Error() }
func (e *listenError) Unwrap() error { return e.err }

type received struct {
	frames [][]byte
	err    error
}

// session runs one socket from open to failure. go-zeromq sockets do not
// recover from a lost peer (Recv returns io.EOF for good) and its automatic
// reconnect races with Close, so each session gets a fresh socket, closed
// only after its receive goroutine is told to stop.
func (s *Subscriber) session(ctx context.Context, attempt int) (gotMessages bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	opts := []zmq4.Option{zmq4.WithDialerRetry(250 * time.Millisecond), zmq4.WithDialerMaxRetries(-1), zmq4.WithLogger(zmqLog)}
	var joined chan struct{} // Bind: a publisher connected
	if s.cfg.Bind {
		joined = make(chan struct{}, 1)
		opts = append(opts, zmq4.WithSecurity(joinSignal{null.Security(), joined}))
	}
	sock := zmq4.NewSub(sctx, opts...)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		sock.Close()
		wg.Wait()
		s.stats.connected.Store(false)
	}()
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return false, err
	}
	if s.cfg.Bind {
		if err := sock.Listen(guarded(s.cfg.Endpoint)); err != nil {
			return false, &listenError{err}
		}
	} else if err := sock.Dial(guarded(s.cfg.Endpoint)); err != nil { // retries until connected or ctx ends
		return false, err
	}
	s.stats.connected.Store(true)
	if attempt > 0 {
		s.stats.reconnects.Add(1)
	}
	s.log.Info().Bool("bind", s.cfg.Bind).Msg("kv events socket up")
	s.seq.reconnected()
	if attempt > 0 && !s.cfg.Bind && s.seq.have {
		s.checkContinuity(sctx)
	}

	in := make(chan received, 1024)
	wg.Add(1)
	go s.receive(sctx, sock, in, &wg)
	for {
		select {
		case <-ctx.Done():
			return gotMessages, nil
		case <-joined:
			s.publisherJoined(sctx)
		case m := <-in:
			select {
			case <-joined:
				// A join is signalled before the publisher's first message
				// can be received, so this one may be it: the join first.
				s.publisherJoined(sctx)
			default:
			}
			if m.err != nil && s.cfg.Bind {
				// A connecting publisher went away; the listener goes on. The
				// next one to connect may be the same publisher restarted.
				s.log.Debug().Err(m.err).Msg("kv events publisher disconnected")
				continue
			}
			if m.err != nil {
				return gotMessages, m.err
			}
			gotMessages = true
			s.onMessage(ctx, m.frames)
		}
	}
}

// joinSignal is the NULL security mechanism (what vLLM's publisher speaks)
// that also reports each peer completing its handshake: go-zeromq tells a
// listening socket's owner of no connection otherwise. Signals coalesce: one
// pending covers every peer that joined before it is taken.
type joinSignal struct {
	zmq4.Security
	joined chan<- struct{}
}

func (j joinSignal) Handshake(conn *zmq4.Conn, server bool) error {
	if err := j.Security.Handshake(conn, server); err != nil {
		return err
	}
	select {
	case j.joined <- struct{}{}:
	default:
	}
	return nil
}

// publisherJoined runs in Bind mode when a publisher has connected, before
// anything it sent is handled. It may be the engine restarted: its numbers
// start over, and if it restarted idle it sends nothing that shows it, so
// with a ring to ask continuity is checked as after a redial. Every join is
// checked, not only one after a publisher was seen to leave: a replacement
// can connect before the old connection is found dead (a peer that vanished
// without closing it holds it open until TCP keepalive gives up); for the
// same reason the threshold for numbers going back is set here, not when a
// publisher leaves. Several publishers at once are not one stream of
// numbers and were never followed as such; a join while one stays
// connected only costs a passing check.
func (s *Subscriber) publisherJoined(ctx context.Context) {
	s.seq.reconnected()
	if s.cfg.ReplayEndpoint != "" && s.seq.have {
		s.checkContinuity(ctx)
	}
}

// checkContinuity runs after reconnecting to a publisher that went away
// (Bind: when one connects): an engine that restarted and has not stored
// anything yet sends nothing, so its sequence numbers cannot reveal the
// restart. Its replay ring can: it still holds our last batch only if it is
// the same publisher. What the ring holds after that batch was published
// while we were away, and is applied at once (on an idle engine no live
// batch would reveal the gap). Without a ring to ask, continuity cannot be
// proved, and a set that may list blocks the engine no longer has is worse
// than an empty one.
func (s *Subscriber) checkContinuity(ctx context.Context) {
	last := s.seq.last
	if s.cfg.ReplayEndpoint == "" {
		s.reset("publisher connection lost and no replay endpoint to prove it did not restart")
		s.seq.reconnected()
		return
	}
	// No live number is in hand, so nothing bounds the replay; the ring's
	// first reply must be our last batch itself.
	first, err := s.replay(ctx, math.MaxUint64, false)
	switch {
	case err != nil && ctx.Err() != nil: // stopping
	case err != nil && first == rUnknown:
		s.stats.replayErrors.Add(1)
		s.reset(fmt.Sprintf("publisher reconnected and its replay failed (%v): it may have restarted", err))
	case err != nil:
		// The first reply decided (and reset if it had to); a gap left
		// is found by the next live batch.
		s.stats.replayErrors.Add(1)
		s.log.Warn().Err(err).Msg("kv events catch-up after reconnecting failed")
	case first == rUnknown:
		s.reset(fmt.Sprintf("publisher restarted while disconnected: its replay ring no longer holds batch %d", last))
	}
	if first != rContinues {
		s.seq.liveAfresh()
	}
	// Otherwise the live threshold stays at our last batch from before the
	// replay: live batches up to the last one it delivered are duplicates
	// (they were published while it ran), not a restart.
}

// receive only moves messages from the socket to in, so the socket stays
// drained while the other goroutine decodes, calls the handler or replays.
func (s *Subscriber) receive(ctx context.Context, sock zmq4.Socket, in chan<- received, wg *sync.WaitGroup) {
	defer wg.Done()
	for {
		msg, err := sock.Recv()
		if ctx.Err() != nil {
			return
		}
		select {
		case in <- received{msg.Frames, err}:
		case <-ctx.Done():
			return
		}
		switch {
		case err == nil:
		case s.cfg.Bind:
			// A listening socket outlives its peers: go on receiving, but
			// never spin on repeated errors.
			time.Sleep(10 * time.Millisecond)
		default:
			return // a dialed socket is dead once its peer is gone
		}
	}
}

func (s *Subscriber) onMessage(ctx context.Context, frames [][]byte) {
	s.stats.messages.Add(1)
	seq, payload, filtered, err := parseLive(frames, s.cfg.Topic)
	switch {
	case err != nil:
		s.stats.malformed.Add(1)
		s.log.Debug().Err(err).Msg("kv events message skipped")
		return
	case filtered:
		s.stats.filtered.Add(1)
		return
	}

	v := s.seq.live(seq)
	if v == vRestart {
		s.reset(fmt.Sprintf("sequence went back from %d to %d: publisher restarted", s.seq.lastLive, seq))
		v = vCatchUp
		if seq == 0 {
			v = vNext
		}
	}
	s.seq.sawLive(seq)
	switch v {
	case vDuplicate:
		s.stats.duplicates.Add(1)
		return
	case vNext:
		s.deliver(seq, payload)
		return
	}

	// Catch up: batches before seq are missing, or none was delivered yet.
	if s.seq.have {
		s.stats.gaps.Add(1)
	}
	switch {
	case s.cfg.ReplayEndpoint != "" && time.Now().After(s.noReplayUntil):
		// A second pass only after the first found a restarted publisher:
		// then its history is fetched from 0.
		for pass := 0; pass < 2; pass++ {
			first, err := s.replay(ctx, seq, true)
			if err != nil {
				s.stats.replayErrors.Add(1)
				s.noReplayUntil = time.Now().Add(s.replayCooldown)
				s.log.Warn().Err(err).Msg("kv events replay failed")
			}
			if first != rRestarted || err != nil {
				break
			}
		}
	case s.seq.have:
		s.reset(fmt.Sprintf("batches %d..%d missed and replay unavailable (none configured, or failing)", s.seq.last+1, seq-1))
	}
	switch {
	case s.seq.have && seq <= s.seq.last: // the replay delivered it
	case s.seq.have && seq == s.seq.last+1:
		s.deliver(seq, payload)
	default:
		if s.seq.have {
			s.reset(fmt.Sprintf("replay ended at %d, short of %d", s.seq.last, seq))
		}
		s.deliver(seq, payload)
	}
}

// deliver decodes and hands over one batch. A payload that does not decode
// is counted and skipped, and still advances the sequence: replaying it
// would give the same bytes.
func (s *Subscriber) deliver(seq uint64, payload []byte) bool {
	s.seq.delivered(seq, xxhash.Sum64(payload))
	s.stats.lastSeq.Store(seq)
	if err := DecodeBatch(payload, &s.batch); err != nil {
		s.stats.decodeErrors.Add(1)
		s.log.Warn().Err(err).Uint64("seq", seq).Msg("kv events batch skipped")
		return false
	}
	s.stats.batches.Add(1)
	s.h.HandleBatch(seq, &s.batch)
	return true
}

func (s *Subscriber) reset(reason string) {
	s.stats.resets.Add(1)
	s.log.Warn().Str("reason", reason).Msg("kv events reset")
	s.seq.forget()
	s.h.HandleReset(reason)
}

// replay asks the ROUTER for everything from the replay start on and
// delivers it in order, resetting first if the ring does not continue what
// was delivered before. upto is the live sequence number that triggered it:
// when the ring has nothing from at or before it, the replay is abandoned
// after the reset and delivery goes on from the live stream, which loses less.
// first is the judgement of the first reply (rUnknown if none came or
// nothing was delivered before); rRestarted means the ring holds a different
// batch under the last delivered number: a new publisher, whose history
// starts at 0.
//
// trustNext accepts a ring whose oldest batch is the one after our last,
// which fills the gap but proves nothing by itself. A gap seen on the live
// stream allows it: the publisher there is known to be the one that sent
// our last batch. A restarted engine comes as a new connection (in Bind
// mode, a publisher joining), and each is checked by checkContinuity,
// which wants our last batch itself, before anything it sends is handled:
// it passes, or the state is reset. checkContinuity itself must not trust.
func (s *Subscriber) replay(ctx context.Context, upto uint64, trustNext bool) (first resumption, err error) {
	from, verify := s.seq.replayStart()
	err = fetchReplay(ctx, s.cfg.ReplayEndpoint, from, s.replayIdle, s.replayTotal, func(seq uint64, payload []byte) bool {
		if verify {
			verify = false
			first = s.seq.resumes(seq, xxhash.Sum64(payload), trustNext)
			switch first {
			case rRestarted:
				s.reset(fmt.Sprintf("replayed batch %d differs from the one delivered: publisher restarted", seq))
				return false
			case rShort:
				why := "the ring no longer covers the gap"
				if !trustNext {
					why = "the ring no longer holds our last batch to prove the publisher did not restart"
				}
				s.reset(fmt.Sprintf("replay from %d starts at %d: %s", from, seq, why))
				if seq > upto {
					return false
				}
			}
		}
		if s.seq.have {
			if seq <= s.seq.last {
				return true
			}
			if seq > s.seq.last+1 {
				s.reset(fmt.Sprintf("replay skips batches %d..%d", s.seq.last+1, seq-1))
				if seq > upto {
					return false
				}
			}
		}
		if s.deliver(seq, payload) {
			s.stats.replayed.Add(1)
		}
		return true
	})
	return first, err
}

// fetchReplay runs one replay over a fresh DEALER: it sends ["", from8] and
// passes each reply to yield until the end marker or yield returns false. A DEALER, not a REQ,
// because the ROUTER sends many replies to one request.
func fetchReplay(ctx context.Context, endpoint string, from uint64, idle, total time.Duration, yield func(seq uint64, payload []byte) bool) error {
	rctx, cancel := context.WithTimeout(ctx, total)
	dealer := zmq4.NewDealer(rctx, zmq4.WithDialerRetry(100*time.Millisecond), zmq4.WithDialerMaxRetries(10), zmq4.WithLogger(zmqLog))
	var wg sync.WaitGroup
	defer func() {
		cancel()
		dealer.Close()
		wg.Wait()
	}()
	if err := dealer.Dial(guarded(endpoint)); err != nil {
		return fmt.Errorf("replay dial: %w", err)
	}
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, seqBytes(from))); err != nil {
		return fmt.Errorf("replay request: %w", err)
	}
	replies := make(chan received, 256)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			msg, err := dealer.Recv()
			select {
			case replies <- received{msg.Frames, err}:
			case <-rctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	timer := time.NewTimer(idle)
	defer timer.Stop()
	for {
		select {
		case <-rctx.Done():
			return fmt.Errorf("replay from %d: %w", from, rctx.Err())
		case <-timer.C:
			return fmt.Errorf("replay from %d: no reply for %v", from, idle)
		case m := <-replies:
			if m.err != nil {
				return fmt.Errorf("replay from %d: %w", from, m.err)
			}
			seq, payload, end, err := parseReplay(m.frames)
			if err != nil {
				return err
			}
			if end {
				return nil
			}
			if !yield(seq, payload) {
				return nil
			}
			timer.Reset(idle)
		}
	}
}
