package gossip

import (
	"sync/atomic"

	"github.com/hashicorp/memberlist"

	"github.com/kvmesh/kvmesh/filterstream"
)

// outgoing is a filterstream send with its member resolved.
type outgoing struct {
	to *memberlist.Node
	filterstream.Send
}

// resolveSends pairs each send with the member it goes to, leaving out
// those to members no longer known.
func resolveSends(sends []filterstream.Send, member func(name string) *memberlist.Node) []outgoing {
	var out []outgoing
	for _, s := range sends {
		if n := member(s.To); n != nil {
			out = append(out, outgoing{n, s})
		}
	}
	return out
}

// deliver sends each message in order: a datagram at once, a stream on its
// own goroutine (a slow peer must not hold the node's loop).
func (n *node) deliver(sends []outgoing) {
	for i := range sends {
		o := &sends[i]
		if !o.Reliable {
			if err := n.send(o.to, &o.Msg, false); err != nil {
				n.log.Debug().Err(err).Str("to", o.to.Name).Str("kind", o.Msg.Kind.String()).Msg("message not sent")
			}
			continue
		}
		go func() {
			if err := n.send(o.to, &o.Msg, true); err != nil {
				n.log.Warn().Err(err).Str("to", o.to.Name).Str("kind", o.Msg.Kind.String()).Msg("message not delivered")
			}
		}()
	}
}

// count adds what a state machine reports to the node's counters.
func (n *node) count(out *filterstream.Output) {
	s := &n.d.stats
	add := func(c *atomic.Uint64, v int) {
		if v > 0 {
			c.Add(uint64(v))
		}
	}
	add(&s.BadMessages, out.Bad)
	add(&s.Resyncs, out.Resyncs)
	add(&s.Resends, out.Resends)
	for why, k := range out.ResyncReasons {
		add(&s.ResyncReasons[why], k)
	}
}
