// Command healthcheck GETs a URL and exits 0 on a 2xx answer, 1 otherwise.
// Images are built FROM scratch, without a shell or curl, so container
// health checks run this instead: healthcheck http://127.0.0.1:8080/ready
package main

import (
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/logging"
)

func main() {
	switch err := run(os.Args[1:]); {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		os.Exit(2)
	default:
		os.Exit(1)
	}
}

var errUsage = errors.New("usage")

func run(args []string) error {
	fs := flag.NewFlagSet("healthcheck", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: healthcheck [flags] URL\nGETs URL; exits 0 on a 2xx answer, 1 otherwise, 2 on bad usage.")
		fs.PrintDefaults()
	}
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	var lo logging.Options
	lo.Register(fs)
	if err := flagenv.Parse(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		return errUsage
	}
	log, err := lo.Logger(os.Stderr, "healthcheck")
	if err != nil {
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		return errUsage
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return errUsage
	}
	url := fs.Arg(0)
	client := http.Client{Timeout: *timeout}
	resp, err := client.Get(url)
	if err != nil {
		log.Error().Err(err).Str("url", url).Msg("unhealthy")
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		log.Error().Int("status", resp.StatusCode).Str("url", url).Msg("unhealthy")
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}
