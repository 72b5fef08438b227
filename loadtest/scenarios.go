package loadtest

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/loadtest/workload"
)

// AllPolicies are the router's policies, baselines first.
var AllPolicies = []string{"random", "round-robin", "least-loaded", "chwbl", "prefix-pin", "kvaware"}

// Scenario is a named workload with the fleet and pace it is sized for.
// Rates and lengths are in simulated time; Duration is the wall length of
// the arrival phase at TimeScale, so the workload covers
// Duration/TimeScale simulated seconds.
type Scenario struct {
	Name     string
	About    string
	Replicas int
	// DataParallelSize above 1 makes each of the Replicas an engine
	// server of that many data-parallel ranks, a sidecar following each.
	DataParallelSize int
	// Routers run by default (--routers overrides); 0 is one.
	Routers   int
	TimeScale float64
	Duration  time.Duration
	// FleetFill is the workload's distinct KV demand over the fleet's KV
	// capacity: --kv-blocks per replica = demand / (FleetFill · replicas).
	FleetFill float64
	// MinKVBlocks keeps room for the running sequences' own blocks; it
	// must be at least enginesim's max model length (32,768) / block size.
	MinKVBlocks int
	// EngineArgs, SidecarArgs and RouterArgs are extra enginesim, sidecar
	// and router flags the scenario needs.
	EngineArgs, SidecarArgs, RouterArgs []string
	// KVRoles, when set, splits the replicas into prefill and decode pools
	// (cluster.Config.KVRoles); the +aggregated variant runs the same
	// replicas with every one serving whole requests.
	KVRoles []string
	// RouterConfig, when set, is the routers' YAML config (--config): the
	// multi-tenant scenarios name their tenants there.
	RouterConfig string
	// Policies run by default (--policies overrides).
	Policies []string
	Generate func(seed uint64, sim time.Duration) (workload.Workload, error)
	// Rated, when set, generates the workload at a steady arrival rate
	// (req/s) instead of the scenario's (loadtest --rate).
	Rated func(seed uint64, sim time.Duration, rate float64) (workload.Workload, error)
}

// AtRate is s generating its workload at rate req/s, or an error when the
// scenario has no rate to set.
func (s Scenario) AtRate(rate float64) (Scenario, error) {
	if s.Rated == nil || rate <= 0 {
		return s, fmt.Errorf("scenario %s: no arrival rate to set (want a positive rate for pd, pd-chunked or pd-short)", s.Name)
	}
	rated := s.Rated
	s.Generate = func(seed uint64, sim time.Duration) (workload.Workload, error) { return rated(seed, sim, rate) }
	return s, nil
}

// tenantsOf is a Generate of the Tenants workload p at its own rates.
func tenantsOf(name string, p workload.TenantsParams) func(uint64, time.Duration) (workload.Workload, error) {
	return func(seed uint64, sim time.Duration) (workload.Workload, error) {
		return workload.Tenants(name, p, seed, sim)
	}
}

// tenantsAt is a Rated generator of the Tenants workload p.
func tenantsAt(name string, p workload.TenantsParams) func(uint64, time.Duration, float64) (workload.Workload, error) {
	return func(seed uint64, sim time.Duration, rate float64) (workload.Workload, error) {
		p.RateStart, p.RateEnd = rate, rate
		return workload.Tenants(name, p, seed, sim)
	}
}

// KVBlocks derives the per-replica capacity from a workload's demand.
func (s Scenario) KVBlocks(w workload.Workload, replicas int) int {
	if s.FleetFill <= 0 || replicas <= 0 {
		return s.MinKVBlocks
	}
	n := int(float64(w.DemandBlocks)/(s.FleetFill*float64(replicas)) + 0.999)
	return max(n, s.MinKVBlocks)
}

// TenantsParams is the tenants scenario: llm-d's "KV-Cache Wins You Can
// See" shape (groups sharing a ≈6,000-token context, users asking
// ≈1,200-token questions, a rising Poisson rate). Outputs are 32 tokens:
// enginesim's calibrated decode cost (405 ns per context token per step,
// measured on eager HF attention) would otherwise make decoding 7k-token
// contexts dominate the engines and the benchmark would stop measuring
// prefill and cache. 64 groups instead of 150 keep the share of requests
// that must meet a cold context (one per group) near 5 % of a ~1,200
// request run; llm-d's far longer run had it near 1 %.
var TenantsParams = workload.TenantsParams{
	Groups: 64, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200, OutputTokens: 32,
	RateStart: 10, RateEnd: 50,
}

