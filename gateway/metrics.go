package gateway

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/fasthttpadaptor"

	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/costfit"
	"github.com/kvmesh/kvmesh/request"
	"github.com/kvmesh/kvmesh/routing"
)

type metrics struct {
	reg          *prometheus.Registry
	routes       *prometheus.CounterVec
	routesByMode map[routing.Mode]prometheus.Counter // routes' children, looked up without hashing labels
	prefixHits   prometheus.Counter
	prompt       prometheus.Counter
	predicted    prometheus.Counter
	// predictedOffloaded is the part of predicted held only on an offload tier.
	predictedOffloaded prometheus.Counter
	actual             prometheus.Counter
	retries            prometheus.Counter
	errors             *prometheus.CounterVec
	ejections          *prometheus.CounterVec
	spills             prometheus.Counter
	prefills           *prometheus.CounterVec
	promptsCut         prometheus.Counter
	promptsTooLong     prometheus.Counter
	ttft               *prometheus.HistogramVec
	upstreamLatency    *prometheus.HistogramVec
	queueDepth         *prometheus.GaugeVec
	queueWait          *prometheus.HistogramVec
	rejected           *prometheus.CounterVec
	tenantTokens       *prometheus.CounterVec
	quotaIsolated      prometheus.Counter
	sessions           *prometheus.CounterVec
	byEndpoint         [request.Messages + 1]prometheus.Counter // kvmesh_router_endpoint_requests_total's children, by request kind
	handler            fasthttp.RequestHandler

	mu sync.Mutex
	// retiredDegradations keeps the count of policies replaced by a reload.
	retiredDegradations uint64
}

