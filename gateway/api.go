package gateway

import (
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/kvmesh/kvmesh/console"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/proxy"
	"github.com/kvmesh/kvmesh/request"
)

func writeJSON(ctx *fasthttp.RequestCtx, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		ctx.Error(err.Error(), fasthttp.StatusInternalServerError)
		return
	}
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}

type modelCard struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Parent  string `json:"parent,omitempty"`
}

// serveModels lists the union of the models live replicas serve, plus
// models with a fallback; given an id, it answers that model's card alone
// (OpenAI's "retrieve model"). Client API keys guard it as vLLM's guard
// every /v1 route.
func (g *Gateway) serveModels(ctx *fasthttp.RequestCtx, id string) {
	s := g.Settings()
	if err := s.authorize(ctx); err != nil {
		g.fail(ctx, err)
		return
	}
	snap := g.table.Snapshot()
	seen := map[string]bool{}
	for i := range snap.Replicas {
		if r := &snap.Replicas[i]; r.Online {
			for _, m := range r.Models {
				seen[m] = true
			}
		}
	}
	for name, m := range s.Models {
		if len(m.Fallback) > 0 {
			seen[name] = true
		}
	}
	names := make([]string, 0, len(seen))
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	cards := make([]modelCard, 0, len(names))
	for _, n := range names {
		c := modelCard{ID: n, Object: "model", OwnedBy: "kvmesh"}
		if m := s.Models[n]; m.Adapter != "" && m.Base != "" {
			c.Parent = m.Base
		}
		cards = append(cards, c)
	}
	if id == "" {
		writeJSON(ctx, map[string]any{"object": "list", "data": cards})
		return
	}
	if i := slices.IndexFunc(cards, func(c modelCard) bool { return c.ID == id }); i >= 0 {
		writeJSON(ctx, cards[i])
		return
	}
	g.fail(ctx, &request.Error{Status: 404, Type: "not_found_error", Message: fmt.Sprintf("model %q is not served here", id)})
}

// serveTokenize answers vLLM's /tokenize with the router's own tokenizer.
func (g *Gateway) serveTokenize(ctx *fasthttp.RequestCtx) {
	s := g.Settings()
	if err := s.authorize(ctx); err != nil {
		g.fail(ctx, err)
		return
	}
	p, err := request.ParseTokenize(ctx.PostBody())
	if err != nil {
		g.fail(ctx, err)
		return
	}
	snap := g.table.Snapshot()
	if p.Model == "" {
		p.Model = soleModel(snap)
	} else if _, configured := s.Models[p.Model]; !configured && !servedBy(snap, p.Model) {
		// As vLLM and the completions: a default tokenizer ("*") would
		// answer for any name, a typo included.
		g.fail(ctx, &request.Error{Status: 404, Type: "not_found_error", Message: fmt.Sprintf("model %q is not served here", p.Model)})
		return
	}
	tk := s.tokenizer(s.Models[p.Model])
	if tk == nil {
		g.fail(ctx, &request.Error{Status: 404, Type: "not_found_error", Message: fmt.Sprintf("no tokenizer for model %q", p.Model)})
		return
	}
	var ids []uint32
	switch {
	case p.Kind.RendersAsChat():
		// vLLM's chat tokenize: add_generation_prompt defaults to true,
		// add_special_tokens to false.
		_, ids, err = tk.EncodeChat(p.ChatInput())
	case p.PromptIDs != nil:
		ids = p.PromptIDs
	default:
		ids, err = tk.Encode(p.PromptText, p.PromptSpecialTokens())
	}
	if err != nil {
		g.fail(ctx, request.Invalid("cannot tokenize: %v", err))
		return
	}
	if ids == nil {
		ids = []uint32{}
	}
	writeJSON(ctx, struct {
		Count  int      `json:"count"`
		Tokens []uint32 `json:"tokens"`
	}{len(ids), ids})
}

// warmupGrace bounds how long a new router waits for the filters of replicas
// it already knows; after it, a replica still without one is routed by load.
const warmupGrace = 10 * time.Second

// serveReady answers 200 once the router can route well: at least one live
// replica, and every live replica with KV events has sent its filter (a
// router started late catches up from snapshots before it takes traffic),
// or warmupGrace has passed. A replica this router ejected for not
// answering is not live: a static upstream is online by configuration,
// dead or not, and a router whose only replicas refuse every request
// cannot serve.
func (g *Gateway) serveReady(ctx *fasthttp.RequestCtx) {
	if g.stopping.Load() {
		notReady(ctx, "shutting down")
		return
	}
	snap := g.table.Snapshot()
	loads := g.loadsOf(snap).loads
	now := g.now().UnixNano()
	live, waiting, ejected := 0, 0, 0
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		if !r.Online {
			continue
		}
		if loads[i].eject.out(now) {
			ejected++
			continue
		}
		live++
		if r.KVEvents && r.FilterGeneration == 0 && !r.Orphan { // an orphan's filter is not coming
			waiting++
		}
	}
	switch {
	case live == 0 && ejected > 0:
		notReady(ctx, fmt.Sprintf("no live replica: %d ejected for not answering", ejected))
		return
	case live == 0 || waiting > 0 && g.now().Sub(g.started) < warmupGrace:
		notReady(ctx, "no live replica")
		return
	}
	writeJSON(ctx, map[string]any{"status": "ready", "live_replicas": live, "awaiting_filters": waiting, "ejected_replicas": ejected})
}

