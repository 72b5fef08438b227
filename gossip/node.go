// Package gossip is kvmesh's control plane on hashicorp/memberlist: who is in
// the cluster (sidecars and routers, with ≤512 B of metadata each), failure
// detection, and carrying the filter stream (package filterstream) between
// them: each member's filterstream state machine — a Sender in a sidecar, a
// Receiver in a router — is fed the messages, membership changes and time
// this package receives, and the messages it returns are sent here.
//
// Nothing large rides memberlist's gossip rounds or push/pull: every message
// is sent point to point with SendBestEffort (one encrypted UDP datagram) or,
// for filter snapshots and route clears, SendReliable (one TCP stream). One
// port, one key, one cluster label cover all of it.
package gossip

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"log"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/filterstream"
)

// DefaultLabel is the cluster label when none is configured.
const DefaultLabel = "kvmesh"

// Config is what both roles need to join the cluster.
type Config struct {
	// Name identifies the member: the replica name for a sidecar, the router
	// name for a router. Member names are "<role>/<Name>", so a router and a
	// replica may share a name.
	Name string
	// BindAddr is host:port to listen on (UDP and TCP); port 0 picks one.
	BindAddr string
	// AdvertiseAddr is host:port others reach this member at; empty: derived
	// from BindAddr.
	AdvertiseAddr string
	// Join lists host:port of members to join; empty starts a new cluster.
	Join []string
	// Key encrypts every packet and stream (AES-GCM); 16, 24 or 32 bytes, or
	// nil for none.
	Key []byte
	// Label keeps clusters apart on one network (default DefaultLabel).
	Label string
	// TrustClaimedSender turns the sender check off: a message is then
	// taken to be from whichever member it names. Only for networks where
	// members do not send from the address they advertise (NAT between
	// them); any key holder can then speak for any member.
	TrustClaimedSender bool

	// Failure detection; zero values take the tuned defaults below.
	ProbeInterval  time.Duration // default 500 ms
	ProbeTimeout   time.Duration // default 250 ms
	SuspicionMult  int           // default 3
	GossipInterval time.Duration // default 100 ms

	Logger zerolog.Logger
}

// ParseKey decodes a --gossip-key value (base64 of 16, 24 or 32 bytes); an
// empty string means no encryption.
func ParseKey(s string) ([]byte, error) {
	if s == "" {
		return nil, nil
	}
	k, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, fmt.Errorf("gossip key: not base64: %w", err)
	}
	switch len(k) {
	case 16, 24, 32:
		return k, nil
	}
	return nil, fmt.Errorf("gossip key: %d bytes, want 16, 24 or 32", len(k))
}

// memberlistConfig turns c into memberlist's configuration: LAN defaults
// with faster failure detection (minimum suspicion 3 × log10(N) × 0.5 s,
// ≈ 2.5 s at N = 50; routers do not wait for it — a silent sidecar is
// dropped by the table within 1 s), no compression (filters do not compress
// and LZW triples the latency), and a short TCP timeout so a vanished peer
// does not hold a snapshot sender for 10 s.
func (c *Config) memberlistConfig(role filterstream.Role, d *delegate) (*memberlist.Config, error) {
	if c.Name == "" || len(c.Name) > 200 {
		return nil, fmt.Errorf("gossip: member name %q: want 1..200 bytes", c.Name)
	}
	mc := memberlist.DefaultLANConfig()
	mc.Name = role.String() + "/" + c.Name
	host, port, err := splitHostPort(c.BindAddr, "0.0.0.0", 7946)
	if err != nil {
		return nil, fmt.Errorf("gossip bind %q: %w", c.BindAddr, err)
	}
	mc.BindAddr, mc.BindPort = host, port
	mc.AdvertisePort = port
	if c.AdvertiseAddr != "" {
		ah, ap, err := splitHostPort(c.AdvertiseAddr, "", port)
		if err != nil {
			return nil, fmt.Errorf("gossip advertise %q: %w", c.AdvertiseAddr, err)
		}
		mc.AdvertiseAddr, mc.AdvertisePort = ah, ap
	}
	mc.ProbeInterval = orDur(c.ProbeInterval, 500*time.Millisecond)
	mc.ProbeTimeout = orDur(c.ProbeTimeout, 250*time.Millisecond)
	mc.SuspicionMult = c.SuspicionMult
	if mc.SuspicionMult <= 0 {
		mc.SuspicionMult = 3
	}
	mc.GossipInterval = orDur(c.GossipInterval, 100*time.Millisecond)
	mc.TCPTimeout = 2 * time.Second
	mc.EnableCompression = false
	mc.DeadNodeReclaimTime = 5 * time.Second // a restarted sidecar may come back at another address
	mc.Label = c.Label
	if mc.Label == "" {
		mc.Label = DefaultLabel
	}
	if len(mc.Label) > memberlist.LabelMaxSize {
		return nil, fmt.Errorf("gossip label: %d bytes, max %d", len(mc.Label), memberlist.LabelMaxSize)
	}
	if c.Key != nil {
		kr, err := memberlist.NewKeyring(nil, c.Key)
		if err != nil {
			return nil, fmt.Errorf("gossip key: %w", err)
		}
		mc.Keyring = kr
		mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	}
	mc.Delegate = d
	mc.Events = d
	mc.Logger = log.New(&logSink{log: c.Logger, stats: &d.stats}, "", 0)
	if !c.TrustClaimedSender {
		nt, err := netTransport(mc)
		if err != nil {
			return nil, err
		}
		st, err := newSenderTransport(nt, mc.BindAddr, d, mc.Label, c.Key, mc.TCPTimeout)
		if err != nil {
			_ = nt.Shutdown()
			return nil, fmt.Errorf("gossip key: %w", err)
		}
		go st.read()
		mc.Transport = st
		d.checkSender = true
	}
	return mc, nil
}

