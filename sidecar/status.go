package sidecar

import (
	"encoding/json"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Status is the /status document. The first fields are the external contract.
type Status struct {
	Name             string   `json:"name"`
	Model            string   `json:"model"`
	BlockSize        int      `json:"block_size"`
	EngineHealthy    bool     `json:"engine_healthy"`
	ResidentBlocks   int      `json:"resident_blocks"`
	FilterGeneration uint64   `json:"filter_generation"`
	EventsReceived   uint64   `json:"events_received"`
	LastSeq          uint64   `json:"last_seq"`
	OrphanBlocks     uint64   `json:"orphan_blocks"`
	Models           []string `json:"models"`
	Engine           string   `json:"engine"`
	Protocol         string   `json:"protocol"`

	FilterEpoch     uint64  `json:"filter_epoch"`
	FilterSeq       uint64  `json:"filter_seq"`
	FilterKeys      int     `json:"filter_keys"`
	FilterFillRatio float64 `json:"filter_fill_ratio"`
	FilterBits      uint    `json:"filter_bits"`
	FilterRebuilds  uint64  `json:"filter_rebuilds"`

	// ResidentEngineBlocks are the engine hashes the exact set holds (over
	// groups), bounded by ResidentLimit: EngineCapacity (or --capacity
	// while the engine does not say) with slack. Stores past it are
	// refused (RefusedFull) and flag the engine EngineOverfull until its
	// next clear; RefusedGroup counts blocks of groups past --max-kv-groups.
	ResidentEngineBlocks int    `json:"resident_engine_blocks"`
	ResidentLimit        int    `json:"resident_limit"`
	EngineCapacity       int    `json:"engine_capacity_blocks"`
	EngineOverfull       bool   `json:"engine_overfull"`
	RefusedFull          uint64 `json:"refused_blocks_full"`
	RefusedGroup         uint64 `json:"refused_blocks_group"`

	Waiting               int     `json:"waiting"`
	Running               int     `json:"running"`
	KVUsage               float64 `json:"kv_usage"`
	InflightRequests      int     `json:"inflight_requests"`
	InflightPrefillTokens int     `json:"inflight_prefill_tokens"`
	ScrapeErrors          uint64  `json:"scrape_errors"`
	// AcceptErrors counts failed accepts on --listen (out of file
	// descriptors...): each is retried after a pause.
	AcceptErrors uint64 `json:"accept_errors"`
	// Version is the sidecar's build (git revision).
	Version string `json:"version"`
	// MetricsReadMS is how long the engine took to answer the last /metrics
	// read.
	MetricsReadMS float64 `json:"metrics_read_ms"`

	KVEvents        bool     `json:"kv_events"`
	EngineResets    uint64   `json:"engine_resets"`
	ResetReasons    []string `json:"reset_reasons,omitempty"`
	BatchesReceived uint64   `json:"batches_received"`
	Gaps            uint64   `json:"gaps"`
	Replayed        uint64   `json:"replayed"`
	DecodeErrors    uint64   `json:"decode_errors"`
	Malformed       uint64   `json:"malformed_messages"`
	// Event connections dropped: a message over --kv-events-max-message-bytes,
	// or no ZMTP handshake within --kv-events-handshake-timeout.
	EventOversized         uint64 `json:"event_connections_oversized"`
	EventHandshakeFailures uint64 `json:"event_handshake_failures"`
	Connected              bool   `json:"events_connected"`

	// DataParallelRank is the data-parallel rank followed (null: the
	// engine is not data-parallel); EventsDataParallelRank the rank the
	// last batch that named one was stamped with; RankMismatches the
	// batches refused for naming another rank than DataParallelRank.
	DataParallelRank *int `json:"data_parallel_rank"`
	// KVRole is the side of prefill/decode disaggregation announced.
	KVRole                 string `json:"kv_role"`
	EventsDataParallelRank *int   `json:"events_data_parallel_rank"`
	RankMismatches         uint64 `json:"data_parallel_rank_mismatches"`

	Gossip  string               `json:"gossip_addr"`
	Routers int                  `json:"routers"`
	Cluster gossip.StatsSnapshot `json:"cluster"`
}

// Status returns the sidecar's current figures.
func (s *Sidecar) Status() Status {
	models := *s.models.Load()
	m := s.load.Load()
	st := Status{
		Name:           s.cfg.Name,
		Models:         models,
		Engine:         s.cfg.EngineURL,
		Protocol:       s.cfg.Protocol,
		EngineHealthy:  s.healthy.Load(),
		Waiting:        m.Waiting,
		Running:        m.Running,
		KVUsage:        m.KVUsage,
		ScrapeErrors:   s.scrapeErrs.Load(),
		AcceptErrors:   s.acceptErrors(),
		Version:        buildinfo.Version(),
		MetricsReadMS:  float64(s.metricsReadNanos.Load()) / 1e6,
		KVEvents:       s.kvEvents(),
		FilterRebuilds: s.rebuilds.Load(),
		RankMismatches: s.rankMismatches.Load(),
		KVRole:         s.cfg.KVRole.String(),
	}
	if s.cfg.DataParallel {
		r := s.cfg.DataParallelRank
		st.DataParallelRank = &r
	}
	if r := int(s.eventsRank.Load()) - 1; r >= 0 {
		st.EventsDataParallelRank = &r
	}
	if len(models) > 0 {
		st.Model = models[0]
	}
	s.mu.Lock()
	st.BlockSize = int(s.blockSize.Load()) // what routers key prompts with
	st.ResidentBlocks = s.set.Len()
	st.OrphanBlocks = s.set.Orphans()
	ss := s.set.Stats()
	st.EventsReceived, st.RefusedFull, st.RefusedGroup = ss.Events, ss.RefusedFull, ss.RefusedGroup
	st.ResidentEngineBlocks, st.ResidentLimit, st.EngineOverfull = s.set.Blocks(), s.residentLimitLocked(), s.set.Overfull()
	st.EngineCapacity = int(s.engineBlocks.Load())
	st.EngineResets = s.resets
	st.ResetReasons = append([]string(nil), s.reasons...)
	gs := s.gens.Stats()
	s.mu.Unlock()
	st.FilterEpoch, st.FilterGeneration, st.FilterSeq, st.FilterKeys = gs.Epoch, gs.Generation, gs.Seq, gs.Keys
	st.FilterFillRatio, st.FilterBits = gs.FillRatio, gs.M
	if sub := s.sub.Load(); sub != nil {
		ks := sub.Stats()
		st.LastSeq, st.BatchesReceived, st.Gaps, st.Replayed = ks.LastSeq, ks.Batches, ks.Gaps, ks.Replayed
		st.DecodeErrors, st.Malformed, st.Connected = ks.DecodeErrors, ks.Malformed, ks.Connected
		st.EventOversized, st.EventHandshakeFailures = ks.Oversized, ks.HandshakeFailures
	}
	if n := s.node.Load(); n != nil {
		st.Gossip = n.Addr()
		st.Routers = n.Routers()
		st.Cluster = n.Stats()
		st.InflightRequests, st.InflightPrefillTokens = n.Inflight()
	}
	return st
}

// Handler serves /status, /metrics and /health.
func (s *Sidecar) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(s.Status())
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector{s})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

