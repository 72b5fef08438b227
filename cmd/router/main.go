// Command router is kvmesh's OpenAI-compatible router: it routes each
// request to the replica that holds its prefix in KV cache, unless that
// replica's queue costs more than the prefill it saves. Run any number;
// they share what they learn over gossip.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/valyala/fasthttp"
	"github.com/valyala/fasthttp/pprofhandler"
	// Mozilla's roots, used only where the system has none (the FROM
	// scratch image), so https upstreams verify without mounting certificates.
	_ "golang.org/x/crypto/x509roots/fallback"

	"github.com/kvmesh/kvmesh/buildinfo"
	"github.com/kvmesh/kvmesh/certfile"
	"github.com/kvmesh/kvmesh/flagenv"
	"github.com/kvmesh/kvmesh/fleet"
	"github.com/kvmesh/kvmesh/gateway"
	"github.com/kvmesh/kvmesh/gossip"
	"github.com/kvmesh/kvmesh/listener"
	"github.com/kvmesh/kvmesh/logging"
	"github.com/kvmesh/kvmesh/routerconfig"
	"github.com/kvmesh/kvmesh/routing"
	"github.com/kvmesh/kvmesh/tokenize"
)

type options struct {
	listen, name                      string
	gossipBind, gossipAdvertise, join string
	gossipKey, configPath, adminToken string
	gossipLabel                       string
	engineAPIKey                      string
	gossipTrustSender, adminOpen      bool
	configMaxBytes                    int64
	configSettle                      time.Duration
	pprofListen, tlsCert, tlsKey      string
	maxBodyBytes, gcPercent           int
	drainTimeout, shutdownDelay       time.Duration
	orphanProbe, orphanForget         time.Duration
	flags                             routerconfig.Flags
	log                               logging.Options
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		os.Exit(1)
	}
}

