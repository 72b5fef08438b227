package gossip

import (
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"hash/crc32"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// Sender binding. The gossip key proves only that a packet comes from some
// member: every member holds it. memberlist hands a delegate the payload
// of a user message without its source, so a message's From field was all
// that named its sender, and any key holder could speak as any replica (a
// forged "unhealthy" load record at 200/s kept a replica offline for as
// long as it ran). memberlist does bind each live member's name to the
// address it joined with (a second claimant of the name is refused), so
// kvmesh checks every message against that: a transport wrapped around
// memberlist's reads each user message before memberlist does, and hands
// it on only when the member its From names is live at the address it came
// from: the exact IP and port for a datagram (members send from their bound
// UDP port), the IP for a stream (whose source port is ephemeral). A key
// holder can then speak for itself only, unless it can send from the
// victim's address (raw sockets on the path, or the victim's host for
// streams).
//
// The wrapper parses memberlist's own framing (label header, AES-GCM,
// checksum, message type; for streams the length and msgpack header),
// pinned by go.mod; what it does not recognise goes to memberlist
// unchanged, and a user message memberlist then finds in it (inside a
// compound or compressed packet, which kvmesh members never send) reaches
// the delegate's NotifyMsg, which drops it as unverified.

// memberlist's message types (its net.go) and limits.
const (
	mlUserMsg     = 8
	mlEncryptMsg  = 10
	mlHasCrcMsg   = 12
	mlHasLabelMsg = 244
	// mlEncryptV1 is the encryption version of protocol versions ≥ 2.
	mlEncryptV1 = 1
	mlNonceSize = 12
	// mlMaxStream is memberlist's cap on an encrypted stream message.
	mlMaxStream = 20 * 1024 * 1024
)

// senderTransport is memberlist's UDP/TCP transport with sender binding.
type senderTransport struct {
	*memberlist.NetTransport
	d       *delegate
	local   *net.TCPAddr // streams leave from the bound IP; nil: any
	label   string
	aead    cipher.AEAD // nil: the cluster is not encrypted
	timeout time.Duration

	packets chan *memberlist.Packet
	streams chan net.Conn
	// quit: stop handing memberlist anything; done: the listeners are
	// closed, stop reading them (until then they must be drained, or
	// closing them waits forever on a blocked send).
	quit, done chan struct{}
	stop       sync.Once
}

func newSenderTransport(nt *memberlist.NetTransport, bindIP string, d *delegate, label string, key []byte, timeout time.Duration) (*senderTransport, error) {
	t := &senderTransport{NetTransport: nt, d: d, label: label, timeout: timeout,
		packets: make(chan *memberlist.Packet), streams: make(chan net.Conn),
		quit: make(chan struct{}), done: make(chan struct{})}
	if key != nil {
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, err
		}
		if t.aead, err = cipher.NewGCM(block); err != nil {
			return nil, err
		}
	}
	if ip := net.ParseIP(bindIP); ip != nil && !ip.IsUnspecified() {
		t.local = &net.TCPAddr{IP: ip}
	}
	return t, nil
}

func (t *senderTransport) PacketCh() <-chan *memberlist.Packet { return t.packets }
func (t *senderTransport) StreamCh() <-chan net.Conn           { return t.streams }

// DialAddressTimeout dials from the bound IP, so that a host's other
// addresses (or another loopback address) do not make the stream look
// like another member's.
func (t *senderTransport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	return t.DialTimeout(a.Addr, timeout)
}

func (t *senderTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	if t.local != nil {
		d.LocalAddr = t.local
	}
	return d.Dial("tcp", addr)
}

func (t *senderTransport) Shutdown() error {
	var err error
	t.stop.Do(func() {
		close(t.quit)
		err = t.NetTransport.Shutdown()
		close(t.done)
	})
	return err
}

// read takes what the listeners receive, until Shutdown: user messages it
// checks and delivers itself, the rest it hands memberlist.
func (t *senderTransport) read() {
	packets, streams := t.NetTransport.PacketCh(), t.NetTransport.StreamCh()
	for {
		select {
		case <-t.done:
			return
		case c := <-streams:
			go t.stream(c)
		case p := <-packets:
			if t.claimPacket(p) {
				continue
			}
			select {
			case t.packets <- p:
			case <-t.quit:
			}
		}
	}
}

// claimPacket delivers a datagram carrying one user message itself and
// reports true; it reports false for what memberlist is to handle (its
// own messages, and anything it will reject and count).
func (t *senderTransport) claimPacket(p *memberlist.Packet) bool {
	buf, label, err := memberlist.RemoveLabelHeaderFromPacket(p.Buf)
	if err != nil || label != t.label {
		return false
	}
	if t.aead != nil {
		if buf = t.open(buf, []byte(label)); buf == nil {
			return false
		}
	}
	if len(buf) >= 5 && buf[0] == mlHasCrcMsg {
		if crc32.ChecksumIEEE(buf[5:]) != binary.BigEndian.Uint32(buf[1:5]) {
			return false
		}
		buf = buf[5:]
	}
	if len(buf) == 0 {
		return false
	}
	if buf[0] != mlUserMsg {
		return false
	}
	t.d.deliver(buf[1:], p.From, true)
	return true
}

// open decrypts memberlist's AES-GCM encoding (version, nonce, sealed
// text); nil when it does not open, which memberlist will then report.
func (t *senderTransport) open(b, ad []byte) []byte {
	if len(b) < 1+mlNonceSize+t.aead.Overhead() || b[0] != mlEncryptV1 {
		return nil
	}
	plain, err := t.aead.Open(nil, b[1:1+mlNonceSize], b[1+mlNonceSize:], ad)
	if err != nil {
		return nil
	}
	return plain
}

