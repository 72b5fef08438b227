// Command loadtest starts a kvmesh fleet from bin/ as real processes on
// loopback, replays a seeded scenario through each routing policy on a
// fresh cluster, prints a table and writes JSON and a TTFT CDF plot.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/loadtest"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/logging"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "loadtest:", err)
		os.Exit(1)
	}
}

type options struct {
	scenario, policies, bin, out, trace, jsonPath, plotPath, costProfile string
	engineArgs, sidecarArgs, routerArgs, prefillEngineArgs               string
	replicas, routers, maxRequests, prefillReplicas                      int
	timeScale, rate                                                      float64
	duration, drain, traceStart, killAt                                  time.Duration
	seed                                                                 uint64
	traceLimit                                                           int
	traceSpeedup                                                         float64
	smoke                                                                bool
	log                                                                  logging.Options
}

func run(args []string) error {
	var o options
	fs := flag.NewFlagSet("loadtest", flag.ContinueOnError)
	fs.StringVar(&o.scenario, "scenario", "tenants", "scenario: "+strings.Join(loadtest.Names(loadtest.Scenarios("", loadtest.TraceDefaults)), ", ")+", or all ("+strings.Join(loadtest.DefaultOrder, ", ")+")")
	fs.StringVar(&o.policies, "policies", "", "comma list of router policies (default: the scenario's; "+strings.Join(loadtest.AllPolicies, ",")+")")
	fs.IntVar(&o.replicas, "replicas", 0, "enginesim+sidecar pairs, or for dp data-parallel engine servers (a sidecar per rank) (default: the scenario's, 8)")
	fs.IntVar(&o.routers, "routers", 0, "routers; requests are spread over them round-robin (default: the scenario's, 1 but for agent's 2)")
	fs.Float64Var(&o.timeScale, "time-scale", 0, "enginesim --time-scale (default: the scenario's); TTFT is reported as wall / time-scale")
	fs.DurationVar(&o.duration, "duration", 0, "wall length of the arrival phase (default: the scenario's)")
	fs.Uint64Var(&o.seed, "seed", 1, "workload seed")
	fs.StringVar(&o.jsonPath, "json", "", "write the report JSON here (default: OUT/SCENARIO.json; with --scenario all, -NAME is added before the extension)")
	fs.StringVar(&o.plotPath, "plot", "", "write the TTFT CDF plot (PNG) here (default: OUT/SCENARIO.png)")
	fs.StringVar(&o.bin, "bin", "bin", "directory holding enginesim, sidecar and router")
	fs.StringVar(&o.out, "out", "", "directory for process logs and per-request records (default: a new temp dir)")
	fs.StringVar(&o.trace, "trace", loadtest.DefaultTrace, "Mooncake JSONL trace for --scenario trace")
	fs.DurationVar(&o.traceStart, "trace-start", 0, "skip trace records before this trace time")
	fs.IntVar(&o.traceLimit, "trace-limit", loadtest.TraceDefaults.Limit, "replay at most this many trace records")
	fs.Float64Var(&o.traceSpeedup, "trace-speedup", loadtest.TraceDefaults.Speedup, "replay the trace this many times faster (in simulated time)")
	fs.IntVar(&o.maxRequests, "max-requests", 0, "cap requests per policy (0: no cap)")
	fs.DurationVar(&o.drain, "drain", 30*time.Second, "wall wait for in-flight requests after the last arrival")
	fs.StringVar(&o.costProfile, "cost-profile", "", "passed to enginesim --cost-profile when set")
	fs.StringVar(&o.engineArgs, "engine-args", "", "extra enginesim flags, space-separated")
	fs.StringVar(&o.prefillEngineArgs, "prefill-engine-args", "", "extra enginesim flags for the prefill pool only, after --engine-args (pd scenarios; not +aggregated runs), e.g. \"--max-num-batched-tokens 8192\"")
	fs.Float64Var(&o.rate, "rate", 0, "steady arrival rate in req/s for the pd scenarios (default: the scenario's)")
	fs.StringVar(&o.sidecarArgs, "sidecar-args", "", "extra sidecar flags, space-separated")
	fs.StringVar(&o.routerArgs, "router-args", "", "extra router flags, space-separated (e.g. --config tune.yaml to try thresholds)")
	fs.DurationVar(&o.killAt, "kill-at", 0, "for scenarios of prefill and decode pools: kill one prefill and one decode engine with SIGKILL this long (wall) into each run's arrivals (+aggregated runs lose the same two servers); 0: no fault")
	fs.IntVar(&o.prefillReplicas, "prefill-replicas", 0, "for scenarios of prefill and decode pools (pd, pd-short): this many prefill replicas, the rest decode (default: the scenario's, 3 of 8)")
	fs.BoolVar(&o.smoke, "smoke", false, "tiny run for tests: 2 replicas, 2 routers, ≤80 requests, round-robin and kvaware; fails on any error")
	o.log.Register(fs)
	if err := flagenv.Parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	log, err := o.log.Logger(os.Stderr, "loadtest")
	if err != nil {
		return err
	}

	tp := loadtest.TraceDefaults
	tp.Start, tp.Limit, tp.Speedup = o.traceStart, o.traceLimit, o.traceSpeedup
	catalogue := loadtest.Scenarios(o.trace, tp)
	var scenarios []loadtest.Scenario
	switch {
	case o.smoke:
		scenarios = []loadtest.Scenario{loadtest.Smoke}
		if o.routers == 0 {
			o.routers = 2
		}
		if o.maxRequests == 0 {
			o.maxRequests = loadtest.SmokeMaxRequests
		}
	case o.scenario == "all":
		for _, n := range loadtest.DefaultOrder {
			scenarios = append(scenarios, catalogue[n])
		}
	default:
		sc, ok := catalogue[o.scenario]
		if !ok {
			return fmt.Errorf("--scenario %q: want one of %s or all", o.scenario, strings.Join(loadtest.Names(catalogue), ", "))
		}
		scenarios = []loadtest.Scenario{sc}
	}
	var policies []string
	if o.policies != "" {
		for _, p := range strings.Split(o.policies, ",") {
			if p = strings.TrimSpace(p); p != "" {
				policies = append(policies, p)
			}
		}
	}
	if o.out == "" {
		if o.out, err = os.MkdirTemp("", "kvmesh-loadtest-"); err != nil {
			return err
		}
	}
	engineArgs := strings.Fields(o.engineArgs)
	if o.costProfile != "" {
		engineArgs = append(engineArgs, "--cost-profile", o.costProfile)
	}

	// Ctrl-C or SIGTERM cancels the run; the cluster is torn down by the
	// deferred stops on the way out.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	begin := time.Now()
	failed := false
	for _, sc := range scenarios {
		if o.rate > 0 {
			if sc, err = sc.AtRate(o.rate); err != nil {
				return err
			}
		}
		if o.prefillReplicas > 0 && len(sc.KVRoles) > 0 {
			sc.KVRoles = loadtest.Pools(o.prefillReplicas, max(o.replicas, sc.Replicas))
		}
		res, err := loadtest.Bench(ctx, loadtest.Config{
			Scenario: sc, Policies: policies, Replicas: o.replicas, Routers: o.routers, TimeScale: o.timeScale,
			Duration: o.duration, Seed: o.seed, MaxRequests: o.maxRequests, BinDir: o.bin, OutDir: o.out,
			Drain: o.drain, EngineArgs: engineArgs, SidecarArgs: strings.Fields(o.sidecarArgs),
			RouterArgs: strings.Fields(o.routerArgs), PrefillEngineArgs: strings.Fields(o.prefillEngineArgs),
			KillAt: o.killAt, Log: log,
		})
		if len(res.Report.Order) > 0 {
			fmt.Printf("\n%s\n", sc.About)
			if werr := res.Report.WriteTable(os.Stdout); werr != nil {
				return werr
			}
			if werr := writeOutputs(o, len(scenarios) > 1, res); werr != nil {
				return werr
			}
			for _, s := range res.Report.Policies {
				failed = failed || s.Errors > 0
			}
		}
		if err != nil {
			return err
		}
	}
	fmt.Printf("\nlogs and per-request records: %s (total %s)\n", o.out, time.Since(begin).Round(time.Second))
	if o.smoke {
		fmt.Println("smoke: a plumbing check (every process starts, routes and answers); its figures are no benchmark: run a --scenario for those")
		if failed {
			return errors.New("smoke run had errors")
		}
	}
	return nil
}

func writeOutputs(o options, many bool, res loadtest.Result) error {
	name := func(path string) string {
		if path == "" {
			return ""
		}
		if !many {
			return path
		}
		ext := filepath.Ext(path)
		return strings.TrimSuffix(path, ext) + "-" + res.Report.Scenario + ext
	}
	jsonPath, plotPath := name(o.jsonPath), name(o.plotPath)
	if jsonPath == "" {
		jsonPath = filepath.Join(o.out, res.Report.Scenario+".json")
	}
	if plotPath == "" {
		plotPath = filepath.Join(o.out, res.Report.Scenario+".png")
	}
	fmt.Printf("report: %s  plot: %s\n", jsonPath, plotPath)
	if p := jsonPath; p != "" {
		f, err := os.Create(p)
		if err != nil {
			return err
		}
		if err := res.Report.WriteJSON(f); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	if p := plotPath; p != "" {
		title := fmt.Sprintf("TTFT CDF — %s, %d replicas, %d router(s)", res.Report.Scenario, res.Report.Replicas, res.Report.Routers)
		if err := report.PlotCDF(p, title, res.Report.Order, res.TTFT); err != nil {
			return err
		}
	}
	return nil
}
