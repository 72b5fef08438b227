// Command fleetsim runs a loadtest scenario or a trace through a simulated
// kvmesh fleet (package fleetsim) for each routing policy, in simulated
// time, and prints and writes the same report and TTFT CDF plot as
// loadtest. The same flags and seed give the same report on any machine.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/engine"
	"github.com/kvmesh/kvmesh/filterstream"
	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/fleetsim"
	"github.com/kvmesh/kvmesh/loadtest"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
	"github.com/kvmesh/kvmesh/logging"
	"github.com/kvmesh/kvmesh/routerconfig"
	"github.com/kvmesh/kvmesh/routing"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "fleetsim:", err)
		os.Exit(1)
	}
}

type options struct {
	scenario, policies, trace, jsonPath, plotPath, costProfile string
	routerConfig, cpuProfile                                   string
	replicas, routers, kvBlocks, maxRequests, traceLimit       int
	loadScale, loss, traceSpeedup                              float64
	duration, deltaInterval, loadInterval, delay, jitter       time.Duration
	traceStart                                                 time.Duration
	seed                                                       uint64
	log                                                        logging.Options
}

// defaultPolicies are run when --policies is not given.
const defaultPolicies = "round-robin,kvaware," + fleetsim.OracleName

func run(args []string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("fleetsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.scenario, "scenario", "tenants", "loadtest scenario: tenants, hot, multiturn, nocache, overload, noisy (ignored with --trace)")
	fs.StringVar(&o.trace, "trace", "", "replay this Mooncake JSONL trace instead of a scenario")
	fs.DurationVar(&o.traceStart, "trace-start", 0, "skip trace records before this trace time")
	fs.IntVar(&o.traceLimit, "trace-limit", loadtest.TraceDefaults.Limit, "replay at most this many trace records (0: all)")
	fs.Float64Var(&o.traceSpeedup, "trace-speedup", loadtest.TraceDefaults.Speedup, "replay the trace this many times faster")
	fs.StringVar(&o.policies, "policies", defaultPolicies, "comma list of policies: kvaware, round-robin, least-loaded, chwbl, prefix-pin, and the references oracle (exact engine state) and router-guess (each router guesses caches from its own decisions, as SGLang's router)")
	fs.IntVar(&o.replicas, "replicas", 0, "engine replicas (default: the scenario's, 8)")
	fs.IntVar(&o.routers, "routers", 1, "routers; requests are spread over them round-robin")
	fs.IntVar(&o.kvBlocks, "kv-blocks", 0, "KV capacity per replica in blocks (default: the scenario's sizing)")
	fs.Float64Var(&o.loadScale, "load-scale", 0, "multiply a generated scenario's rates and prompt groups by this (default: replicas / the scenario's replicas, so each replica sees the load it does in loadtest); traces are replayed as they are")
	fs.DurationVar(&o.duration, "duration", 0, "simulated length of the arrival phase (default: the scenario's)")
	fs.IntVar(&o.maxRequests, "max-requests", 0, "cap requests per policy (0: no cap)")
	fs.Uint64Var(&o.seed, "seed", 1, "workload and simulation seed")
	fs.DurationVar(&o.deltaInterval, "delta-interval", 25*time.Millisecond, "sidecars' filter delta interval")
	fs.DurationVar(&o.loadInterval, "load-interval", 100*time.Millisecond, "sidecars' load record interval")
	fs.DurationVar(&o.delay, "delay", time.Millisecond, "one-way network delay, sidecar ↔ router")
	fs.DurationVar(&o.jitter, "jitter", time.Millisecond, "extra random delay, up to this")
	fs.Float64Var(&o.loss, "loss", 0, "datagram loss probability (snapshots travel on streams and are not lost)")
	fs.StringVar(&o.costProfile, "cost-profile", "", "engine cost profile overrides, as enginesim --cost-profile")
	fs.StringVar(&o.routerConfig, "config", "", "router config YAML (the router's --config): its routing section tunes every router's policy")
	fs.StringVar(&o.jsonPath, "json", "", "write the report JSON here")
	fs.StringVar(&o.plotPath, "plot", "", "write the TTFT CDF plot (PNG) here")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the simulation (pprof format) here")
	o.log.Register(fs)
	if err := flagenv.Parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if _, err := o.log.Logger(stderr, "fleetsim"); err != nil {
		return err
	}
	sc, w, err := o.workload()
	if err != nil {
		return err
	}
	cost, err := engine.ParseCostProfile(engine.DefaultCost, o.costProfile)
	if err != nil {
		return err
	}
	var rc routing.Config
	if o.routerConfig != "" {
		data, err := os.ReadFile(o.routerConfig)
		if err != nil {
			return err
		}
		c, err := routerconfig.Parse(data)
		if err != nil {
			return fmt.Errorf("--config %s: %w", o.routerConfig, err)
		}
		rc = c.Routing.Config()
	}
	kv := o.kvBlocks
	if kv <= 0 {
		kv = sc.KVBlocks(w, o.replicas)
	}
	maxModelLen, err := maxModelLen(sc.EngineArgs)
	if err != nil {
		return err
	}
	rep := fleetReport{Report: report.Report{
		Scenario: sc.Name, Replicas: o.replicas, Routers: o.routers, TimeScale: 1, Seed: o.seed,
		Requests: len(w.Requests), KVBlocks: kv, DemandBlocks: w.DemandBlocks, Units: report.Units,
		Policies: map[string]report.Summary{},
	}, Fleet: map[string]fleetStats{}}
	ttft := map[string][]float64{}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	fmt.Fprintf(stderr, "fleetsim: %s, %d requests over %v simulated, %d replicas × %d KV blocks, %d router(s)\n",
		sc.Name, len(w.Requests), w.Span().Round(time.Millisecond), o.replicas, kv, o.routers)
	for _, policy := range splitList(o.policies) {
		cfg := fleetsim.Config{
			Replicas: o.replicas, Routers: o.routers, Policy: policy, Seed: o.seed, Routing: rc,
			Engine:        engine.Config{BlockSize: w.BlockSize, KVBlocks: kv, MaxModelLen: maxModelLen, Cost: cost},
			Network:       fleetsim.Network{Delay: o.delay, Jitter: o.jitter, Loss: o.loss},
			DeltaInterval: o.deltaInterval, LoadInterval: o.loadInterval,
		}
		began := time.Now()
		cfg.Progress = func(p fleetsim.Progress) {
			fmt.Fprintf(stderr, "fleetsim: %s: %d/%d requests done, %.1f s simulated, %.1f s wall\n",
				policy, p.Done, p.Total, p.Sim.Seconds(), time.Since(began).Seconds())
		}
		res, err := fleetsim.Run(cfg, &w)
		if err != nil {
			return fmt.Errorf("policy %s: %w", policy, err)
		}
		wall := time.Since(began)
		sum := report.Summarize(res.Records, 1, res.Degradations)
		fmt.Fprintf(stderr, "fleetsim: %s: %d requests in %.1f s wall (%.0f µs per request), %.1f s simulated, %d events, %d engine steps, %d filter rebuilds\n",
			policy, len(res.Records), wall.Seconds(), float64(wall.Microseconds())/float64(max(1, len(res.Records))),
			res.Sim.Seconds(), res.Events, res.Steps, res.Rebuilds)
		st := fleetStatsOf(res)
		if hit, n := followUpHit(res.Records); n > 0 {
			st.FollowUps, st.FollowUpHit = n, hit
			fmt.Fprintf(stderr, "fleetsim: %s: follow-up turns %d, hit rate %.1f %%\n", policy, n, 100*hit)
		}
		fmt.Fprintf(stderr, "fleetsim: %s: into router-0 %.0f messages/s, %.0f kB/s (deltas %.0f, load %.0f, snapshots %.0f kB/s; memberlist framing +%d B per datagram, +%d B per stream); router-0 holds %.0f kB per replica (filter %.0f kB)\n",
			policy, st.MessagesPerS, st.BytesPerS/1e3, st.Kinds["delta"].BytesPerS/1e3, st.Kinds["load"].BytesPerS/1e3, st.Kinds["snapshot"].BytesPerS/1e3,
			fleetsim.DatagramOverhead, fleetsim.StreamOverhead, st.RouterBytesPerReplica/1e3, st.FilterBytesPerReplica/1e3)
		rep.Order = append(rep.Order, policy)
		rep.Policies[policy] = sum
		rep.Fleet[policy] = st
		for _, r := range res.Records {
			if r.OK() {
				ttft[policy] = append(ttft[policy], report.SimMillis(r.TTFT, 1))
			}
		}
	}
	if err := rep.WriteTable(stdout); err != nil {
		return err
	}
	return writeOutputs(o, rep, ttft)
}

// workload generates the scenario's requests, or reads the trace, with
// o.replicas filled in.
func (o *options) workload() (loadtest.Scenario, workload.Workload, error) {
	tp := loadtest.TraceDefaults
	tp.Start, tp.Limit, tp.Speedup = o.traceStart, o.traceLimit, o.traceSpeedup
	name := o.scenario
	if o.trace != "" {
		name = "trace"
	} else if name == "trace" {
		o.trace = loadtest.DefaultTrace
	}
	sc, ok := loadtest.Scenarios(o.trace, tp)[name]
	if !ok {
		return sc, workload.Workload{}, fmt.Errorf("--scenario %q: want one of %s", o.scenario, strings.Join(loadtest.Names(loadtest.Scenarios("", tp)), ", "))
	}
	if o.replicas <= 0 {
		o.replicas = sc.Replicas
	}
	if o.routers <= 0 {
		return sc, workload.Workload{}, errors.New("--routers must be positive")
	}
	scale := o.loadScale
	if scale <= 0 {
		scale = float64(o.replicas) / float64(sc.Replicas)
	}
	d := o.duration
	if d <= 0 {
		d = time.Duration(float64(sc.Duration) / sc.TimeScale)
	}
	var w workload.Workload
	var err error
	if name == "trace" {
		if o.duration > 0 {
			tp.Window = time.Duration(float64(o.duration) * max(tp.Speedup, 1))
		}
		w, err = traceWorkload(o.trace, tp, o.seed)
	} else {
		w, err = scaled(sc, scale, o.seed, d)
	}
	if err != nil {
		return sc, w, fmt.Errorf("scenario %s: %w", name, err)
	}
	w.Truncate(o.maxRequests)
	if len(w.Requests) == 0 {
		return sc, w, fmt.Errorf("scenario %s: the workload is empty", name)
	}
	return sc, w, nil
}

func traceWorkload(path string, tp workload.TraceParams, seed uint64) (workload.Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return workload.Workload{}, err
	}
	defer f.Close()
	recs, err := workload.ParseTrace(f, tp)
	if err != nil {
		return workload.Workload{}, err
	}
	return workload.Trace(recs, tp, seed)
}

