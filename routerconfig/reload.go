package routerconfig

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/gateway"
)

// Reloader re-reads the config file onto the flags' base configuration and
// applies it. A file that is too large, unreadable, or fails to parse,
// validate or build is logged and counted, and the configuration in force
// stays. It is a prometheus.Collector of kvmesh_router_config_reloads_total
// and kvmesh_router_config_unsettled_total.
type Reloader struct {
	Base    *Config
	Path    string // empty: flags only
	Builder *Builder
	Gateway *gateway.Gateway
	Log     zerolog.Logger
	// MaxBytes refuses a larger file unread (0: DefaultMaxBytes).
	MaxBytes int64
	// Settle is how long a change must stay the same before Watch applies
	// it (0: DefaultSettle).
	Settle time.Duration

	mu          sync.Mutex
	metricsOnce sync.Once
	m           *reloadMetrics
}

type reloadMetrics struct {
	results   *prometheus.CounterVec
	unsettled prometheus.Counter
}

// Reload results, the values of kvmesh_router_config_reloads_total{result}.
const (
	resultApplied    = "applied"
	resultInvalid    = "invalid"
	resultTooLarge   = "too_large"
	resultUnreadable = "unreadable"
)

func (r *Reloader) metrics() *reloadMetrics {
	r.metricsOnce.Do(func() {
		r.m = &reloadMetrics{
			results: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "kvmesh_router_config_reloads_total",
				Help: "Config file changes, by result: applied, invalid (parse, validation or build failed), too_large (over --config-max-bytes, not read) or unreadable.",
			}, []string{"result"}),
			unsettled: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "kvmesh_router_config_unsettled_total",
				Help: "Times the config file read differently across --config-settle with no write seen in between (a write in progress or an unseen one): it is read again, not applied.",
			}),
		}
		for _, res := range []string{resultApplied, resultInvalid, resultTooLarge, resultUnreadable} {
			r.m.results.WithLabelValues(res)
		}
	})
	return r.m
}

// Describe implements prometheus.Collector.
func (r *Reloader) Describe(ch chan<- *prometheus.Desc) {
	r.metrics().results.Describe(ch)
	r.metrics().unsettled.Describe(ch)
}

// Collect implements prometheus.Collector.
func (r *Reloader) Collect(ch chan<- prometheus.Metric) {
	r.metrics().results.Collect(ch)
	r.metrics().unsettled.Collect(ch)
}

func (r *Reloader) maxBytes() int64 {
	if r.MaxBytes > 0 {
		return r.MaxBytes
	}
	return DefaultMaxBytes
}

func (r *Reloader) settle() time.Duration {
	if r.Settle > 0 {
		return r.Settle
	}
	return DefaultSettle
}

// Reload reads the file now, then builds and applies the configuration.
func (r *Reloader) Reload() error {
	if r.Path == "" {
		return r.apply(nil, nil)
	}
	data, err := ReadFile(r.Path, r.maxBytes())
	return r.apply(data, err)
}

// apply builds and applies data, the file's content, or counts readErr.
func (r *Reloader) apply(data []byte, readErr error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	cfg := r.Base
	if r.Path != "" {
		result, err := resultUnreadable, readErr
		if errors.Is(err, ErrTooLarge) {
			result = resultTooLarge
		}
		var file *Config
		if err == nil {
			result = resultInvalid
			file, err = parseFile(r.Path, data)
		}
		if err == nil && file.empty {
			// Applied, it would mean all defaults: client API keys off,
			// every static upstream gone. Far likelier a write caught half
			// way (> file, a failed envsubst) than meant.
			err = fmt.Errorf("config: %s is empty", r.Path)
		}
		if err != nil {
			r.metrics().results.WithLabelValues(result).Inc()
			r.Log.Error().Err(err).Msg("config not reloaded: keeping the one in force")
			return err
		}
		cfg = Overlay(r.Base, file)
	}
	if err := r.Builder.Apply(r.Gateway, cfg); err != nil {
		r.metrics().results.WithLabelValues(resultInvalid).Inc()
		r.Log.Error().Err(err).Msg("config not applied: keeping the one in force")
		return err
	}
	r.metrics().results.WithLabelValues(resultApplied).Inc()
	r.Log.Info().Str("path", r.Path).Str("policy", r.Gateway.Settings().Policy.Name()).
		Int("models", len(cfg.Models)).Int("static_upstreams", len(cfg.StaticUpstreams)).Msg("config applied")
	return nil
}
