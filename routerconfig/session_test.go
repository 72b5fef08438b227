package routerconfig

import (
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
)

// TestSessionHeaders: the flag's list, the file's over it, and "none".
func TestSessionHeaders(t *testing.T) {
	for _, c := range []struct {
		flag, file string
		want       string
	}{
		{"", "", "[]"}, // nil: the gateway's defaults
		{"X-A, X-B", "", "[X-A X-B]"},
		{"X-A", "session_headers: [X-C]\n", "[X-C]"},
		{"none", "", "[]"},
	} {
		s := buildOver(t, Flags{Policy: "kvaware", SessionHeaders: c.flag}, c.file)
		if got := fmt.Sprint(s.SessionHeaders); got != c.want || (c.flag == "none") != (s.SessionHeaders != nil && len(s.SessionHeaders) == 0) {
			t.Errorf("flag %q file %q: %s (nil %v), want %s", c.flag, c.file, got, s.SessionHeaders == nil, c.want)
		}
	}
}

// buildOver is the settings flags make with the config file text over them.
func buildOver(t *testing.T, flags Flags, file string) gateway.Settings {
	t.Helper()
	base, err := FromFlags(flags)
	if err != nil {
		t.Fatal(err)
	}
	f, err := Parse([]byte(file))
	if err != nil {
		t.Fatal(err)
	}
	s, err := (&Builder{Table: fleet.NewTable(fleet.TableConfig{})}).Build(Overlay(base, f))
	if err != nil {
		t.Fatal(err)
	}
	return s
}