// scaled generates sc's workload with its rates and prompt populations
// multiplied by f: a fleet f times the scenario's sees the same load per
// replica and the same share of cold prefixes.
func scaled(sc loadtest.Scenario, f float64, seed uint64, d time.Duration) (workload.Workload, error) {
	if f == 1 {
		return sc.Generate(seed, d)
	}
	n := func(v int) int { return max(1, int(float64(v)*f+0.5)) }
	switch sc.Name {
	case "tenants", "hot":
		p := loadtest.TenantsParams
		if sc.Name == "hot" {
			p = loadtest.HotParams
		}
		p.Groups, p.RateStart, p.RateEnd = n(p.Groups), p.RateStart*f, p.RateEnd*f
		return workload.Tenants(sc.Name, p, seed, d)
	case "multiturn":
		p := loadtest.MultiturnParams
		p.ConversationRate, p.SystemPrompts = p.ConversationRate*f, n(p.SystemPrompts)
		return workload.Multiturn(p, seed, d)
	case "nocache":
		p := loadtest.NoCacheParams
		p.Rate *= f
		return workload.NoCache(p, seed, d)
	}
	return workload.Workload{}, fmt.Errorf("--load-scale %g: scenario %s cannot be scaled; give --load-scale 1", f, sc.Name)
}