// stream reads the start of an incoming stream: a user message is
// delivered here and the stream closed (memberlist answers none); anything
// else is replayed to memberlist from its first byte.
func (t *senderTransport) stream(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(t.timeout))
	pk := &peekConn{Conn: c}
	if payload, ok := t.peekUser(pk); ok {
		_ = c.Close()
		t.d.deliver(payload, c.RemoteAddr(), false)
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	pk.replay = true
	select {
	case t.streams <- pk:
	case <-t.quit:
		_ = c.Close()
	}
}

// peekUser reads a user message from the stream; false when the stream is
// memberlist's own (push/pull, ping), one it will refuse, or a user message
// in a form kvmesh never sends.
func (t *senderTransport) peekUser(pk *peekConn) ([]byte, bool) {
	label := ""
	b, err := pk.next(1)
	if err != nil {
		return nil, false
	}
	if b[0] == mlHasLabelMsg {
		n, err := pk.next(1)
		if err != nil || n[0] == 0 {
			return nil, false
		}
		l, err := pk.next(int(n[0]))
		if err != nil {
			return nil, false
		}
		label = string(l)
		if b, err = pk.next(1); err != nil {
			return nil, false
		}
	}
	if label != t.label {
		return nil, false
	}
	if t.aead == nil {
		if b[0] != mlUserMsg {
			return nil, false
		}
		return readUserMsg(pk.next)
	}
	if b[0] != mlEncryptMsg {
		return nil, false
	}
	hdr, err := pk.next(4)
	if err != nil {
		return nil, false
	}
	n := binary.BigEndian.Uint32(hdr)
	if n > mlMaxStream {
		return nil, false
	}
	sealed, err := pk.next(int(n))
	if err != nil {
		return nil, false
	}
	ad := append([]byte{mlEncryptMsg}, hdr...)
	plain := t.open(sealed, append(ad, label...))
	if len(plain) == 0 || plain[0] != mlUserMsg {
		return nil, false
	}
	rest := plain[1:]
	return readUserMsg(func(n int) ([]byte, error) {
		if len(rest) < n {
			return nil, io.ErrUnexpectedEOF
		}
		v := rest[:n]
		rest = rest[n:]
		return v, nil
	})
}

// readUserMsg reads memberlist's user message header (msgpack
// {"UserMsgLen": n}) and the n bytes it announces.
func readUserMsg(next func(int) ([]byte, error)) ([]byte, bool) {
	const key = "UserMsgLen"
	h, err := next(2 + len(key))
	if err != nil || h[0] != 0x81 || h[1] != 0xa0|byte(len(key)) || string(h[2:]) != key {
		return nil, false
	}
	c, err := next(1)
	if err != nil {
		return nil, false
	}
	var n uint64
	switch {
	case c[0] <= 0x7f:
		n = uint64(c[0])
	case c[0] >= 0xcc && c[0] <= 0xd3: // uint8..uint64, int8..int64
		v, err := next(1 << ((c[0] - 0xcc) % 4))
		if err != nil || c[0] >= 0xd0 && v[0]&0x80 != 0 {
			return nil, false
		}
		for _, x := range v {
			n = n<<8 | uint64(x)
		}
	default:
		return nil, false
	}
	if n == 0 || n > mlMaxStream+1024 {
		return nil, false
	}
	payload, err := next(int(n))
	if err != nil {
		return nil, false
	}
	return payload, true
}

// peekConn records what is read from a stream until it is handed to
// memberlist, which then reads it again from the first byte.
type peekConn struct {
	net.Conn
	buf    []byte
	off    int // replayed so far
	replay bool
}

// next reads n more bytes, growing the buffer as they arrive rather than
// by what the peer declared.
func (p *peekConn) next(n int) ([]byte, error) {
	start := len(p.buf)
	for len(p.buf)-start < n {
		chunk := min(n-(len(p.buf)-start), 64<<10)
		p.buf = slices.Grow(p.buf, chunk)
		got, err := io.ReadFull(p.Conn, p.buf[len(p.buf):len(p.buf)+chunk])
		p.buf = p.buf[:len(p.buf)+got]
		if err != nil {
			return nil, err
		}
	}
	return p.buf[start:], nil
}

func (p *peekConn) Read(b []byte) (int, error) {
	if p.off < len(p.buf) {
		n := copy(b, p.buf[p.off:])
		p.off += n
		if p.off == len(p.buf) {
			p.buf = nil
			p.off = 0
		}
		return n, nil
	}
	return p.Conn.Read(b)
}

// memberAddrs is every live member's address as memberlist holds it.
type memberAddrs struct {
	mu    sync.RWMutex
	addrs map[string]netip.AddrPort
}

func (a *memberAddrs) set(n *memberlist.Node) {
	ip, _ := netip.AddrFromSlice(n.Addr)
	a.mu.Lock()
	if a.addrs == nil {
		a.addrs = map[string]netip.AddrPort{}
	}
	a.addrs[n.Name] = netip.AddrPortFrom(ip.Unmap(), n.Port)
	a.mu.Unlock()
}

func (a *memberAddrs) remove(name string) {
	a.mu.Lock()
	delete(a.addrs, name)
	a.mu.Unlock()
}

// binds reports whether a message that came from src may be the member
// name's: known, at src's IP and, for a datagram, at its port.
func (a *memberAddrs) binds(name string, src net.Addr, datagram bool) bool {
	var from netip.AddrPort
	switch s := src.(type) {
	case *net.UDPAddr:
		from = s.AddrPort()
	case *net.TCPAddr:
		from = s.AddrPort()
	default:
		return false
	}
	a.mu.RLock()
	want, ok := a.addrs[name]
	a.mu.RUnlock()
	if !ok || from.Addr().Unmap() != want.Addr() {
		return false
	}
	return !datagram || from.Port() == want.Port()
}
