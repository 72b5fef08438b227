package gossip

import (
	"strings"
	"testing"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvmesh/kvmesh/filterstream"
)

func TestCollectorExportsStats(t *testing.T) {
	s := StatsSnapshot{
		Members: 3, Received: map[string]uint64{"load": 7}, ReceivedBytesByKind: map[string]uint64{"load": 700},
		Sent: map[string]uint64{"inflight": 2}, SentBytes: 90, RejectedDecrypt: 4, QueueFull: 1,
		Resyncs: 2, ResyncReasons: map[string]uint64{"gap": 2}, ForgedSender: 200,
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(Collector("kvmesh_router", func() StatsSnapshot { return s }))
	want := `
# HELP kvmesh_router_gossip_members Live cluster members seen by this node.
# TYPE kvmesh_router_gossip_members gauge
kvmesh_router_gossip_members 3
# HELP kvmesh_router_gossip_received_bytes_total Bytes of kvmesh messages received, by kind.
# TYPE kvmesh_router_gossip_received_bytes_total counter
kvmesh_router_gossip_received_bytes_total{kind="load"} 700
# HELP kvmesh_router_gossip_rejected_total Packets memberlist refused: wrong cluster label, wrong key, malformed.
# TYPE kvmesh_router_gossip_rejected_total counter
kvmesh_router_gossip_rejected_total{reason="decrypt"} 4
kvmesh_router_gossip_rejected_total{reason="label"} 0
kvmesh_router_gossip_rejected_total{reason="malformed"} 0
# HELP kvmesh_router_gossip_dropped_total Messages dropped for a full queue: the node's inbox or memberlist's handoff queue.
# TYPE kvmesh_router_gossip_dropped_total counter
kvmesh_router_gossip_dropped_total{queue="handoff"} 1
kvmesh_router_gossip_dropped_total{queue="inbox"} 0
# HELP kvmesh_router_gossip_resync_reasons_total Why a router asked for a snapshot.
# TYPE kvmesh_router_gossip_resync_reasons_total counter
kvmesh_router_gossip_resync_reasons_total{reason="gap"} 2
# HELP kvmesh_router_gossip_unverified_sender_total Messages dropped because they could not be from the member they name: forged (another member's address, or no live member's), or in a form the sender check cannot read.
# TYPE kvmesh_router_gossip_unverified_sender_total counter
kvmesh_router_gossip_unverified_sender_total{reason="forged"} 200
kvmesh_router_gossip_unverified_sender_total{reason="unreadable"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvmesh_router_gossip_members",
		"kvmesh_router_gossip_received_bytes_total", "kvmesh_router_gossip_rejected_total",
		"kvmesh_router_gossip_dropped_total", "kvmesh_router_gossip_resync_reasons_total",
		"kvmesh_router_gossip_unverified_sender_total"); err != nil {
		t.Fatal(err)
	}
}

// The metadata limit filterstream encodes to is memberlist's.
func TestMetaLimitIsMemberlists(t *testing.T) {
	if filterstream.MetaMaxSize != memberlist.MetaMaxSize {
		t.Fatalf("filterstream.MetaMaxSize %d, memberlist.MetaMaxSize %d", filterstream.MetaMaxSize, memberlist.MetaMaxSize)
	}
}
