package filterstream

import (
	"testing"
	"time"
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
