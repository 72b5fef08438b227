package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestFromSettings(t *testing.T) {
	rev := []debug.BuildSetting{{Key: "vcs.revision", Value: "f4ecfd4a01b2c3d4e5f60718293a4b5c6d7e8f90"}}
	for _, c := range []struct {
		name     string
		module   string
		settings []debug.BuildSetting
		want     string
	}{
		{"git build", "(devel)", rev, "f4ecfd4a01b2"},
		{"uncommitted changes", "(devel)", append(rev, debug.BuildSetting{Key: "vcs.modified", Value: "true"}), "f4ecfd4a01b2-dirty"},
		{"clean tree", "(devel)", append(rev, debug.BuildSetting{Key: "vcs.modified", Value: "false"}), "f4ecfd4a01b2"},
		{"module download", "v1.2.3", nil, "v1.2.3"},
		{"nothing recorded", "(devel)", nil, "devel"},
	} {
		if got := fromSettings(c.module, c.settings); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
	if Version() == "" {
		t.Error("empty version")
	}
}
