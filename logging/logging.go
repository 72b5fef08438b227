// Package logging builds the zerolog logger every kvmesh binary uses from
// its --log-format and --log-level flags.
package logging

import (
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rs/zerolog"
)

// Options are the logging flags.
type Options struct {
	Format string
	Level  string
}

// Register adds --log-format and --log-level to fs.
func (o *Options) Register(fs *flag.FlagSet) {
	fs.StringVar(&o.Format, "log-format", "console", "log format: json or console")
	fs.StringVar(&o.Level, "log-level", "info", "log level: debug, info, warn, error")
}

// Logger returns a logger writing to w (stderr when nil) for component.
func (o Options) Logger(w io.Writer, component string) (zerolog.Logger, error) {
	if w == nil {
		w = os.Stderr
	}
	level, err := zerolog.ParseLevel(o.Level)
	if err != nil || o.Level == "" {
		return zerolog.Nop(), fmt.Errorf("--log-level %q: want debug, info, warn or error", o.Level)
	}
	switch o.Format {
	case "json":
	case "console":
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339Nano}
	default:
		return zerolog.Nop(), fmt.Errorf("--log-format %q: want json or console", o.Format)
	}
	return zerolog.New(w).Level(level).With().Timestamp().Str("component", component).Logger(), nil
}
