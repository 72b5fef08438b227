// Package flagenv lets every flag of a FlagSet also be set from the
// environment as KVMESH_<FLAG_IN_CAPS> (dashes become underscores). A flag
// given on the command line wins over its variable.
package flagenv

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Prefix is prepended to every variable name.
const Prefix = "KVMESH_"

// VarName returns the environment variable that sets flag name.
func VarName(name string) string {
	return Prefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// Parse parses args into fs, then sets each flag not given in args from its
// environment variable. The usage text names each variable.
func Parse(fs *flag.FlagSet, args []string) error {
	fs.VisitAll(func(f *flag.Flag) {
		f.Usage = fmt.Sprintf("%s (env %s)", f.Usage, VarName(f.Name))
	})
	if err := fs.Parse(args); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || given[f.Name] {
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
