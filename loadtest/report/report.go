// Package report turns per-request load-test records into the per-policy
// summary (percentiles, throughput, hit rates), the JSON CONTRACT.md names,
// a text table and a TTFT CDF plot.
//
// Times in a summary are simulated-equivalent: wall time divided by the
// engines' --time-scale, so a run at time-scale 0.1 reads like the real
// engine would. Records keep wall time; Summarize converts.
package report

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Record is what one request produced.
type Record struct {
	Policy  string
	Router  string // router URL the request went to
	Replica string // X-Kvmesh-Replica
	Mode    string // X-Kvmesh-Mode
	Key     string // workload prompt key
	// Start is the wall offset from the run's start at which it was sent;
	// TTFT (to the first content chunk) and E2E are wall durations.
	Start, TTFT, E2E time.Duration
	// PredictedCached is X-Kvmesh-Cached-Tokens (-1 when absent);
	// ActualCached is usage.prompt_tokens_details.cached_tokens.
	PredictedCached, ActualCached int
	// RouterPromptTokens is X-Kvmesh-Prompt-Tokens (-1 when absent): 0
	// for a request the router routed by load without tokenizing it.
	RouterPromptTokens         int
	PromptTokens, OutputTokens int
	// FollowUp marks a request continuing a stored response
	// (previous_response_id); StoredMissing one that failed because that
	// response was not found (a 404).
	FollowUp, StoredMissing bool
	Status                  int
	Err                     string // empty on success
	// Tenant and Priority are what the workload sent (empty when none).
	Tenant, Priority string
	// QueueMs is X-Kvmesh-Queue-Ms, wall ms the router held it (-1 when
	// absent); RejectReason is X-Kvmesh-Reject-Reason; RetryAfter says a
	// Retry-After header came with the answer.
	QueueMs      float64
	RejectReason string
	RetryAfter   bool
	// PrefillCached is X-Kvmesh-Prefill-Cached-Tokens (-1 when absent):
	// a split request's prompt tokens its prefill engine found cached,
	// which ActualCached then holds too (the decode's usage counts the
	// transferred prompt as cached).
	PrefillCached int
	// PrefillReplica is X-Kvmesh-Prefill-Replica: where a split request
	// was prefilled.
	PrefillReplica string
	// Gaps are the wall times between consecutive content chunks of a
	// stream (inter-token latency); not in the JSON report.
	Gaps []time.Duration `json:"-"`
}

// Rejected reports whether the router turned r away as overload asks it
// to: 429 or 503 with Retry-After.
func (r Record) Rejected() bool {
	return (r.Status == 429 || r.Status == 503) && r.RetryAfter
}

// Group is the summary of one tenant's or one priority's requests.
type Group struct {
	Requests int `json:"requests"`
	Served   int `json:"served"`
	// Rejected were turned away with 429/503 and Retry-After, by reason;
	// Failed is every other failure (unfinished at the drain included).
	Rejected map[string]int `json:"rejected,omitempty"`
	Failed   int            `json:"failed"`
	TTFT     Percentiles    `json:"ttft_ms"`
	// QueueP90Ms is the P90 of the time served requests were held by the
	// router, simulated-equivalent ms.
	QueueP90Ms float64 `json:"queue_p90_ms"`
}

func groups(recs []Record, timeScale float64, by func(Record) string) map[string]Group {
	type acc struct {
		g            Group
		ttft, queued []float64
	}
	accs := map[string]*acc{}
	for _, r := range recs {
		k := by(r)
		if k == "" {
			continue
		}
		a := accs[k]
		if a == nil {
			a = &acc{}
			accs[k] = a
		}
		a.g.Requests++
		switch {
		case r.OK():
			a.g.Served++
			a.ttft = append(a.ttft, SimMillis(r.TTFT, timeScale))
			if r.QueueMs >= 0 {
				a.queued = append(a.queued, r.QueueMs/timeScale)
			}
		case r.Rejected():
			if a.g.Rejected == nil {
				a.g.Rejected = map[string]int{}
			}
			a.g.Rejected[fmt.Sprintf("%d %s", r.Status, r.RejectReason)]++
		default:
			a.g.Failed++
		}
	}
	if len(accs) == 0 {
		return nil
	}
	out := make(map[string]Group, len(accs))
	for k, a := range accs {
		a.g.TTFT = percentiles(a.ttft)
		a.g.QueueP90Ms = percentiles(a.queued).P90
		out[k] = a.g
	}
	return out
}