func parse(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "HTTP listen address (OpenAI API, admin, metrics)")
	fs.StringVar(&o.name, "name", "", "router name in the cluster (default: host name and listen port)")
	fs.StringVar(&o.gossipBind, "gossip-bind", "", "gossip listen host:port (empty with no --join: no gossip, static upstreams only)")
	fs.StringVar(&o.gossipAdvertise, "gossip-advertise", "", "gossip host:port others reach this router at")
	fs.StringVar(&o.join, "join", "", "comma list of gossip host:port to join")
	fs.StringVar(&o.gossipKey, "gossip-key", "", "base64 AES key (16, 24 or 32 bytes) encrypting gossip")
	fs.StringVar(&o.gossipLabel, "gossip-label", gossip.DefaultLabel, "cluster label, the same on every sidecar and router of one cluster; members with another label are rejected")
	fs.BoolVar(&o.gossipTrustSender, "gossip-trust-sender", false, "take a gossip message's named sender on trust instead of checking it against the address it came from: only where members do not send from the address they advertise (NAT)")
	fs.StringVar(&o.flags.Policy, "policy", "kvaware", "routing policy: "+strings.Join(routing.Names, ", "))
	fs.Var(&o.flags.Tokenizers, "tokenizer", "MODEL=SPEC, repeatable; SPEC is a HuggingFace model dir, engine, or builtin; MODEL * sets the default")
	fs.StringVar(&o.configPath, "config", "", "YAML config file, reloaded on change; replace it by rename (write beside, then mv)")
	fs.Int64Var(&o.configMaxBytes, "config-max-bytes", routerconfig.DefaultMaxBytes, "largest --config file read; a larger one is refused unread")
	fs.DurationVar(&o.configSettle, "config-settle", routerconfig.DefaultSettle, "how long a changed --config file must stay the same before it is applied (a file written in place passes through halves that parse)")
	fs.StringVar(&o.adminToken, "admin-token", "", "bearer token required by /admin/routes/clear")
	fs.BoolVar(&o.adminOpen, "admin-open", false, "serve /admin/routes/clear to anyone who reaches --listen, without --admin-token (else it is refused)")
	fs.StringVar(&o.engineAPIKey, "engine-api-key", "", "API key the engines were started with (vllm serve --api-key), sent to every replica instead of the client's Authorization; prefer the env variable")
	fs.IntVar(&o.maxBodyBytes, "max-body-bytes", 64<<20, "largest request body accepted")
	fs.Var(&o.flags.Statics, "static-upstream", "NAME=URL[,MODEL...], repeatable: an engine without a sidecar, load-balanced")
	fs.Var(&o.flags.Fallbacks, "fallback", "MODEL=URL[,API_KEY_ENV], repeatable: serves MODEL when no replica can")
	fs.Var(&o.flags.SpillAfter, "spill-after", "MODEL=DURATION, repeatable: MODEL's requests go to its --fallback first when the best replica's predicted time to first token is longer (kvaware)")
	fs.IntVar(&o.flags.MaxPrefixTokens, "max-prefix-tokens", 16384, "prompt tokens used for prefix matching")
	fs.IntVar(&o.flags.MaxPrefixBytes, "max-prefix-bytes", tokenize.DefaultMaxPrefixBytes, "prompt bytes rendered and tokenized at most to find the --max-prefix-tokens leading tokens (the rest is counted by estimate); a prompt whose leading tokens are not found within them is routed by load")
	fs.IntVar(&o.flags.MaxAttempts, "max-attempts", 3, "replicas tried per request before the fallback")
	fs.BoolVar(&o.flags.CalibrateCost, "calibrate-cost", false, "kvaware decides by the cost model it fits per model to the times to first token of streamed requests (exported in /metrics either way) instead of by routing.prefill_per_token and per_running")
	fs.BoolVar(&o.flags.ResumeStreams, "resume-streams", false, "continue a stream that breaks mid-answer at the next replica, from the text already sent (else: an SSE error event)")
	fs.StringVar(&o.pprofListen, "pprof-listen", "", "serve Go profiles (/debug/pprof/) on this address; empty: off")
	fs.StringVar(&o.tlsCert, "tls-cert", "", "PEM certificate: serve HTTPS (with --tls-key); renewed files are picked up within 10s")
	fs.StringVar(&o.tlsKey, "tls-key", "", "PEM private key of --tls-cert")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests may finish")
	fs.DurationVar(&o.orphanProbe, "orphan-probe-interval", time.Second, "how often the router asks the engine of a replica whose sidecar failed for /health (it is routed by load while it answers)")
	fs.DurationVar(&o.orphanForget, "orphan-forget-after", time.Minute, "forget a replica whose sidecar failed once its engine has not answered /health for this long")
	fs.DurationVar(&o.shutdownDelay, "shutdown-delay", 0, "on SIGTERM, answer /ready with 503 but keep serving this long before draining, so load balancers stop sending first (k8s: a few readiness periods)")
	fs.IntVar(&o.gcPercent, "gc-percent", 0, fmt.Sprintf("Go GC target (GOGC); 0: GOGC if set, else %d", gateway.DefaultGCPercent))
	o.log.Register(fs)
	if err := flagenv.Parse(fs, args); err != nil {
		return nil, err
	}
	if o.maxBodyBytes <= 0 {
		return nil, fmt.Errorf("--max-body-bytes must be positive")
	}
	if o.configMaxBytes <= 0 || o.configSettle <= 0 {
		return nil, fmt.Errorf("--config-max-bytes and --config-settle must be positive")
	}
	if o.adminOpen && o.adminToken != "" {
		return nil, fmt.Errorf("--admin-open and --admin-token exclude each other: the token would guard the clear anyway")
	}
	if (o.tlsCert == "") != (o.tlsKey == "") {
		return nil, fmt.Errorf("--tls-cert and --tls-key go together")
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
	log, err := o.log.Logger(nil, "router")
	if err != nil {
		return err
	}
	switch {
	case o.gcPercent != 0:
		debug.SetGCPercent(o.gcPercent)
	case os.Getenv("GOGC") == "":
		debug.SetGCPercent(gateway.DefaultGCPercent)
	}
	base, err := routerconfig.FromFlags(o.flags)
	if err != nil {
		return err
	}
	if o.orphanProbe <= 0 || o.orphanForget <= 0 {
		return fmt.Errorf("--orphan-probe-interval and --orphan-forget-after must be positive")
	}
	table := fleet.NewTable(fleet.TableConfig{ForgetOrphanAfter: o.orphanForget})
	builder := &routerconfig.Builder{Table: table, AdminToken: o.adminToken, AdminOpen: o.adminOpen, EngineAPIKey: o.engineAPIKey, Log: log}
	cfg := base
	if o.configPath != "" {
		file, err := routerconfig.Load(o.configPath, o.configMaxBytes, o.configSettle)
		if err != nil {
			return err
		}
		cfg = routerconfig.Overlay(base, file)
	}
	settings, err := builder.Build(cfg)
	if err != nil {
		return err
	}
	g := gateway.New(table, nil, settings, log)
	reloader := &routerconfig.Reloader{Base: base, Path: o.configPath, Builder: builder, Gateway: g, Log: log,
		MaxBytes: o.configMaxBytes, Settle: o.configSettle}
	if err := g.RegisterMetrics(reloader); err != nil {
		return err
	}
	if err := builder.Apply(g, cfg); err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	// drained closes once no request is left: until then the other routers
	// must still see this one's in-flight work on each replica.
	drained := make(chan struct{})
	drainedNow := sync.OnceFunc(func() { close(drained) })
	defer drainedNow()
	var node *gossip.RouterNode
	if o.gossipBind != "" || o.join != "" {
		if node, err = startGossip(o, table, g, log); err != nil {
			return err
		}
		g.SetCluster(node)
		if err := g.RegisterMetrics(gossip.Collector("kvmesh_router", node.Stats)); err != nil {
			return err
		}
		go g.ReportInflight(100*time.Millisecond, drained)
		go g.ProbeOrphans(o.orphanProbe, min(o.orphanProbe, 2*time.Second), ctx.Done())
	}
	go g.DiscoverStatic(10*time.Second, ctx.Done())
	go g.ForgetDeparted(time.Minute, 10*time.Minute, ctx.Done())
	if o.configPath != "" {
		if err := reloader.Watch(ctx, func() { go g.RefreshStaticModels() }); err != nil {
			log.Warn().Err(err).Msg("config file not watched: changes need a restart")
		}
	}

	ln, err := guardedListen(o.listen, "api", g, log)
	if err != nil {
		return err
	}
	if o.tlsCert != "" {
		certs, err := certfile.Load(o.tlsCert, o.tlsKey, 10*time.Second)
		if err != nil {
			return err
		}
		ln = tls.NewListener(ln, certs.Config())
	}
	if o.pprofListen != "" {
		if pln, err := guardedListen(o.pprofListen, "pprof", g, log); err != nil {
			log.Warn().Err(err).Msg("pprof server")
		} else {
			go func() { _ = fasthttp.Serve(pln, pprofhandler.PprofHandler) }()
		}
	}
	srv := g.Server(o.maxBodyBytes)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.Info().Str("version", buildinfo.Version()).Str("listen", ln.Addr().String()).Bool("tls", o.tlsCert != "").Str("policy", g.Settings().Policy.Name()).
		Bool("gossip", node != nil).Msg("router ready")

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	stop() // a second signal ends the process at once, delay and drain cut short
	g.Stopping()
	if o.shutdownDelay > 0 {
		log.Info().Dur("shutdown_delay", o.shutdownDelay).Msg("shutting down: not ready, still serving")
		time.Sleep(o.shutdownDelay)
	}
	log.Info().Int("inflight", g.Inflight()).Dur("drain_timeout", o.drainTimeout).Msg("shutting down: draining")
	drainCtx, cancel := context.WithTimeout(context.Background(), o.drainTimeout)
	defer cancel()
	if err := srv.ShutdownWithContext(drainCtx); err != nil {
		log.Warn().Err(err).Int("inflight", g.Inflight()).Msg("drain timed out")
	}
	drainedNow()
	if node != nil {
		if err := node.Leave(2 * time.Second); err != nil {
			log.Warn().Err(err).Msg("leaving the cluster")
		}
	}
	log.Info().Msg("stopped")
	return nil
}

