package filterstream

import (
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/bloom"
	"github.com/kvmesh/kvmesh/fleet"
)

// TestSenderHonoursClearFromARouterNotYetKnown: a route clear needs no
// answer, so a sidecar acts on one even before the sender's membership
// reaches it (the clearing router then waits for the rebuild, see
// clearWait), and only on one that names its replica.
func TestSenderHonoursClearFromARouterNotYetKnown(t *testing.T) {
	s := NewSender(SenderConfig{Self: "sidecar/a", Name: "a", Epoch: 5})
	now := time.Unix(1_900_000_000, 0)
	for _, c := range []struct {
		names []string
		want  bool
	}{{[]string{"b"}, false}, {[]string{"a"}, true}, {[]string{"b", "a"}, true}, {nil, true}} {
		out := s.Handle(&Message{Kind: KindClearRoutes, From: "router/x", Names: c.names}, now)
		if out.Cleared != c.want || len(out.Sends) != 0 {
			t.Errorf("clear of %v: cleared %v, sends %d; want %v, none", c.names, out.Cleared, len(out.Sends), c.want)
		}
	}
}

// FuzzHandle: whatever a member sends that decodes, neither side panics on
// it, whichever member it claims to be from, and a sender answers a router
// it knows with at most the deltas it keeps.
func FuzzHandle(f *testing.F) {
	for _, m := range goldenMessages() {
		f.Add(m.Append(nil))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			return
		}
		now := time.Unix(1_900_000_000, 0)
		tb := fleet.NewTable(fleet.TableConfig{})
		r := NewReceiver(ReceiverConfig{Self: "router/r1", Epoch: 9}, tb)
		r.Member(m.From, sidecarA, now)
		r.Handle(&m, now)
		r.Tick(now.Add(time.Second))

		s := NewSender(SenderConfig{Self: "sidecar/a", Name: "a", Epoch: 7})
		s.Member(m.From, Meta{Role: RoleRouter, Name: "r1", Capabilities: CapInflightOthers}, true)
		g := bloom.NewGenerations(bloom.GenerationConfig{Capacity: 64, MaxDeltaKeys: 2}, 7, now)
		g.Add(1)
		s.Flush(g)
		out := s.Handle(&m, now)
		if len(out.Sends) > maxRecent {
			t.Fatalf("%d messages sent for one %s", len(out.Sends), m.Kind)
		}
		s.Load(Load{Healthy: true}, g, false, now)
	})
}

// TestSenderSaysWhenARoutersInflightChanged: a report that changes what a
// router has dispatched here says so (the sidecar then sends a load record
// early); the same figures again, or a stale report, do not.
func TestSenderSaysWhenARoutersInflightChanged(t *testing.T) {
	s := NewSender(SenderConfig{Self: "sidecar/a", Name: "a", Epoch: 5})
	s.Member("router/r1", Meta{Role: RoleRouter, Name: "r1", Capabilities: CapInflightOthers}, true)
	now := time.Unix(1_900_000_000, 0)
	for _, c := range []struct {
		seq      uint64
		requests int
		changed  bool
	}{{1, 3, true}, {2, 3, false}, {3, 4, true}, {2, 9, false}, {4, 0, true}} {
		out := s.Handle(&Message{Kind: KindInflight, From: "router/r1", Epoch: 9, Seq: c.seq, Requests: c.requests}, now)
		if out.InflightChanged != c.changed {
			t.Errorf("report %d (%d requests): changed %v, want %v", c.seq, c.requests, out.InflightChanged, c.changed)
		}
	}
}