// notReady answers /ready with 503, OpenAI-shaped, and a Retry-After.
func notReady(ctx *fasthttp.RequestCtx, why string) {
	ctx.Response.Header.Set(fasthttp.HeaderRetryAfter, "1")
	proxy.WriteError(ctx, fasthttp.StatusServiceUnavailable, "service_unavailable", why)
}

// replicaView is one entry of /admin/replicas.
type replicaView struct {
	Name     string   `json:"name"`
	Model    string   `json:"model"`
	Models   []string `json:"models"`
	URL      string   `json:"url"`
	Protocol string   `json:"protocol"`
	Online   bool     `json:"online"`
	Selected bool     `json:"selected"`
	KVEvents bool     `json:"kv_events"`
	Stale    bool     `json:"stale"`
	// Orphan: the sidecar failed; routed by load while the engine answers
	// this router's health probes.
	Orphan           bool    `json:"orphan"`
	Waiting          int     `json:"waiting"`
	Running          int     `json:"running"`
	KVUsage          float64 `json:"kv_usage"`
	BlockSize        int     `json:"block_size"`
	FilterGeneration uint64  `json:"filter_generation"`
	FilterKeys       int     `json:"filter_keys"`
	StateAgeMS       int64   `json:"state_age_ms"`
	// Cluster-wide in-flight work (gossiped) and this router's own.
	ClusterInflightRequests      int `json:"cluster_inflight_requests"`
	ClusterInflightPrefillTokens int `json:"cluster_inflight_prefill_tokens"`
	LocalInflightRequests        int `json:"local_inflight_requests"`
	LocalInflightPrefillTokens   int `json:"local_inflight_prefill_tokens"`
	// RoutingDegraded is true while the policy has any model in least-load
	// mode (not necessarily one this replica serves).
	RoutingDegraded bool `json:"routing_degraded"`
	// EjectedMS is how long the replica stays out of this router's routing
	// after failing to answer (0: in routing).
	EjectedMS int64 `json:"ejected_ms"`
	// Server and DataParallelRank, for one data-parallel rank of an engine
	// server: the server (its URL, which its ranks share: the ranks of one
	// server are the replicas with the same server) and the rank.
	Server           string `json:"server,omitempty"`
	DataParallelRank *int   `json:"data_parallel_rank,omitempty"`
	// OffloadMedia are the offload tiers whose blocks its filter holds
	// apart (its sidecar's --offload-capacity), cheapest first.
	OffloadMedia []string `json:"offload_media,omitempty"`
	// KVRole is its engine's side of prefill/decode disaggregation:
	// prefill, decode or both.
	KVRole string `json:"kv_role"`
}

func (g *Gateway) serveReplicas(ctx *fasthttp.RequestCtx) {
	snap := g.table.Snapshot()
	now := g.now()
	degraded := g.routingDegraded()
	out := make([]replicaView, 0, len(snap.Replicas))
	for i := range snap.Replicas {
		r := &snap.Replicas[i]
		l := g.inflight.get(r.Name)
		clusterRequests, clusterPrefill := l.clusterView(r.Load)
		v := replicaView{
			Name: r.Name, Models: slices.Clone(r.Models), URL: r.URL, Protocol: r.Protocol,
			Online: r.Online, Selected: r.Selected, KVEvents: r.KVEvents, Stale: r.Stale, Orphan: r.Orphan,
			Waiting: r.Load.Waiting, Running: r.Load.Running, KVUsage: r.Load.KVUsage,
			BlockSize: r.BlockSize, FilterGeneration: r.FilterGeneration, FilterKeys: r.FilterKeys,
			ClusterInflightRequests:      clusterRequests,
			ClusterInflightPrefillTokens: clusterPrefill,
			LocalInflightRequests:        int(l.requests.Load()),
			LocalInflightPrefillTokens:   int(l.prefill.Load()),
			RoutingDegraded:              degraded,
			OffloadMedia:                 slices.Clone(r.OffloadMedia),
			KVRole:                       r.KVRole.String(),
		}
		if until := l.eject.until.Load(); until > now.UnixNano() {
			v.EjectedMS = time.Duration(until - now.UnixNano()).Milliseconds()
		}
		if r.DataParallel {
			rank := r.DataParallelRank
			v.Server, v.DataParallelRank = r.URL, &rank
		}
		if v.Models == nil {
			v.Models = []string{}
		}
		if len(r.Models) > 0 {
			v.Model = r.Models[0]
		}
		if !r.UpdatedAt.IsZero() {
			v.StateAgeMS = now.Sub(r.UpdatedAt).Milliseconds()
		}
		out = append(out, v)
	}
	writeJSON(ctx, out)
}