// guardedListen listens on addr through a listener that survives accept
// errors (fasthttp's Serve returns on the first one: at the open-file limit
// the router exited), counted in kvmesh_router_accept_errors_total{listener=name}.
func guardedListen(addr, name string, g *gateway.Gateway, log zerolog.Logger) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	guarded := listener.Guard(ln, log)
	if err := g.RegisterAcceptErrors(name, guarded.Errors); err != nil {
		_ = ln.Close()
		return nil, err
	}
	return guarded, nil
}

func startGossip(o *options, table *fleet.Table, g *gateway.Gateway, log zerolog.Logger) (*gossip.RouterNode, error) {
	key, err := gossip.ParseKey(o.gossipKey)
	if err != nil {
		return nil, err
	}
	name := o.name
	if name == "" {
		host, _ := os.Hostname()
		_, port, _ := net.SplitHostPort(o.listen)
		name = host + ":" + port
	}
	var join []string
	for _, j := range strings.Split(o.join, ",") {
		if j = strings.TrimSpace(j); j != "" {
			join = append(join, j)
		}
	}
	bind := o.gossipBind
	if bind == "" {
		bind = "127.0.0.1:0"
	}
	return gossip.StartRouter(gossip.RouterConfig{
		Config: gossip.Config{
			Name: name, BindAddr: bind, AdvertiseAddr: o.gossipAdvertise, Join: join, Key: key, Label: o.gossipLabel,
			TrustClaimedSender: o.gossipTrustSender,
			Logger:             log.With().Str("component", "gossip").Logger(),
		},
		OnClearRoutes: g.ClearRecords,
	}, table)
}