// HotParams is the hot scenario: 16 tenants with 3,000-token contexts at a
// constant rate, tenant 0 sending half of all requests — more than one
// replica can serve, so pinning by cache alone melts that replica.
var HotParams = workload.TenantsParams{
	Groups: 16, UsersPerGroup: 8, ContextTokens: 3000, QuestionTokens: 300, OutputTokens: 32,
	RateStart: 64, RateEnd: 64, HotShare: 0.5,
}

// DPParams is the dp scenario: the tenants shape at 10→30 req/s, what 2
// servers of 4 data-parallel ranks serve on this machine.
var DPParams = workload.TenantsParams{
	Groups: 64, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200, OutputTokens: 32,
	RateStart: 10, RateEnd: 30,
}

// MultiturnParams is the multiturn scenario: ShareGPT-like chats.
var MultiturnParams = workload.MultiturnParams{
	ConversationRate: 8, MinTurns: 4, MaxTurns: 12, SystemPrompts: 4, SystemTokens: 400,
	UserMedian: 200, AssistantMedian: 120, MaxUser: 2000, MaxAssistant: 400, ThinkTime: 2 * time.Second,
}

// AgentParams is the agent scenario: coding-agent conversations of 3–10
// turns over four agents' 2,000-token instructions, each turn adding a
// tool's ≈300-token output, 1 s of tool time apart; 30 % of the
// conversations chain turns by previous_response_id on stored responses.
var AgentParams = workload.AgentParams{
	ConversationRate: 3, MinTurns: 3, MaxTurns: 10, Agents: 4, InstructionTokens: 2000,
	TaskMedian: 150, ToolOutputMedian: 300, MaxToolOutput: 2000, OutputTokens: 32,
	StoredShare: 0.3, ThinkTime: time.Second,
}

// PDParams is the pd scenario: long prompts with long answers, the shape
// disaggregation is for — a 2,000-token context shared by each group's
// users and a 6,000-token document of each request's own, 256 tokens of
// answer, 6 req/s.
var PDParams = workload.TenantsParams{
	Groups: 16, UsersPerGroup: 40, ContextTokens: 2000, QuestionTokens: 6000, OutputTokens: 256,
	RateStart: 6, RateEnd: 6,
}

// PDChunkedParams is pd-chunked: the pd requests at 8 req/s, where the
// prefills of an aggregated fleet of 8 take about a fifth of its engine
// time and two fifths of a prefill pool of 4 (loadtest/README.md).
var PDChunkedParams = func() workload.TenantsParams {
	p := PDParams
	p.RateStart, p.RateEnd = 8, 8
	return p
}()

// pdChunkedEngine is the engine setup of pd-chunked: a 512-token step
// budget, vLLM's chunked-prefill default from May 2024 (vllm-project/vllm
// #4580, picked for the best inter-token latency on A100) until #10544
// raised it to 2048 in November 2024 as conservative on H100, and the
// budget Sarathi-Serve runs under strict latency targets; decode priced
// memory-bound as paged attention on an H200 reads its KV (≈ 27 ns per
// context token, rounded to 30; 10 µs per sequence for sampling and
// bookkeeping, an estimate).
var pdChunkedEngine = []string{"--max-model-len", "16384", "--max-num-batched-tokens", "512",
	"--cost-profile", "decode_ns_per_context_token=30,decode_us_per_seq=10"}

// PDShortParams is pd-short: chat-like prompts (300 tokens of shared
// system prompt, 200 of question) with 128-token answers at 12 req/s,
// where splitting only adds a hop.
var PDShortParams = workload.TenantsParams{
	Groups: 8, UsersPerGroup: 100, ContextTokens: 300, QuestionTokens: 200, OutputTokens: 128,
	RateStart: 12, RateEnd: 12,
}

