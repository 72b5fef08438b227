// Package tenant says whom a request is from and what it may ask for: the
// tenant its client API key (or a trusted gateway's header) names, that
// tenant's share weight, the highest priority it may ask for, and its quota.
//
// A Directory is built once per configuration and read concurrently without
// locks; a reload builds a new one. It holds no state about requests: the
// queue (flowcontrol) and the quota ledger (quota) keep that, keyed by the
// tenant's name.
package tenant

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"sort"

	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/quota"
)

// DefaultName names the tenant of clients no configured tenant claims: an
// unkeyed client, or one presenting a key of the router's plain api_keys.
const DefaultName = "default"

// maxNameBytes bounds a tenant name: it is a metric label and gossiped.
const maxNameBytes = 64

// Tenant is one client population.
type Tenant struct {
	Name string
	// Weight is its share within a priority band relative to the other
	// tenants queued there (> 0).
	Weight float64
	// MaxPriority is the highest band its requests may ask for; a request
	// asking for more is served at this one.
	MaxPriority flowcontrol.Priority
	// Quota limits its requests and tokens a minute across all routers.
	Quota quota.Limits
}

// Bound returns the priority a request of t asking for asked is served at,
// and whether the ceiling lowered it.
func (t *Tenant) Bound(asked flowcontrol.Priority) (flowcontrol.Priority, bool) {
	if asked < t.MaxPriority { // lower value, higher band
		return t.MaxPriority, true
	}
	return asked, false
}

// Spec is what a Directory is built from.
type Spec struct {
	// Default serves clients no tenant claims; its name is DefaultName
	// whatever Spec says. A zero Weight is 1; the zero MaxPriority is
	// Critical, so callers set it (routerconfig defaults it to Standard).
	Default Tenant
	// Tenants are the named tenants; Keys[i] are the API keys of Tenants[i].
	Tenants []Tenant
	Keys    [][]string
	// DefaultKeys are keys that authenticate a client as the default
	// tenant (the router's api_keys).
	DefaultKeys []string
	// Header, when not empty, is a request header a trusted upstream
	// gateway sets to name the tenant; it overrides the key's tenant.
	Header string
}

// Directory finds a request's tenant.
type Directory struct {
	def    *Tenant
	byName map[string]*Tenant
	byKey  map[string]*Tenant
	header string
}

// New checks spec and builds its directory.
func New(spec Spec) (*Directory, error) {
	d := &Directory{byName: map[string]*Tenant{}, byKey: map[string]*Tenant{}, header: spec.Header}
	var errs []error
	def := spec.Default
	def.Name = DefaultName
	if def.Weight == 0 {
		def.Weight = 1
	}
	if len(spec.Keys) != len(spec.Tenants) {
		return nil, fmt.Errorf("tenant: %d tenants but %d key lists", len(spec.Tenants), len(spec.Keys))
	}
	add := func(t Tenant) *Tenant {
		if err := check(t); err != nil {
			errs = append(errs, err)
		}
		if d.byName[t.Name] != nil {
			errs = append(errs, fmt.Errorf("tenant %q is named twice", t.Name))
		}
		p := &t
		d.byName[t.Name] = p
		return p
	}
	d.def = add(def)
	claim := func(key string, t *Tenant) {
		if key == "" {
			errs = append(errs, fmt.Errorf("tenant %q: an empty API key", t.Name))
			return
		}
		if other := d.byKey[key]; other != nil && other != t {
			// Not the key itself: it is a secret.
			errs = append(errs, fmt.Errorf("tenant: one API key is given to both %q and %q", other.Name, t.Name))
			return
		}
		d.byKey[key] = t
	}
	for _, k := range spec.DefaultKeys {
		claim(k, d.def)
	}
	for i, t := range spec.Tenants {
		if t.Weight == 0 {
			t.Weight = 1
		}
		p := add(t)
		if len(spec.Keys[i]) == 0 {
			errs = append(errs, fmt.Errorf("tenant %q has no API keys: nothing would select it", t.Name))
		}
		for _, k := range spec.Keys[i] {
			claim(k, p)
		}
	}
	if h := spec.Header; h != "" && !validHeaderName(h) {
		errs = append(errs, fmt.Errorf("tenant: header %q is not a header name", h))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return d, nil
}

func check(t Tenant) error {
	switch {
	case t.Name == "":
		return errors.New("tenant: a tenant has no name")
	case len(t.Name) > maxNameBytes || !printableASCII(t.Name):
		return fmt.Errorf("tenant %.64q: a name is at most %d printable ASCII characters", t.Name, maxNameBytes)
	case !(t.Weight > 0) || math.IsInf(t.Weight, 0):
		return fmt.Errorf("tenant %q: weight %v must be a positive number", t.Name, t.Weight)
	case t.MaxPriority > flowcontrol.Sheddable:
		return fmt.Errorf("tenant %q: max_priority %v is not a priority", t.Name, t.MaxPriority)
	case t.Quota.RequestsPerMinute < 0 || t.Quota.TokensPerMinute < 0:
		return fmt.Errorf("tenant %q: quotas must not be negative", t.Name)
	}
	return nil
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] > '~' {
			return false
		}
	}
	return true
}

func validHeaderName(h string) bool {
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c == '-' || c == '_' || '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z') {
			return false
		}
	}
	return true
}

// RequiresKey reports whether clients must present an API key: any key is
// configured, for the default tenant or a named one.
func (d *Directory) RequiresKey() bool { return len(d.byKey) > 0 }

// Header is the trusted tenant header's name, "" when off.
func (d *Directory) Header() string { return d.header }

// Identify returns the tenant of a request that presented key (its bearer
// token, empty for none) and header (the trusted header's value, empty when
// absent or off). ok is false when a key is required and key is not one:
// the request is unauthorized. A header naming no configured tenant leaves
// the key's tenant: a gateway's typo must not become a tenant of its own.
// It takes the request's bytes as they are: the lookups do not copy them.
func (d *Directory) Identify(key, header []byte) (t *Tenant, ok bool) {
	t = d.def
	if len(d.byKey) > 0 {
		if t = d.byKey[string(bytes.TrimSpace(key))]; t == nil {
			return nil, false
		}
	}
	if d.header != "" && len(header) > 0 {
		if named := d.byName[string(bytes.TrimSpace(header))]; named != nil {
			t = named
		}
	}
	return t, true
}

// Lookup returns the tenant named name, nil if none.
func (d *Directory) Lookup(name string) *Tenant { return d.byName[name] }

// Default returns the default tenant.
func (d *Directory) Default() *Tenant { return d.def }

// Weight is a flow's share weight, for flowcontrol.Config.Weight: a name no
// longer configured (a reload removed it while its requests wait) weighs as
// the default tenant.
func (d *Directory) Weight(name string) float64 {
	if t := d.byName[name]; t != nil {
		return t.Weight
	}
	return d.def.Weight
}

// Names returns every tenant's name, the default first, then by name.
func (d *Directory) Names() []string {
	out := make([]string, 0, len(d.byName))
	out = append(out, DefaultName)
	for n := range d.byName {
		if n != DefaultName {
			out = append(out, n)
		}
	}
	sort.Strings(out[1:])
	return out
}
