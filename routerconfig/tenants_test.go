package routerconfig

import (
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/flowcontrol"
)

func TestTenantsFromYAML(t *testing.T) {
	t.Setenv("KVMESH_TEST_BATCH_KEYS", "sk-batch-2, sk-batch-3")
	c, err := Parse([]byte(`
api_keys: [sk-plain]
tenant_header: X-Tenant
default_tenant: {weight: 0.5, tokens_per_minute: 100000}
tenants:
  - name: search
    api_keys: [sk-search]
    weight: 4
    max_priority: critical
    requests_per_minute: 600
  - name: batch
    api_keys: [sk-batch]
    api_keys_env: KVMESH_TEST_BATCH_KEYS
    max_priority: sheddable
`))
	if err != nil {
		t.Fatal(err)
	}
	d, err := c.Tenants()
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"sk-plain": "default", "sk-search": "search", "sk-batch": "batch", "sk-batch-3": "batch"} {
		if got, ok := d.Identify([]byte(key), nil); !ok || got.Name != want {
			t.Errorf("key %s: %v %v, want %s", key, got, ok, want)
		}
	}
	if _, ok := d.Identify(nil, nil); ok {
		t.Error("keys configured, yet an unkeyed client is let in")
	}
	if got, _ := d.Identify([]byte("sk-plain"), []byte("search")); got.Name != "search" {
		t.Errorf("tenant_header: %s", got.Name)
	}
	s, def := d.Lookup("search"), d.Default()
	if s.Weight != 4 || s.MaxPriority != flowcontrol.Critical || s.Quota.RequestsPerMinute != 600 {
		t.Errorf("search: %+v", s)
	}
	if def.Weight != 0.5 || def.MaxPriority != flowcontrol.Standard || def.Quota.TokensPerMinute != 100000 {
		t.Errorf("default: %+v", def)
	}
	if b := d.Lookup("batch"); b.Weight != 1 || b.MaxPriority != flowcontrol.Sheddable {
		t.Errorf("batch: %+v", b)
	}
}

func TestBadTenantsFailTheBuild(t *testing.T) {
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	for doc, want := range map[string]string{
		"tenants: [{name: a, api_keys: [k], max_priority: urgent}]": `tenant "a": max_priority: priority "urgent": want critical, standard or sheddable`,
		"tenants: [{name: a}]": `tenant "a" has no API keys`,
		"tenants: [{name: a, api_keys: [k]}, {name: b, api_keys: [k]}]": `one API key is given to both "a" and "b"`,
		"tenants: [{name: a, api_keys_env: KVMESH_TEST_UNSET_VAR}]":     `tenant "a" api_keys_env KVMESH_TEST_UNSET_VAR is empty`,
		"default_tenant: {weight: -2}":                                  `weight -2 must be a positive number`,
		"tenants: [{name: a, api_keys: [k], requests_per_minute: -1}]":  `quotas must not be negative`,
	} {
		c, err := Parse([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		if _, err := b.Build(c); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", doc, err, want)
		}
	}
}

func TestOverlayMergesTenantsByName(t *testing.T) {
	base := &Config{TenantList: []Tenant{{Name: "a", APIKeys: []string{"k1"}}, {Name: "b", APIKeys: []string{"k2"}}}}
	file := &Config{TenantList: []Tenant{{Name: "b", APIKeys: []string{"k3"}, Limits: Limits{Weight: 2}}}, TenantHeader: "X-T"}
	out := Overlay(base, file)
	if len(out.TenantList) != 2 || out.TenantList[1].APIKeys[0] != "k3" || out.TenantList[1].Weight != 2 || out.TenantHeader != "X-T" {
		t.Fatalf("%+v", out)
	}
}

func TestFlowControlFromFlagAndFile(t *testing.T) {
	b := &Builder{Table: fleet.NewTable(fleet.TableConfig{})}
	base, err := FromFlags(Flags{FlowControl: true})
	if err != nil {
		t.Fatal(err)
	}
	file, err := Parse([]byte("routing: {prefill_per_token: 60us}\nflow_control: {max_inflight_per_replica: 8, sheddable: {max_wait: 2s, max_per_tenant: 10}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := b.Build(Overlay(base, file))
	if err != nil {
		t.Fatal(err)
	}
	f := s.Flow
	if !f.Enabled || f.MaxInflightPerReplica != 8 || f.Bands[flowcontrol.Sheddable].MaxWait != 2*time.Second ||
		f.Bands[flowcontrol.Sheddable].MaxPerFlow != 10 || f.MaxEngineQueue != 8192*60*time.Microsecond {
		t.Fatalf("%+v", f)
	}
	off, err := Parse([]byte("flow_control: {enabled: false}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s, err := b.Build(Overlay(base, off)); err != nil || s.Flow.Enabled {
		t.Fatalf("the file's enabled: false: %v %+v", err, s.Flow)
	}
	if _, err := Parse([]byte("flow_control: {critical: {max_wait: -1s}}\n")); err == nil || !strings.Contains(err.Error(), "flow_control.critical") {
		t.Fatalf("negative bound: %v", err)
	}
}