// maxModelLen reads --max-model-len from a scenario's enginesim flags (0:
// the engine's default).
func maxModelLen(args []string) (int, error) {
	for i, a := range args {
		if a == "--max-model-len" && i+1 < len(args) {
			return strconv.Atoi(args[i+1])
		}
	}
	return 0, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// fleetReport is loadtest's report with what only a simulation can
// measure, by policy.
type fleetReport struct {
	report.Report
	Fleet map[string]fleetStats `json:"fleet"`
}

// fleetStats is one policy's run: the filter stream into router-0 while
// requests arrived (each message's own encoding; memberlist's framing is
// DatagramOverhead or StreamOverhead more per message) and the memory
// router-0 holds per replica at the end.
type fleetStats struct {
	Events                uint64               `json:"events"`
	EngineSteps           uint64               `json:"engine_steps"`
	FilterRebuilds        int                  `json:"filter_rebuilds"`
	GossipWindowS         float64              `json:"gossip_window_s"`
	MessagesPerS          float64              `json:"gossip_messages_per_s"`
	BytesPerS             float64              `json:"gossip_bytes_per_s"`
	Kinds                 map[string]kindStats `json:"gossip_by_kind"`
	DatagramOverhead      int                  `json:"memberlist_datagram_overhead_bytes"`
	StreamOverhead        int                  `json:"memberlist_stream_overhead_bytes"`
	RouterBytesPerReplica float64              `json:"router_bytes_per_replica"`
	FilterBytesPerReplica float64              `json:"router_filter_bytes_per_replica"`
	RouterMemory          routerMemory         `json:"router_memory"`
	// FollowUps counts a conversation's turns after its first (multiturn
	// keys "cN/tM" with M > 0), FollowUpHit their cached / prompt tokens.
	FollowUps   int     `json:"follow_ups,omitempty"`
	FollowUpHit float64 `json:"follow_up_hit,omitempty"`
}

// followUpHit is the hit rate (actual cached / prompt tokens) of the
// served requests that continue a conversation, and how many there are.
func followUpHit(recs []report.Record) (float64, int) {
	var cached, prompt, n int
	for i := range recs {
		r := &recs[i]
		_, turn, ok := strings.Cut(r.Key, "/t")
		if !ok || turn == "0" || !r.OK() || !strings.HasPrefix(r.Key, "c") {
			continue
		}
		if _, err := strconv.Atoi(turn); err != nil {
			continue
		}
		cached, prompt, n = cached+r.ActualCached, prompt+r.PromptTokens, n+1
	}
	if prompt == 0 {
		return 0, n
	}
	return float64(cached) / float64(prompt), n
}

type kindStats struct {
	Messages  int64   `json:"messages"`
	Bytes     int64   `json:"bytes"`
	BytesPerS float64 `json:"bytes_per_s"`
}

type routerMemory struct {
	Sidecars     int `json:"sidecars"`
	FilterBytes  int `json:"filter_bytes"`
	PendingBytes int `json:"pending_delta_bytes"`
	StateBytes   int `json:"receiver_state_bytes"`
	TableBytes   int `json:"table_bytes"`
}

func fleetStatsOf(res fleetsim.Result) fleetStats {
	g := &res.Gossip
	msgs, bytes := g.Total()
	m := res.RouterMemory
	fs := fleetStats{
		Events: res.Events, EngineSteps: res.Steps, FilterRebuilds: res.Rebuilds,
		GossipWindowS: g.Window.Seconds(), MessagesPerS: g.PerSecond(msgs), BytesPerS: g.PerSecond(bytes),
		Kinds:            map[string]kindStats{},
		DatagramOverhead: fleetsim.DatagramOverhead, StreamOverhead: fleetsim.StreamOverhead,
		RouterBytesPerReplica: m.PerReplica(),
		RouterMemory:          routerMemory{m.Sidecars, m.FilterBytes, m.PendingBytes, m.StateBytes, m.TableBytes},
	}
	if m.Sidecars > 0 {
		fs.FilterBytesPerReplica = float64(m.FilterBytes) / float64(m.Sidecars)
	}
	for k := range g.Messages {
		if g.Messages[k] > 0 {
			fs.Kinds[filterstream.Kind(k).String()] = kindStats{g.Messages[k], g.Bytes[k], g.PerSecond(g.Bytes[k])}
		}
	}
	return fs
}

func writeOutputs(o options, rep fleetReport, ttft map[string][]float64) error {
	if o.jsonPath != "" {
		f, err := os.Create(o.jsonPath)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(f)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	if o.plotPath != "" {
		title := fmt.Sprintf("TTFT CDF — %s, %d replicas, %d router(s), simulated", rep.Scenario, rep.Replicas, rep.Routers)
		return report.PlotCDF(o.plotPath, title, rep.Order, ttft)
	}
	return nil
}
