package routerconfig

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

// Builder turns configurations into gateway settings. It keeps what is
// costly or stateful across reloads: loaded tokenizers (by spec) and the
// routing policy (while its name and parameters stay the same, so its
// speculative records and degradation count survive a reload).
type Builder struct {
	Table *fleet.Table
	// AdminToken and AdminOpen come from flags only (never from a watched
	// file): see gateway.Settings.
	AdminToken string
	AdminOpen  bool
	// EngineAPIKey is the engines' API key given by flag (the file can only
	// name an environment variable holding one: engine_api_key_env).
	EngineAPIKey string
	// NoDataParallelHeader is --no-data-parallel-header
	// (gateway.Settings.NoDataParallelHeader).
	NoDataParallelHeader bool
	// IgnoreTiers is --ignore-tiers (gateway.Settings.IgnoreTiers).
	IgnoreTiers bool
	// CarryStoredState is --carry-stored-state
	// (gateway.Settings.CarryStoredState).
	CarryStoredState bool
	// Log gets a line per tokenizer loaded (the zero Logger: none).
	Log zerolog.Logger

	mu         sync.Mutex
	tokenizers map[string]tokenize.Model
	policy     routing.Policy
	policyKey  string
}

// Build validates c and returns the settings it describes. Nothing is
// applied, so a bad configuration leaves the running one untouched.
func (b *Builder) Build(c *Config) (gateway.Settings, error) {
	if err := c.Validate(); err != nil {
		return gateway.Settings{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tokenizers == nil {
		b.tokenizers = map[string]tokenize.Model{}
	}
	var errs []error
	for _, m := range c.Models {
		if m.SpillAfter > 0 && len(m.Fallback) == 0 {
			errs = append(errs, fmt.Errorf("config: model %q: spill_after needs a fallback (models[].fallback or --fallback)", m.Name))
		}
	}
	engineKey := b.EngineAPIKey
	if c.EngineAPIKeyEnv != "" {
		if engineKey = os.Getenv(c.EngineAPIKeyEnv); engineKey == "" {
			errs = append(errs, fmt.Errorf("config: engine_api_key_env %s is empty", envName(c.EngineAPIKeyEnv)))
		}
	}
	s := gateway.Settings{
		EngineAPIKey:    engineKey,
		MaxPrefixTokens: c.MaxPrefixTokens,
		MaxPrefixBytes:  c.MaxPrefixBytes,
		MaxAttempts:     c.MaxAttempts,
		ResumeStreams:   c.ResumeStreams != nil && *c.ResumeStreams,

		NoDataParallelHeader: b.NoDataParallelHeader,
		IgnoreTiers:          b.IgnoreTiers,
		CarryStoredState:     b.CarryStoredState,
		SessionHeaders:       sessionHeaders(c.SessionHeaders),
		PassthroughPaths:     c.PassthroughPaths,
		AdminToken:           b.AdminToken,
		AdminOpen:            b.AdminOpen,
		Models:               map[string]gateway.Model{},
		Upstream: proxy.Options{
			DialTimeout: c.Upstream.DialTimeout, FirstByteTimeout: c.Upstream.FirstByteTimeout,
			IdleTimeout: c.Upstream.IdleTimeout, MaxConns: c.Upstream.MaxConns,
		},
	}
	policy := c.Policy
	if policy == "" {
		policy = "kvaware"
	}
	rc := c.Routing.Config()
	// The policy in force is kept across reloads that leave its settings
	// alone (its speculative records and learned costs with it). A new one
	// replaces it only once the whole configuration built: a rejected
	// reload must not leave a policy nobody used as the one to compare with.
	key := fmt.Sprintf("%s %+v", policy, rc) // values, not the pointers in Routing
	s.Policy = b.policy
	if b.policy == nil || key != b.policyKey {
		p, err := routing.New(policy, rc)
		if err != nil {
			errs = append(errs, err)
		}
		s.Policy = p
	}

	if c.DefaultTokenizer != "" {
		tk, err := b.tokenizer(c.DefaultTokenizer, "", engineKey)
		errs = append(errs, err)
		s.DefaultTokenizer = tk
	}
	byName := map[string]Model{}
	for _, m := range c.Models {
		byName[m.Name] = m
	}
	for _, m := range c.Models {
		gm := gateway.Model{Base: m.AdapterOf, SpillAfter: m.SpillAfter, EnginePriority: m.EnginePriority}
		if m.AdapterOf != "" {
			gm.Adapter = m.Name
		}
		spec := m.Tokenizer
		if spec == "" && m.AdapterOf != "" {
			spec = byName[m.AdapterOf].Tokenizer
		}
		if spec != "" {
			tk, err := b.tokenizer(spec, m.Name, engineKey)
			errs = append(errs, err)
			gm.Tokenizer = tk
		}
		for i, f := range m.Fallback {
			name := f.Name
			if name == "" {
				name = fmt.Sprintf("fallback-%s-%d", m.Name, i)
			}
			key := ""
			if f.APIKeyEnv != "" {
				key = os.Getenv(f.APIKeyEnv)
				if key == "" {
					errs = append(errs, fmt.Errorf("config: model %q fallback %q: environment variable %s is empty", m.Name, name, envName(f.APIKeyEnv)))
				}
			}
			up, err := proxy.NewUpstream(name, f.URL, key, s.Upstream)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			gm.Fallback = append(gm.Fallback, up)
		}
		s.Models[m.Name] = gm
	}
	clientKeys, err := keys(c.APIKeys, c.APIKeysEnv, "api_keys_env")
	if err != nil {
		errs = append(errs, err)
	}
	if s.Tenants, err = c.tenants(clientKeys); err != nil {
		errs = append(errs, err)
	}
	s.Flow = c.FlowControl.settings(rc.PrefillPerToken)
	s.Split, _ = plan.ParseSplit(c.Disaggregation.Split) // Validate checked it
	s.SplitMinUncached = splitMinUncached(c.Disaggregation.MinPrefill, rc.PrefillPerToken)
	if len(clientKeys) > 0 {
		s.APIKeys = map[string]bool{}
		for _, k := range clientKeys {
			s.APIKeys[k] = true
		}
	}
	if err := errors.Join(errs...); err != nil {
		return gateway.Settings{}, err
	}
	b.policy, b.policyKey = s.Policy, key
	return s, nil
}

// envName returns name for an error message when it looks like a variable's
// name; a key pasted where its variable's name belongs is not logged.
func envName(name string) string {
	for i, r := range name {
		if !(r == '_' || 'A' <= r && r <= 'Z' || 'a' <= r && r <= 'z' || i > 0 && '0' <= r && r <= '9') {
			return "(not a variable name: the key itself? not shown)"
		}
	}
	return name
}

// tokenizer returns the model for spec, loading it once (an engine
// tokenizer once per model and engine API key).
func (b *Builder) tokenizer(spec, model, engineKey string) (tokenize.Model, error) {
	cacheKey := spec
	if spec == "engine" {
		cacheKey = "engine\x00" + model + "\x00" + engineKey
	}
	if tk := b.tokenizers[cacheKey]; tk != nil {
		return tk, nil
	}
	var tk tokenize.Model
	switch spec {
	case "builtin":
		tk = tokenize.Builtin{}
	case "engine":
		if b.Table == nil {
			return nil, errors.New("config: tokenizer engine needs the replica table")
		}
		tk = gateway.EngineTokenizer(b.Table, model, engineKey)
	default:
		hf, err := tokenize.LoadDir(spec)
		if err != nil {
			return nil, fmt.Errorf("config: tokenizer %q: %w", spec, err)
		}
		// Templates rendered in Go save ≈ 20 µs per 4 KB chat over jinja:
		// say which this one is.
		b.Log.Info().Str("tokenizer", spec).Str("chat_template", hf.ChatRenderer()).Msg("tokenizer loaded")
		tk = hf
	}
	b.tokenizers[cacheKey] = tk
	return tk, nil
}

// Apply installs c: the gateway's settings swap atomically, static upstreams
// and the selection are synced into the table. On error nothing changes.
func (b *Builder) Apply(g *gateway.Gateway, c *Config) error {
	s, err := b.Build(c)
	if err != nil {
		return err
	}
	if err := b.Table.Select(c.Selection); err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, st := range c.StaticUpstreams {
		b.Table.AddStatic(st.Name, st.URL, st.Models)
		keep[st.Name] = true
	}
	b.Table.RemoveStatic(keep)
	g.Apply(s)
	return nil
}

// sessionHeaders is the configured list as the gateway takes it: nil for
// its defaults, empty for none.
func sessionHeaders(list []string) []string {
	if len(list) == 1 && strings.EqualFold(list[0], "none") {
		return []string{}
	}
	return list
}

// splitMinUncached is the uncached prompt tokens whose prefill takes
// minPrefill (DefaultMinPrefill when 0) at perToken (routing's default
// when 0).
func splitMinUncached(minPrefill, perToken time.Duration) int {
	if minPrefill == 0 {
		minPrefill = DefaultMinPrefill
	}
	if perToken <= 0 {
		perToken = routing.DefaultPrefillPerToken
	}
	return int(minPrefill / perToken)
}
