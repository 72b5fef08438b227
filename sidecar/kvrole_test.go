package sidecar

import (
	"testing"

	"github.com/kvmesh/kvmesh/fleet"
)

func TestKVRoleOf(t *testing.T) {
	cases := []struct {
		role, config string
		want         fleet.KVRole
		bad          bool
	}{
		{"", "", fleet.KVBoth, false},
		{"prefill", "", fleet.KVPrefill, false},
		{"decode", `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`, fleet.KVDecode, false}, // the flag wins
		{"", `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`, fleet.KVPrefill, false},
		{"", `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`, fleet.KVDecode, false},
		{"", `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`, fleet.KVBoth, false},
		{"", `{"kv_connector":"OffloadingConnector"}`, fleet.KVBoth, false},
		{"", `{"kv_role":"kv_mirror"}`, fleet.KVBoth, true},
		{"", `not json`, fleet.KVBoth, true},
		{"primary", "", fleet.KVBoth, true},
	}
	for _, c := range cases {
		got, err := KVRoleOf(c.role, c.config)
		if got != c.want || (err != nil) != c.bad {
			t.Errorf("KVRoleOf(%q, %q) = %v, %v; want %v (error %v)", c.role, c.config, got, err, c.want, c.bad)
		}
	}
}