// OK reports whether the request succeeded.
func (r Record) OK() bool { return r.Err == "" && r.Status == 200 }

// Percentiles are TTFT figures in simulated-equivalent milliseconds.
type Percentiles struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
}

// Summary is one policy's result: the CONTRACT.md fields first, then extras.
type Summary struct {
	TTFT             Percentiles `json:"ttft_ms"`
	ThroughputRPS    float64     `json:"throughput_rps"`
	OutputTokensPerS float64     `json:"output_tokens_per_s"`
	Errors           int         `json:"errors"`
	HitRatePredicted float64     `json:"hit_rate_predicted"`
	HitRateActual    float64     `json:"hit_rate_actual"`
	Degradations     int         `json:"degradations"`

	Requests int         `json:"requests"`
	E2E      Percentiles `json:"e2e_ms"`
	// ITL is over every gap between two content chunks of every served
	// stream (vLLM's benchmark ITL), TPOT over requests: (E2E − TTFT) /
	// (output tokens − 1) for those with two or more.
	ITL       Percentiles    `json:"itl_ms"`
	TPOT      Percentiles    `json:"tpot_ms"`
	Replicas  map[string]int `json:"replicas"` // requests served per replica
	Modes     map[string]int `json:"modes"`    // requests per X-Kvmesh-Mode
	ErrorKind map[string]int `json:"error_kinds,omitempty"`
	// MaxSendLagMs is the worst lateness of a send behind schedule, in
	// wall ms: large values mean the load generator was CPU-starved.
	MaxSendLagMs float64 `json:"max_send_lag_ms"`
	// RouterCPUPerRequestUs is the routers' CPU time over the replay
	// (user + system, every router summed) per request sent: what sizes
	// a router fleet. 0 when not measured.
	RouterCPUPerRequestUs float64 `json:"router_cpu_us_per_request,omitempty"`
	// Tenants and Priorities break the requests down by what the workload
	// sent (multi-tenant scenarios only).
	Tenants    map[string]Group `json:"tenants,omitempty"`
	Priorities map[string]Group `json:"priorities,omitempty"`
	// Served counts successful requests. PredictedExact is the share of
	// them whose predicted cached tokens equal the engine's;
	// PredictedExactTokenized the same share over the Tokenized ones the
	// router tokenized (X-Kvmesh-Prompt-Tokens above 0), leaving out
	// what it routes by load, such as stored-response follow-ups.
	Served                  int     `json:"served"`
	PredictedExact          float64 `json:"predicted_exact"`
	Tokenized               int     `json:"tokenized"`
	PredictedExactTokenized float64 `json:"predicted_exact_tokenized"`
	// FollowUps were sent with previous_response_id; FollowUpsMissing
	// of them failed because their stored response was not found.
	FollowUps        int `json:"follow_ups,omitempty"`
	FollowUpsMissing int `json:"follow_ups_missing,omitempty"`
	// Killed names the engine processes a fault run killed during the
	// replay (loadtest --kill-at).
	Killed []string `json:"killed,omitempty"`
}

// Percentile returns the nearest-rank p-th percentile (0 < p ≤ 100) of
// sorted values; 0 for none.
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[max(0, min(len(sorted)-1, rank-1))]
}

func percentiles(values []float64) Percentiles {
	if len(values) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(values)
	slices.Sort(s)
	sum := 0.0
	for _, v := range s {
		sum += v
	}
	return Percentiles{P50: Percentile(s, 50), P90: Percentile(s, 90), P99: Percentile(s, 99), Mean: sum / float64(len(s))}
}

// SimMillis converts a wall duration at timeScale to simulated milliseconds.
func SimMillis(d time.Duration, timeScale float64) float64 {
	if timeScale <= 0 {
		timeScale = 1
	}
	return float64(d) / float64(time.Millisecond) / timeScale
}

