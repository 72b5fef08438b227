package loadtest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmesh/kvmesh/loadtest/cluster"
	"github.com/kvmesh/kvmesh/loadtest/report"
	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// Config is one scenario run over several policies.
type Config struct {
	Scenario    Scenario
	Policies    []string
	Replicas    int
	Routers     int
	TimeScale   float64
	Duration    time.Duration // wall length of the arrival phase
	Seed        uint64
	MaxRequests int
	BinDir      string
	OutDir      string
	Model       string
	// Drain bounds the wait for in-flight requests after the last arrival
	// (wall); default 30 s.
	Drain time.Duration
	// Extra flags per binary, passed through to the cluster.
	EngineArgs, SidecarArgs, RouterArgs []string
	// PrefillEngineArgs are extra enginesim flags for a scenario's prefill
	// pool only, after EngineArgs (unused by +aggregated runs).
	PrefillEngineArgs []string
	// KillAt, when positive, kills one prefill and one decode engine
	// server of a scenario's pools with SIGKILL this long (wall) into each
	// run's arrival phase; a +aggregated run loses the same two servers.
	KillAt time.Duration
	Log    zerolog.Logger
}

// Result is a finished scenario.
type Result struct {
	Report report.Report
	// TTFT holds each policy's successful TTFTs in simulated ms (for plots).
	TTFT map[string][]float64
}

// Bench generates the scenario's workload once and replays it through a
// fresh cluster per policy, so every policy starts with cold caches and
// sees identical traffic.
func Bench(ctx context.Context, cfg Config) (Result, error) {
	sc := cfg.Scenario
	if cfg.Replicas <= 0 {
		cfg.Replicas = sc.Replicas
	}
	if cfg.Routers <= 0 {
		cfg.Routers = max(sc.Routers, 1)
	}
	if cfg.TimeScale <= 0 {
		cfg.TimeScale = sc.TimeScale
	}
	if cfg.Duration <= 0 {
		cfg.Duration = sc.Duration
	}
	if len(cfg.Policies) == 0 {
		cfg.Policies = sc.Policies
	}
	if cfg.Model == "" {
		cfg.Model = "sim"
	}
	if cfg.Drain <= 0 {
		cfg.Drain = 30 * time.Second
	}
	sim := time.Duration(float64(cfg.Duration) / cfg.TimeScale)
	w, err := sc.Generate(cfg.Seed, sim)
	if err != nil {
		return Result{}, fmt.Errorf("scenario %s: %w", sc.Name, err)
	}
	w.Truncate(cfg.MaxRequests)
	if len(w.Requests) == 0 {
		return Result{}, fmt.Errorf("scenario %s: the workload is empty", sc.Name)
	}
	if cfg.KillAt > 0 {
		if _, err := KillTargets(sc.KVRoles); err != nil {
			return Result{}, fmt.Errorf("scenario %s: %w", sc.Name, err)
		}
	}
	ranks := max(sc.DataParallelSize, 1)
	kv := sc.KVBlocks(w, cfg.Replicas*ranks)
	rep := report.Report{
		Scenario: sc.Name, Replicas: cfg.Replicas * ranks, DataParallelSize: sc.DataParallelSize, Routers: cfg.Routers, TimeScale: cfg.TimeScale, Seed: cfg.Seed,
		Requests: len(w.Requests), KVBlocks: kv, DemandBlocks: w.DemandBlocks, Units: report.Units,
		Policies: map[string]report.Summary{}, Decode: len(sc.KVRoles) > 0,
	}
	res := Result{Report: rep, TTFT: map[string][]float64{}}
	cfg.Log.Info().Str("scenario", sc.Name).Int("requests", len(w.Requests)).Dur("simulated", w.Span()).
		Int("kv_blocks", kv).Int("demand_blocks", w.DemandBlocks).Int("replicas", cfg.Replicas).
		Int("routers", cfg.Routers).Float64("time_scale", cfg.TimeScale).Msg("workload ready")

	for _, policy := range cfg.Policies {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		run, err := parseRun(policy, w)
		if err != nil {
			return res, fmt.Errorf("scenario %s: %w", sc.Name, err)
		}
		sum, ttft, err := runPolicy(ctx, cfg, run, kv)
		if err != nil {
			return res, fmt.Errorf("scenario %s, policy %s: %w", sc.Name, policy, err)
		}
		res.Report.Order = append(res.Report.Order, policy)
		res.Report.Policies[policy] = sum
		res.TTFT[policy] = ttft
	}
	return res, nil
}

