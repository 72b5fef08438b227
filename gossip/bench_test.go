package gossip

import (
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/filterstream"
)

// benchPair is one sidecar member and one router member on loopback, with
// the sidecar's own loop kept quiet so the benchmark drives every message.
func benchPair(b *testing.B) (*SidecarNode, *memberlist.Node, *RouterNode, func(uint64) bool) {
	r, tb := startTestRouter(b, "r1")
	g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 65536}, 1, time.Now())
	s, err := StartSidecar(SidecarConfig{Config: baseConfig("a", r.Addr()), Protocol: "vllm", Filter: g,
		LoadInterval: time.Hour, DeltaInterval: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Leave(0) })
	waitFor(b, 5*time.Second, "snapshot at router", func() bool {
		rep, ok := replica(tb, "a")
		return ok && rep.Filter != nil
	})
	s.mu.Lock()
	var to *memberlist.Node
	for _, l := range s.links {
		to = l.node
	}
	s.mu.Unlock()
	return s, to, r, func(k uint64) bool { return hasKey(tb, "a", k) }
}

// BenchmarkDeltaVisible: one 150-key delta (one ~1.3 KB encrypted datagram,
// SendBestEffort) from sending to visible in the router's table.
func BenchmarkDeltaVisible(b *testing.B) {
	s, to, _, has := benchPair(b)
	st := s.filter.Load().Stats()
	keys := make([]uint64, 150)
	seq := st.Seq
	for b.Loop() {
		seq++
		for i := range keys {
			keys[i] = seq<<8 | uint64(i)
		}
		d := bloom.Delta{Epoch: st.Epoch, Generation: st.Generation, Seq: seq, Keys: keys}
		msg := filterstream.Message{Kind: filterstream.KindDelta, From: s.d.self, Epoch: st.Epoch, Payload: d.AppendBinary(nil)}
		if err := s.send(to, &msg, false); err != nil {
			b.Fatal(err)
		}
		for !has(keys[149]) {
		}
	}
}

// BenchmarkSnapshotVisible: a whole 65,536-block filter (~80 KB,
// SendReliable: one TCP connection) from sending to visible in the table.
func BenchmarkSnapshotVisible(b *testing.B) {
	s, to, _, has := benchPair(b)
	g := s.filter.Load()
	var key uint64 = 1 << 40
	for b.Loop() {
		key++
		g.Add(key)
		g.Rebuild(time.Now(), func(yield func(uint64) bool) { yield(key) })
		msg := filterstream.SnapshotMessage(s.d.self, g.Snapshot())
		if err := s.send(to, &msg, true); err != nil {
			b.Fatal(err)
		}
		for !has(key) {
		}
	}
	b.ReportMetric(float64(bloom.SnapshotSize(g.Stats().M)), "snapshot_bytes")
}