func (s *Sidecar) acceptErrors() uint64 {
	if g := s.accepts.Load(); g != nil {
		return g.Errors()
	}
	return 0
}

// collector exports Status as Prometheus series at scrape time.
type collector struct{ s *Sidecar }

type series struct {
	name, help string
	counter    bool
	value      func(*Status) float64
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// refused is kvmesh_sidecar_refused_blocks_total, one series per reason.
var refused = prometheus.NewDesc("kvmesh_sidecar_refused_blocks_total",
	"blocks the exact set refused: full (stored past its limit) or group (group_idx past --max-kv-groups)", []string{"reason"}, nil)

var sidecarSeries = []series{
	{"kvmesh_sidecar_engine_healthy", "1 when the engine answers /health", false, func(s *Status) float64 { return b2f(s.EngineHealthy) }},
	{"kvmesh_sidecar_resident_blocks", "exact resident block keys", false, func(s *Status) float64 { return float64(s.ResidentBlocks) }},
	{"kvmesh_sidecar_orphan_blocks_total", "stored blocks whose parent was unknown", true, func(s *Status) float64 { return float64(s.OrphanBlocks) }},
	{"kvmesh_sidecar_resident_engine_blocks", "engine block hashes the exact set holds (over KV-cache groups)", false, func(s *Status) float64 { return float64(s.ResidentEngineBlocks) }},
	{"kvmesh_sidecar_resident_limit_blocks", "most engine blocks the exact set holds: the engine's capacity with slack", false, func(s *Status) float64 { return float64(s.ResidentLimit) }},
	{"kvmesh_sidecar_engine_capacity_blocks", "KV capacity the engine reports (num_gpu_blocks); 0 when it does not", false, func(s *Status) float64 { return float64(s.EngineCapacity) }},
	{"kvmesh_sidecar_engine_overfull", "1 when the engine's events claimed more resident blocks than its capacity with slack since its last clear (misbehaving engine or lost removals)", false, func(s *Status) float64 { return b2f(s.EngineOverfull) }},
	{"kvmesh_sidecar_events_total", "KV events applied", true, func(s *Status) float64 { return float64(s.EventsReceived) }},
	{"kvmesh_sidecar_event_batches_total", "KV event batches received", true, func(s *Status) float64 { return float64(s.BatchesReceived) }},
	{"kvmesh_sidecar_event_gaps_total", "sequence gaps detected", true, func(s *Status) float64 { return float64(s.Gaps) }},
	{"kvmesh_sidecar_event_replayed_total", "batches recovered by replay", true, func(s *Status) float64 { return float64(s.Replayed) }},
	{"kvmesh_sidecar_event_decode_errors_total", "event payloads that did not decode (skipped)", true, func(s *Status) float64 { return float64(s.DecodeErrors) }},
	{"kvmesh_sidecar_event_malformed_total", "event messages with bad framing (skipped)", true, func(s *Status) float64 { return float64(s.Malformed) }},
	{"kvmesh_sidecar_event_oversized_total", "KV event connections dropped for a message over --kv-events-max-message-bytes", true, func(s *Status) float64 { return float64(s.EventOversized) }},
	{"kvmesh_sidecar_event_handshake_failures_total", "KV event connections dropped before their ZMTP handshake completed (not ZMTP, closed, or over --kv-events-handshake-timeout)", true, func(s *Status) float64 { return float64(s.EventHandshakeFailures) }},
	{"kvmesh_sidecar_data_parallel_rank_mismatches_total", "KV event batches refused: stamped with another data-parallel rank than --data-parallel-rank", true, func(s *Status) float64 { return float64(s.RankMismatches) }},
	{"kvmesh_sidecar_engine_resets_total", "event stream resets (engine restart or unrecoverable gap)", true, func(s *Status) float64 { return float64(s.EngineResets) }},
	{"kvmesh_sidecar_last_seq", "sequence number of the last event batch", false, func(s *Status) float64 { return float64(s.LastSeq) }},
	{"kvmesh_sidecar_filter_generation", "current filter generation", false, func(s *Status) float64 { return float64(s.FilterGeneration) }},
	{"kvmesh_sidecar_filter_keys", "keys in the current filter generation", false, func(s *Status) float64 { return float64(s.FilterKeys) }},
	{"kvmesh_sidecar_filter_fill_ratio", "fraction of filter bits set", false, func(s *Status) float64 { return s.FilterFillRatio }},
	{"kvmesh_sidecar_filter_rebuilds_total", "filter generations rebuilt", true, func(s *Status) float64 { return float64(s.FilterRebuilds) }},
	{"kvmesh_sidecar_engine_waiting", "engine requests waiting", false, func(s *Status) float64 { return float64(s.Waiting) }},
	{"kvmesh_sidecar_engine_running", "engine requests running", false, func(s *Status) float64 { return float64(s.Running) }},
	{"kvmesh_sidecar_engine_kv_usage", "engine KV cache usage 0..1", false, func(s *Status) float64 { return s.KVUsage }},
	{"kvmesh_sidecar_inflight_requests", "requests routers report in flight here", false, func(s *Status) float64 { return float64(s.InflightRequests) }},
	{"kvmesh_sidecar_scrape_errors_total", "failed engine metric scrapes", true, func(s *Status) float64 { return float64(s.ScrapeErrors) }},
	{"kvmesh_sidecar_accept_errors_total", "failed accepts on the status listener (each retried after a pause)", true, func(s *Status) float64 { return float64(s.AcceptErrors) }},
	{"kvmesh_sidecar_engine_metrics_read_seconds", "time the engine took to answer the last /metrics read (it is read every scrape interval)", false, func(s *Status) float64 { return s.MetricsReadMS / 1e3 }},
	{"kvmesh_sidecar_routers", "routers this sidecar feeds", false, func(s *Status) float64 { return float64(s.Routers) }},
	{"kvmesh_sidecar_gossip_members", "live cluster members", false, func(s *Status) float64 { return float64(s.Cluster.Members) }},
	{"kvmesh_sidecar_gossip_sent_bytes_total", "bytes of kvmesh messages sent", true, func(s *Status) float64 { return float64(s.Cluster.SentBytes) }},
	{"kvmesh_sidecar_gossip_resyncs_total", "snapshot requests from routers", true, func(s *Status) float64 { return float64(s.Cluster.Resyncs) }},
	{"kvmesh_sidecar_gossip_rejected_total", "packets rejected (wrong label or key, malformed)", true, func(s *Status) float64 {
		return float64(s.Cluster.RejectedLabel + s.Cluster.RejectedDecrypt + s.Cluster.RejectedMalformed + s.Cluster.BadMessages)
	}},
	{"kvmesh_sidecar_gossip_unverified_sender_total", "messages dropped because they could not be from the member they name (forged, or unreadable by the sender check)", true, func(s *Status) float64 {
		return float64(s.Cluster.ForgedSender + s.Cluster.Unverified)
	}},
}

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range sidecarSeries {
		ch <- prometheus.NewDesc(m.name, m.help, nil, nil)
	}
	ch <- refused
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.Status()
	for _, m := range sidecarSeries {
		t := prometheus.GaugeValue
		if m.counter {
			t = prometheus.CounterValue
		}
		ch <- prometheus.MustNewConstMetric(prometheus.NewDesc(m.name, m.help, nil, nil), t, m.value(&st))
	}
	ch <- prometheus.MustNewConstMetric(refused, prometheus.CounterValue, float64(st.RefusedFull), "full")
	ch <- prometheus.MustNewConstMetric(refused, prometheus.CounterValue, float64(st.RefusedGroup), "group")
}

var _ kvevents.Handler = (*Sidecar)(nil)
