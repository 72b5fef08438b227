// Package routerconfig is the router's configuration: the YAML file (models,
// tokenizers, the replica selection for prefix matching, routing weights
// and thresholds, fallbacks, static upstreams, client API keys), its merge
// with command-line flags, validation, turning it into the gateway's
// settings, and reloading it when the file changes.
package routerconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"reflect"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/plan"
	"github.com/kvmesh/kvmesh/routing"
)

// Config is the whole router configuration. The YAML keys are the yaml tags.
type Config struct {
	// Policy is the routing policy (routing.Names); default kvaware.
	Policy string `yaml:"policy"`
	// Routing holds the cost model and thresholds; zero fields take
	// routing's defaults.
	Routing Routing `yaml:"routing"`
	// MaxPrefixTokens caps the prompt tokens used for matching.
	MaxPrefixTokens int `yaml:"max_prefix_tokens"`
	// MaxPrefixBytes bounds the prompt bytes rendered and tokenized to
	// find those tokens (tokenize.Bounds).
	MaxPrefixBytes int `yaml:"max_prefix_bytes"`
	// MaxAttempts bounds the replicas tried per request before the fallback.
	MaxAttempts int `yaml:"max_attempts"`
	// DefaultTokenizer tokenizes models without their own: builtin, engine
	// or a HuggingFace model directory; empty routes them by load only.
	DefaultTokenizer string  `yaml:"default_tokenizer"`
	Models           []Model `yaml:"models"`
	// Selection names the 2–50 replicas taking part in prefix matching;
	// empty means all. The others still receive traffic by load.
	Selection       []string `yaml:"selection"`
	StaticUpstreams []Static `yaml:"static_upstreams"`
	// APIKeys, when set, are the bearer tokens clients must present.
	// APIKeysEnv names an environment variable with more, comma-separated.
	APIKeys    []string `yaml:"api_keys"`
	APIKeysEnv string   `yaml:"api_keys_env"`
	// TenantList names client populations by their API keys, each with a
	// share weight, a priority ceiling and quotas; DefaultTenant limits
	// every other client. TenantHeader, when set, is a header a trusted
	// upstream gateway sets to name a request's tenant (off by default:
	// clients could otherwise name themselves).
	TenantList    []Tenant `yaml:"tenants"`
	DefaultTenant Limits   `yaml:"default_tenant"`
	TenantHeader  string   `yaml:"tenant_header"`
	// FlowControl holds requests in the router while the fleet is
	// saturated: strict priority, fair share between tenants, bounded waits.
	FlowControl FlowControl `yaml:"flow_control"`
	// Disaggregation is when requests to models served by prefill and
	// decode pools are split.
	Disaggregation Disaggregation `yaml:"disaggregation"`
	// EngineAPIKeyEnv names an environment variable holding the key the
	// engines were started with (vllm serve --api-key); the router sends it
	// to every replica instead of the client's Authorization.
	EngineAPIKeyEnv string `yaml:"engine_api_key_env"`
	// Upstream timeouts.
	Upstream Upstream `yaml:"upstream"`
	// ResumeStreams continues a stream that breaks mid-answer at the next
	// replica, from the text already sent (nil: the flag's setting).
	ResumeStreams *bool `yaml:"resume_streams"`
	// SessionHeaders are the request headers naming a client's session, a
	// placement hint (empty: gateway.DefaultSessionHeaders; ["none"]: no
	// hints).
	SessionHeaders []string `yaml:"session_headers"`
	// PassthroughPaths are engine POST routes passed through by model and
	// load beside the ones the router lists (gateway.Settings.PassthroughPaths).
	PassthroughPaths []string `yaml:"passthrough_paths"`

	// empty is set by Parse for a document with nothing in it (whitespace
	// and comments): the reloader refuses it.
	empty bool
}

// Disaggregation is when a request to a model whose replicas announce
// prefill and decode roles is split (prefilled on one, decoded on another).
type Disaggregation struct {
	// Split is auto (default), always or never (plan.Split).
	Split string `yaml:"split"`
	// MinPrefill is auto's threshold: a request is split when computing
	// the uncached part of its prompt on the best decode-capable replica
	// would take at least this long at the cost model's prefill_per_token
	// (0: DefaultMinPrefill), the stall it would put on every decode
	// running there.
	MinPrefill time.Duration `yaml:"min_prefill"`
}