// netTransport binds memberlist's UDP and TCP listeners as memberlist
// would itself, retrying a dynamic port another socket took between the
// two binds, and fixes the port in mc.
func netTransport(mc *memberlist.Config) (*memberlist.NetTransport, error) {
	var err error
	for range 10 {
		var nt *memberlist.NetTransport
		nt, err = memberlist.NewNetTransport(&memberlist.NetTransportConfig{
			BindAddrs: []string{mc.BindAddr}, BindPort: mc.BindPort, Logger: mc.Logger})
		if err == nil {
			if mc.BindPort == 0 {
				mc.BindPort = nt.GetAutoBindPort()
				if mc.AdvertisePort == 0 {
					mc.AdvertisePort = mc.BindPort
				}
			}
			return nt, nil
		}
		if mc.BindPort != 0 || !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	return nil, fmt.Errorf("gossip: bind %s:%d: %w", mc.BindAddr, mc.BindPort, err)
}

func orDur(v, def time.Duration) time.Duration {
	if v > 0 {
		return v
	}
	return def
}

func splitHostPort(s, defHost string, defPort int) (string, int, error) {
	if s == "" {
		return defHost, defPort, nil
	}
	h, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, err
	}
	if h == "" {
		h = defHost
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("bad port %q", p)
	}
	return h, port, nil
}

// Stats count what a node received, sent and rejected. Read them with Load.
type Stats struct {
	Received      [filterstream.MaxKind + 1]atomic.Uint64 // decoded messages by kind
	ReceivedBytes [filterstream.MaxKind + 1]atomic.Uint64 // their bytes, by kind
	Sent          [filterstream.MaxKind + 1]atomic.Uint64 // messages sent by kind
	SentBytes     atomic.Uint64
	SendErrors    atomic.Uint64
	// BadMessages failed to decode (ours: wrong magic, truncated, garbage).
	BadMessages atomic.Uint64
	// Dropped were decoded fine but found the inbox full; QueueFull were
	// dropped earlier by memberlist (its handoff queue was full).
	Dropped   atomic.Uint64
	QueueFull atomic.Uint64
	// ForgedSender are messages whose From names a member other than the
	// one at the address they came from, or no live member; Unverified,
	// user messages in a form the sender check cannot read (compressed,
	// inside a compound packet), which kvmesh members never send.
	ForgedSender atomic.Uint64
	Unverified   atomic.Uint64
	// RejectedLabel, RejectedDecrypt and RejectedMalformed are packets and
	// streams memberlist refused: wrong cluster label, wrong key (or
	// plaintext into an encrypted cluster), or unparseable.
	RejectedLabel     atomic.Uint64
	RejectedDecrypt   atomic.Uint64
	RejectedMalformed atomic.Uint64
	// Resyncs are snapshot requests (sent by a router, received by a sidecar).
	Resyncs       atomic.Uint64
	ResyncReasons [filterstream.NumResyncReasons]atomic.Uint64 // router, by filterstream.ResyncReason
	// Resends are deltas a sidecar sent again to answer a resync.
	Resends atomic.Uint64
}

