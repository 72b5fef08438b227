package routerconfig

import (
	"fmt"
	"strings"
	"time"
)

// List is a repeatable flag. One value may also hold several entries
// separated by ';' (handy in one environment variable).
type List []string

func (l *List) String() string { return strings.Join(*l, ";") }

// Set implements flag.Value.
func (l *List) Set(v string) error {
	for _, part := range strings.Split(v, ";") {
		if part = strings.TrimSpace(part); part != "" {
			*l = append(*l, part)
		}
	}
	return nil
}

// Flags are the settings given on the command line for the simple case.
type Flags struct {
	Policy string
	// Tokenizers: MODEL=SPEC (SPEC builtin, engine or an HF directory);
	// MODEL * sets the default for models not named.
	Tokenizers List
	// Statics: NAME=URL[,MODEL...].
	Statics List
	// Fallbacks: MODEL=URL[,API_KEY_ENV].
	Fallbacks List
	// SpillAfter: MODEL=DURATION.
	SpillAfter      List
	MaxPrefixTokens int
	MaxPrefixBytes  int
	MaxAttempts     int
	ResumeStreams   bool
	// SessionHeaders: comma-separated request headers naming a client's
	// session ("" : the defaults, "none": no session hints).
	SessionHeaders string
	// PassthroughPaths: comma-separated engine POST routes passed through
	// beside the router's own list (passthrough_paths).
	PassthroughPaths string
	// FlowControl holds requests in the router while the fleet is saturated.
	FlowControl bool
	// FlowMaxEngineQueue bounds the predicted wait at the best replica
	// before requests are held (flow_control.max_engine_queue).
	FlowMaxEngineQueue time.Duration
	// FlowMaxInflightPerReplica (flow_control.max_inflight_per_replica).
	FlowMaxInflightPerReplica int
	// CalibrateCost: kvaware decides by the cost model fitted to measured TTFTs.
	CalibrateCost bool
	// Split and SplitMinPrefill (disaggregation.split, .min_prefill).
	Split           string
	SplitMinPrefill time.Duration
}

// FromFlags builds the base configuration the file is overlaid on.
func FromFlags(f Flags) (*Config, error) {
	c := &Config{Policy: f.Policy, MaxPrefixTokens: f.MaxPrefixTokens, MaxPrefixBytes: f.MaxPrefixBytes, MaxAttempts: f.MaxAttempts, ResumeStreams: &f.ResumeStreams,
		Routing: Routing{Calibrate: &f.CalibrateCost}, FlowControl: FlowControl{Enabled: &f.FlowControl, MaxEngineQueue: f.FlowMaxEngineQueue, MaxInflightPerReplica: f.FlowMaxInflightPerReplica},
		Disaggregation: Disaggregation{Split: f.Split, MinPrefill: f.SplitMinPrefill}}
	if f.SessionHeaders != "" {
		for _, h := range strings.Split(f.SessionHeaders, ",") {
			if h = strings.TrimSpace(h); h != "" {
				c.SessionHeaders = append(c.SessionHeaders, h)
			}
		}
	}
	for _, p := range strings.Split(f.PassthroughPaths, ",") {
		if p = strings.TrimSpace(p); p != "" {
			c.PassthroughPaths = append(c.PassthroughPaths, p)
		}
	}
	model := func(name string) *Model {
		for i := range c.Models {
			if c.Models[i].Name == name {
				return &c.Models[i]
			}
		}
		c.Models = append(c.Models, Model{Name: name})
		return &c.Models[len(c.Models)-1]
	}
	for _, t := range f.Tokenizers {
		name, spec, ok := strings.Cut(t, "=")
		if !ok || name == "" || spec == "" {
			return nil, fmt.Errorf("--tokenizer %q: want MODEL=SPEC", t)
		}
		if name == "*" {
			c.DefaultTokenizer = spec
			continue
		}
		model(name).Tokenizer = spec
	}
	for _, s := range f.Statics {
		name, rest, ok := strings.Cut(s, "=")
		if !ok || name == "" || rest == "" {
			return nil, fmt.Errorf("--static-upstream %q: want NAME=URL[,MODEL...]", s)
		}
		parts := strings.Split(rest, ",")
		c.StaticUpstreams = append(c.StaticUpstreams, Static{Name: name, URL: parts[0], Models: parts[1:]})
	}
	for _, fb := range f.Fallbacks {
		name, rest, ok := strings.Cut(fb, "=")
		if !ok || name == "" || rest == "" {
			return nil, fmt.Errorf("--fallback %q: want MODEL=URL[,API_KEY_ENV]", fb)
		}
		url, env, _ := strings.Cut(rest, ",")
		m := model(name)
		m.Fallback = append(m.Fallback, Endpoint{URL: url, APIKeyEnv: env})
	}
	for _, sp := range f.SpillAfter {
		name, text, ok := strings.Cut(sp, "=")
		d, err := time.ParseDuration(text)
		if !ok || name == "" || err != nil {
			return nil, fmt.Errorf("--spill-after %q: want MODEL=DURATION (e.g. llama=5s)", sp)
		}
		model(name).SpillAfter = d
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}