// DefaultMinPrefill is Disaggregation.MinPrefill's default: about two
// decode steps of a lightly loaded engine (a step's floor is 5–10 ms on
// the calibration's H200; 15 ms is 500 tokens at 30 µs each). A shorter
// prefill costs the decodes it joins less than the transfer and the extra
// hop cost its own first token.
const DefaultMinPrefill = 15 * time.Millisecond

// Routing mirrors routing.Config.
type Routing struct {
	PrefillPerToken   time.Duration `yaml:"prefill_per_token"`
	PerRunning        time.Duration `yaml:"per_running"`
	TokensPerWaiting  int           `yaml:"tokens_per_waiting"`
	LoadBound         float64       `yaml:"load_bound"`
	ColdSlack         time.Duration `yaml:"cold_slack"`
	ImbalanceEnter    float64       `yaml:"imbalance_enter"`
	ImbalanceExit     float64       `yaml:"imbalance_exit"`
	ImbalanceMinQueue time.Duration `yaml:"imbalance_min_queue"`
	SpeculativeTTL    time.Duration `yaml:"speculative_ttl"`
	// OffloadPerToken prices a token loaded back from an offload tier (0:
	// routing.DefaultOffloadPerToken); OffloadPerTokenByMedium per medium
	// (keys as the engine's events name them, e.g. CPU).
	OffloadPerToken         time.Duration            `yaml:"offload_per_token"`
	OffloadPerTokenByMedium map[string]time.Duration `yaml:"offload_per_token_by_medium"`
	// Calibrate decides by the cost model fitted per model to measured
	// times to first token (nil: the flag's setting).
	Calibrate *bool `yaml:"calibrate"`
}

// Config is the routing.Config these settings make (what a router decides
// with; fleetsim reads a router config file through it).
func (r Routing) Config() routing.Config {
	return routing.Config{
		PrefillPerToken: r.PrefillPerToken, PerRunning: r.PerRunning, TokensPerWaiting: r.TokensPerWaiting,
		LoadBound: r.LoadBound, ColdSlack: r.ColdSlack, ImbalanceEnter: r.ImbalanceEnter,
		ImbalanceExit: r.ImbalanceExit, ImbalanceMinQueue: r.ImbalanceMinQueue, SpeculativeTTL: r.SpeculativeTTL,
		Calibrate:       r.Calibrate != nil && *r.Calibrate,
		OffloadPerToken: r.OffloadPerToken, OffloadPerTokenBy: upperKeys(r.OffloadPerTokenByMedium),
	}
}

// upperKeys is m with upper-case keys: media are compared so.
func upperKeys(m map[string]time.Duration) map[string]time.Duration {
	if m == nil {
		return nil
	}
	out := make(map[string]time.Duration, len(m))
	for k, v := range m {
		out[strings.ToUpper(k)] = v
	}
	return out
}

// Model is one served model name (or LoRA adapter).
type Model struct {
	Name string `yaml:"name"`
	// Tokenizer: builtin, engine, or a HuggingFace model directory. An
	// adapter without one uses its base model's.
	Tokenizer string `yaml:"tokenizer"`
	// AdapterOf names the base model when Name is a LoRA adapter; its block
	// keys are then seeded with the adapter name.
	AdapterOf string `yaml:"adapter_of"`
	// Fallback serves the model when no replica can: a backup pool or an
	// upstream with its own API key.
	Fallback []Endpoint `yaml:"fallback"`
	// SpillAfter sends requests to the fallback first when the best
	// replica's predicted time to first token is over it (kvaware only;
	// 0: never).
	SpillAfter time.Duration `yaml:"spill_after"`
	// EnginePriority: its replicas run vLLM's --scheduling-policy priority;
	// each request's priority band is sent as vLLM's priority field
	// (critical -1, standard 0, sheddable 1).
	EnginePriority bool `yaml:"engine_priority"`
}

// Endpoint is a fallback upstream.
type Endpoint struct {
	Name string `yaml:"name"`
	URL  string `yaml:"url"`
	// APIKeyEnv names the environment variable holding its API key.
	APIKeyEnv string `yaml:"api_key_env"`
}

// Static is an upstream without a sidecar, load-balanced only.
type Static struct {
	Name string `yaml:"name"`
	URL  string `yaml:"url"`
	// Models it serves; empty: learned from its /v1/models, and until then
	// any model.
	Models []string `yaml:"models"`
}

// Upstream holds connection timeouts.
type Upstream struct {
	DialTimeout      time.Duration `yaml:"dial_timeout"`
	FirstByteTimeout time.Duration `yaml:"first_byte_timeout"`
	IdleTimeout      time.Duration `yaml:"idle_timeout"`
	MaxConns         int           `yaml:"max_conns"`
}