// pdRoles are the pd scenarios' pools: 3 prefill and 5 decode replicas.
var pdRoles = Pools(3, 8)

// Pools are the KV roles of replicas replicas, the first prefill of them
// prefill, the rest decode.
func Pools(prefill, replicas int) []string {
	roles := make([]string, replicas)
	for i := range roles {
		roles[i] = "decode"
		if i < prefill {
			roles[i] = "prefill"
		}
	}
	return roles
}

// NoCacheParams is the nocache scenario: unique summarization-like prompts.
var NoCacheParams = workload.NoCacheParams{Rate: 40, InputMedian: 2000, OutputMedian: 64, MaxInput: 8000, MaxOutput: 256}

// OverloadStreams is the overload scenario: three tenants, one per priority
// band, together offering about twice what 2 replicas serve of
// tenants-shaped requests (6,000-token shared contexts, 1,200 uncached
// tokens each: 2 replicas served 16.5 req/s offered 24), the critical one
// a sixth of it.
var OverloadStreams = []workload.Stream{
	{Tenant: "interactive", Priority: "critical", Rate: 5, Groups: 8, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200, OutputTokens: 32},
	{Tenant: "app", Priority: "standard", Rate: 11, Groups: 16, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200, OutputTokens: 32},
	{Tenant: "batch", Priority: "sheddable", Rate: 17, Groups: 16, UsersPerGroup: 5, ContextTokens: 6000, QuestionTokens: 1200, OutputTokens: 32},
}

// NoisyStreams is the noisy scenario: two tenants chatting over a shared
// 1,500-token system prompt at 3 req/s each, and a third sending 40 req/s
// of cold 3,000-token prompts, about ten times its fair share of 2
// replicas, all at the same priority.
var NoisyStreams = []workload.Stream{
	{Tenant: "chat-a", Priority: "standard", Rate: 3, Groups: 1, UsersPerGroup: 50, ContextTokens: 1500, QuestionTokens: 100, OutputTokens: 32},
	{Tenant: "chat-b", Priority: "standard", Rate: 3, Groups: 1, UsersPerGroup: 50, ContextTokens: 1500, QuestionTokens: 100, OutputTokens: 32},
	{Tenant: "noisy", Priority: "standard", Rate: 40, ContextTokens: 3000, OutputTokens: 32},
}

// tenantConfig is a router config naming streams' tenants by the keys the
// load test's client sends, each allowed any priority and weighted alike.
func tenantConfig(streams []workload.Stream) string {
	var b strings.Builder
	b.WriteString("tenants:\n")
	seen := map[string]bool{}
	for _, s := range streams {
		if seen[s.Tenant] {
			continue
		}
		seen[s.Tenant] = true
		fmt.Fprintf(&b, "  - {name: %s, api_keys: [%s], max_priority: critical}\n", s.Tenant, workload.TenantKey(s.Tenant))
	}
	return b.String()
}

// DefaultTrace is the Mooncake trace shipped beside the repository.
const DefaultTrace = "../shared/traces/mooncake_conversation_trace.jsonl"

// TraceDefaults replay the first 400 requests (≈2 minutes of the trace) at
// 2× speed with outputs capped at 64 tokens. (At 4×, the prefill of
// Mooncake's long prompts — quadratic attention included — overloads 8
// calibrated replicas whatever the routing.)
// TiersParams is the tiers scenario: tenants-shaped traffic whose working
// set is 4× the fleet's GPU KV cache (FleetFill 4), with a host tier on
// every engine (vLLM's OffloadingConnector, CPU backend) large enough to
// hold all of it, so that most prefixes are a load from host memory away.
// Many contexts with short questions keep both true at once: each
// replica's GPU cache still holds eight or so requests, as a real one holds
// many (with few contexts it would hold two, and its P90 would be the wait
// for KV space, whatever the routing), and the first request of each
// context, which no router can help, stays under a tenth of the run.
var TiersParams = workload.TenantsParams{Groups: 128, UsersPerGroup: 4, ContextTokens: 3000, QuestionTokens: 200, OutputTokens: 32, RateStart: 12, RateEnd: 36}

