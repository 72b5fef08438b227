package routerconfig

import (
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/fleet"
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
		base, err := FromFlags(Flags{Policy: "kvaware", SessionHeaders: c.flag})
		if err != nil {
			t.Fatal(err)
		}
		f, err := Parse([]byte(c.file))
		if err != nil {
			t.Fatal(err)
		}
		s, err := (&Builder{Table: fleet.NewTable(fleet.TableConfig{})}).Build(Overlay(base, f))
		if err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(s.SessionHeaders); got != c.want || (c.flag == "none") != (s.SessionHeaders != nil && len(s.SessionHeaders) == 0) {
			t.Errorf("flag %q file %q: %s (nil %v), want %s", c.flag, c.file, got, s.SessionHeaders == nil, c.want)
		}
	}
}