func newMetrics(g *Gateway) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	f := promauto{m.reg}
	m.routes = f.counterVec("kvmesh_router_routes_total", "Requests served, by routing mode.", "mode")
	m.prefixHits = f.counter("kvmesh_router_prefix_hits_total", "Requests routed to a replica predicted to hold part of their prefix.")
	m.prompt = f.counter("kvmesh_router_prompt_tokens_total", "Prompt tokens of served requests as the router tokenized them (0 where tokenizing failed): the denominator of the cache hit rates.")
	m.predicted = f.counter("kvmesh_router_predicted_cached_tokens_total", "Prompt tokens predicted to be cached where requests were sent.")
	m.predictedOffloaded = f.counter("kvmesh_router_predicted_offloaded_tokens_total", "Part of kvmesh_router_predicted_cached_tokens_total predicted held only on an offload tier (host memory, disk): loaded back, not found on the GPU.")
	m.actual = f.counter("kvmesh_router_actual_cached_tokens_total", "Prompt tokens the engines reported cached (usage.prompt_tokens_details.cached_tokens).")
	m.retries = f.counter("kvmesh_router_retries_total", "Attempts on a further replica after a failure before the first byte.")
	m.errors = f.counterVec("kvmesh_router_errors_total", "Errors by type.", "type")
	m.prefills = f.counterVec("kvmesh_router_prefills_total", "Prefill steps of split (prefill/decode disaggregated) requests, by outcome: ok (transfer parameters answered), failed (retried at the next prefill replica, or the request served whole).", "outcome")
	m.spills = f.counter("kvmesh_router_spills_total", "Requests sent to their model's fallback first because the best replica's predicted time to first token was over spill_after.")
	m.promptsCut = f.counter("kvmesh_router_prompts_cut_total", "Prompts longer than the window first tokenized (8 bytes per max_prefix_tokens token): matched on their exact leading tokens, the rest counted by estimate.")
	m.promptsTooLong = f.counter("kvmesh_router_prompts_too_long_total", "Prompts routed by load because their leading tokens could not be found within max_prefix_bytes (no word end to cut at, or a chat template not known to render in order).")
	m.sessions = f.counterVec("kvmesh_router_session_requests_total", "Served requests that named a session (a session header), by placement: home (the session's home replica, kept within the cost rule's slack) or elsewhere.", "placement")
	endpoints := f.counterVec("kvmesh_router_endpoint_requests_total", "Requests served, by API: chat_completions, completions, responses, messages, or other (an engine endpoint passed through by load).", "endpoint")
	for k, name := range map[request.Kind]string{request.Chat: "chat_completions", request.Completion: "completions",
		request.Responses: "responses", request.Messages: "messages", request.Passthrough: "other"} {
		m.byEndpoint[k] = endpoints.WithLabelValues(name)
	}
	for _, placement := range []string{"home", "elsewhere"} {
		m.sessions.WithLabelValues(placement)
	}
	m.ejections = f.counterVec("kvmesh_router_ejections_total", "Replicas taken out of routing for a while after a request could not reach them, by replica.", "replica")
	m.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvmesh_router_ttft_seconds", Help: "Time from dispatch to the upstream's first response byte (a stream's first event), by replica.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
	}, []string{"replica"})
	m.upstreamLatency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvmesh_router_upstream_latency_seconds", Help: "Time from dispatch to the end of the response, by replica.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 20),
	}, []string{"replica"})
	m.queueDepth = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_router_queue_depth", Help: "Requests held in this router while their model's fleet is saturated, by tenant and priority.",
	}, []string{"tenant", "priority"})
	m.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvmesh_router_queue_wait_seconds", Help: "Time requests were held in this router before being dispatched or turned away, by priority.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
	}, []string{"priority"})
	m.rejected = f.counterVec("kvmesh_router_rejected_total", "Requests turned away for overload, by reason: saturated, over_share, evicted, queue_full (503/429 from the router's queue), quota (429), slo (503, sheddable work no replica could serve within its X-Kvmesh-TTFT-SLO-Ms), client_left (the client hung up while held; nothing answered).", "reason")
	m.tenantTokens = f.counterVec("kvmesh_router_tenant_tokens_total", "Tokens of served requests by tenant, as quotas count them: prompt plus completion tokens, the engine's counts when it reported them (the max_tokens asked for an answer without a completion count).", "tenant")
	m.quotaIsolated = f.counter("kvmesh_router_quota_isolated_total", "Quota decisions this router took cut off from every other router it knew: it enforced its own share of the limit alone.")
	m.reg.MustRegister(m.ttft, m.upstreamLatency, m.queueDepth, m.queueWait,
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvmesh_router_degradations_total",
			Help: "Switches of the kvaware policy into least-load mode for imbalance among a model's replicas.",
		}, func() float64 {
			m.mu.Lock()
			n := m.retiredDegradations
			m.mu.Unlock()
			if d, ok := g.Settings().Policy.(routing.Degrader); ok {
				n += d.Degradations()
			}
			return float64(n)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvmesh_router_degraded", Help: "1 while the kvaware policy has any model in least-load mode.",
		}, func() float64 {
			if g.routingDegraded() {
				return 1
			}
			return 0
		}),
		inflightCollector{g},
		infoCollector{g},
		costCollector{g},
		collectors.NewGoCollector(),
		// process_cpu_seconds_total sizes a router fleet (docs/production.md).
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	m.routesByMode = map[routing.Mode]prometheus.Counter{}
	for _, mode := range []routing.Mode{routing.ModePrefix, routing.ModeBalance, routing.ModeCold, routing.ModeStatic, routing.ModeFallback, routing.ModeSplit} {
		m.routesByMode[mode] = m.routes.WithLabelValues(string(mode))
	}
	m.handler = fasthttpadaptor.NewFastHTTPHandler(promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	return m
}

func (m *metrics) serve(ctx *fasthttp.RequestCtx) { m.handler(ctx) }

// RegisterMetrics adds c to the router's /metrics (e.g. gossip counters).
func (g *Gateway) RegisterMetrics(c prometheus.Collector) error { return g.metrics.reg.Register(c) }

// RegisterAcceptErrors exports a listener's count of failed accepts as
// kvmesh_router_accept_errors_total{listener}: at the open-file limit
// every accept fails until descriptors are free again.
func (g *Gateway) RegisterAcceptErrors(listener string, errors func() uint64) error {
	return g.metrics.reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name:        "kvmesh_router_accept_errors_total",
		Help:        "Accepts that failed (too many open files...); the listener waits up to 1 s and accepts again.",
		ConstLabels: prometheus.Labels{"listener": listener},
	}, func() float64 { return float64(errors()) }))
}

// infoCollector exports kvmesh_router_info{policy,version} = 1: the policy in
// force (it changes with a config reload) and the build running.
type infoCollector struct{ g *Gateway }

var infoDesc = prometheus.NewDesc("kvmesh_router_info", "The router's routing policy and build (value 1).", []string{"policy", "version"}, nil)

func (c infoCollector) Describe(ch chan<- *prometheus.Desc) { ch <- infoDesc }

func (c infoCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(infoDesc, prometheus.GaugeValue, 1, c.g.Settings().Policy.Name(), buildinfo.Version())
}

