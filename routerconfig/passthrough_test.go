package routerconfig

import (
	"fmt"
	"strings"
	"testing"
)

// TestPassthroughPaths: the flag's comma-separated list, the file's
// passthrough_paths over it, and a path the router answers itself refused
// from either.
func TestPassthroughPaths(t *testing.T) {
	for _, c := range []struct {
		flag, file, want string
	}{
		{"", "", "[]"},
		{" /v1/a, /invocations ,", "", "[/v1/a /invocations]"},
		{"/v1/a", "passthrough_paths: [/v1/b]\n", "[/v1/b]"},
	} {
		s := buildOver(t, Flags{Policy: "kvaware", PassthroughPaths: c.flag}, c.file)
		if got := fmt.Sprint(s.PassthroughPaths); got != c.want {
			t.Errorf("flag %q file %q: %s, want %s", c.flag, c.file, got, c.want)
		}
	}
	if _, err := FromFlags(Flags{Policy: "kvaware", PassthroughPaths: "/v1/a,/v1/chat/completions"}); err == nil ||
		!strings.Contains(err.Error(), "/v1/chat/completions is the router's own route") {
		t.Errorf("--passthrough-paths /v1/chat/completions: %v, want refused as the router's own", err)
	}
	if _, err := Parse([]byte("passthrough_paths: [v1/x]\n")); err == nil || !strings.Contains(err.Error(), "absolute path") {
		t.Errorf("passthrough_paths [v1/x]: %v, want refused", err)
	}
}