// run is one column of a report: a policy, the router flags its variants
// add, and the workload they leave.
type run struct {
	name, policy string
	routerArgs   []string
	w            workload.Workload
	chat         bool // agent turns as chat completions
	aggregated   bool // every replica serves whole requests (no KV roles)
}

// parseRun reads "policy[+variant...]": "+fc" turns the routers' flow
// control on, "+blind" makes them blind to offload tiers (--ignore-tiers),
// "+noheader" keeps them from sending X-data-parallel-rank, "+chat" sends
// agent turns as the chat completions they amount to instead of through
// the Responses API, "+aggregated" runs a scenario's prefill and decode
// pools as replicas serving whole requests, "+always" and "+never" set the
// routers' --split, "+without=X" drops the requests of tenant or priority
// X, "+only=X" keeps only those (the same traffic, less a part of it, since
// workload streams are drawn independently).
func parseRun(spec string, w workload.Workload) (run, error) {
	parts := strings.Split(spec, "+")
	r := run{name: spec, policy: parts[0], w: w}
	for _, v := range parts[1:] {
		key, val, _ := strings.Cut(v, "=")
		var err error
		switch {
		case key == "fc" && val == "":
			r.routerArgs = append(r.routerArgs, "--flow-control")
		case key == "blind" && val == "":
			r.routerArgs = append(r.routerArgs, "--ignore-tiers")
		case key == "noheader" && val == "":
			r.routerArgs = append(r.routerArgs, "--no-data-parallel-header")
		case key == "chat" && val == "":
			r.chat = true
		case key == "aggregated" && val == "":
			r.aggregated = true
		case (key == "always" || key == "never") && val == "":
			r.routerArgs = append(r.routerArgs, "--split", key)
		case (key == "without" || key == "only") && val != "":
			keep := key == "only"
			r.w, err = r.w.Keep(func(q workload.Request) bool { return (q.Tenant == val || q.Priority == val) == keep })
			if err == nil && len(r.w.Requests) == 0 {
				err = fmt.Errorf("%s leaves no request", spec)
			}
		default:
			err = fmt.Errorf("%s: unknown variant %q (want fc, blind, noheader, chat, aggregated, always, never, without=X or only=X)", spec, v)
		}
		if err != nil {
			return run{}, err
		}
	}
	return r, nil
}