// logSink forwards memberlist's log lines to zerolog and counts the ones
// that mean a packet or stream was rejected (memberlist has no counters for
// those).
type logSink struct {
	log   zerolog.Logger
	stats *Stats
}

func (s *logSink) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	switch {
	case strings.Contains(line, "unacceptable label"), strings.Contains(line, "label header"):
		s.stats.RejectedLabel.Add(1)
	case strings.Contains(line, "ecrypt"), strings.Contains(line, "ncryption is configured"):
		s.stats.RejectedDecrypt.Add(1)
	case strings.Contains(line, "handler queue full"):
		s.stats.QueueFull.Add(1)
	case strings.Contains(line, "invalid checksum"), strings.Contains(line, "missing message type"),
		strings.Contains(line, "not supported"), strings.Contains(line, "invalid msgType"),
		strings.Contains(line, "Failed to decode"):
		s.stats.RejectedMalformed.Add(1)
	}
	ev := s.log.Debug()
	switch {
	case strings.HasPrefix(line, "[ERR"):
		ev = s.log.Warn()
	case strings.HasPrefix(line, "[WARN]"):
		ev = s.log.Info()
	}
	ev.Str("from", "memberlist").Msg(line)
	return len(p), nil
}

// member is what a node knows of another member.
type member struct {
	node *memberlist.Node // a private copy (memberlist reuses its own)
	meta filterstream.Meta
}

// event is a membership change, handed to the role's loop.
type event struct {
	kind   eventKind
	member member
}

type eventKind uint8

const (
	evJoin eventKind = iota + 1
	evUpdate
	evLeave
)

// delegate is the memberlist hook shared by both roles: it serves our
// metadata, copies incoming messages into an inbox and membership changes
// into an event queue, never blocking memberlist's goroutines.
type delegate struct {
	self  string // member name
	meta  atomic.Pointer[[]byte]
	inbox chan filterstream.Message
	evq   chan event
	stats Stats
	log   zerolog.Logger
	// checkSender: messages come through the sender check (deliver), and
	// memberlist's own NotifyMsg only with what the check could not read.
	checkSender bool
	members     memberAddrs
	forgedLog   zerolog.Logger // sampled: a forger must not flood the log
}

func newDelegate(self string, log zerolog.Logger) *delegate {
	return &delegate{self: self, inbox: make(chan filterstream.Message, 8192), evq: make(chan event, 1024), log: log,
		forgedLog: log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 10 * time.Second})}
}

func (d *delegate) NodeMeta(limit int) []byte {
	if p := d.meta.Load(); p != nil && len(*p) <= limit {
		return *p
	}
	return nil
}

func (d *delegate) NotifyMsg(b []byte) {
	if d.checkSender {
		d.stats.Unverified.Add(1)
		return
	}
	// b is reused by memberlist: decode from a copy the message may alias.
	d.deliver(bytes.Clone(b), nil, false)
}

// deliver decodes b (which the message may alias) and queues it; when src
// is set (the sender transport read it from there), only if its From is
// the member at src.
func (d *delegate) deliver(b []byte, src net.Addr, datagram bool) {
	m, err := filterstream.Decode(b)
	if err != nil {
		d.stats.BadMessages.Add(1)
		return
	}
	if src != nil && !d.members.binds(m.From, src, datagram) {
		d.stats.ForgedSender.Add(1)
		d.forgedLog.Warn().Str("claimed", m.From).Str("source", src.String()).Str("kind", m.Kind.String()).
			Msg("gossip message dropped: its sender is not the member it names")
		return
	}
	d.stats.Received[m.Kind].Add(1)
	d.stats.ReceivedBytes[m.Kind].Add(uint64(len(b)))
	select {
	case d.inbox <- m:
	default:
		d.stats.Dropped.Add(1)
	}
}

func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *delegate) LocalState(join bool) []byte                { return nil }
func (d *delegate) MergeRemoteState(buf []byte, join bool)     {}

