package filterstream

// Send is a message a state machine asks its caller to deliver.
type Send struct {
	To  string // member name
	Msg Message
	// Reliable asks for a stream (TCP) instead of one datagram: route
	// clears, which go once and must arrive.
	Reliable bool
}

// ResyncReason says why a receiver asked for filter state again.
type ResyncReason uint8

const (
	ResyncGap       ResyncReason = iota // a delta is missing
	ResyncBehind                        // load records announce state the mirror lacks
	ResyncBlockSize                     // the sidecar announced another block size
	// NumResyncReasons sizes arrays indexed by ResyncReason.
	NumResyncReasons
)

func (r ResyncReason) String() string {
	switch r {
	case ResyncGap:
		return "gap"
	case ResyncBehind:
		return "behind"
	case ResyncBlockSize:
		return "block_size"
	}
	return "unknown"
}

// Output is what a Sender or Receiver asks of its caller after one input:
// messages to deliver and what happened, for the caller's metrics and logs.
type Output struct {
	// Sends are messages to deliver, in order.
	Sends []Send
	// Snapshots names the routers a Sender wants sent the current filter
	// snapshot (SnapshotMessage): one that joined or asked for one.
	Snapshots []string
	// Cleared: a route clear arrived. At a Receiver, another router
	// cleared ClearedNames (nil: all) and the router drops its own
	// speculative records too; at a Sender, the clear names this replica
	// and its filter is to be rebuilt now.
	Cleared      bool
	ClearedNames []string
	// Bad counts filter payloads that did not decode.
	Bad int
	// Resyncs counts resync requests: sent (Receiver, by reason in
	// ResyncReasons) or received (Sender).
	Resyncs       int
	ResyncReasons [NumResyncReasons]int
	// Resends counts deltas a Sender sends again to answer a resync.
	Resends int
	// Silent names replicas a Receiver's table stopped routing by filter
	// for silence; Orphaned, replicas whose sidecar failed (left without
	// a word) and which stay routed by load while their engine answers.
	Silent   []string
	Orphaned []string
	// Usage is another router's per-tenant report, for the caller's quota
	// ledger (Receiver).
	Usage *UsageReport
	// InflightChanged: a router's in-flight report changed what it has
	// dispatched here (Sender), so the other routers' view of the replica's
	// load is behind: the caller may send a load record before its interval.
	InflightChanged bool
}

// UsageReport is one router's KindTenantUsage message.
type UsageReport struct {
	From  string
	Usage []TenantUsage
}