// Summarize computes a policy's summary. Throughput counts successful
// requests and their output tokens over the simulated span from the first
// send to the last completion. Hit rates are cached over prompt tokens of
// successful requests; requests without a predicted figure count as 0.
func Summarize(recs []Record, timeScale float64, degradations int) Summary {
	s := Summary{Requests: len(recs), Degradations: degradations,
		Replicas: map[string]int{}, Modes: map[string]int{}}
	var ttft, e2e, itl, tpot []float64
	var first, last time.Duration = -1, 0
	prompt, predicted, actual, output := 0, 0, 0, 0
	exact, exactTokenized := 0, 0
	for _, r := range recs {
		if first < 0 || r.Start < first {
			first = r.Start
		}
		if r.FollowUp {
			s.FollowUps++
		}
		if r.StoredMissing {
			s.FollowUpsMissing++
		}
		if !r.OK() {
			s.Errors++
			if s.ErrorKind == nil {
				s.ErrorKind = map[string]int{}
			}
			s.ErrorKind[errorKind(r)]++
			continue
		}
		last = max(last, r.Start+r.E2E)
		ttft = append(ttft, SimMillis(r.TTFT, timeScale))
		e2e = append(e2e, SimMillis(r.E2E, timeScale))
		for _, g := range r.Gaps {
			itl = append(itl, SimMillis(g, timeScale))
		}
		if r.OutputTokens > 1 && r.E2E > r.TTFT {
			tpot = append(tpot, SimMillis(r.E2E-r.TTFT, timeScale)/float64(r.OutputTokens-1))
		}
		prompt += r.PromptTokens
		predicted += max(r.PredictedCached, 0)
		actual += r.ActualCached
		output += r.OutputTokens
		s.Replicas[r.Replica]++
		s.Modes[r.Mode]++
		s.Served++
		hit := r.PredictedCached == r.ActualCached
		if hit {
			exact++
		}
		if r.RouterPromptTokens > 0 {
			s.Tokenized++
			if hit {
				exactTokenized++
			}
		}
	}
	if s.Served > 0 {
		s.PredictedExact = float64(exact) / float64(s.Served)
	}
	if s.Tokenized > 0 {
		s.PredictedExactTokenized = float64(exactTokenized) / float64(s.Tokenized)
	}
	s.TTFT, s.E2E, s.ITL, s.TPOT = percentiles(ttft), percentiles(e2e), percentiles(itl), percentiles(tpot)
	if span := SimMillis(last-first, timeScale) / 1000; len(ttft) > 0 && span > 0 {
		s.ThroughputRPS = float64(len(ttft)) / span
		s.OutputTokensPerS = float64(output) / span
	}
	s.Tenants = groups(recs, timeScale, func(r Record) string { return r.Tenant })
	s.Priorities = groups(recs, timeScale, func(r Record) string { return r.Priority })
	if prompt > 0 {
		s.HitRatePredicted = float64(predicted) / float64(prompt)
		s.HitRateActual = float64(actual) / float64(prompt)
	}
	return s
}

func errorKind(r Record) string {
	if r.Status != 0 && r.Status != 200 {
		return fmt.Sprintf("http %d", r.Status)
	}
	return r.Err
}

// Report is one scenario run: the setup and a summary per policy.
type Report struct {
	Scenario string `json:"scenario"`
	// Replicas counts routing targets: engine servers × DataParallelSize
	// when the servers run data-parallel ranks.
	Replicas         int     `json:"replicas"`
	DataParallelSize int     `json:"data_parallel_size,omitempty"`
	Routers          int     `json:"routers"`
	TimeScale        float64 `json:"time_scale"`
	Seed             uint64  `json:"seed"`
	// Requests is the workload size each policy was given.
	Requests     int    `json:"requests"`
	KVBlocks     int    `json:"kv_blocks_per_replica"`
	DemandBlocks int    `json:"demand_blocks"`
	Units        string `json:"units"`
	// Order lists the policies as run; Policies holds their summaries.
	Order    []string           `json:"policy_order"`
	Policies map[string]Summary `json:"policies"`
	// Decode shows the decode table (writeDecode) whatever the modes: a
	// scenario of prefill and decode pools.
	Decode bool `json:"-"`
}

// Units is the note every report carries about its time figures.
const Units = "ttft_ms and e2e_ms are simulated-equivalent milliseconds (wall ms / time_scale); throughput_rps and output_tokens_per_s are per simulated second; hit rates are cached / prompt tokens"

