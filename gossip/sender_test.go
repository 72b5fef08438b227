package gossip

import (
	"net"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/fleet"
)

// startVictim starts sidecar a on another loopback address than the
// router's and the forger's (127.0.0.1), so that even its streams, bound
// by IP only, are told apart from theirs.
func startVictim(t *testing.T, join string) (*SidecarNode, *bloom.Generations) {
	t.Helper()
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 4096, MaxDeltaKeys: 150}, uint64(time.Now().UnixNano()), time.Now())
	cfg := baseConfig("a", join)
	cfg.BindAddr = "127.0.0.2:0"
	s, err := StartSidecar(SidecarConfig{Config: cfg, Models: []string{"m"}, EngineURL: "http://a",
		Protocol: fleet.ProtocolVLLM, BlockSize: 16, Filter: g})
	if err != nil {
		t.Skipf("no second loopback address: %v", err)
	}
	t.Cleanup(func() { _ = s.Leave(0) })
	return s, g
}

func memberNamed(t *testing.T, n *node, name string) *memberlist.Node {
	t.Helper()
	var found *memberlist.Node
	waitFor(t, 3*time.Second, name+" known", func() bool {
		for _, m := range n.ml.Members() {
			if m.Name == name {
				found = m
				return true
			}
		}
		return false
	})
	return found
}

// TestForgedSenderIsDroppedAndCounted: a member holding the key sends, as
// sidecar a, unhealthy load records at 200/s, a snapshot and a delta. The
// router drops and counts every one; a stays online with its own filter.
func TestForgedSenderIsDroppedAndCounted(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	s, g := startVictim(t, r.Addr())
	g.Add(5)
	waitFor(t, 3*time.Second, "victim's key at router", func() bool { return hasKey(tb, "a", 5) })
	evil, _ := startTestSidecar(t, "evil", r.Addr())
	to := memberNamed(t, evil.node, "router/r1")
	epoch := s.meta.Epoch // announced in a's metadata: known to every member

	snap := bloom.Snapshot{Epoch: epoch, Generation: 9, M: 1024, K: 3, Keys: 1}
	f := bloom.NewFilter(1024, 0.01)
	f.Add(666)
	snap.M, snap.K, snap.Words = f.M(), f.K(), f.AppendWords(nil)
	if err := evil.send(to, &filterstream.Message{Kind: filterstream.KindSnapshot, From: "sidecar/a", Epoch: epoch, Payload: snap.AppendBinary(nil)}, true); err != nil {
		t.Fatal(err)
	}
	d := bloom.Delta{Epoch: epoch, Generation: 1, Seq: 1 << 20, Keys: []uint64{667}}
	_ = evil.send(to, &filterstream.Message{Kind: filterstream.KindDelta, From: "sidecar/a", Epoch: epoch, Payload: d.AppendBinary(nil)}, false)
	const forged = 200
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for i := range forged {
		<-tick.C
		_ = evil.send(to, &filterstream.Message{Kind: filterstream.KindLoad, From: "sidecar/a", Epoch: epoch, Seq: 1<<40 + uint64(i)}, false)
		if rep, _ := replica(tb, "a"); !rep.Online || !hasKey(tb, "a", 5) {
			t.Fatalf("after %d forged records: %+v", i, rep)
		}
	}
	waitFor(t, 2*time.Second, "forgeries counted", func() bool { return r.Stats().ForgedSender >= forged+2 })
	rep, _ := replica(tb, "a")
	if !rep.Online || !hasKey(tb, "a", 5) || hasKey(tb, "a", 666) || hasKey(tb, "a", 667) || rep.FilterGeneration != 1 {
		t.Fatalf("victim after the forgeries: %+v", rep)
	}
	// The victim itself is still heard.
	g.Add(6)
	waitFor(t, 2*time.Second, "victim's new key", func() bool { return hasKey(tb, "a", 6) })
	t.Logf("forged messages dropped and counted: %d", r.Stats().ForgedSender)
}

// TestMemberReusingALiveNameIsNotHeard: a second sidecar started under a
// live replica's name (memberlist refuses its membership) speaks from its
// own address; the router ignores it and the victim's filter and load go on
// as before.
func TestMemberReusingALiveNameIsNotHeard(t *testing.T) {
	r, tb := startTestRouter(t, "r1")
	s, g := startVictim(t, r.Addr())
	g.Add(5)
	s.SetEngineLoad(EngineLoad{Healthy: true, Waiting: 2})
	waitFor(t, 3*time.Second, "victim at router", func() bool {
		rep, _ := replica(tb, "a")
		return hasKey(tb, "a", 5) && rep.Load.Waiting == 2
	})
	impostor, ig := startTestSidecar(t, "a", r.Addr())
	ig.Add(77)
	impostor.SetEngineLoad(EngineLoad{Healthy: false, Waiting: 50})
	waitFor(t, 3*time.Second, "impostor's messages refused", func() bool { return r.Stats().ForgedSender > 10 })
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		rep, _ := replica(tb, "a")
		if !rep.Online || !hasKey(tb, "a", 5) || hasKey(tb, "a", 77) || rep.Load.Waiting != 2 {
			t.Fatalf("victim disturbed by the impostor: %+v", rep)
		}
	}
	g.Add(6)
	waitFor(t, 2*time.Second, "victim's new key", func() bool { return hasKey(tb, "a", 6) })
}

