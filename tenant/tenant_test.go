package tenant

import (
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/flowcontrol"
	"github.com/kvmesh/kvmesh/quota"
)

func directory(t *testing.T, header string, defaultKeys ...string) *Directory {
	t.Helper()
	d, err := New(Spec{
		Default: Tenant{MaxPriority: flowcontrol.Standard},
		Tenants: []Tenant{
			{Name: "search", Weight: 4, MaxPriority: flowcontrol.Critical, Quota: quota.Limits{TokensPerMinute: 1000}},
			{Name: "batch", MaxPriority: flowcontrol.Sheddable},
		},
		Keys:        [][]string{{"sk-search"}, {"sk-batch", "sk-batch-2"}},
		DefaultKeys: defaultKeys,
		Header:      header,
	})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestIdentify(t *testing.T) {
	for _, c := range []struct {
		name        string
		header      string // the directory's trusted header
		defaultKeys []string
		key, named  string
		want        string // "" unauthorized
	}{
		{name: "search key", key: "sk-search", want: "search"},
		{name: "second batch key", key: "sk-batch-2", want: "batch"},
		{name: "keys configured, none sent", want: ""},
		{name: "keys configured, unknown key", key: "sk-nope", want: ""},
		{name: "plain api_keys are the default tenant", defaultKeys: []string{"sk-plain"}, key: "sk-plain", want: DefaultName},
		{name: "header ignored unless configured", key: "sk-batch", named: "search", want: "batch"},
		{name: "trusted header overrides the key", header: "X-Tenant", key: "sk-batch", named: "search", want: "search"},
		{name: "trusted header naming no tenant keeps the key's", header: "X-Tenant", key: "sk-batch", named: "nobody", want: "batch"},
		{name: "trusted header does not authenticate", header: "X-Tenant", named: "search", want: ""},
	} {
		d := directory(t, c.header, c.defaultKeys...)
		got, ok := d.Identify([]byte(c.key), []byte(c.named))
		if c.want == "" {
			if ok {
				t.Errorf("%s: authorized as %q, want unauthorized", c.name, got.Name)
			}
			continue
		}
		if !ok || got.Name != c.want {
			t.Errorf("%s: got %v %v, want %q", c.name, got, ok, c.want)
		}
	}
}

func TestUnkeyedClientsAreTheDefaultTenant(t *testing.T) {
	d, err := New(Spec{Default: Tenant{MaxPriority: flowcontrol.Standard}, Header: "X-Tenant"})
	if err != nil {
		t.Fatal(err)
	}
	if d.RequiresKey() {
		t.Fatal("no keys configured, yet keys required")
	}
	got, ok := d.Identify([]byte("anything"), nil)
	if !ok || got.Name != DefaultName || got.Weight != 1 {
		t.Fatalf("got %+v %v", got, ok)
	}
}

func TestPriorityCeiling(t *testing.T) {
	d := directory(t, "")
	for _, c := range []struct {
		tenant  string
		asked   flowcontrol.Priority
		want    flowcontrol.Priority
		lowered bool
	}{
		{"search", flowcontrol.Critical, flowcontrol.Critical, false},
		{"batch", flowcontrol.Critical, flowcontrol.Sheddable, true},
		{"batch", flowcontrol.Sheddable, flowcontrol.Sheddable, false},
		{DefaultName, flowcontrol.Critical, flowcontrol.Standard, true},
		{DefaultName, flowcontrol.Sheddable, flowcontrol.Sheddable, false},
	} {
		got, lowered := d.Lookup(c.tenant).Bound(c.asked)
		if got != c.want || lowered != c.lowered {
			t.Errorf("%s asking %v: got %v lowered=%v, want %v %v", c.tenant, c.asked, got, lowered, c.want, c.lowered)
		}
	}
}

func TestWeights(t *testing.T) {
	d := directory(t, "")
	if d.Weight("search") != 4 || d.Weight("batch") != 1 || d.Weight("removed-by-reload") != 1 {
		t.Fatalf("weights %v %v %v", d.Weight("search"), d.Weight("batch"), d.Weight("removed-by-reload"))
	}
	if got := strings.Join(d.Names(), ","); got != "default,batch,search" {
		t.Fatalf("names %s", got)
	}
}

func TestBadSpecsSayWhat(t *testing.T) {
	ok := Tenant{Name: "a", Weight: 1, MaxPriority: flowcontrol.Standard}
	for _, c := range []struct {
		spec Spec
		want string
	}{
		{Spec{Tenants: []Tenant{ok, ok}, Keys: [][]string{{"k1"}, {"k2"}}}, `tenant "a" is named twice`},
		{Spec{Tenants: []Tenant{ok}, Keys: [][]string{nil}}, `tenant "a" has no API keys`},
		{Spec{Tenants: []Tenant{{Name: "b", Weight: -1}}, Keys: [][]string{{"k"}}}, `weight -1 must be a positive number`},
		{Spec{Tenants: []Tenant{{Name: "b c"}}, Keys: [][]string{{"k"}}}, `printable ASCII`},
		{Spec{Tenants: []Tenant{{Name: "default"}}, Keys: [][]string{{"k"}}}, `tenant "default" is named twice`},
		{Spec{Tenants: []Tenant{ok}, Keys: [][]string{{"shared"}}, DefaultKeys: []string{"shared"}}, `one API key is given to both "default" and "a"`},
		{Spec{Tenants: []Tenant{{Name: "b", Quota: quota.Limits{TokensPerMinute: -5}}}, Keys: [][]string{{"k"}}}, `quotas must not be negative`},
		{Spec{Header: "X Tenant"}, `is not a header name`},
	} {
		_, err := New(c.spec)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want it to say %q", c.spec, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "shared") {
			t.Errorf("an error shows the key itself: %v", err)
		}
	}
}

// TestIdentifyCopiesNothing: it runs on every request.
func TestIdentifyCopiesNothing(t *testing.T) {
	d := directory(t, "X-Tenant")
	key, header := []byte(" sk-batch "), []byte("search")
	if n := testing.AllocsPerRun(100, func() { d.Identify(key, header) }); n != 0 {
		t.Fatalf("%v allocations per call", n)
	}
}