// unknownReplicas returns the names in names that snap does not list.
func unknownReplicas(snap *fleet.Snapshot, names []string) []string {
	var unknown []string
	for _, n := range names {
		if snap.Find(n) < 0 {
			unknown = append(unknown, strconv.Quote(n))
		}
	}
	return unknown
}

// serveClear clears route records, here and cluster-wide. Naming a replica
// the table does not hold is a 404 rather than a silent no-op: a typo would
// otherwise look like a clear that happened.
func (g *Gateway) serveClear(ctx *fasthttp.RequestCtx) {
	s := g.Settings()
	switch {
	case s.AdminToken != "":
		got := ctx.Request.Header.Peek(fasthttp.HeaderAuthorization)
		want := []byte("Bearer " + s.AdminToken)
		if subtle.ConstantTimeCompare(got, want) != 1 {
			g.fail(ctx, &request.Error{Status: 401, Type: "invalid_request_error", Message: "admin token required: send Authorization: Bearer followed by the router's --admin-token"})
			return
		}
	case !s.AdminOpen:
		g.fail(ctx, &request.Error{Status: 403, Type: "permission_error",
			Message: "route clearing is disabled: start the router with --admin-token (KVMESH_ADMIN_TOKEN) and send it as a bearer token, or with --admin-open (KVMESH_ADMIN_OPEN) to let anyone who reaches this port clear"})
		return
	}
	var req struct {
		Replicas []string `json:"replicas"`
	}
	if body := ctx.PostBody(); len(body) > 0 {
		if err := json.Unmarshal(body, &req); err != nil {
			g.fail(ctx, request.Invalid(`want {} or {"replicas":["name",...]}: %v`, err))
			return
		}
	}
	names := req.Replicas
	snap := g.table.Snapshot()
	if unknown := unknownReplicas(snap, names); len(unknown) > 0 {
		g.fail(ctx, &request.Error{Status: 404, Type: "not_found_error",
			Message: fmt.Sprintf("no replica named %s in this router's table (GET /admin/replicas lists them); nothing was cleared", strings.Join(unknown, ", "))})
		return
	}
	if g.cluster != nil {
		g.cluster.ClearRoutes(names)
	} else {
		g.table.ClearRoutes(names)
	}
	g.ClearRecords(names)
	scope := any("all")
	if len(names) > 0 {
		scope = names
	}
	out := clearAnswer{Cleared: scope, Replicas: []clearedReplica{}}
	for i := range snap.Replicas {
		if r := &snap.Replicas[i]; len(names) == 0 || slices.Contains(names, r.Name) {
			out.Replicas = append(out.Replicas, clearedReplica{Name: r.Name, FilterKeys: r.FilterKeys, KVEvents: r.KVEvents})
			out.FilterKeys += r.FilterKeys
		}
	}
	g.log.Info().Interface("replicas", scope).Int("filter_keys", out.FilterKeys).Msg("route records cleared")
	writeJSON(ctx, out)
}

// clearAnswer is what POST /admin/routes/clear answers: what the clear
// dropped, as this router held it.
type clearAnswer struct {
	// Cleared is "all" or the names asked for.
	Cleared  any              `json:"cleared"`
	Replicas []clearedReplica `json:"replicas"`
	// FilterKeys sums the replicas' filter_keys.
	FilterKeys int `json:"filter_keys"`
}

// clearedReplica is one replica a clear reached.
type clearedReplica struct {
	Name string `json:"name"`
	// FilterKeys is the block keys its filter held here before the clear:
	// until its sidecar publishes a fresh filter (its exact resident set,
	// rebuilt on the clear), no prompt matches there and its requests are
	// routed by load.
	FilterKeys int `json:"filter_keys"`
	// KVEvents is false for a static upstream: it has no filter, only the
	// policy's records of what was routed to it, also dropped.
	KVEvents bool `json:"kv_events"`
}

// modelPrefix starts GET /v1/models/{id}; an id may itself hold slashes
// ("meta-llama/Llama-3.1-8B-Instruct").
var modelPrefix = []byte("/v1/models/")