// WriteJSON writes r as indented JSON.
func (r Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable prints one line per policy.
func (r Report) WriteTable(w io.Writer) error {
	dp := ""
	if r.DataParallelSize > 1 {
		dp = fmt.Sprintf(" (%d servers × %d data-parallel ranks)", r.Replicas/r.DataParallelSize, r.DataParallelSize)
	}
	fmt.Fprintf(w, "scenario %s: %d replicas%s, %d router(s), time-scale %g, seed %d, %d requests per policy, KV %d blocks/replica (demand %d blocks = %.0f%% of fleet, %.1f× one replica)\n",
		r.Scenario, r.Replicas, dp, r.Routers, r.TimeScale, r.Seed, r.Requests, r.KVBlocks, r.DemandBlocks,
		100*float64(r.DemandBlocks)/float64(max(1, r.KVBlocks*r.Replicas)), float64(r.DemandBlocks)/float64(max(1, r.KVBlocks)))
	fmt.Fprintln(w, "TTFT in simulated-equivalent ms (wall / time-scale); rates per simulated second")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tp50\tp90\tp99\tmean\treq/s\tout tok/s\terrors\thit pred\thit actual\tdegrad\trouter CPU µs/req\t")
	for _, name := range r.Order {
		s := r.Policies[name]
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f\t%.0f\t%.2f\t%.0f\t%d\t%.1f%%\t%.1f%%\t%d\t%.0f\t\n",
			name, s.TTFT.P50, s.TTFT.P90, s.TTFT.P99, s.TTFT.Mean, s.ThroughputRPS, s.OutputTokensPerS,
			s.Errors, 100*s.HitRatePredicted, 100*s.HitRateActual, s.Degradations, s.RouterCPUPerRequestUs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := r.writePredictions(w); err != nil {
		return err
	}
	if err := r.writeDecode(w); err != nil {
		return err
	}
	for _, name := range r.Order {
		if s := r.Policies[name]; len(s.Killed) > 0 {
			fmt.Fprintf(w, "%s: killed %s during the run; %d of %d requests served, %d failed\n",
				name, strings.Join(s.Killed, ", "), s.Served, s.Requests, s.Errors)
		}
	}
	return r.writeGroups(w)
}

// writePredictions prints, once requests were served, one line per policy
// on how exactly the router predicted the engines' cached tokens, and on
// stored-response follow-ups.
func (r Report) writePredictions(w io.Writer) error {
	served := false
	for _, name := range r.Order {
		served = served || r.Policies[name].Served > 0
	}
	if !served {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tserved\tpredicted=cached\ttokenized\tpredicted=cached (tokenized)\tfollow-ups\tfollow-ups not found\t")
	for _, name := range r.Order {
		s := r.Policies[name]
		fmt.Fprintf(tw, "%s\t%d\t%.1f%%\t%d\t%.1f%%\t%d\t%d\t\n", name, s.Served, 100*s.PredictedExact,
			s.Tokenized, 100*s.PredictedExactTokenized, s.FollowUps, s.FollowUpsMissing)
	}
	return tw.Flush()
}

// writeDecode prints, for scenarios that split requests (a policy served
// some in mode split, or Decode is set), one line per policy on decoding:
// inter-token latency, time per output token, output tokens per second per
// replica, and the share of requests split.
func (r Report) writeDecode(w io.Writer) error {
	show := r.Decode
	for _, name := range r.Order {
		show = show || r.Policies[name].Modes["split"] > 0
	}
	if !show {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy	itl p50	itl p90	itl p99	tpot p50	tpot p90	out tok/s/replica	split	")
	for _, name := range r.Order {
		s := r.Policies[name]
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f%%\t\n", name, s.ITL.P50, s.ITL.P90, s.ITL.P99, s.TPOT.P50, s.TPOT.P90,
			s.OutputTokensPerS/float64(max(r.Replicas, 1)), 100*float64(s.Modes["split"])/float64(max(s.Served, 1)))
	}
	return tw.Flush()
}

// writeGroups prints, for multi-tenant scenarios, one line per policy and
// tenant, then per policy and priority.
func (r Report) writeGroups(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	header := false
	for _, kind := range []string{"tenant", "priority"} {
		for _, name := range r.Order {
			s := r.Policies[name]
			gs := s.Tenants
			if kind == "priority" {
				gs = s.Priorities
			}
			keys := slices.Sorted(maps.Keys(gs))
			for _, k := range keys {
				if !header {
					fmt.Fprintln(tw, "policy\tby\tgroup\trequests\tserved\tfailed\trejected\tp50\tp90\tp99\tqueue p90\t")
					header = true
				}
				g := gs[k]
				rejected := 0
				for _, n := range g.Rejected {
					rejected += n
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%.0f\t%.0f\t%.0f\t%.0f\t\n", name, kind, k,
					g.Requests, g.Served, g.Failed, rejected, g.TTFT.P50, g.TTFT.P90, g.TTFT.P99, g.QueueP90Ms)
			}
		}
	}
	return tw.Flush()
}
