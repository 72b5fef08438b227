// Package buildinfo says which build of kvmesh is running: the git revision
// `make build` links in, else what the go command stamped (its VCS stamp is
// often off: GOFLAGS=-buildvcs=false), else "devel".
package buildinfo

import (
	"runtime/debug"
	"sync"
)

// revision is set at link time by make build (-X), as git describe gives it:
// "f4ecfd4e8c64", "f4ecfd4e8c64-dirty", or a tag.
var revision string

// Version is the revision the binary was built from, e.g. "f4ecfd4e8c64" or
// "f4ecfd4e8c64-dirty"; a module version when built from one; "devel" when
// the build recorded neither (go run, or a build outside git).
func Version() string { return version() }

var version = sync.OnceValue(func() string {
	if revision != "" {
		return revision
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	return fromSettings(info.Main.Version, info.Settings)
})

func fromSettings(moduleVersion string, settings []debug.BuildSetting) string {
	rev, dirty := "", false
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	switch {
	case rev != "":
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if dirty {
			rev += "-dirty"
		}
		return rev
	case moduleVersion != "" && moduleVersion != "(devel)":
		return moduleVersion
	}
	return "devel"
}