func (d *delegate) NotifyJoin(n *memberlist.Node)   { d.membership(evJoin, n) }
func (d *delegate) NotifyUpdate(n *memberlist.Node) { d.membership(evUpdate, n) }
func (d *delegate) NotifyLeave(n *memberlist.Node)  { d.membership(evLeave, n) }

func (d *delegate) membership(k eventKind, n *memberlist.Node) {
	if n.Name == d.self {
		return
	}
	// At once, not through the event queue: memberlist calls this as it
	// changes its own view, which the sender check must follow exactly.
	if k == evLeave {
		d.members.remove(n.Name)
	} else {
		d.members.set(n)
	}
	cp := *n
	cp.Meta = bytes.Clone(n.Meta)
	ev := event{kind: k, member: member{node: &cp}}
	if k != evLeave {
		m, err := filterstream.DecodeMeta(cp.Meta)
		if err != nil {
			d.log.Warn().Err(err).Str("member", n.Name).Msg("ignoring member with bad metadata")
			return
		}
		ev.member.meta = m
	}
	select {
	case d.evq <- ev:
	default:
		// Never expected (1024 deep); the member will be seen on its next update.
		d.log.Warn().Str("member", n.Name).Msg("membership queue full")
	}
}

// node is a running memberlist member of either role.
type node struct {
	ml   *memberlist.Memberlist
	d    *delegate
	meta filterstream.Meta
	log  zerolog.Logger

	metaMu sync.Mutex
	down   atomic.Bool // left or shut down
	addr   string
	quit   chan struct{} // closed when the member stops

	sendBuf sync.Pool
}

func start(cfg Config, meta filterstream.Meta) (*node, error) {
	name := meta.Role.String() + "/" + cfg.Name
	d := newDelegate(name, cfg.Logger)
	n := &node{d: d, meta: meta, log: cfg.Logger}
	if err := n.setMeta(meta); err != nil {
		return nil, err
	}
	mc, err := cfg.memberlistConfig(meta.Role, d)
	if err != nil {
		return nil, err
	}
	ml, err := memberlist.Create(mc)
	if err != nil {
		if mc.Transport != nil {
			_ = mc.Transport.Shutdown()
		}
		return nil, fmt.Errorf("gossip: start member: %w", err)
	}
	n.ml = ml
	// Cached: memberlist's LocalNode is mutated in place by UpdateNode.
	ln := ml.LocalNode()
	n.addr = net.JoinHostPort(ln.Addr.String(), strconv.Itoa(int(ln.Port)))
	n.quit = make(chan struct{})
	if len(cfg.Join) > 0 {
		if _, err := ml.Join(cfg.Join); err != nil {
			// Not fatal: the peers may not be up yet; keep trying.
			cfg.Logger.Warn().Err(err).Strs("join", cfg.Join).Msg("join failed; retrying")
		}
		go n.rejoin(cfg.Join)
	}
	return n, nil
}

// rejoin joins the configured peers again whenever this member is alone
// (they were not up at start, or every peer was lost), every second at first
// and backing off to every 10 s.
func (n *node) rejoin(peers []string) {
	wait := time.Second
	for {
		select {
		case <-n.quit:
			return
		case <-time.After(wait):
		}
		if n.down.Load() || n.ml.NumMembers() > 1 {
			wait = time.Second
			continue
		}
		if k, err := n.ml.Join(peers); err == nil && k > 0 {
			n.log.Info().Strs("join", peers).Msg("joined the cluster")
			wait = time.Second
			continue
		}
		wait = min(2*wait, 10*time.Second)
	}
}

func (n *node) setMeta(m filterstream.Meta) error {
	b, dropped, err := m.Encode()
	if err != nil {
		return err
	}
	if dropped > 0 {
		n.log.Warn().Int("models_left_out", dropped).Msg("node metadata full: some model names not announced")
	}
	n.d.meta.Store(&b)
	return nil
}

// updateMeta announces new metadata to the cluster.
func (n *node) updateMeta(m filterstream.Meta) error {
	n.metaMu.Lock()
	defer n.metaMu.Unlock()
	if err := n.setMeta(m); err != nil {
		return err
	}
	n.meta = m
	return n.ml.UpdateNode(time.Second)
}

