package routerconfig

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/quota"
	"github.com/kvmesh/kvmesh/tenant"
)

// Tenant is a named client population: the API keys that select it, its
// share of a saturated fleet, the highest priority it may ask for, and its
// quotas.
type Tenant struct {
	Name string `yaml:"name"`
	// APIKeys select this tenant; APIKeysEnv names a variable with more,
	// comma-separated.
	APIKeys    []string `yaml:"api_keys"`
	APIKeysEnv string   `yaml:"api_keys_env"`
	Limits     `yaml:",inline"`
}

// Limits is what a tenant may take.
type Limits struct {
	// Weight is its share within a priority band against the other tenants
	// queued there; 0 is 1.
	Weight float64 `yaml:"weight"`
	// MaxPriority is the highest X-Kvmesh-Priority its requests are served
	// at (critical, standard or sheddable); empty is standard, so critical
	// is only for tenants named so.
	MaxPriority string `yaml:"max_priority"`
	// RequestsPerMinute and TokensPerMinute are quotas enforced across all
	// routers; 0 is unlimited.
	RequestsPerMinute int64 `yaml:"requests_per_minute"`
	TokensPerMinute   int64 `yaml:"tokens_per_minute"`
}

func (l Limits) tenant(name string) (tenant.Tenant, error) {
	p := flowcontrol.Standard
	if l.MaxPriority != "" {
		var err error
		if p, err = flowcontrol.ParsePriority(l.MaxPriority); err != nil {
			return tenant.Tenant{}, fmt.Errorf("config: tenant %q: max_priority: %w", name, err)
		}
	}
	return tenant.Tenant{
		Name: name, Weight: l.Weight, MaxPriority: p,
		Quota: quota.Limits{RequestsPerMinute: l.RequestsPerMinute, TokensPerMinute: l.TokensPerMinute},
	}, nil
}

// Tenants builds the tenant directory: the default tenant (unkeyed clients,
// and those presenting one of api_keys) and every configured tenant, with
// keys read from their variables.
func (c *Config) Tenants() (*tenant.Directory, error) {
	clientKeys, err := keys(c.APIKeys, c.APIKeysEnv, "api_keys_env")
	d, terr := c.tenants(clientKeys)
	return d, errors.Join(err, terr)
}

func (c *Config) tenants(clientKeys []string) (*tenant.Directory, error) {
	var errs []error
	spec := tenant.Spec{Header: c.TenantHeader, DefaultKeys: clientKeys}
	var err error
	if spec.Default, err = c.DefaultTenant.tenant(tenant.DefaultName); err != nil {
		errs = append(errs, err)
	}
	for _, t := range c.TenantList {
		tt, err := t.tenant(t.Name)
		if err != nil {
			errs = append(errs, err)
		}
		k, err := keys(t.APIKeys, t.APIKeysEnv, fmt.Sprintf("tenant %q api_keys_env", t.Name))
		if err != nil {
			errs = append(errs, err)
		}
		spec.Tenants = append(spec.Tenants, tt)
		spec.Keys = append(spec.Keys, k)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	d, err := tenant.New(spec)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return d, nil
}

// FlowControl configures the router-held queues (gateway.FlowControl).
type FlowControl struct {
	// Enabled holds requests while their model's fleet is saturated (nil:
	// the --flow-control flag's setting).
	Enabled *bool `yaml:"enabled"`
	// MaxEngineQueue: the fleet is saturated for a request when its best
	// replica's predicted wait behind queued work is over it; 0 is about one
	// scheduler step of prefill at the cost model's prefill_per_token.
	MaxEngineQueue time.Duration `yaml:"max_engine_queue"`
	// MaxInflightPerReplica: also saturated when every candidate holds this
	// many requests; 0 is no such limit.
	MaxInflightPerReplica int `yaml:"max_inflight_per_replica"`
	// Per-priority bounds; zero fields take the defaults.
	Critical  Band `yaml:"critical"`
	Standard  Band `yaml:"standard"`
	Sheddable Band `yaml:"sheddable"`
}

// Band bounds one priority's queue.
type Band struct {
	// MaxQueued bounds its held requests, MaxPerTenant one tenant's.
	MaxQueued    int `yaml:"max_queued"`
	MaxPerTenant int `yaml:"max_per_tenant"`
	// MaxWait is how long one is held before a 429 or 503.
	MaxWait time.Duration `yaml:"max_wait"`
}

func (f FlowControl) validate() error {
	if f.MaxEngineQueue < 0 || f.MaxInflightPerReplica < 0 {
		return errors.New("config: flow_control: max_engine_queue and max_inflight_per_replica must not be negative")
	}
	for _, b := range []struct {
		name string
		Band
	}{{"critical", f.Critical}, {"standard", f.Standard}, {"sheddable", f.Sheddable}} {
		if b.MaxQueued < 0 || b.MaxPerTenant < 0 || b.MaxWait < 0 {
			return fmt.Errorf("config: flow_control.%s: bounds must not be negative", b.name)
		}
	}
	return nil
}

// settings is f as the gateway takes it; prefill is the cost model's
// per-token prefill time, which the default engine-queue bound scales by.
func (f FlowControl) settings(prefill time.Duration) gateway.FlowControl {
	out := gateway.FlowControl{Enabled: f.Enabled != nil && *f.Enabled, MaxEngineQueue: f.MaxEngineQueue, MaxInflightPerReplica: f.MaxInflightPerReplica}
	if out.MaxEngineQueue == 0 && prefill > 0 {
		out.MaxEngineQueue = gateway.DefaultMaxEngineQueue / (30 * time.Microsecond) * prefill
	}
	for i, b := range []Band{f.Critical, f.Standard, f.Sheddable} {
		out.Bands[i] = flowcontrol.Limits{MaxQueued: b.MaxQueued, MaxPerFlow: b.MaxPerTenant, MaxWait: b.MaxWait}
	}
	return out
}

// keys returns list plus the comma-separated keys in the variable env; an
// env named but empty is an error (a deployment that lost its secret must
// not turn authentication off).
func keys(list []string, env, what string) ([]string, error) {
	out := append([]string(nil), list...)
	if env == "" {
		return out, nil
	}
	v := os.Getenv(env)
	if v == "" {
		return out, fmt.Errorf("config: %s %s is empty", what, envName(env))
	}
	for _, k := range strings.Split(v, ",") {
		if k = strings.TrimSpace(k); k != "" {
			out = append(out, k)
		}
	}
	return out, nil
}
