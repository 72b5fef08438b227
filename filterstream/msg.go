package filterstream

import (
	"fmt"
)

// Kind names a message sent point to point between members (never gossiped).
type Kind uint8

const (
	KindLoad        Kind = iota + 1 // sidecar → router, ~10 Hz
	KindSnapshot                    // sidecar → router: a whole filter generation
	KindDelta                       // sidecar → router: keys added since the previous delta
	KindResync                      // router → sidecar: send the deltas I miss, or a snapshot
	KindClearRoutes                 // router → sidecars and routers
	KindInflight                    // router → sidecar: what this router has in flight there
	KindTenantUsage                 // router → routers: what each tenant used here in the last minute

	// MaxKind is the highest kind this build knows (counters index by kind).
	MaxKind = KindTenantUsage
)

// String names the kind as metrics label it ("load", "delta", ...).
func (k Kind) String() string {
	switch k {
	case KindLoad:
		return "load"
	case KindSnapshot:
		return "snapshot"
	case KindDelta:
		return "delta"
	case KindResync:
		return "resync"
	case KindClearRoutes:
		return "clear_routes"
	case KindInflight:
		return "inflight"
	case KindTenantUsage:
		return "tenant_usage"
	}
	return fmt.Sprintf("kind%d", uint8(k))
}

const (
	msgMagic   = 0x6b // 'k'
	msgVersion = 1
	// maxNames bounds a route-clear list (a selection is at most 50 replicas;
	// leave room for larger fleets).
	maxNames = 4096
	// maxTenants bounds a tenant-usage report (tenants come from the
	// routers' config).
	maxTenants = 4096
	// maxPayload bounds a filter payload: memberlist's own reliable-message cap.
	maxPayload = 20 << 20
)

// MaxFilterPayload is the largest filter encoding (bloom snapshot) a
// sidecar can send: memberlist refuses a reliable message over 20 MiB, and
// the message also holds its header (a sender name of up to 255 bytes) and
// memberlist's stream framing and AES-GCM nonce and tag; 1 KiB covers them.
// A bigger snapshot would be dropped by every router, so a sidecar refuses
// at start a capacity whose filter would be bigger.
const MaxFilterPayload = maxPayload - 1<<10

// Load is a sidecar's load record.
type Load struct {
	Healthy bool // engine answers /health; false announces it offline
	// Leaving: the sidecar's last record as it leaves the cluster on
	// purpose (a drain); routers take the replica out of routing, where a
	// sidecar that fails leaves its engine routed by load. Implies
	// !Healthy (older routers read it as a bad record and drop it).
	Leaving bool
	Waiting int
	Running int
	KVUsage float32
	// InflightRequests/InflightPrefillTokens are summed over the routers'
	// reports for this replica (expired when a router falls silent): every
	// router's, or, for a router announcing CapInflightOthers, every other
	// router's.
	InflightRequests      int
	InflightPrefillTokens int
	// FilterGen/FilterSeq name the last filter message sent, so a router
	// notices a lost trailing delta without waiting for the next one.
	FilterGen  uint64
	FilterSeq  uint64
	FilterKeys int // exact resident set size
}

// Message is one decoded message. Which fields are set depends on Kind.
type Message struct {
	Kind Kind
	From string // sender's member name
	// Epoch is the sender's boot epoch. For a resync it is the epoch of the
	// sidecar state the router holds (0 when none).
	Epoch uint64
	// Seq: load-record sequence (KindLoad), in-flight report sequence
	// (KindInflight), clear id (KindClearRoutes), or the last delta the
	// router holds of generation Gen (KindResync). Filter messages carry
	// their generation and sequence inside bloom's encoding.
	Seq uint64
	// Gen is the filter generation a resync asks to continue (KindResync);
	// 0 asks for a snapshot.
	Gen uint64

	Load Load
	// Payload is bloom's encoding of a snapshot or delta (KindSnapshot,
	// KindDelta). Decode aliases it into its input.
	Payload []byte
	// Names are the replicas whose route records to clear; empty means all
	// (KindClearRoutes).
	Names []string
	// Requests and PrefillTokens are a router's in-flight work at the
	// recipient's replica (KindInflight).
	Requests      int
	PrefillTokens int
	// Usage is a router's whole per-tenant report (KindTenantUsage): a
	// tenant left out used nothing there.
	Usage []TenantUsage
}

// TenantUsage is what one router admitted of a tenant over the last minute,
// and the part of its share of the tenant's quota it has not spent yet
// (which the others count as used: package quota).
type TenantUsage struct {
	Tenant                           string
	Requests, Tokens                 int64
	ReservedRequests, ReservedTokens int64
}