// send encodes m and sends it best effort (one datagram) or reliably (one
// TCP stream).
func (n *node) send(to *memberlist.Node, m *filterstream.Message, reliable bool) error {
	buf, _ := n.sendBuf.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	*buf = m.Append((*buf)[:0])
	var err error
	if reliable {
		err = n.ml.SendReliable(to, *buf)
	} else {
		err = n.ml.SendBestEffort(to, *buf)
	}
	if err != nil {
		n.d.stats.SendErrors.Add(1)
	} else {
		n.d.stats.Sent[m.Kind].Add(1)
		n.d.stats.SentBytes.Add(uint64(len(*buf)))
	}
	if cap(*buf) <= 1<<16 {
		n.sendBuf.Put(buf)
	}
	return err
}

// Addr is the address other members reach this one at (host:port).
func (n *node) Addr() string { return n.addr }

// Members counts live members, this one included.
func (n *node) Members() int { return n.ml.NumMembers() }

func (n *node) leave(timeout time.Duration) error {
	if n.down.Swap(true) {
		return nil
	}
	close(n.quit)
	if timeout <= 0 {
		timeout = 250 * time.Millisecond // memberlist would wait forever
	}
	err := n.ml.Leave(timeout)
	if serr := n.ml.Shutdown(); err == nil {
		err = serr
	}
	return err
}

// StatsSnapshot is a copy of a node's counters, for metrics and status (a
// sidecar's /status serves it as "cluster", in its snake_case).
type StatsSnapshot struct {
	Members int `json:"members"`
	// Received and Sent count messages by kind name ("load", "delta", ...),
	// ReceivedBytesByKind their bytes; ReceivedBytes is the total.
	Received            map[string]uint64 `json:"received"`
	Sent                map[string]uint64 `json:"sent"`
	ReceivedBytesByKind map[string]uint64 `json:"received_bytes_by_kind"`
	ReceivedBytes       uint64            `json:"received_bytes"`
	SentBytes           uint64            `json:"sent_bytes"`
	SendErrors          uint64            `json:"send_errors"`
	BadMessages         uint64            `json:"bad_messages"`
	Dropped             uint64            `json:"dropped"`
	QueueFull           uint64            `json:"queue_full"`
	ForgedSender        uint64            `json:"forged_sender"`
	Unverified          uint64            `json:"unverified"`
	RejectedLabel       uint64            `json:"rejected_label"`
	RejectedDecrypt     uint64            `json:"rejected_decrypt"`
	RejectedMalformed   uint64            `json:"rejected_malformed"`
	Resyncs             uint64            `json:"resyncs"`
	// ResyncReasons (router): "gap", "behind", "block_size".
	ResyncReasons map[string]uint64 `json:"resync_reasons"`
	Resends       uint64            `json:"resends"` // sidecar: deltas sent again for a resync
}

func (n *node) stats() StatsSnapshot {
	s := &n.d.stats
	out := StatsSnapshot{
		Members:             n.ml.NumMembers(),
		Received:            map[string]uint64{},
		Sent:                map[string]uint64{},
		ReceivedBytesByKind: map[string]uint64{},
		SentBytes:           s.SentBytes.Load(),
		SendErrors:          s.SendErrors.Load(),
		BadMessages:         s.BadMessages.Load(),
		ForgedSender:        s.ForgedSender.Load(),
		Unverified:          s.Unverified.Load(),
		Dropped:             s.Dropped.Load(),
		QueueFull:           s.QueueFull.Load(),
		RejectedLabel:       s.RejectedLabel.Load(),
		RejectedDecrypt:     s.RejectedDecrypt.Load(),
		RejectedMalformed:   s.RejectedMalformed.Load(),
		Resyncs:             s.Resyncs.Load(),
		Resends:             s.Resends.Load(),
		ResyncReasons:       map[string]uint64{},
	}
	for why := range filterstream.NumResyncReasons {
		out.ResyncReasons[why.String()] = s.ResyncReasons[why].Load()
	}
	for k := filterstream.KindLoad; k <= filterstream.MaxKind; k++ {
		out.Received[k.String()] = s.Received[k].Load()
		out.ReceivedBytesByKind[k.String()] = s.ReceivedBytes[k].Load()
		out.ReceivedBytes += s.ReceivedBytes[k].Load()
		out.Sent[k.String()] = s.Sent[k].Load()
	}
	return out
}
