// Package flagenv lets every flag of a FlagSet also be set from the
// environment as KVMESH_<FLAG_IN_CAPS> (dashes become underscores). A flag
// given on the command line wins over its variable. It also gives every
// binary --version.
package flagenv

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/kvmesh/kvmesh/buildinfo"
)

// Prefix is prepended to every variable name.
const Prefix = "KVMESH_"

// VarName returns the environment variable that sets flag name.
func VarName(name string) string {
	return Prefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// Parse parses args into fs, then sets each flag not given in args from its
// environment variable. The usage text names each variable.
//
// --version prints the program's name and build to standard output (buildinfo.Version) and
// returns flag.ErrHelp, so that every main ends as it does for -h. It has no
// variable: a KVMESH_VERSION set for something else must not stop a server.
func Parse(fs *flag.FlagSet, args []string) error {
	fs.VisitAll(func(f *flag.Flag) {
		f.Usage = fmt.Sprintf("%s (env %s)", f.Usage, VarName(f.Name))
	})
	version := fs.Bool("version", false, "print the build and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *version {
		out := fs.Output()
		if out == os.Stderr { // flag's default; a version goes to stdout, for scripts
			out = os.Stdout
		}
		fmt.Fprintln(out, fs.Name(), buildinfo.Version())
		return flag.ErrHelp
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || given[f.Name] || f.Name == "version" {
			return
		}
		if v, ok := os.LookupEnv(VarName(f.Name)); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("%s=%q: %w", VarName(f.Name), v, e)
			}
		}
	})
	return err
}
