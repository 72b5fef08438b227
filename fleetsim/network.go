package fleetsim

import (
	"math/rand/v2"
	"time"
)

// Network models the links that carry the filter stream between sidecars
// and routers.
type Network struct {
	// Delay is every message's one-way latency; Jitter adds up to this
	// much more, uniformly drawn, so datagrams may overtake each other.
	Delay, Jitter time.Duration
	// Loss is the probability a datagram (load record, delta, resync,
	// in-flight report) is lost. Streams (snapshots) are never lost and
	// arrive in order on each link, as over TCP.
	Loss float64
}

// link is one direction between two members.
type link struct{ from, to int }

// network draws each message's fate from its own seeded source.
type network struct {
	cfg Network
	rng *rand.Rand
	// streamFree is when the last stream message on a link arrives: the
	// next cannot arrive before it.
	streamFree map[link]time.Duration
}

func newNetwork(cfg Network, seed uint64) *network {
	return &network{cfg: cfg, rng: rand.New(rand.NewPCG(seed, 0x6e6574)), streamFree: map[link]time.Duration{}}
}

// arrival is when a message sent at now on l arrives, and whether it does.
func (n *network) arrival(now time.Duration, l link, stream bool) (time.Duration, bool) {
	at := now + n.cfg.Delay
	if n.cfg.Jitter > 0 {
		at += time.Duration(n.rng.Int64N(int64(n.cfg.Jitter) + 1))
	}
	if stream {
		at = max(at, n.streamFree[l])
		n.streamFree[l] = at
		return at, true
	}
	if n.cfg.Loss > 0 && n.rng.Float64() < n.cfg.Loss {
		return 0, false
	}
	return at, true
}