func runPolicy(ctx context.Context, cfg Config, run run, kv int) (report.Summary, []float64, error) {
	policy, w := run.name, run.w
	dir := filepath.Join(cfg.OutDir, cfg.Scenario.Name, policy)
	log := cfg.Log.With().Str("scenario", cfg.Scenario.Name).Str("policy", policy).Logger()
	started := time.Now()
	routerArgs := append(append(slices.Clone(run.routerArgs), cfg.Scenario.RouterArgs...), cfg.RouterArgs...)
	if cfg.Scenario.RouterConfig != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return report.Summary{}, nil, err
		}
		path := filepath.Join(dir, "router.yaml")
		if err := os.WriteFile(path, []byte(cfg.Scenario.RouterConfig), 0o644); err != nil {
			return report.Summary{}, nil, err
		}
		routerArgs = append(routerArgs, "--config", path)
	}
	kvRoles := cfg.Scenario.KVRoles
	if run.aggregated {
		kvRoles = nil
	}
	cl, err := cluster.Start(ctx, cluster.Config{
		BinDir: cfg.BinDir, OutDir: dir, Replicas: cfg.Replicas, DataParallelSize: cfg.Scenario.DataParallelSize, Routers: cfg.Routers, Policy: run.policy,
		Model: cfg.Model, KVBlocks: kv, BlockSize: w.BlockSize, TimeScale: cfg.TimeScale,
		EngineArgs: append(slices.Clone(cfg.Scenario.EngineArgs), cfg.EngineArgs...), SidecarArgs: append(slices.Clone(cfg.Scenario.SidecarArgs), cfg.SidecarArgs...), RouterArgs: routerArgs,
		KVRoles: kvRoles, PrefillEngineArgs: cfg.PrefillEngineArgs,
	})
	if err != nil {
		return report.Summary{}, nil, err
	}
	defer func() {
		if killed := cl.Stop(); len(killed) > 0 {
			log.Warn().Strs("killed", killed).Msg("processes needed SIGKILL")
		}
	}()
	log.Info().Dur("startup", time.Since(started)).Strs("routers", cl.Routers).Str("logs", dir).Msg("cluster ready")

	client := NewClient(cfg.Model)
	client.Chat = run.chat
	defer client.HTTP.CloseIdleConnections()
	cpu0 := cl.RouterCPU()
	var killed []string
	var killMu sync.Mutex
	if cfg.KillAt > 0 {
		targets, _ := KillTargets(cfg.Scenario.KVRoles) // checked in Bench
		t := time.AfterFunc(cfg.KillAt, func() {
			for _, i := range targets {
				name, err := cl.KillEngine(i)
				if err != nil {
					log.Error().Err(err).Msg("kill failed")
					continue
				}
				killMu.Lock()
				killed = append(killed, name)
				killMu.Unlock()
				log.Info().Str("process", name).Str("role", cfg.Scenario.KVRoles[i]).Msg("killed with SIGKILL")
			}
		})
		defer t.Stop()
	}
	out := Replay(ctx, client, w, ReplayOptions{Targets: cl.Routers, TimeScale: cfg.TimeScale, Drain: cfg.Drain})
	routerCPU := cl.RouterCPU() - cpu0
	for i := range out.Records {
		out.Records[i].Policy = policy
	}
	if err := ctx.Err(); err != nil {
		return report.Summary{}, nil, err
	}
	if err := cl.Exited(); err != nil {
		return report.Summary{}, nil, fmt.Errorf("a process died during the run: %w", err)
	}
	degradations := 0
	for _, r := range cl.Routers {
		n, err := scrapeCounter(ctx, r+"/metrics", "kvmesh_router_degradations_total")
		if err != nil {
			log.Warn().Err(err).Str("router", r).Msg("degradations not scraped")
		}
		degradations += n
	}
	if err := writeRecords(filepath.Join(dir, "records.jsonl"), out.Records); err != nil {
		log.Warn().Err(err).Msg("records not written")
	}
	sum := report.Summarize(out.Records, cfg.TimeScale, degradations)
	killMu.Lock()
	sum.Killed = slices.Clone(killed)
	killMu.Unlock()
	sum.MaxSendLagMs = float64(out.MaxLag) / float64(time.Millisecond)
	if n := len(out.Records); n > 0 {
		sum.RouterCPUPerRequestUs = float64(routerCPU) / float64(time.Microsecond) / float64(n)
	}
	ev := log.Info()
	if out.MaxLag > 100*time.Millisecond {
		ev = log.Warn().Str("note", "load generator fell behind schedule: CPU-starved")
	}
	ev.Dur("wall", out.Wall).Dur("max_send_lag", out.MaxLag).Float64("ttft_p90_ms", sum.TTFT.P90).Int("errors", sum.Errors).
		Dur("router_cpu", routerCPU).Msg("policy done")
	var ttft []float64
	for _, r := range out.Records {
		if r.OK() {
			ttft = append(ttft, report.SimMillis(r.TTFT, cfg.TimeScale))
		}
	}
	return sum, ttft, nil
}

// KillTargets are the engine servers a fault run kills: the first of the
// prefill pool and the first of the decode pool. A scenario without pools
// has none to name.
func KillTargets(roles []string) ([]int, error) {
	pre, dec := slices.Index(roles, "prefill"), slices.Index(roles, "decode")
	if pre < 0 || dec < 0 {
		return nil, errors.New("killing replicas needs prefill and decode pools (a pd scenario)")
	}
	return []int{pre, dec}, nil
}

// scrapeCounter sums every sample of a Prometheus counter family.
func scrapeCounter(ctx context.Context, url, name string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s: status %d", url, resp.StatusCode)
	}
	return sumCounter(io.LimitReader(resp.Body, 32<<20), name)
}

// sumCounter adds the values of name's samples in Prometheus text format.
func sumCounter(r io.Reader, name string) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	total, found := 0.0, false
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		fields := strings.Fields(rest[strings.LastIndexByte(rest, '}')+1:])
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return 0, fmt.Errorf("metric %s: %q: %w", name, line, err)
		}
		total += v
		found = true
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	if !found {
		return 0, errors.New("metric " + name + " not exported")
	}
	return int(total), nil
}

func writeRecords(path string, recs []report.Record) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	enc := json.NewEncoder(bw)
	for _, r := range recs {
		if err := enc.Encode(r); err != nil {
			f.Close()
			return err
		}
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
