package fleetsim

import (
	"time"
	"unsafe"

	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
)

// Gossip is the filter-stream traffic the network delivered to one router
// (router-0) while requests arrived: messages and bytes by kind, the bytes
// being each message's own encoding (filterstream's Append), without
// memberlist's framing (DatagramOverhead, StreamOverhead).
type Gossip struct {
	// Window is the simulated time counted: from the first arrival to the
	// last.
	Window   time.Duration
	Messages [filterstream.MaxKind + 1]int64
	Bytes    [filterstream.MaxKind + 1]int64
}

// memberlist's framing around a kvmesh message, as gossip sends them
// (memberlist v0.7's net.go and security.go; gossip's sender binding
// parses the same): a datagram carries the cluster label header (2 bytes
// and the label, "kvmesh" by default), AES-GCM (a version byte, a 12-byte
// nonce, a 16-byte tag) when a key is set, a CRC (5 bytes) and the
// user-message type byte; a stream the label header, the encrypted frame's
// type and length (5 bytes) and AES-GCM, the type byte and msgpack's
// {"UserMsgLen": n} (17 bytes at most). UDP/IP and TCP headers and a
// stream's connection setup come on top.
const (
	DatagramOverhead = 8 + 29 + 5 + 1
	StreamOverhead   = 8 + 5 + 29 + 1 + 17
)

// Total sums the messages and bytes of every kind.
func (g *Gossip) Total() (messages, bytes int64) {
	for k := range g.Bytes {
		messages += g.Messages[k]
		bytes += g.Bytes[k]
	}
	return messages, bytes
}

// PerSecond is n over the window, per simulated second.
func (g *Gossip) PerSecond(n int64) float64 {
	if g.Window <= 0 {
		return 0
	}
	return float64(n) / g.Window.Seconds()
}

// RouterMemory is what router-0 holds for the fleet's replicas at the end
// of a run: its receiver's footprint (mirrored filters, buffered deltas,
// per-sidecar state) and its table's (each replica's entry and its copy in
// the current snapshot, strings included).
type RouterMemory struct {
	filterstream.Footprint
	TableBytes int
}

// PerReplica is the total over the replicas the receiver follows.
func (m RouterMemory) PerReplica() float64 {
	if m.Sidecars == 0 {
		return 0
	}
	return float64(m.FilterBytes+m.PendingBytes+m.StateBytes+m.TableBytes) / float64(m.Sidecars)
}

// countGossip adds msg, delivered to router-0 now, to the gossip figures
// when it was sent while requests arrived.
func (s *sim) countGossip(msg *filterstream.Message) {
	if s.now < s.cfg.Warmup || s.now > s.cfg.Warmup+s.w.Span() {
		return
	}
	s.wire = msg.Append(s.wire[:0])
	k := min(int(msg.Kind), int(filterstream.MaxKind))
	s.res.Gossip.Messages[k]++
	s.res.Gossip.Bytes[k] += int64(len(s.wire))
}

func (s *sim) routerMemory() RouterMemory {
	rt := s.routers[0]
	m := RouterMemory{Footprint: rt.recv.Footprint()}
	for _, r := range rt.table.Snapshot().Replicas {
		m.TableBytes += 2*int(unsafe.Sizeof(fleet.Replica{})) + len(r.Name) + len(r.URL) + len(r.Protocol)
		for _, name := range r.Models {
			m.TableBytes += int(unsafe.Sizeof(name)) + len(name)
		}
	}
	return m
}
