package gossip

import "github.com/prometheus/client_golang/prometheus"

// Collector exports a node's gossip counters as Prometheus metrics named
// <prefix>_gossip_* (e.g. kvmesh_router_gossip_members), read from stats on
// every scrape.
func Collector(prefix string, stats func() StatsSnapshot) prometheus.Collector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prefix+"_gossip_"+name, help, labels, nil)
	}
	return &collector{
		stats:     stats,
		members:   d("members", "Live cluster members seen by this node."),
		received:  d("received_messages_total", "kvmesh messages received, by kind.", "kind"),
		recvBytes: d("received_bytes_total", "Bytes of kvmesh messages received, by kind.", "kind"),
		sent:      d("sent_messages_total", "kvmesh messages sent, by kind.", "kind"),
		sentBytes: d("sent_bytes_total", "Bytes of kvmesh messages sent."),
		sendErrs:  d("send_errors_total", "Messages that could not be sent."),
		bad:       d("bad_messages_total", "Messages that failed to decode (garbage, truncated, wrong magic)."),
		forged:    d("unverified_sender_total", "Messages dropped because they could not be from the member they name: forged (another member's address, or no live member's), or in a form the sender check cannot read.", "reason"),
		dropped:   d("dropped_total", "Messages dropped for a full queue: the node's inbox or memberlist's handoff queue.", "queue"),
		rejected:  d("rejected_total", "Packets memberlist refused: wrong cluster label, wrong key, malformed.", "reason"),
		resyncs:   d("resyncs_total", "Snapshot requests (sent by a router, received by a sidecar)."),
		reasons:   d("resync_reasons_total", "Why a router asked for a snapshot.", "reason"),
	}
}

type collector struct {
	stats                                              func() StatsSnapshot
	members, received, recvBytes, sent, sentBytes      *prometheus.Desc
	sendErrs, bad, dropped, rejected, resyncs, reasons *prometheus.Desc
	forged                                             *prometheus.Desc
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.members, c.received, c.recvBytes, c.sent, c.sentBytes,
		c.sendErrs, c.bad, c.forged, c.dropped, c.rejected, c.resyncs, c.reasons} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	ch <- prometheus.MustNewConstMetric(c.members, prometheus.GaugeValue, float64(s.Members))
	for kind, v := range s.Received {
		counter(c.received, v, kind)
	}
	for kind, v := range s.ReceivedBytesByKind {
		counter(c.recvBytes, v, kind)
	}
	for kind, v := range s.Sent {
		counter(c.sent, v, kind)
	}
	counter(c.sentBytes, s.SentBytes)
	counter(c.sendErrs, s.SendErrors)
	counter(c.bad, s.BadMessages)
	counter(c.forged, s.ForgedSender, "forged")
	counter(c.forged, s.Unverified, "unreadable")
	counter(c.dropped, s.Dropped, "inbox")
	counter(c.dropped, s.QueueFull, "handoff")
	counter(c.rejected, s.RejectedLabel, "label")
	counter(c.rejected, s.RejectedDecrypt, "decrypt")
	counter(c.rejected, s.RejectedMalformed, "malformed")
	counter(c.resyncs, s.Resyncs)
	for reason, v := range s.ResyncReasons {
		counter(c.reasons, v, reason)
	}
}