// tiersHostBlocks is the host tier of each engine in the tiers scenario,
// and what its sidecar follows: room for the whole working set.
const tiersHostBlocks = "32768"

var TraceDefaults = workload.TraceParams{Limit: 400, Speedup: 2, MaxOutput: 64}

// Scenarios returns the catalogue; trace reads traceFile with tp.
func Scenarios(traceFile string, tp workload.TraceParams) map[string]Scenario {
	return map[string]Scenario{
		"tenants": {
			Name: "tenants", About: "64 groups × 6,000-token shared context, 5 users each asking 1,200-token questions, Poisson 10→50 req/s",
			// Time-scale 1: 50 req/s of 43 KB prompts is what 2 shared
			// cores sustain; faster would also magnify CPU stalls.
			Replicas: 8, TimeScale: 1, Duration: 40 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			Policies: AllPolicies,
			Generate: tenantsOf("tenants", TenantsParams),
		},
		"hot": {
			Name: "hot", About: "16 tenants × 3,000-token context, tenant 0 sends half of 64 req/s",
			// A small KV cache per replica (all tenants' demand is a quarter
			// of the fleet's) bounds how many sequences one replica runs,
			// as on a real GPU; --max-model-len 8192 lets enginesim start
			// with it. Time-scale 1: 64 req/s is what this machine can send.
			Replicas: 8, TimeScale: 1, Duration: 12 * time.Second, FleetFill: 0.25, MinKVBlocks: 512,
			EngineArgs: []string{"--max-model-len", "8192"},
			Policies:   []string{"least-loaded", "prefix-pin", "kvaware"},
			Generate:   tenantsOf("hot", HotParams),
		},
		"tiers": {
			Name: "tiers", About: "128 groups × 3,000-token context, 4 users each asking 200-token questions, 12→36 req/s; working set 4× the GPU KV cache, all of it in each engine's CPU tier",
			Replicas: 4, TimeScale: 1, Duration: 80 * time.Second, FleetFill: 4, MinKVBlocks: 512,
			EngineArgs:  []string{"--max-model-len", "8192", "--cpu-offload-blocks", tiersHostBlocks},
			SidecarArgs: []string{"--offload-capacity", tiersHostBlocks},
			Policies:    []string{"kvaware", "kvaware+blind", "least-loaded"},
			Generate:    tenantsOf("tiers", TiersParams),
		},
		"multiturn": {
			Name: "multiturn", About: "chats of 4–12 turns 1–3 s apart, 8 new per second, history resent each turn",
			Replicas: 8, TimeScale: 1, Duration: 20 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			Policies: []string{"round-robin", "least-loaded", "chwbl", "kvaware"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				return workload.Multiturn(MultiturnParams, seed, d)
			},
		},
		"agent": {
			Name: "agent", About: "tool-using agent conversations of 3–10 turns through /v1/responses (30 % chained by previous_response_id on stored responses) and, +chat, the same turns as chat completions",
			Replicas: 4, Routers: 2, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			RouterArgs: []string{"--carry-stored-state"},
			Policies:   []string{"kvaware", "kvaware+chat"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				return workload.Agent(AgentParams, seed, d)
			},
		},
		"dp": {
			Name: "dp", About: "tenants (64 groups × 6,000-token context, 10→30 req/s) on 2 servers × 4 data-parallel ranks; +noheader: routers without X-data-parallel-rank",
			Replicas: 2, DataParallelSize: 4, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			Policies: []string{"kvaware", "kvaware+noheader"},
			Generate: tenantsOf("dp", DPParams),
		},
		"pd": {
			Name: "pd", About: "prefill/decode disaggregation: 3 prefill + 5 decode replicas (+aggregated: the same 8 serving whole requests), 2,000-token group contexts + 6,000-token documents, 256-token answers, 6 req/s; +always / +never: --split always / never",
			Replicas: 8, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 4096,
			EngineArgs: []string{"--max-model-len", "16384"}, KVRoles: pdRoles,
			Policies: []string{"kvaware+aggregated", "kvaware"},
			Generate: tenantsOf("pd", PDParams),
			Rated:    tenantsAt("pd", PDParams),
		},
		"pd-chunked": {
			Name: "pd-chunked", About: "the pd requests at 8 req/s on engines chunking prefills at a 512-token step budget (memory-bound decode cost): 4 prefill + 4 decode against the same 8 aggregated, where chunked prefills slow many decode steps",
			Replicas: 8, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 4096,
			EngineArgs: pdChunkedEngine, KVRoles: Pools(4, 8),
			Policies: []string{"kvaware+aggregated", "kvaware"},
			Generate: tenantsOf("pd-chunked", PDChunkedParams),
			Rated:    tenantsAt("pd-chunked", PDChunkedParams),
		},
		"pd-short": {
			Name: "pd-short", About: "the pd pools on short chats (300-token system prompts, 200-token questions, 128-token answers, 12 req/s): auto splitting against aggregated and always-split",
			Replicas: 8, TimeScale: 1, Duration: 20 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			EngineArgs: []string{"--max-model-len", "8192"}, KVRoles: pdRoles,
			Policies: []string{"kvaware+aggregated", "kvaware", "kvaware+always"},
			Generate: tenantsOf("pd-short", PDShortParams),
			Rated:    tenantsAt("pd-short", PDShortParams),
		},
		"nocache": {
			Name: "nocache", About: "unique ≈2,000-token prompts at 40 req/s",
			Replicas: 8, TimeScale: 1, Duration: 15 * time.Second, FleetFill: 1, MinKVBlocks: 4096,
			Policies: []string{"least-loaded", "kvaware"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				return workload.NoCache(NoCacheParams, seed, d)
			},
		},
		"overload": {
			Name: "overload", About: "three tenants at critical, standard and sheddable priority offering ≈2× what 2 replicas serve (5 + 11 + 17 req/s of tenants-shaped requests)",
			Replicas: 2, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			// Engines schedule by priority as vLLM's --scheduling-policy
			// priority does, and the routers send each request's band.
			EngineArgs:   []string{"--scheduling-policy", "priority"},
			RouterConfig: tenantConfig(OverloadStreams) + "models: [{name: sim, engine_priority: true}]\n",
			Policies:     []string{"kvaware", "kvaware+fc", "kvaware+only=critical"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				return workload.Mix("overload", OverloadStreams, seed, d)
			},
		},
		"noisy": {
			Name: "noisy", About: "two tenants chatting over a shared 1,500-token prompt at 3 req/s each, a third sending 40 req/s of cold 3,000-token prompts",
			Replicas: 2, TimeScale: 1, Duration: 30 * time.Second, FleetFill: 0.7, MinKVBlocks: 2048,
			RouterConfig: tenantConfig(NoisyStreams),
			Policies:     []string{"kvaware", "kvaware+fc", "kvaware+without=noisy"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				return workload.Mix("noisy", NoisyStreams, seed, d)
			},
		},
		"trace": {
			Name: "trace", About: fmt.Sprintf("Mooncake conversation trace %s, %d requests from %v at %g× speed", traceFile, tp.Limit, tp.Start, tp.Speedup),
			// enginesim's default capacity (≈100 GiB of an 8B model's KV):
			// the whole trace's demand is about the fleet's. Mooncake
			// prompts reach 126k tokens.
			Replicas: 8, TimeScale: 0.5, Duration: 0, MinKVBlocks: 51200,
			EngineArgs: []string{"--max-model-len", "131072"},
			Policies:   []string{"round-robin", "least-loaded", "chwbl", "kvaware"},
			Generate: func(seed uint64, d time.Duration) (workload.Workload, error) {
				f, err := os.Open(traceFile)
				if err != nil {
					return workload.Workload{}, err
				}
				defer f.Close()
				p := tp
				if d > 0 {
					// --duration bounds the replayed window (in trace time
					// after speed-up).
					p.Window = time.Duration(float64(d) * max(p.Speedup, 1))
				}
				recs, err := workload.ParseTrace(f, p)
				if err != nil {
					return workload.Workload{}, err
				}
				return workload.Trace(recs, p, seed)
			},
		},
	}
}

// DefaultOrder is the order of --scenario all.
var DefaultOrder = []string{"tenants", "hot", "nocache", "multiturn"}

// Names lists the catalogue's scenarios.
func Names(m map[string]Scenario) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