func TestMemberAddrsBindDatagramsByPortStreamsByIP(t *testing.T) {
	var a memberAddrs
	a.set(&memberlist.Node{Name: "sidecar/a", Addr: net.ParseIP("10.0.0.1"), Port: 7946})
	for _, c := range []struct {
		name     string
		src      net.Addr
		datagram bool
		want     bool
	}{
		{"sidecar/a", &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 7946}, true, true},
		{"sidecar/a", &net.UDPAddr{IP: net.ParseIP("::ffff:10.0.0.1"), Port: 7946}, true, true},
		{"sidecar/a", &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 7947}, true, false},
		{"sidecar/a", &net.UDPAddr{IP: net.ParseIP("10.0.0.2"), Port: 7946}, true, false},
		{"sidecar/a", &net.TCPAddr{IP: net.ParseIP("10.0.0.1"), Port: 40000}, false, true},
		{"sidecar/a", &net.TCPAddr{IP: net.ParseIP("10.0.0.2"), Port: 7946}, false, false},
		{"sidecar/b", &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 7946}, true, false},
	} {
		if got := a.binds(c.name, c.src, c.datagram); got != c.want {
			t.Errorf("%s from %v (datagram %v): %v, want %v", c.name, c.src, c.datagram, got, c.want)
		}
	}
	a.remove("sidecar/a")
	if a.binds("sidecar/a", &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 7946}, true) {
		t.Fatal("a member that left still binds")
	}
}

// TestUncheckedUserMessagesAreDropped: with the sender check on, a user
// message memberlist delivers itself (the check could not read it: inside
// a compressed or compound packet) is dropped and counted.
func TestUncheckedUserMessagesAreDropped(t *testing.T) {
	d := newDelegate("router/r1", testLog())
	d.checkSender = true
	d.NotifyMsg(sampleWire()[0])
	if len(d.inbox) != 0 || d.stats.Unverified.Load() != 1 {
		t.Fatalf("inbox %d, unverified %d", len(d.inbox), d.stats.Unverified.Load())
	}
}

// sampleWire is a few encoded messages as members send them.
func sampleWire() [][]byte {
	msgs := []filterstream.Message{
		{Kind: filterstream.KindLoad, From: "sidecar/a", Epoch: 7, Seq: 3, Load: filterstream.Load{Healthy: true, Waiting: 2}},
		{Kind: filterstream.KindDelta, From: "sidecar/a", Epoch: 7, Payload: []byte("KB\x01\x02delta")},
		{Kind: filterstream.KindClearRoutes, From: "router/r1", Epoch: 9, Seq: 42, Names: []string{"a"}},
	}
	var out [][]byte
	for i := range msgs {
		out = append(out, msgs[i].Append(nil))
	}
	return out
}

// fuzzTransport is a sender transport without sockets, for its parsers.
func fuzzTransport(f *testing.F) *senderTransport {
	st, err := newSenderTransport(nil, "", newDelegate("router/r1", zerolog.Nop()), "kvmesh-test", testKey, time.Second)
	if err != nil {
		f.Fatal(err)
	}
	return st
}

// sealedUserMsg is a user message as memberlist sends it in a datagram.
func sealedUserMsg(st *senderTransport, payload []byte) []byte {
	label, _ := memberlist.AddLabelHeaderToPacket(nil, st.label)
	nonce := make([]byte, mlNonceSize)
	b := append(append(label, mlEncryptV1), nonce...)
	return st.aead.Seal(b, nonce, append([]byte{mlUserMsg}, payload...), []byte(st.label))
}

// FuzzSenderCheckPacket: any datagram is claimed or left to memberlist,
// never a panic; what is claimed comes through the check.
func FuzzSenderCheckPacket(f *testing.F) {
	st := fuzzTransport(f)
	for _, b := range sampleWire() {
		f.Add(sealedUserMsg(st, b))
	}
	f.Add([]byte{mlHasLabelMsg, 3, 'a', 'b', 'c', 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		st.claimPacket(&memberlist.Packet{Buf: b, From: &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}})
		if len(st.d.inbox) > 0 { // no member is known: nothing may get through
			t.Fatal("a message from an unknown member was delivered")
		}
	})
}

// FuzzSenderCheckStream: any stream start is read as a user message or
// left to memberlist, within the bytes it holds.
func FuzzSenderCheckStream(f *testing.F) {
	st := fuzzTransport(f)
	f.Add([]byte{mlHasLabelMsg, 11, 'k', 'v', 'm', 'e', 's', 'h', '-', 't', 'e', 's', 't', mlUserMsg,
		0x81, 0xaa, 'U', 's', 'e', 'r', 'M', 's', 'g', 'L', 'e', 'n', 0xcd, 0x00, 0x03, 'a', 'b', 'c'})
	f.Add([]byte{mlHasLabelMsg, 11, 'k', 'v', 'm', 'e', 's', 'h', '-', 't', 'e', 's', 't', mlEncryptMsg, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, w := net.Pipe()
		go func() {
			_, _ = w.Write(b)
			_ = w.Close()
		}()
		pk := &peekConn{Conn: c}
		if payload, ok := st.peekUser(pk); ok && len(payload) > len(b) {
			t.Fatalf("a %d-byte payload from %d bytes", len(payload), len(b))
		}
		if len(pk.buf) > len(b) {
			t.Fatalf("%d bytes buffered from %d", len(pk.buf), len(b))
		}
		_ = c.Close()
	})
}