// Parse decodes and validates YAML. Unknown keys are errors, so a typo does
// not silently leave a setting at its default.
func Parse(data []byte) (*Config, error) {
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); errors.Is(err, io.EOF) {
		c.empty = true
	} else if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// DefaultMaxBytes bounds the config file: a router's YAML is a few KB (tens
// of thousands of API keys still fit), while decoding costs about six times
// the file in memory (300 MB took 1.8 GB and 20 s), so a wrong file named by
// --config must not be read at all.
const DefaultMaxBytes = 4 << 20

// ErrTooLarge marks a config file over the size limit.
var ErrTooLarge = errors.New("config file over --config-max-bytes")

// ReadFile returns the content of the file at path, refusing one that is
// not a regular file (a FIFO would block the read, a device never end) or is
// over maxBytes, before reading it.
func ReadFile(path string, maxBytes int64) ([]byte, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("config: %s is not a regular file", path)
	}
	if st.Size() > maxBytes {
		return nil, fmt.Errorf("config: %s is %d bytes, over the limit of %d: %w", path, st.Size(), maxBytes, ErrTooLarge)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	defer f.Close()
	// It may have grown since the stat.
	data, err := io.ReadAll(io.LimitReader(f, maxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if int64(len(data)) > maxBytes {
		return nil, fmt.Errorf("config: %s is over the limit of %d bytes: %w", path, maxBytes, ErrTooLarge)
	}
	return data, nil
}

// Load reads and parses the file at path once it has settled (ReadSettled).
func Load(path string, maxBytes int64, settle time.Duration) (*Config, error) {
	data, err := ReadSettled(path, maxBytes, settle)
	if err != nil {
		return nil, err
	}
	return parseFile(path, data)
}

func parseFile(path string, data []byte) (*Config, error) {
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Validate checks what can be checked without building anything.
func (c *Config) Validate() error {
	var errs []error
	if err := routing.Validate(c.Policy, c.Routing.Config()); err != nil {
		errs = append(errs, err)
	}
	if c.MaxPrefixTokens < 0 || c.MaxPrefixBytes < 0 || c.MaxAttempts < 0 {
		errs = append(errs, errors.New("config: max_prefix_tokens, max_prefix_bytes and max_attempts must not be negative"))
	}
	selected := map[string]bool{}
	for _, n := range c.Selection {
		if selected[n] {
			errs = append(errs, fmt.Errorf("config: selection names %q twice", n))
		}
		selected[n] = true
	}
	if n := len(selected); n > 0 && (n < fleet.MinSelected || n > fleet.MaxSelected) {
		errs = append(errs, fmt.Errorf("config: selection names %d replicas, want %d..%d", n, fleet.MinSelected, fleet.MaxSelected))
	}
	names := map[string]bool{}
	for i, m := range c.Models {
		if m.Name == "" {
			errs = append(errs, fmt.Errorf("config: models[%d] has no name", i))
		}
		if names[m.Name] {
			errs = append(errs, fmt.Errorf("config: model %q listed twice", m.Name))
		}
		names[m.Name] = true
		// That spill_after has a fallback is checked by Build, on the
		// merged config: the two may come from flags and file apart.
		if m.SpillAfter < 0 {
			errs = append(errs, fmt.Errorf("config: model %q: spill_after must not be negative", m.Name))
		}
		for j, f := range m.Fallback {
			if !httpURL(f.URL) {
				errs = append(errs, fmt.Errorf("config: model %q fallback[%d]: url %q must be http(s)://host[:port][/prefix]", m.Name, j, f.URL))
			}
		}
	}
	if err := c.FlowControl.validate(); err != nil {
		errs = append(errs, err)
	}
	if _, err := plan.ParseSplit(c.Disaggregation.Split); err != nil {
		errs = append(errs, fmt.Errorf("config: disaggregation: %w", err))
	}
	if c.Disaggregation.MinPrefill < 0 {
		errs = append(errs, errors.New("config: disaggregation: min_prefill must not be negative"))
	}
	for _, p := range c.PassthroughPaths {
		if err := gateway.CheckPassthroughPath(p); err != nil {
			errs = append(errs, fmt.Errorf("config: %w", err))
		}
	}
	statics := map[string]bool{}
	for i, s := range c.StaticUpstreams {
		if s.Name == "" || statics[s.Name] {
			errs = append(errs, fmt.Errorf("config: static_upstreams[%d]: name missing or repeated", i))
		}
		statics[s.Name] = true
		if !httpURL(s.URL) {
			errs = append(errs, fmt.Errorf("config: static upstream %q: url %q must be http(s)://host[:port][/prefix]", s.Name, s.URL))
		}
	}
	return errors.Join(errs...)
}

// httpURL reports whether raw is an upstream URL the proxy can dial (as
// proxy.NewUpstream checks it): one without a host would be accepted here and
// fail every request instead.
func httpURL(raw string) bool {
	u, err := url.Parse(raw)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// Overlay returns base with everything file sets on top: scalars it sets
// win, models and static upstreams are merged by name (file wins), lists
// it sets replace.
func Overlay(base, file *Config) *Config {
	out := *base
	if file == nil {
		return &out
	}
	if file.Policy != "" {
		out.Policy = file.Policy
	}
	if !reflect.ValueOf(file.Routing).IsZero() {
		out.Routing = file.Routing
		if file.Routing.Calibrate == nil {
			out.Routing.Calibrate = base.Routing.Calibrate
		}
	}
	if file.MaxPrefixTokens > 0 {
		out.MaxPrefixTokens = file.MaxPrefixTokens
	}
	if file.MaxPrefixBytes > 0 {
		out.MaxPrefixBytes = file.MaxPrefixBytes
	}
	if file.MaxAttempts > 0 {
		out.MaxAttempts = file.MaxAttempts
	}
	if file.DefaultTokenizer != "" {
		out.DefaultTokenizer = file.DefaultTokenizer
	}
	if file.Upstream != (Upstream{}) {
		out.Upstream = file.Upstream
	}
	if file.ResumeStreams != nil {
		out.ResumeStreams = file.ResumeStreams
	}
	if len(file.SessionHeaders) > 0 {
		out.SessionHeaders = file.SessionHeaders
	}
	if len(file.PassthroughPaths) > 0 {
		out.PassthroughPaths = file.PassthroughPaths
	}
	if len(file.Selection) > 0 {
		out.Selection = file.Selection
	}
	out.APIKeys = append(append([]string(nil), base.APIKeys...), file.APIKeys...)
	if file.APIKeysEnv != "" {
		out.APIKeysEnv = file.APIKeysEnv
	}
	if file.EngineAPIKeyEnv != "" {
		out.EngineAPIKeyEnv = file.EngineAPIKeyEnv
	}
	out.TenantList = mergeByName(base.TenantList, file.TenantList, func(t Tenant) string { return t.Name },
		func(_, o Tenant) Tenant { return o })
	if file.DefaultTenant != (Limits{}) {
		out.DefaultTenant = file.DefaultTenant
	}
	if file.TenantHeader != "" {
		out.TenantHeader = file.TenantHeader
	}
	if file.Disaggregation.Split != "" {
		out.Disaggregation.Split = file.Disaggregation.Split
	}
	if file.Disaggregation.MinPrefill != 0 {
		out.Disaggregation.MinPrefill = file.Disaggregation.MinPrefill
	}
	if fc := file.FlowControl; fc != (FlowControl{}) {
		if fc.Enabled == nil {
			fc.Enabled = base.FlowControl.Enabled
		}
		if fc.MaxEngineQueue == 0 {
			fc.MaxEngineQueue = base.FlowControl.MaxEngineQueue
		}
		if fc.MaxInflightPerReplica == 0 {
			fc.MaxInflightPerReplica = base.FlowControl.MaxInflightPerReplica
		}
		out.FlowControl = fc
	}
	out.Models = mergeByName(base.Models, file.Models, func(m Model) string { return m.Name }, func(b, o Model) Model {
		if o.Tokenizer == "" {
			o.Tokenizer = b.Tokenizer
		}
		if o.AdapterOf == "" {
			o.AdapterOf = b.AdapterOf
		}
		if len(o.Fallback) == 0 {
			o.Fallback = b.Fallback
		}
		if o.SpillAfter == 0 {
			o.SpillAfter = b.SpillAfter
		}
		o.EnginePriority = o.EnginePriority || b.EnginePriority
		return o
	})
	out.StaticUpstreams = mergeByName(base.StaticUpstreams, file.StaticUpstreams, func(s Static) string { return s.Name },
		func(_, o Static) Static { return o })
	return &out
}

func mergeByName[T any](base, over []T, name func(T) string, merge func(base, over T) T) []T {
	out := append([]T(nil), base...)
	for _, o := range over {
		replaced := false
		for i := range out {
			if name(out[i]) == name(o) {
				out[i], replaced = merge(out[i], o), true
			}
		}
		if !replaced {
			out = append(out, o)
		}
	}
	return out
}
