// Command router is kvmesh's OpenAI-compatible router: it routes each
// request to the replica that holds its prefix in KV cache, unless that
// replica's queue costs more than the prefill it saves. Run any number;
// they share what they learn over gossip. The router itself is package
// router; this command turns flags into its Config.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	// Mozilla's roots, used only where the system has none (the FROM
	// scratch image), so https upstreams verify without mounting certificates.
	_ "golang.org/x/crypto/x509roots/fallback"

	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/memberflags"
	"github.com/kvmesh/kvmesh/router"
	"github.com/kvmesh/kvmesh/routerconfig"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		os.Exit(1)
	}
}

// options are the flags: the router's Config, and the GC target, which
// is the process's.
type options struct {
	cfg       router.Config
	gcPercent int
}

func parse(args []string) (*options, error) {
	o := &options{}
	c := &o.cfg
	var member memberflags.Flags
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.StringVar(&c.Listen, "listen", "127.0.0.1:8080", "HTTP listen address (OpenAI API; also admin, console and metrics without --admin-listen)")
	fs.StringVar(&c.AdminListen, "admin-listen", "", "serve /admin/*, the console and /metrics on this address only (--listen then answers them 404); empty: on --listen")
	fs.StringVar(&c.Name, "name", "", "router name in the cluster (default: host name and listen port)")
	member.Register(fs, "")
	fs.StringVar(&c.Flags.Policy, "policy", "kvaware", "routing policy: "+strings.Join(routing.Names, ", "))
	fs.Var(&c.Flags.Tokenizers, "tokenizer", "MODEL=SPEC, repeatable; SPEC is a HuggingFace model dir, engine, or builtin; MODEL * sets the default")
	fs.StringVar(&c.ConfigPath, "config", "", "YAML config file, reloaded on change; replace it by rename (write beside, then mv)")
	fs.Int64Var(&c.ConfigMaxBytes, "config-max-bytes", routerconfig.DefaultMaxBytes, "largest --config file read; a larger one is refused unread")
	fs.DurationVar(&c.ConfigSettle, "config-settle", routerconfig.DefaultSettle, "how long a changed --config file must stay the same before it is applied (a file written in place passes through halves that parse)")
	fs.StringVar(&c.AdminToken, "admin-token", "", "bearer token required by /admin/routes/clear")
	fs.BoolVar(&c.AdminOpen, "admin-open", false, "serve /admin/routes/clear to anyone who reaches it (--listen, or --admin-listen when set), without --admin-token (else it is refused)")
	fs.IntVar(&c.MaxBodyBytes, "max-body-bytes", 64<<20, "largest request body accepted")
	fs.Var(&c.Flags.Statics, "static-upstream", "NAME=URL[,MODEL...], repeatable: an engine without a sidecar, load-balanced")
	fs.Var(&c.Flags.Fallbacks, "fallback", "MODEL=URL[,API_KEY_ENV], repeatable: serves MODEL when no replica can")
	fs.Var(&c.Flags.SpillAfter, "spill-after", "MODEL=DURATION, repeatable: MODEL's requests go to its --fallback first when the best replica's predicted time to first token is longer (kvaware)")
	fs.IntVar(&c.Flags.MaxPrefixTokens, "max-prefix-tokens", 16384, "prompt tokens used for prefix matching")
	fs.IntVar(&c.Flags.MaxPrefixBytes, "max-prefix-bytes", tokenize.DefaultMaxPrefixBytes, "prompt bytes rendered and tokenized at most to find the --max-prefix-tokens leading tokens (the rest is counted by estimate); a prompt whose leading tokens are not found within them is routed by load")
	fs.IntVar(&c.Flags.MaxAttempts, "max-attempts", 3, "replicas tried per request before the fallback")
	fs.BoolVar(&c.Flags.CalibrateCost, "calibrate-cost", false, "kvaware decides by the cost model it fits per model to the times to first token of streamed requests (exported in /metrics either way) instead of by routing.prefill_per_token and per_running")
	fs.StringVar(&c.Flags.Split, "split", "auto", "for models served by prefill and decode pools (sidecars' --kv-role): auto splits a request when the uncached part of its prompt on the best decode replica would take --split-min-prefill or more to compute, always splits every one, never serves them whole on the decode pool")
	fs.DurationVar(&c.Flags.SplitMinPrefill, "split-min-prefill", 0, "with --split auto, the prefill time (uncached tokens × the cost model's prefill_per_token) from which a request is split (0: 15ms, about two decode steps)")
	fs.BoolVar(&c.Flags.FlowControl, "flow-control", false, "hold requests in the router while their model's fleet is saturated and dispatch them by priority (X-Kvmesh-Priority) and fair share between tenants as replicas free up; bounds in the config file's flow_control")
	fs.DurationVar(&c.Flags.FlowMaxEngineQueue, "flow-max-engine-queue", 0, "with --flow-control, hold requests while the best replica's predicted wait behind queued work is over this (0: about one scheduler step of prefill, 8,192 tokens at the cost model's prefill_per_token)")
	fs.IntVar(&c.Flags.FlowMaxInflightPerReplica, "flow-max-inflight-per-replica", 0, "with --flow-control, also hold requests while every replica of their model has this many requests running, waiting or in flight (0: no such limit)")
	fs.StringVar(&c.Flags.SessionHeaders, "session-headers", "", "comma-separated request headers naming a client's session, a placement hint (kvaware keeps a session on its home replica while the cost rule allows); empty: "+strings.Join(gateway.DefaultSessionHeaders, ",")+"; none: no hints")
	fs.StringVar(&c.Flags.PassthroughPaths, "passthrough-paths", "", "comma-separated engine POST routes to pass through to a replica of the body's model, by load, beside those the router lists (README: HTTP); any other path is the router's 404")
	fs.BoolVar(&c.Flags.ResumeStreams, "resume-streams", false, "continue a stream that breaks mid-answer at the next replica, from the text already sent (else: an SSE error event)")
	fs.BoolVar(&c.IgnoreTiers, "ignore-tiers", false, "match only the blocks replicas hold on a GPU: blocks their sidecars publish as held on an offload tier (--offload-capacity) are neither matched nor priced, as by a router that predates tiers; for comparison")
	fs.BoolVar(&c.CarryStoredState, "carry-stored-state", false, "have the ids of stored responses (/v1/responses) carry what predicting their follow-ups' cached tokens needs; routers of the release before cannot read such ids, so turn it on once every router runs this one")
	fs.BoolVar(&c.NoDataParallelHeader, "no-data-parallel-header", false, "send no X-data-parallel-rank to a replica that is one data-parallel rank of an engine server (its sidecar's --data-parallel-rank): the engine's balancer then picks the rank, not the one whose cache the router predicted; for comparison, or engines that refuse the header")
	fs.StringVar(&c.PprofListen, "pprof-listen", "", "serve Go profiles (/debug/pprof/) on this address; empty: off")
	fs.StringVar(&c.TLSCert, "tls-cert", "", "PEM certificate: serve HTTPS (with --tls-key); renewed files are picked up within 10s")
	fs.StringVar(&c.TLSKey, "tls-key", "", "PEM private key of --tls-cert")
	fs.DurationVar(&c.DrainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests may finish")
	fs.DurationVar(&c.OrphanProbe, "orphan-probe-interval", time.Second, "how often the router asks the engine of a replica whose sidecar failed for /health (it is routed by load while it answers)")
	fs.DurationVar(&c.OrphanForget, "orphan-forget-after", time.Minute, "forget a replica whose sidecar failed once its engine has not answered /health for this long")
	fs.DurationVar(&c.ShutdownDelay, "shutdown-delay", 0, "on SIGTERM, answer /ready with 503 but keep serving this long before draining, so load balancers stop sending first (k8s: a few readiness periods)")
	fs.IntVar(&o.gcPercent, "gc-percent", 0, fmt.Sprintf("Go GC target (GOGC); 0: GOGC if set, else %d", gateway.DefaultGCPercent))
	if err := flagenv.Parse(fs, args); err != nil {
		return nil, err
	}
	var err error
	if c.Gossip, err = member.Gossip(); err != nil {
		return nil, err
	}
	c.EngineAPIKey = member.EngineAPIKey
	if c.Logger, err = member.Log.Logger(nil, "router"); err != nil {
		return nil, err
	}
	return o, nil
}

func run(args []string) error {
	o, err := parse(args)
	if err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return err
	}
	switch {
	case o.gcPercent != 0:
		debug.SetGCPercent(o.gcPercent)
	case os.Getenv("GOGC") == "":
		debug.SetGCPercent(gateway.DefaultGCPercent)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// After the first signal a second one ends the process at once, the
	// shutdown delay and the drain cut short.
	context.AfterFunc(ctx, stop)
	return router.Run(ctx, o.cfg)
}
