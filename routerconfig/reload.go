package routerconfig

import (
	"fmt"
	"sync"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/gateway"
)

// Reloader re-reads the config file onto the flags' base configuration and
// applies it. A file that fails to parse, validate or build is logged and
// the configuration in force stays.
type Reloader struct {
	Base    *Config
	Path    string // empty: flags only
	Builder *Builder
	Gateway *gateway.Gateway
	Log     zerolog.Logger

	mu sync.Mutex
}

// Reload loads, builds and applies the configuration.
func (r *Reloader) Reload() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	cfg := r.Base
	if r.Path != "" {
		file, err := Load(r.Path)
		if err == nil && file.empty {
			// Applied, it would mean all defaults: client API keys off,
			// every static upstream gone. Far likelier a write caught half
			// way (> file, a failed envsubst) than meant.
			err = fmt.Errorf("config: %s is empty", r.Path)
		}
		if err != nil {
			r.Log.Error().Err(err).Msg("config not reloaded: keeping the one in force")
			return err
		}
		cfg = Overlay(r.Base, file)
	}
	if err := r.Builder.Apply(r.Gateway, cfg); err != nil {
		r.Log.Error().Err(err).Msg("config not applied: keeping the one in force")
		return err
	}
	r.Log.Info().Str("path", r.Path).Str("policy", r.Gateway.Settings().Policy.Name()).
		Int("models", len(cfg.Models)).Int("static_upstreams", len(cfg.StaticUpstreams)).Msg("config applied")
	return nil
}