// Append appends m's encoding to dst.
func (m *Message) Append(dst []byte) []byte {
	w := writer{b: dst}
	w.byte(msgMagic)
	w.byte(msgVersion)
	w.byte(byte(m.Kind))
	w.str(m.From)
	w.u64(m.Epoch)
	w.uvarint(m.Seq)
	switch m.Kind {
	case KindLoad:
		l := &m.Load
		var h byte
		switch {
		case l.Leaving:
			h = 2
		case l.Healthy:
			h = 1
		}
		w.byte(h)
		w.uvarint(uint64(max(l.Waiting, 0)))
		w.uvarint(uint64(max(l.Running, 0)))
		w.f32(l.KVUsage)
		w.uvarint(uint64(max(l.InflightRequests, 0)))
		w.uvarint(uint64(max(l.InflightPrefillTokens, 0)))
		w.uvarint(l.FilterGen)
		w.uvarint(l.FilterSeq)
		w.uvarint(uint64(max(l.FilterKeys, 0)))
	case KindSnapshot, KindDelta:
		w.b = append(w.b, m.Payload...)
	case KindResync:
		w.uvarint(m.Gen)
	case KindClearRoutes:
		w.uvarint(uint64(len(m.Names)))
		for _, n := range m.Names {
			w.str(n)
		}
	case KindInflight:
		w.uvarint(uint64(max(m.Requests, 0)))
		w.uvarint(uint64(max(m.PrefillTokens, 0)))
	case KindTenantUsage:
		w.uvarint(uint64(len(m.Usage)))
		for _, u := range m.Usage {
			w.str(u.Tenant)
			for _, v := range [...]int64{u.Requests, u.Tokens, u.ReservedRequests, u.ReservedTokens} {
				w.uvarint(uint64(max(v, 0)))
			}
		}
	}
	return w.b
}

// Decode parses one message. Payload aliases b; copy b first if it is reused.
// Fields a later version appends to a load record, resync, route clear,
// in-flight or tenant-usage report are ignored; a message cut short is rejected.
func Decode(b []byte) (Message, error) {
	var m Message
	r := reader{b: b}
	if r.byte() != msgMagic && r.err == nil {
		return m, fmt.Errorf("filterstream: not a kvmesh message")
	}
	if v := r.byte(); v != msgVersion && r.err == nil {
		return m, fmt.Errorf("filterstream: message version %d, want %d", v, msgVersion)
	}
	m.Kind = Kind(r.byte())
	m.From = r.str(255)
	m.Epoch = r.u64()
	m.Seq = r.uvarint()
	const maxCount = 1 << 31
	switch m.Kind {
	case KindLoad:
		l := &m.Load
		switch r.byte() {
		case 0:
		case 1:
			l.Healthy = true
		case 2:
			l.Leaving = true
		default:
			r.fail(fmt.Errorf("filterstream: bad health flag"))
		}
		l.Waiting = r.int(maxCount)
		l.Running = r.int(maxCount)
		l.KVUsage = r.f32()
		l.InflightRequests = r.int(maxCount)
		l.InflightPrefillTokens = r.int(maxCount)
		l.FilterGen = r.uvarint()
		l.FilterSeq = r.uvarint()
		l.FilterKeys = r.int(maxCount)
		if !(l.KVUsage >= 0 && l.KVUsage <= 1.5) { // also rejects NaN
			r.fail(fmt.Errorf("filterstream: kv usage %v out of range", l.KVUsage))
		}
	case KindSnapshot, KindDelta:
		m.Payload = r.rest()
		if len(m.Payload) > maxPayload {
			r.fail(fmt.Errorf("filterstream: payload of %d bytes", len(m.Payload)))
		}
	case KindResync:
		m.Gen = r.uvarint()
	case KindClearRoutes:
		n := r.int(maxNames)
		for i := 0; i < n && r.err == nil; i++ {
			m.Names = append(m.Names, r.str(255))
		}
	case KindInflight:
		m.Requests = r.int(maxCount)
		m.PrefillTokens = r.int(maxCount)
	case KindTenantUsage:
		n := r.int(maxTenants)
		for i := 0; i < n && r.err == nil; i++ {
			u := TenantUsage{Tenant: r.str(255)}
			for _, v := range [...]*int64{&u.Requests, &u.Tokens, &u.ReservedRequests, &u.ReservedTokens} {
				*v = int64(r.int(1 << 62))
			}
			m.Usage = append(m.Usage, u)
		}
	default:
		r.fail(fmt.Errorf("filterstream: unknown message kind %d", uint8(m.Kind)))
	}
	// Bytes left after the fields of a fixed-layout kind are fields a later
	// version appended: ignored, so that versions can be mixed in a
	// rolling upgrade. Snapshots and deltas take the rest as their payload.
	if r.err != nil {
		return Message{}, r.err
	}
	if m.From == "" {
		return Message{}, fmt.Errorf("filterstream: %s message without a sender", m.Kind)
	}
	return m, nil
}