func (m *metrics) routed(mode routing.Mode) prometheus.Counter {
	if c, ok := m.routesByMode[mode]; ok {
		return c
	}
	return m.routes.WithLabelValues(string(mode))
}

// latency and ttft return replica's histograms, kept in its in-flight
// entry so that a request does not hash label values (l may be nil, for
// fallback upstreams).
func (m *metrics) latency(l *replicaLoad, replica string) prometheus.Observer {
	return cachedObserver(l, 0, m.upstreamLatency, replica)
}

func (m *metrics) ttftOf(l *replicaLoad, replica string) prometheus.Observer {
	return cachedObserver(l, 1, m.ttft, replica)
}

func cachedObserver(l *replicaLoad, slot int, vec *prometheus.HistogramVec, replica string) prometheus.Observer {
	if l == nil {
		return vec.WithLabelValues(replica)
	}
	if o, ok := l.observers[slot].Load().(prometheus.Observer); ok {
		return o
	}
	o := vec.WithLabelValues(replica)
	l.observers[slot].Store(o)
	return o
}

// forget deletes replica's metric series (it left the fleet for good).
func (m *metrics) forget(replica string) {
	m.ttft.DeleteLabelValues(replica)
	m.upstreamLatency.DeleteLabelValues(replica)
	m.ejections.DeleteLabelValues(replica)
}

// routingDegraded reports whether the policy in force routes some model by
// load alone for imbalance.
func (g *Gateway) routingDegraded() bool {
	d, ok := g.Settings().Policy.(routing.Degrader)
	return ok && d.Degraded()
}

func (m *metrics) retirePolicy(p routing.Policy) {
	if d, ok := p.(routing.Degrader); ok {
		m.mu.Lock()
		m.retiredDegradations += d.Degradations()
		m.mu.Unlock()
	}
}

type promauto struct{ reg *prometheus.Registry }

func (f promauto) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	f.reg.MustRegister(c)
	return c
}

func (f promauto) counterVec(name, help, label string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{label})
	f.reg.MustRegister(c)
	return c
}

var (
	inflightRequestsDesc = prometheus.NewDesc("kvmesh_router_inflight_requests",
		"Requests this router has dispatched to a replica and not seen finish.", []string{"replica"}, nil)
	inflightPrefillDesc = prometheus.NewDesc("kvmesh_router_inflight_prefill_tokens",
		"Uncached prompt tokens this router dispatched to a replica that have no first token yet.", []string{"replica"}, nil)
)

// inflightCollector exports the per-replica in-flight gauges.
type inflightCollector struct{ g *Gateway }

func (c inflightCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inflightRequestsDesc
	ch <- inflightPrefillDesc
}

func (c inflightCollector) Collect(ch chan<- prometheus.Metric) {
	c.g.inflight.each(func(name string, l *replicaLoad) {
		ch <- prometheus.MustNewConstMetric(inflightRequestsDesc, prometheus.GaugeValue, float64(l.requests.Load()), name)
		ch <- prometheus.MustNewConstMetric(inflightPrefillDesc, prometheus.GaugeValue, float64(l.prefill.Load()), name)
	})
}

var (
	costDesc = prometheus.NewDesc("kvmesh_router_cost_model_seconds",
		"kvaware's cost model as calibrated from measured times to first token, by model and term: base (every request), prefill_per_token, per_running (sequence).",
		[]string{"model", "term"}, nil)
	costObservationsDesc = prometheus.NewDesc("kvmesh_router_cost_model_observations",
		"Weight of the measured times to first token behind a model's calibrated cost model (observations, older ones forgotten gradually).",
		[]string{"model"}, nil)
)

// costCollector exports the calibrated cost models.
type costCollector struct{ g *Gateway }

func (c costCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- costDesc
	ch <- costObservationsDesc
}

func (c costCollector) Collect(ch chan<- prometheus.Metric) {
	p, ok := c.g.Settings().Policy.(routing.CostModeler)
	if !ok {
		return
	}
	p.CostModels(func(model string, k costfit.Coefficients, n float64) {
		ch <- prometheus.MustNewConstMetric(costDesc, prometheus.GaugeValue, k.Base.Seconds(), model, "base")
		ch <- prometheus.MustNewConstMetric(costDesc, prometheus.GaugeValue, k.PerToken.Seconds(), model, "prefill_per_token")
		ch <- prometheus.MustNewConstMetric(costDesc, prometheus.GaugeValue, k.PerRunning.Seconds(), model, "per_running")
		ch <- prometheus.MustNewConstMetric(costObservationsDesc, prometheus.GaugeValue, n, model)
	})
}