// enginePaths are the engine endpoints a POST is passed through to,
// untouched, at a replica serving the request's model (a JSON field, or a
// form field of a multipart upload), chosen by load. Any other path is the
// router's own 404 (noRoute): a mistyped URL is not sent to an engine to
// be answered there, or served by an engine route nobody meant to expose.
// An engine route missing here is added with --passthrough-paths
// (Settings.PassthroughPaths) until a release lists it.
//
// The list is the model-serving POST routes of vLLM's OpenAI server
// (vllm/entrypoints/openai/api_server.py and the routers it mounts: v0.14.0,
// the version deploy/k8s pins, up to what the v0.32 documentation lists) and
// of SGLang's (python/sglang/srt/entrypoints/http_server.py), less what the
// router answers itself (/v1/chat/completions, /v1/completions,
// /v1/responses and /v1/messages, routed by prefix; /tokenize, from its own
// tokenizer; /v1/models; stored responses, /v1/responses/{id} and
// .../cancel, sent where their id says they live) and what must not reach
// just one replica of many: adapter loading, cache resets, sleep, profiling
// and weight updates act on one engine; files and batches live on the
// engine that made them. /inference/v1/generate is vLLM's token-in,
// token-out route (vllm/entrypoints/serve/disagg/api_router.py, main at
// 063e5a89d54d); SageMaker's /invocations is left out: its body, not its
// path, says which API it is.
var enginePaths = map[string]bool{
	// OpenAI's API
	"/v1/embeddings":              true, // vLLM, SGLang
	"/v1/audio/transcriptions":    true, // vLLM (speech models; multipart)
	"/v1/audio/translations":      true, // vLLM (speech models; multipart)
	"/v1/chat/completions/batch":  true, // vLLM: several chats in one body
	"/v1/chat/completions/render": true, // vLLM: the prompt a chat renders to
	"/v1/completions/render":      true, // vLLM
	// Anthropic's API
	"/v1/messages/count_tokens": true, // vLLM
	// Pooling models
	"/pooling":     true, // vLLM
	"/classify":    true, // vLLM, SGLang
	"/v1/classify": true, // SGLang
	"/score":       true, // vLLM
	"/v1/score":    true, // vLLM (deprecated alias), SGLang
	"/rerank":      true, // vLLM (Jina's shape)
	"/v1/rerank":   true, // vLLM, SGLang
	"/v2/rerank":   true, // vLLM (Cohere's shape)
	"/v2/embed":    true, // vLLM (Cohere's shape)
	// Native generation APIs, routed by load (their prompts are not
	// matched against caches). SGLang's body names no model: it is routed
	// when the fleet serves a single one, else refused as a request
	// without a model.
	"/inference/v1/generate": true, // vLLM: token ids in and out (disaggregated serving)
	"/generate":              true, // SGLang's native API
	// Tokenizer
	"/detokenize":    true, // vLLM, SGLang
	"/v1/tokenize":   true, // SGLang (the router answers /tokenize itself)
	"/v1/detokenize": true, // SGLang
}

// passedThrough reports whether a POST to path goes to a replica of the
// request's model, by load (enginePaths).
func passedThrough(path []byte) bool { return enginePaths[string(path)] }

// CheckPassthroughPath says why path cannot be one of
// Settings.PassthroughPaths: it must be an absolute path alone (no query,
// fragment, space or control byte, matched exactly as a request's path is)
// and none the router answers itself, which it would shadow or never reach.
func CheckPassthroughPath(path string) error {
	switch {
	case !strings.HasPrefix(path, "/") || len(path) < 2:
		return fmt.Errorf("passthrough path %q: want an absolute path such as /v1/new_endpoint", path)
	case strings.ContainsAny(path, "?# ") || strings.ContainsFunc(path, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fmt.Errorf("passthrough path %q: a path alone, without query, fragment or spaces", path)
	}
	b := []byte(path)
	switch path {
	case "/health", "/ready", "/tokenize", "/v1/models",
		"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages":
		return fmt.Errorf("passthrough path %s is the router's own route", path)
	}
	if operatorRoute(b) || bytes.HasPrefix(b, responsesPrefix) || bytes.HasPrefix(b, modelPrefix) {
		return fmt.Errorf("passthrough path %s is the router's own route", path)
	}
	return nil
}

// postOnly reports whether path is served for POST alone, so that another
// method gets a 405 rather than a 404 that reads as a wrong URL.
func postOnly(path []byte) bool {
	switch string(path) {
	case "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize", "/admin/routes/clear":
		return true
	}
	return passedThrough(path)
}

// operatorRoute reports whether path is one of the operator's: the admin
// API, the console and /metrics. With an admin listener (Servers) only it
// serves them: whoever reaches the API port then sees neither the fleet's
// state nor the metrics, nor can clear routes.
func operatorRoute(path []byte) bool {
	return bytes.HasPrefix(path, []byte("/admin/")) || string(path) == "/metrics" || console.Owns(path)
}
